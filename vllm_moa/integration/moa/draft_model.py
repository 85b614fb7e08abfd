"""The MoA drafter as a vLLM model (architecture "MoADraftModel", registered by the plugin).

Same maths as `vllm_moa.kinds.moa.model.MoADrafter` (any TLI), laid out for vLLM's paged caches:

    tap (MoAProposer, once per step, outside CUDA graphs):
        target per-layer paged KV of the step's verified tokens --LSA (vllm_moa.kernels: Triton
        on GPU, PyTorch twin on CPU)--> Ekv2E rows --CA k/v projections, RoPE at the row's
        position--> written into CA's paged KV cache at the token's own slot
    forward (vLLM's draft-model loop; compiled, CUDA graphs where vLLM uses them):
        token embedding (target's) --SA (vLLM Attention, causal, own paged KV)--> CA query
        --CA (vLLM Attention over the row cache; writes nothing)--> out_norm (TLI = 0) or the
        target's own last TLI layers + final norm (TLI > 0) --> target LM head

CA attends exactly the R verified rows of its request: MoAProposer gives CA its own sequence
lengths (R) and, in the first pass, non-causal attention (every query of the pass, in particular
the one at the token the target just sampled, sees rows 0..R-1; the other queries' outputs are
not used). The target's KV, SA's KV and CA's rows of a token share its slot, so vLLM's block
management (prefix caching, preemption, chunked prefill) keeps them together.

SA and CA are built from vLLM layers (QKV/merged/row-parallel linears, RMSNorm, get_rope,
Attention), so vLLM owns their KV blocks (in the target's block tables), their attention
backend and their compilation; under tensor parallelism they shard by heads like the target's
attention, and the tap gathers each verified token's KV-head slices from every rank
(integration/moa/tensor_parallel.py). LSA is `vllm_moa.kinds.moa.model.LayerSelfAttention`, the module
whose weights the LSA kernel reads.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn
from vllm.compilation.decorators import support_torch_compile
from vllm.config import VllmConfig
from vllm.model_executor.layers.attention import Attention
from vllm.model_executor.layers.layernorm import RMSNorm
from vllm.model_executor.layers.linear import (
    ColumnParallelLinear,
    MergedColumnParallelLinear,
    QKVParallelLinear,
    ReplicatedLinear,
    RowParallelLinear,
)
from vllm.model_executor.layers.logits_processor import LogitsProcessor
from vllm.model_executor.layers.rotary_embedding import get_rope
from vllm.model_executor.model_loader.weight_utils import default_weight_loader
from vllm.model_executor.models.utils import maybe_prefix

from vllm_moa import envs
from vllm_moa.config import DrafterConfigError
from vllm_moa.integration.moa import tensor_parallel
from vllm_moa.integration.shell import tp_layout
from vllm_moa.kernels import lsa_attention
from vllm_moa.kernels.paged import gather_layer_rows
from vllm_moa.kinds.moa import MoAConfig
from vllm_moa.kinds.moa.model import LayerSelfAttention
from vllm_moa.packed_linear import check_drafter_weights, frozen_linear, linear, weight_format

AttentionFactory = Callable[..., nn.Module]

# checkpoint name (vllm_moa.kinds.moa.model.MoADrafter) -> (parameter name here, shard id or None)
_STACKED = {
    "sa.attn.q_proj": ("model.sa.qkv_proj", "q"),
    "sa.attn.k_proj": ("model.sa.qkv_proj", "k"),
    "sa.attn.v_proj": ("model.sa.qkv_proj", "v"),
    "ca.attn.k_proj": ("model.ca.kv_proj", 0),
    "ca.attn.v_proj": ("model.ca.kv_proj", 1),
    "sa.mlp.gate_proj": ("model.sa.mlp.gate_up_proj", 0),
    "sa.mlp.up_proj": ("model.sa.mlp.gate_up_proj", 1),
    "ca.mlp.gate_proj": ("model.ca.mlp.gate_up_proj", 0),
    "ca.mlp.up_proj": ("model.ca.mlp.gate_up_proj", 1),
}
_RENAMED = {
    "sa.attn.o_proj": "model.sa.o_proj",
    "ca.attn.q_proj": "model.ca.q_proj",
    "ca.attn.o_proj": "model.ca.o_proj",
}


def _stacked_rows_loader(rows: int) -> Callable[[Tensor, Tensor, int], None]:
    """A weight loader for a replicated stacked projection: shard i fills rows i*rows ... (i+1)*rows."""

    def load(param: Tensor, tensor: Tensor, shard: int) -> None:
        param.data[shard * rows: (shard + 1) * rows].copy_(tensor)

    return load


class MoAAttention(Attention):
    """vLLM's Attention for the drafter's SA and CA. With MoA's attention_window W it reads as a
    sliding-window layer of W does (the backend masks every key more than W - 1 positions before
    the query's last one: SA reads positions p - W + 1 .. p, CA the last W verified rows, as
    models/masks.py defines the window), while its KV cache stays a full-attention one: SA's and
    CA's entries share the target's blocks and slots (module docstring), and a sliding-window spec
    would put them in a KV cache group of their own whose blocks vLLM frees behind the window."""

    def get_kv_cache_spec(self, vllm_config: VllmConfig):
        window, self.sliding_window = self.sliding_window, None
        try:
            return super().get_kv_cache_spec(vllm_config)
        finally:
            self.sliding_window = window


def _rope(head_dim: int, theta: float, max_positions: int) -> nn.Module:
    return get_rope(head_dim, max_position=max_positions, is_neox_style=True,
                    rope_parameters={"rope_type": "default", "rope_theta": theta})


class MoAMLP(nn.Module):
    """SwiGLU. The activation is written out (vLLM's SiluAndMul needs its compiled ops even to
    be constructed on CPU); vLLM's compilation of the drafter fuses it on GPU. Under tensor
    parallelism it is split like the target's MLPs when the ranks divide its width, else
    replicated on every rank (no collective; e.g. width 1,024 at tensor_parallel_size 3), and
    always with VLLM_MOA_TP_DRAFTER_MLP=replicated."""

    def __init__(self, width: int, intermediate: int, prefix: str) -> None:
        super().__init__()
        if intermediate % tp_layout.tp_size() == 0 and tp_layout.tp_options()[0] == "sharded":
            self.gate_up_proj = MergedColumnParallelLinear(width, [intermediate] * 2, bias=False,
                                                           prefix=f"{prefix}.gate_up_proj")
            self.down_proj = RowParallelLinear(intermediate, width, bias=False, prefix=f"{prefix}.down_proj")
            return
        self.gate_up_proj = ReplicatedLinear(width, 2 * intermediate, bias=False, prefix=f"{prefix}.gate_up_proj")
        self.gate_up_proj.weight.weight_loader = _stacked_rows_loader(intermediate)  # gate (0) then up (1)
        self.down_proj = ReplicatedLinear(intermediate, width, bias=False, prefix=f"{prefix}.down_proj")

    def forward(self, x: Tensor) -> Tensor:
        gate_up, _ = self.gate_up_proj(x)  # [T, 2I]
        d = gate_up.shape[-1] // 2
        out, _ = self.down_proj(F.silu(gate_up[..., :d]) * gate_up[..., d:])
        return out


class _BlockOutput(nn.Module):
    """What SA and CA share: RoPE, vLLM's attention over this block's paged cache, and the second
    half (o_proj of the attention output, the residual, the MLP)."""

    def _build_output(self, config: MoAConfig, vllm_config: VllmConfig, attention: AttentionFactory, prefix: str,
                      heads: int, head_dim: int, intermediate: int) -> None:
        width = config.target_signature.hidden_size
        self.o_proj = RowParallelLinear(heads * head_dim, width, bias=False, prefix=f"{prefix}.o_proj")
        self.rotary_emb = _rope(head_dim, config.rope_theta, vllm_config.model_config.max_model_len)
        window = {"per_layer_sliding_window": config.attention_window} if config.attention_window else {}
        self.attn = attention(self.num_heads, head_dim, head_dim ** -0.5, num_kv_heads=self.num_kv_heads,
                              cache_config=vllm_config.cache_config, prefix=f"{prefix}.attn", **window)
        self.post_norm = RMSNorm(width, eps=config.rms_norm_eps)
        self.mlp = MoAMLP(width, intermediate, f"{prefix}.mlp")

    def finish(self, hidden: Tensor, attended: Tensor) -> Tensor:
        """hidden [T, E], attended [T, H * d] -> the block's output [T, E]"""
        out, _ = self.o_proj(attended)
        hidden = hidden + out
        return hidden + self.mlp(self.post_norm(hidden))


class MoASelfAttention(_BlockOutput):
    """SA: a pre-norm decoder block over the token embeddings, causal, vLLM-paged KV."""

    def __init__(self, config: MoAConfig, vllm_config: VllmConfig, attention: AttentionFactory, prefix: str) -> None:
        super().__init__()
        width = config.target_signature.hidden_size
        heads, kv_heads, d = config.sa_num_heads, config.sa_num_kv_heads, config.sa_head_dim
        tp = tp_layout.tp_size()  # heads of this rank (QKVParallelLinear's split)
        self.num_heads = tp_layout.local_heads(heads, tp, "the drafter's SA")
        self.num_kv_heads, self.head_dim = tp_layout.local_kv_heads(kv_heads, tp), d
        self.q_size, self.kv_size = self.num_heads * d, self.num_kv_heads * d
        self.input_norm = RMSNorm(width, eps=config.rms_norm_eps)
        self.qkv_proj = QKVParallelLinear(width, d, heads, kv_heads, bias=False, prefix=f"{prefix}.qkv_proj")
        self._build_output(config, vllm_config, attention, prefix, heads, d, config.sa_intermediate_size)

    # The block is written once, in three pieces: the paged forward below, the tree levels
    # (tree_levels.py: a dense masked attention over gathered K/V) and the catch-up's K/V
    # (keys_values) share them; only the attention between project and finish differs.
    def project(self, positions: Tensor, hidden: Tensor) -> tuple[Tensor, Tensor, Tensor]:
        """positions [T], hidden [T, E] -> q [T, H * d], k, v [T, H_kv * d] (q and k rotated)"""
        qkv, _ = self.qkv_proj(self.input_norm(hidden))
        q, k, v = qkv.split([self.q_size, self.kv_size, self.kv_size], dim=-1)
        q, k = self.rotary_emb(positions, q, k)
        return q, k, v

    def keys_values(self, positions: Tensor, hidden: Tensor) -> tuple[Tensor, Tensor]:
        """positions [T], hidden [T, E] -> k, v [T, H_kv * d] (k rotated): what the forward caches."""
        qkv, _ = self.qkv_proj(self.input_norm(hidden))
        _, k, v = qkv.split([self.q_size, self.kv_size, self.kv_size], dim=-1)
        k, _ = self.rotary_emb(positions, k, None)  # RoPE on k alone
        return k, v

    def forward(self, positions: Tensor, hidden: Tensor) -> Tensor:
        """positions [T], hidden [T, E] -> [T, E]"""
        q, k, v = self.project(positions, hidden)
        return self.finish(hidden, self.attn(q, k, v))


class MoACrossAttention(_BlockOutput):
    """CA: queries from SA's output; keys/values are the Ekv2E rows the tap wrote into this
    attention's paged cache (see the module docstring)."""

    def __init__(self, config: MoAConfig, vllm_config: VllmConfig, attention: AttentionFactory, prefix: str) -> None:
        super().__init__()
        width = config.target_signature.hidden_size
        heads, kv_heads, d = config.ca_num_heads, config.ca_num_kv_heads, config.ca_head_dim
        tp = tp_layout.tp_size()  # heads of this rank (the column-parallel projections' split)
        self.num_heads = tp_layout.local_heads(heads, tp, "the drafter's CA")
        self.num_kv_heads = tp_layout.local_heads(kv_heads, tp, "the drafter's CA KV")
        self.head_dim, self.kv_size = d, self.num_kv_heads * d
        self.query_norm = RMSNorm(width, eps=config.rms_norm_eps)
        self.row_norm = RMSNorm(width, eps=config.rms_norm_eps)
        self.q_proj = ColumnParallelLinear(width, heads * d, bias=False, prefix=f"{prefix}.q_proj")
        self.kv_proj = MergedColumnParallelLinear(width, [kv_heads * d] * 2, bias=False, prefix=f"{prefix}.kv_proj")
        self._build_output(config, vllm_config, attention, prefix, heads, d, config.ca_intermediate_size)

    def row_keys_values(self, rows: Tensor, positions: Tensor) -> tuple[Tensor, Tensor]:
        """Ekv2E rows [M, E] of tokens at positions [M] -> k, v [M, H_kv, d] (k rotated)."""
        kv, _ = self.kv_proj(self.row_norm(rows))
        k, v = kv.split([self.kv_size, self.kv_size], dim=-1)
        k, _ = self.rotary_emb(positions, k, None)  # RoPE on k alone, at the rows' own positions
        return k.view(-1, self.num_kv_heads, self.head_dim), v.view(-1, self.num_kv_heads, self.head_dim)

    def queries(self, positions: Tensor, hidden: Tensor) -> Tensor:
        """positions [T], hidden [T, E] (SA output) -> q [T, H * d] (rotated)"""
        q, _ = self.q_proj(self.query_norm(hidden))
        q, _ = self.rotary_emb(positions, q, None)
        return q

    def forward(self, positions: Tensor, hidden: Tensor) -> Tensor:
        """positions [T], hidden [T, E] (SA output) -> [T, E]"""
        # vLLM's attention op takes k/v tensors; CA has no slot mapping in the forward context,
        # so nothing is written and the backend reads K/V from the cache only.
        unused = hidden.new_zeros(hidden.shape[0], self.kv_size)
        return self.finish(hidden, self.attn(self.queries(positions, hidden), unused, unused))


@support_torch_compile(dynamic_arg_dims={"input_ids": {0: "b"}, "positions": {0: "b"}, "inputs_embeds": {0: "b"}})
class MoADraftStack(nn.Module):
    """The compiled part: embedding -> SA -> CA -> out_norm, over vLLM's flattened tokens."""

    def __init__(self, *, vllm_config: VllmConfig, prefix: str = "", attention: AttentionFactory | None = None) -> None:
        super().__init__()
        config = draft_hf_config(vllm_config)
        attention = attention or MoAAttention
        self.embed_tokens: nn.Module | None = None  # the target's; MoAProposer.load_model sets it
        # vLLM orders and binds KV caches by the one integer in each attention layer's name
        # (bind_kv_cache): SA and CA are numbered after the target's L layers, as EAGLE heads are.
        first = config.target_signature.num_layers
        self.sa = MoASelfAttention(config, vllm_config, attention, maybe_prefix(prefix, f"layers.{first}.sa"))
        self.ca = MoACrossAttention(config, vllm_config, attention, maybe_prefix(prefix, f"layers.{first + 1}.ca"))
        # TLI = 0: the CA output stands for the target's final post-norm hidden state (out_norm).
        # TLI = N > 0: it stands for the hidden state entering the target's layer L - N, and the
        # target's own last N decoder layers and final norm run on it (MoAProposer.load_model
        # hands them over; a tuple, so their weights stay the target's and are not the drafter's
        # parameters). Their attention reads and writes the target's own paged KV cache: the
        # target's K/V at verified positions, predicted K/V at drafted ones (MoAProposer gives
        # them slots only at drafted positions, which the target's next verification overwrites).
        self.out_norm = RMSNorm(config.target_signature.hidden_size, eps=config.rms_norm_eps) \
            if config.tli == 0 else None
        self.target_tail: tuple[tuple[nn.Module, ...], nn.Module] | None = None  # (last N layers, final norm)

    def forward(self, input_ids: torch.Tensor | None, positions: torch.Tensor,
                inputs_embeds: torch.Tensor | None = None) -> torch.Tensor:
        """input_ids [T] (or inputs_embeds [T, E]), positions [T] -> predicted final hidden [T, E]"""
        hidden = inputs_embeds if inputs_embeds is not None else self.embed_tokens(input_ids)
        hidden = self.sa(positions, hidden)
        hidden = self.ca(positions, hidden)  # [T, E]
        if self.out_norm is not None:
            return self.out_norm(hidden)
        layers, final_norm = self.target_tail
        residual = None
        for layer in layers:  # vLLM's decoder layers: (positions, hidden, residual) -> (hidden, residual)
            hidden, residual = layer(positions, hidden, residual)
        hidden, _ = final_norm(hidden, residual)
        return hidden


def draft_hf_config(vllm_config: VllmConfig) -> MoAConfig:
    spec = vllm_config.speculative_config
    config = spec.draft_model_config.hf_config if spec is not None else vllm_config.model_config.hf_config
    if not isinstance(config, MoAConfig):
        raise DrafterConfigError(f"MoADraftModel needs a MoA drafter config, got {type(config).__name__}")
    return config


class MoADraftModel(nn.Module):
    """vLLM's handle on the drafter: forward / compute_logits for the draft loop, `write_rows`
    for the tap, load_weights for MoADrafter checkpoints (trainable weights only)."""

    def __init__(self, *, vllm_config: VllmConfig, prefix: str = "", attention: AttentionFactory | None = None) -> None:
        super().__init__()
        self.config = config = draft_hf_config(vllm_config)
        self.model = MoADraftStack(vllm_config=vllm_config, prefix=maybe_prefix(prefix, "model"), attention=attention)
        # the head rows and LSA run through packed_linear, on VLLM_MOA_DRAFTER_WEIGHTS in CPU
        # inference (drafts change a little, outputs never: the target is untouched)
        self.weight_format = check_drafter_weights(envs.VLLM_MOA_DRAFTER_WEIGHTS, "VLLM_MOA_DRAFTER_WEIGHTS")
        self.lsa = weight_format(LayerSelfAttention(config), self.weight_format)
        self.lm_head: nn.Module | None = None  # the target's; MoAProposer.load_model sets it
        self.logits_processor = LogitsProcessor(config.target_signature.vocab_size)
        # a reduced draft vocabulary (config draft_vocab_size > 0): [N] target ids, from the checkpoint
        self.draft_vocab: Tensor | None
        if config.draft_vocab_size:
            self.register_buffer("draft_vocab", torch.arange(config.draft_vocab_size, dtype=torch.long))
        else:
            self.draft_vocab = None
        self._draft_vocab_rows: tuple[tuple[int, int, int], nn.Linear] | None = None  # (weights' key, [N, E] head)
        self.tap_traffic = tensor_parallel.TapTraffic()  # the tap's all-gathers (tensor parallelism)
        self.tap_fp8 = tp_layout.tp_options()[1] == "fp8"  # VLLM_MOA_TP_TAP_DTYPE, read once

    # -- the draft loop ---------------------------------------------------------------------
    def embed_input_ids(self, input_ids: Tensor, **_: Any) -> Tensor:
        return self.model.embed_tokens(input_ids)

    def forward(self, input_ids: Tensor | None, positions: Tensor, inputs_embeds: Tensor | None = None,
                **_: Any) -> Tensor:
        return self.model(input_ids, positions, inputs_embeds)

    def compute_logits(self, hidden_states: Tensor) -> Tensor | None:
        """hidden [M, E] -> logits [M, V]; with a draft vocabulary only its N rows of the LM head
        are multiplied and every other token gets -inf (never drafted)."""
        if self.draft_vocab is None:
            return self.logits_processor(self.lm_head, hidden_states)
        # the head's N rows [N, E], gathered once and kept (gathering them at every draft step
        # copied N x E values per step: 15% of a SmolLM2 worker's time at concurrency 1); under
        # tensor parallelism vLLM shards the head by vocabulary and the rows take a collective
        key = (self.lm_head.weight.data_ptr(), self.lm_head.weight._version, self.draft_vocab._version)
        if self._draft_vocab_rows is None or self._draft_vocab_rows[0] != key:
            rows = tensor_parallel.vocab_rows(self.lm_head, self.draft_vocab)  # [N, E]
            self._draft_vocab_rows = key, frozen_linear(rows, self.weight_format)
        logits = linear(hidden_states, self._draft_vocab_rows[1])  # [M, N]
        full = logits.new_full((logits.shape[0], self.config.target_signature.vocab_size), float("-inf"))
        return full.index_copy_(-1, self.draft_vocab, logits)

    # -- catching up after steps without drafts (integration/moa/catch_up.py) ----------------------
    @torch.inference_mode()
    def write_sa_keys_values(self, token_ids: Tensor, positions: Tensor, slots: Tensor) -> None:
        """SA's keys/values of tokens [M] at positions [M], written at slots [M] of SA's paged
        cache: what the first pass writes for them (they depend on the token and its position only)."""
        sa = self.model.sa
        k, v = sa.keys_values(positions, self.model.embed_tokens(token_ids))
        shape = (-1, sa.num_kv_heads, sa.head_dim)
        sa.attn.impl.do_kv_cache_update(sa.attn, k.view(shape), v.view(shape), sa.attn.kv_cache, slots)

    # -- the tap ----------------------------------------------------------------------------
    @torch.inference_mode()
    def write_rows(self, target_kv_caches: list[Tensor], layout: Callable, read_slots: Tensor,
                   row_positions: Tensor, write_slots: Tensor, final_hidden: Tensor | None = None,
                   token_ids: Tensor | None = None) -> None:
        """Turn verified tokens into CA keys/values in CA's paged cache.

        target_kv_caches: the target's L per-layer caches (vLLM's tensors, read in `layout`; LSA reads
                          those of its layers, config lsa_layer_stride)
        read_slots [M]:    the tokens' slots in those caches
        row_positions [M]: their positions (RoPE of the CA keys)
        write_slots [M]:   CA cache slots to write (the same slots; -1 = skip, a rejected draft)
        final_hidden [M, E]: the tokens' final post-norm target hidden states (the target's output
                          this step; read with config final_hidden_rows)
        token_ids [M]:     the tokens (tensor parallelism: a checksum of the verified ones in
                          tap_traffic shows that the ranks stay in step)
        """
        caches = self.lsa.select(target_kv_caches)
        if tp_layout.tp_size() == 1:
            rows = lsa_attention(self.lsa, caches, read_slots, layout=layout)  # [M, E]
        else:  # this rank holds some KV heads: gather the verified tokens' rows, LSA replicated
            step_tokens = read_slots.shape[0]
            keep = (write_slots >= 0).nonzero().squeeze(1)  # [A] (same on every rank)
            if keep.numel() == 0:
                return
            read_slots, row_positions, write_slots = read_slots[keep], row_positions[keep], write_slots[keep]
            final_hidden = None if final_hidden is None else final_hidden[keep]
            local = gather_layer_rows(caches, read_slots, layout)  # [A, L, H_local * 2d]
            if token_ids is not None:
                self.tap_traffic.add_tokens(token_ids[keep], row_positions)
            full = tensor_parallel.gather_full_rows(local, self.config.target_signature.num_kv_heads,
                                                    self.tap_traffic, step_tokens,
                                                    self.config.target_signature.head_dim,
                                                    self.tap_fp8)  # [A, L, H_kv * 2d]
            rows = self.lsa(full)
        rows = self.lsa.add_final_hidden(rows, final_hidden)
        k, v = self.model.ca.row_keys_values(rows, row_positions)
        attn = self.model.ca.attn
        attn.impl.do_kv_cache_update(attn, k, v, attn.kv_cache, write_slots)

    # -- weights ----------------------------------------------------------------------------
    def load_weights(self, weights: Iterable[tuple[str, Tensor]]) -> set[str]:
        """Load a MoADrafter checkpoint (names as `MoADrafter.state_dict()`); returns the
        parameter names filled, which vLLM's loader compares with the model's."""
        params = dict(self.named_parameters())
        loaded: set[str] = set()
        for name, tensor in weights:
            if name == "draft_vocab":  # a buffer, not a parameter: vLLM's loader does not track it
                if self.draft_vocab is None or tensor.shape != self.draft_vocab.shape:
                    raise DrafterConfigError("MoA checkpoint's draft_vocab does not match config draft_vocab_size")
                self.draft_vocab.copy_(tensor.to(self.draft_vocab.device, torch.long))
                continue
            module, _, leaf = name.rpartition(".")
            if module in _STACKED:
                target, shard = _STACKED[module]
                param = params[f"{target}.{leaf}"]
                param.weight_loader(param, tensor, shard)
                loaded.add(f"{target}.{leaf}")
                continue
            target_name = f"{_RENAMED[module]}.{leaf}" if module in _RENAMED else _checkpoint_to_param(name)
            if target_name not in params:
                raise DrafterConfigError(f"MoA checkpoint tensor {name!r} has no place in {type(self).__name__}")
            param = params[target_name]
            getattr(param, "weight_loader", default_weight_loader)(param, tensor)
            loaded.add(target_name)
        return loaded


def _checkpoint_to_param(name: str) -> str:
    """lsa.* keeps its name; sa.*, ca.*, out_norm.* live under the compiled stack `model.`."""
    if name.startswith("lsa."):
        return name
    return f"model.{name}"
