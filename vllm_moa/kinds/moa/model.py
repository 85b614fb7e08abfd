"""The MoA drafter (docs/method.md section 1).

    target per-layer K/V --LSA over the layer axis, mean--> Ekv2E --> CA keys/values (1 row / token)
    target token embedding --> SA (causal, own KV cache) --> CA query
    CA output --> [TLI > 0: target's last TLI layers + final norm] --> target LM head

Two forward modes share every weight:
* training: whole sequences, K-step-bounded masks (models/masks.py);
* incremental drafting: `MoADraftState` caches (CA rows of verified tokens, SA KV, the last-N
  layers' K/V). For any anchor a, training logits at a+k equal incremental logits k steps past a
  (tests/unit/test_moa_equivalence.py): that property is what makes the training honest.
"""

from __future__ import annotations

import hashlib
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import TypeVar

import torch
from torch import Tensor, nn

from vllm_moa.kinds.moa.config import MoAConfig
from vllm_moa.layers import (
    AttentionProjections,
    DecoderBlock,
    KVCache,
    RMSNorm,
    RotaryEmbedding,
    SwiGLU,
    apply_rotary,
    attend,
    causal_mask_after,
)
from vllm_moa.models.base import Drafter, DraftOutput, TrainingBatchView
from vllm_moa.models.masks import (
    cross_attention_mask,
    self_attention_mask,
    target_layers_mask,
    within_last_rows,
    within_window,
)
from vllm_moa.packed_linear import Linear
from vllm_moa.target import TargetKVCache, TargetModel, TargetOutput, stack_layer_kv

T = TypeVar("T")


class LayerSelfAttention(nn.Module):
    """LSA: a pre-norm decoder block over the *layer axis* of one token's target K/V, unmasked,
    RoPE at the layer's index among those read; then mean over layers and Ekv2E.

    rows [N, L', 2*Ekv] -> [N, E], where L' = len(self.layers): the target layers LSA reads (all of
    them, or every n-th with the last: config lsa_layer_stride). Callers pick those layers
    (`select`). Tokens never mix, so each verified token is processed once. `kernels/` holds a
    Triton version that reads the rows straight from paged caches.
    """

    def __init__(self, config: MoAConfig) -> None:
        super().__init__()
        sig = config.target_signature
        width = 2 * sig.kv_width
        head_dim = width // config.lsa_num_heads
        self.num_heads, self.head_dim = config.lsa_num_heads, head_dim
        self.input_norm = RMSNorm(width, config.rms_norm_eps)
        self.attn = AttentionProjections(width, width, config.lsa_num_heads, config.lsa_num_heads, head_dim)
        self.post_norm = RMSNorm(width, config.rms_norm_eps)
        self.mlp = SwiGLU(width, config.lsa_intermediate_size)
        self.rotary = RotaryEmbedding(head_dim, config.lsa_rope_theta)
        self.ekv2e = Linear(width, sig.hidden_size, bias=False)
        # config final_hidden_rows: + hidden2e(final hidden state); zero at the start, so a drafter
        # trained without it starts out unchanged
        self.hidden2e = Linear(sig.hidden_size, sig.hidden_size, bias=False) if config.final_hidden_rows else None
        if self.hidden2e is not None:
            nn.init.zeros_(self.hidden2e.weight)
        self.layers = config.lsa_layers
        self.reads_all_layers = len(self.layers) == sig.num_layers

    @property
    def reads_final_hidden(self) -> bool:
        """Whether a row also reads its token's final hidden state (config final_hidden_rows): callers
        hand the hidden states to every row-making call and ask this, never the option."""
        return self.hidden2e is not None

    def select(self, per_layer: Sequence[T]) -> list[T]:
        """The entries of the layers LSA reads, from a per-target-layer sequence (caches, K or V)."""
        return list(per_layer) if self.reads_all_layers else [per_layer[i] for i in self.layers]

    def select_rows(self, rows: Tensor, dim: int) -> Tensor:
        """Per-layer rows (all L target layers along `dim`) -> the L' layers LSA reads."""
        if self.reads_all_layers:
            return rows
        return rows.index_select(dim, torch.tensor(self.layers, device=rows.device))

    def forward(self, rows: Tensor) -> Tensor:
        """rows [N, L', 2*Ekv] (the layers LSA reads) -> Ekv2E output [N, E]"""
        num_layers = rows.shape[1]
        if num_layers != len(self.layers):
            raise ValueError(f"LSA reads {len(self.layers)} target layers, got rows of {num_layers}")
        cos, sin = self.rotary(torch.arange(num_layers, device=rows.device), rows.dtype)  # [L, d]
        q, k, v = self.attn.queries_keys_values(self.input_norm(rows))  # q [N, H, L, d], k, v [N, H, L, d]
        q, k = apply_rotary(q, cos, sin), apply_rotary(k, cos, sin)
        h = rows + self.attn.output(attend(q, k, v, None))  # no mask: every layer sees every layer
        h = h + self.mlp(self.post_norm(h))
        return self.ekv2e(h.mean(dim=1))

    def add_final_hidden(self, rows: Tensor, final_hidden: Tensor | None) -> Tensor:
        """Ekv2E rows [..., E] + hidden2e(the same tokens' final post-norm target hidden [..., E]);
        the rows unchanged for a drafter without final_hidden_rows."""
        if self.hidden2e is None:
            return rows
        if final_hidden is None:
            raise ValueError("this MoA drafter's rows carry the target's final hidden state (config "
                             "final_hidden_rows): pass the verified tokens' final hidden states")
        return rows + self.hidden2e(final_hidden.to(rows.dtype))


class CrossAttentionBlock(nn.Module):
    """CA: queries from SA's output, keys/values from the Ekv2E rows of target-verified tokens,
    RoPE on both at their own token positions."""

    def __init__(self, config: MoAConfig) -> None:
        super().__init__()
        width = config.target_signature.hidden_size
        self.query_norm = RMSNorm(width, config.rms_norm_eps)
        self.row_norm = RMSNorm(width, config.rms_norm_eps)
        self.attn = AttentionProjections(width, width, config.ca_num_heads, config.ca_num_kv_heads, config.ca_head_dim)
        self.post_norm = RMSNorm(width, config.rms_norm_eps)
        self.mlp = SwiGLU(width, config.ca_intermediate_size)
        self.rotary = RotaryEmbedding(config.ca_head_dim, config.rope_theta)

    def row_keys_values(self, rows: Tensor, row_positions: Tensor) -> tuple[Tensor, Tensor]:
        """Ekv2E rows [B, S, E] at positions [B, S] -> k, v [B, H_kv, S, d]"""
        cos, sin = self.rotary(row_positions, rows.dtype)
        k, v = self.attn.keys_values(self.row_norm(rows))
        return apply_rotary(k, cos, sin), v

    def forward(self, hidden: Tensor, positions: Tensor, row_k: Tensor, row_v: Tensor, mask: Tensor | None) -> Tensor:
        """hidden [B, T, E] (SA output) at positions [B, T]; mask [B, 1, T, S] -> [B, T, E]"""
        cos, sin = self.rotary(positions, hidden.dtype)
        q = apply_rotary(self.attn.queries(self.query_norm(hidden)), cos, sin)
        h = hidden + self.attn.output(attend(q, row_k, row_v, mask))
        return h + self.mlp(self.post_norm(h))


@dataclass
class MoADraftState:
    """The drafter's caches for a batch of sequences moving in lockstep.

    rows:      [B, R, E] Ekv2E rows of the R target-verified tokens (positions 0..R-1)
    row_k/v:   CA keys/values of those rows [B, H_kv, R, d] (cached: rows never change)
    sa:        SA KV cache over verified + drafted tokens
    tli_true:  the target's own K/V of verified tokens for its last TLI layers
    tli_pred:  K/V of drafted positions for those layers (cleared when new tokens are verified)
    """

    rows: Tensor | None = None
    row_k: Tensor | None = None
    row_v: Tensor | None = None
    sa: KVCache = field(default_factory=KVCache)
    tli_true: TargetKVCache = field(default_factory=TargetKVCache)
    tli_pred: TargetKVCache = field(default_factory=TargetKVCache)

    @property
    def num_verified(self) -> int:
        return 0 if self.rows is None else self.rows.shape[1]

    @property
    def sa_length(self) -> int:
        return self.sa.length


class MoADrafter(Drafter):
    config_class = MoAConfig

    def __init__(self, config: MoAConfig) -> None:
        super().__init__(config)
        config.check_values()
        self.tli = config.tli
        self.lsa = LayerSelfAttention(config)
        sig = config.target_signature
        self.sa = DecoderBlock(sig.hidden_size, config.sa_num_heads, config.sa_num_kv_heads, config.sa_head_dim,
                               config.sa_intermediate_size, config.rope_theta, config.rms_norm_eps)
        self.ca = CrossAttentionBlock(config)
        # TLI = 0: the CA output stands for the target's final *post-norm* hidden state; a trainable
        # RMSNorm (our addition to the reference) puts it on that scale before the LM head.
        self.out_norm = RMSNorm(config.target_signature.hidden_size, config.rms_norm_eps) if self.tli == 0 else None
        # config attention_window: SA and CA read the last W positions (0: all); a runtime user may
        # set it on a drafter trained without one (it is a mask: no weight depends on it)
        self.attention_window = config.attention_window

    @torch.no_grad()
    def init_from_target(self, target: TargetModel) -> None:
        """TLI = 0: the output norm starts as the target's final norm (its weights, not ones): the
        CA output is trained to equal the target's post-norm hidden state, whose per-channel scale
        is that norm's (SmolLM2: mean 1.8), which a norm started at 1.0 does not reach in a short
        run at a decaying learning rate."""
        if self.out_norm is not None:
            self.out_norm.weight.copy_(target.decoder.norm.weight.to(self.out_norm.weight))

    # -- shared pieces ------------------------------------------------------------------------
    def lsa_fingerprint(self) -> str:
        """sha256 of the LSA + Ekv2E weights (bf16-rounded, so fp16/fp32 copies agree) and TLI: what
        must be identical on client and server for server-made rows to mean the same to the drafter."""
        # the layers read are part of what a row means; drafters reading all layers keep their fingerprint
        layers = "" if self.lsa.reads_all_layers else f"lsa_layers={','.join(map(str, self.lsa.layers))};"
        digest = hashlib.sha256(f"tli={self.tli};{layers}".encode())
        for name, weight in sorted(self.lsa.state_dict().items()):
            digest.update(name.encode())
            digest.update(weight.detach().to("cpu", torch.float32).to(torch.bfloat16).view(torch.int16).numpy().tobytes())
        return digest.hexdigest()[:16]

    def rows_from_kv(self, keys: list[Tensor], values: list[Tensor], final_hidden: Tensor | None = None) -> Tensor:
        """Per-layer K/V (L x [B, H_kv, T, d]) of verified tokens (+ their final post-norm hidden
        states [B, T, E], read with config final_hidden_rows) -> CA rows [B, T, E]."""
        layer_rows = stack_layer_kv(self.lsa.select(keys), self.lsa.select(values))  # [B, T, L', 2*Ekv]
        b, t, num_layers, width = layer_rows.shape
        rows = self.lsa(layer_rows.reshape(b * t, num_layers, width)).view(b, t, -1)
        return self.lsa.add_final_hidden(rows, final_hidden)

    def _head(self, ca_out: Tensor) -> Tensor:
        """CA output -> predicted feature (TLI = 0: final post-norm hidden; else: hidden entering L-N)."""
        return self.out_norm(ca_out) if self.out_norm is not None else ca_out

    def features(self, embeds: Tensor, positions: Tensor, sa_mask: Tensor | None, sa_cache: KVCache | None,
                 row_k: Tensor, row_v: Tensor, ca_mask: Tensor | None) -> Tensor:
        """MoA's forward, written once: token embeddings [B, T, E] at positions [B, T] -> SA (with
        its cache when drafting) -> CA over the rows' keys/values [B, H_kv, R, d] -> the predicted
        feature [B, T, E]. Training (whole sequences, K-step-bounded masks), incremental drafting
        (draft_step) and batched drafting (batched.py) differ only in the masks and caches they
        pass. The vLLM-native drafter (integration/moa/draft_model.py) keeps its own copy: vLLM's
        layers own the paged KV, the compiled graph and the tensor-parallel split (pinned to this
        one by tests/integration/vllm/test_vllm_model.py). With an attention window SA reads the
        last W positions and CA the last W rows it may read (models/masks), for every mode at once."""
        if self.attention_window:
            num_sa_keys = (0 if sa_cache is None else sa_cache.length) + embeds.shape[1]
            sa_mask = within_window(sa_mask, positions, num_sa_keys, self.attention_window)
            ca_mask = within_last_rows(ca_mask, row_k.shape[2], self.attention_window, row_k.device)
        hidden = self.sa(embeds, positions, sa_mask, sa_cache)
        return self._head(self.ca(hidden, positions, row_k, row_v, ca_mask))

    # -- training mode ------------------------------------------------------------------------
    def training_forward(self, batch: TrainingBatchView, target: TargetModel, target_out: TargetOutput) -> DraftOutput:
        ids, s = batch.input_ids, batch.last_anchor
        b, t = ids.shape
        positions = torch.arange(t, device=ids.device).expand(b, t)
        # only the layers LSA reads are gathered (a stride of 3 on SmolLM2: 10 of 30)
        if target_out.layer_rows is not None:
            layer_rows = self.lsa.select_rows(target_out.layer_rows, 2)  # [B, T, L', 2*Ekv]
        else:
            layer_rows = stack_layer_kv(self.lsa.select(target_out.keys), self.lsa.select(target_out.values))
        layer_rows = layer_rows.reshape(b * t, *layer_rows.shape[2:])  # [B*T, L', 2*Ekv]
        final_target = target_out.hidden_states[-1]  # [B, T, E]
        final_in = final_target.reshape(b * t, -1) if self.lsa.hidden2e is not None else None
        real = batch.real_tokens()  # LSA is per token: padding (never read by a real position) is skipped
        if real is None:
            flat = self.lsa.add_final_hidden(self.lsa(layer_rows), final_in)
            rows = flat.view(b, t, -1)  # [B, T, E]
        else:
            flat = self.lsa(layer_rows.index_select(0, real))  # [R, E]
            flat = self.lsa.add_final_hidden(flat, None if final_in is None else final_in.index_select(0, real))
            rows = flat.new_zeros(b * t, flat.shape[-1]).index_copy(0, real, flat).view(b, t, -1)
        row_k, row_v = self.ca.row_keys_values(rows, positions)
        feature = self.features(target.embed(ids), positions, self_attention_mask(s, batch.staircase), None,
                                row_k, row_v, cross_attention_mask(s))
        if self.tli == 0:
            return DraftOutput(self.vocab_logits(feature, target), [(feature, final_target, 1.0)], self.draft_vocab)
        # TLI > 0: at anchors the true hidden state replaces the prediction (the target's own
        # output there); elsewhere the last N layers attend true rows <= s(i), predicted rows > s(i).
        first = target.num_layers - self.tli
        true_mid = target_out.hidden_states[first]
        anchors = (s == torch.arange(t, device=ids.device))[..., None]
        mid = torch.where(anchors, true_mid, feature)
        final = target.run_last_layers(
            self.tli, mid, positions, target_out.keys[first:], target_out.values[first:], target_layers_mask(s)
        )
        return DraftOutput(self.vocab_logits(final, target), [(feature, true_mid, 0.5), (final, final_target, 0.5)],
                           self.draft_vocab)

    # -- incremental drafting -----------------------------------------------------------------
    def new_state(self) -> MoADraftState:
        return MoADraftState()

    def extend_verified(self, state: MoADraftState, keys: list[Tensor], values: list[Tensor],
                        final_hidden: Tensor | None = None) -> None:
        """Append n newly verified tokens from their per-layer target K/V (L x [B, H_kv, n, d]) (+
        their final post-norm hidden states [B, n, E], read with config final_hidden_rows)."""
        first = len(keys) - self.tli
        self.extend_rows(state, self.rows_from_kv(keys, values, final_hidden), keys[first:], values[first:])

    def extend_rows(self, state: MoADraftState, new_rows: Tensor, tli_keys: list[Tensor],
                    tli_values: list[Tensor], row_kv: tuple[Tensor, Tensor] | None = None) -> None:
        """Append n newly verified tokens as Ekv2E rows [B, n, E] (+ the target's K/V of its last TLI
        layers, TLI x [B, H_kv, n, d]): all the drafter needs from the target, so a remote client
        can be sent just this (serving/). Drafted TLI rows are dropped. `row_kv`: their CA keys and
        values [B, H_kv, n, d] when already computed (batched.py, for many sequences at once)."""
        b, n, _ = new_rows.shape
        if row_kv is None:
            start = state.num_verified
            row_kv = self.ca.row_keys_values(new_rows, torch.arange(start, start + n, device=new_rows.device).expand(b, n))
        k, v = row_kv
        if state.rows is None:
            state.rows, state.row_k, state.row_v = new_rows, k, v
        else:
            state.rows = torch.cat([state.rows, new_rows], dim=1)
            state.row_k = torch.cat([state.row_k, k], dim=2)
            state.row_v = torch.cat([state.row_v, v], dim=2)
        if len(tli_keys) != self.tli or len(tli_values) != self.tli:
            raise ValueError(f"TLI={self.tli} needs K/V of the target's last {self.tli} layers, got {len(tli_keys)}")
        for i in range(self.tli):
            state.tli_true.append(i, tli_keys[i], tli_values[i])
        state.tli_pred = TargetKVCache()

    def feed(self, state: MoADraftState, input_ids: Tensor, target: TargetModel) -> None:
        """Run tokens [B, n] through SA only (verified tokens whose drafts are not needed)."""
        b, n = input_ids.shape
        start = state.sa_length
        if self.tli > 0 and start + n > state.num_verified:
            raise ValueError("feed() is for verified tokens only; use draft_step() past the last verified token")
        positions = torch.arange(start, start + n, device=input_ids.device).expand(b, n)
        state.sa.append(*self.sa.keys_values(target.embed(input_ids), positions))  # SA is one block: its
        # cache of a token does not depend on what the token attends

    def rollback(self, state: MoADraftState, length: int) -> None:
        """Forget SA tokens from position `length` on (rejected drafts)."""
        state.sa.crop(length)
        state.tli_pred.crop(max(0, length - state.num_verified))

    def draft_step(self, state: MoADraftState, input_ids: Tensor, target: TargetModel,
                   positions: Tensor | None = None, visible: Tensor | None = None) -> Tensor:
        """Feed tokens [B, n] after the last verified token and return next-token logits [B, n, V].

        Default: a chain, at the next SA positions. A draft tree passes `positions` [B, n] and
        `visible` [n, D + n]: which of the D drafted tokens already fed this round (in feeding
        order), then these n, each new token attends (its ancestors and itself)."""
        b, n = input_ids.shape
        start, num_rows = state.sa_length, state.num_verified
        if num_rows == 0:
            raise ValueError("draft_step needs at least one verified token (call extend_verified first)")
        if (self.tli > 0 or visible is not None) and start < num_rows:
            raise ValueError(
                f"drafting starts after the last verified token (needed with TLI > 0 or a tree): SA has "
                f"{start} tokens, {num_rows} are verified"
            )
        device = input_ids.device
        if positions is None:
            positions = torch.arange(start, start + n, device=device).expand(b, n)
        if visible is None:
            sa_mask = causal_mask_after(start, n, device) if n > 1 else None  # one query sees every key
            drafted = torch.arange(num_rows, start + n, device=device)  # TLI rows: the chain so far
            visible = drafted[None, :] <= torch.arange(start, start + n, device=device)[:, None]
        elif n == 1 and bool(visible.all()):
            sa_mask = None  # a chain's step (or a tree's first level): its one query sees every key
        else:
            sa_mask = torch.cat([torch.ones(n, num_rows, dtype=torch.bool, device=device), visible], dim=-1)[None, None]
        if start >= num_rows:  # drafting past the verified prefix: every row is visible (no mask)
            ca_mask = None
        else:
            row_pos = torch.arange(num_rows, device=device)
            ca_mask = (row_pos[None, None, :] <= positions[:, :, None])[:, None]  # [B, 1, n, R]: j <= position
        feature = self.features(target.embed(input_ids), positions, sa_mask, state.sa, state.row_k, state.row_v,
                                ca_mask)
        if self.tli == 0:
            return self.draft_logits(feature, target)
        # the last N layers: true rows of verified tokens, then predicted rows of drafted ones
        true_mask = torch.ones(n, num_rows, dtype=torch.bool, device=device)
        mask = torch.cat([true_mask, visible], dim=-1)[None, None]
        final = target.run_last_layers(
            self.tli, feature, positions, state.tli_true.keys, state.tli_true.values, mask, state.tli_pred
        )
        return self.draft_logits(final, target)
