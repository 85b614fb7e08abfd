"""Adapter over a transformers target (Llama and Qwen2 families).

The drafter needs more of the target than `forward()` exposes: every layer's post-RoPE K/V (what
LSA reads, exactly as a serving engine caches it), the hidden state entering any layer, the final
norm, the embedding and LM head, and the last N decoder layers run on *predicted* hidden states
against a mix of true and predicted keys (TLI). So the adapter runs the target's own frozen
modules through a small functional decoder, identical in maths to transformers' (a test checks
logits against `model(...)`), and independent of transformers' cache classes.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass, field
from pathlib import Path
from typing import Protocol, runtime_checkable

import torch
from torch import Tensor, nn

from vllm_moa.config import TargetSignature
from vllm_moa.layers import KVCache, apply_rotary, attend, causal_mask_after
from vllm_moa.packed_linear import linear

SUPPORTED_ARCHITECTURES = (
    "LlamaForCausalLM",
    "Qwen2ForCausalLM",
    "MistralForCausalLM",
)


class UnsupportedTargetError(ValueError):
    """The target is not a Llama/Qwen2-family causal LM."""


@runtime_checkable
class LayeredKVCache(Protocol):
    """The contract of a cache the target writes through (`TargetModel.forward`, and
    `run_last_layers` for TLI's predicted rows). Two caches implement it:

      TargetKVCache           one growing sequence (or a batch of equal length): plain decoding,
                              training, TLI caches of the MoA drafter
      decoding.cache.SlotKVCache  a batch of sequences of different lengths in per-sequence slots,
                              draft trees compacted to their accepted paths: the runtime and server

    `layers.KVCache` is the building block below them: one attention's K/V (`append(k, v)`), also
    the drafters' own attention caches."""

    @property
    def length(self) -> int:
        """Positions before this forward's new tokens (for a batch: its longest sequence)."""
        ...

    def append(self, layer: int, k: Tensor, v: Tensor) -> tuple[Tensor, Tensor]:
        """k, v [B, H_kv, N, d]: this forward's new tokens in `layer` (post-RoPE K) -> the K/V
        they attend over [B, H_kv, S, d], themselves included."""
        ...


@dataclass
class TargetKVCache:
    """Per-layer K/V of the target, post-RoPE: one `KVCache` per layer, keys[l] / values[l] are
    [B, H_kv, T, d]. A `LayeredKVCache`."""

    layers: list[KVCache] = field(default_factory=list)

    @property
    def keys(self) -> list[Tensor]:
        return [layer.k for layer in self.layers]

    @property
    def values(self) -> list[Tensor]:
        return [layer.v for layer in self.layers]

    @property
    def length(self) -> int:
        return self.layers[0].length if self.layers else 0

    def append(self, layer: int, k: Tensor, v: Tensor) -> tuple[Tensor, Tensor]:
        """Append this step's K/V of one layer; return the layer's whole K/V."""
        if len(self.layers) <= layer:
            self.layers.append(KVCache())
        return self.layers[layer].append(k, v)

    def crop(self, length: int) -> None:
        """Drop everything from token position `length` on (rejected draft tokens)."""
        for layer in self.layers:
            layer.crop(length)


@dataclass
class TargetOutput:
    """What one target forward over T new tokens gives the drafter.

    logits:        [B, T, V]
    hidden_states: L + 1 tensors [B, T, E]; hidden_states[l] enters layer l, hidden_states[L] is
                   the final *post-norm* hidden state (what the LM head reads)
    keys, values:  L tensors [B, H_kv, T, d] of the new tokens (K post-RoPE, as cached)

    Read back from the offline feature cache (training/features.py) instead, logits are None,
    hidden_states / keys / values hold only the entries the drafters read (others None), and:
    layer_rows:    [B, T, L, 2 * Ekv] the K/V already in stack_layer_kv's layout (LSA input)
    argmax:        [B, T] the target's greedy next token over the full vocabulary
    """

    logits: Tensor | None
    hidden_states: list[Tensor | None]
    keys: list[Tensor | None]
    values: list[Tensor | None]
    layer_rows: Tensor | None = None
    argmax: Tensor | None = None

    def greedy_tokens(self) -> Tensor:
        """[B, T] the target's argmax next token."""
        return self.argmax if self.argmax is not None else self.logits.argmax(-1)


class TargetModel(nn.Module):
    """A frozen transformers causal LM seen through the operations MoA needs."""

    def __init__(self, hf_model: nn.Module, name: str = "") -> None:
        super().__init__()
        architecture = type(hf_model).__name__
        if architecture not in SUPPORTED_ARCHITECTURES:
            raise UnsupportedTargetError(
                f"target architecture {architecture} is not supported; "
                f"supported: {', '.join(SUPPORTED_ARCHITECTURES)}"
            )
        self.hf_model = hf_model.eval()
        for param in self.hf_model.parameters():
            param.requires_grad_(False)
        cfg = hf_model.config
        self.architecture = architecture
        self.name = name or getattr(cfg, "_name_or_path", "") or architecture
        self.num_layers: int = cfg.num_hidden_layers
        self.hidden_size: int = cfg.hidden_size
        self.num_heads: int = cfg.num_attention_heads
        self.num_kv_heads: int = getattr(cfg, "num_key_value_heads", None) or cfg.num_attention_heads
        self.head_dim: int = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
        self.vocab_size: int = cfg.vocab_size
        window = getattr(cfg, "sliding_window", None)
        if getattr(cfg, "use_sliding_window", True) and window and window < getattr(cfg, "max_position_embeddings", 0):
            raise UnsupportedTargetError(
                f"target uses sliding-window attention (sliding_window={window}); not supported yet"
            )
        self._fingerprint: str | None = None
        # the local folder it was loaded from (a servable drafter names it as its verifier)
        self.directory: Path | None = None

    # -- loading ------------------------------------------------------------------------------
    @classmethod
    def from_pretrained(cls, path: str | Path, dtype: torch.dtype = torch.float32,
                        device: str | torch.device = "cpu") -> TargetModel:
        import transformers
        from packaging.version import Version
        from transformers import AutoModelForCausalLM

        # transformers renamed `torch_dtype` to `dtype` in 4.56
        key = "dtype" if Version(transformers.__version__) >= Version("4.56") else "torch_dtype"
        try:
            hf_model = AutoModelForCausalLM.from_pretrained(str(path), **{key: dtype})
        except (OSError, ValueError) as err:
            raise UnsupportedTargetError(f"cannot load a causal LM target from {path}: {err}") from None
        model = cls(hf_model.to(device), name=Path(str(path)).name)
        if Path(str(path)).is_dir():
            model.directory = Path(str(path)).resolve()
        return model

    # -- parts --------------------------------------------------------------------------------
    @property
    def decoder(self) -> nn.Module:
        return self.hf_model.model

    @property
    def layers(self) -> nn.ModuleList:
        return self.hf_model.model.layers

    @property
    def device(self) -> torch.device:
        return self.hf_model.lm_head.weight.device

    @property
    def dtype(self) -> torch.dtype:
        return self.hf_model.lm_head.weight.dtype

    def embed(self, input_ids: Tensor) -> Tensor:
        """[B, T] -> [B, T, E]"""
        return self.decoder.embed_tokens(input_ids)

    def final_norm(self, hidden: Tensor) -> Tensor:
        return self.decoder.norm(hidden)

    def lm_head(self, hidden: Tensor) -> Tensor:
        """post-norm hidden [..., E] -> logits [..., V]"""
        return linear(hidden, self.hf_model.lm_head)

    def lm_head_weight(self) -> Tensor:
        """[V, E] the LM head's weight (its rows give a reduced draft vocabulary's logits)."""
        return self.hf_model.lm_head.weight

    def rotary(self, positions: Tensor) -> tuple[Tensor, Tensor]:
        """positions [B, T] -> cos, sin [B, T, d] (the target's own rotary, scaling included)."""
        probe = torch.empty(0, device=positions.device, dtype=self.dtype)
        return self.decoder.rotary_emb(probe, positions)

    @property
    def signature(self) -> TargetSignature:
        return TargetSignature(
            architecture=self.architecture,
            num_layers=self.num_layers,
            hidden_size=self.hidden_size,
            num_attention_heads=self.num_heads,
            num_kv_heads=self.num_kv_heads,
            head_dim=self.head_dim,
            vocab_size=self.vocab_size,
            name=self.name,
            fingerprint=self.fingerprint(),
        )

    def fingerprint(self) -> str:
        """sha256 of a strided, bf16-rounded sample of embedding and LM head (dtype-independent)."""
        if self._fingerprint is None:
            digest = hashlib.sha256()
            for weight in (self.decoder.embed_tokens.weight, self.hf_model.lm_head.weight):
                rows = weight[:: max(1, weight.shape[0] // 256)]
                sample = rows.detach().to("cpu", torch.float32).to(torch.bfloat16).view(torch.int16)
                digest.update(sample.numpy().tobytes())
            self._fingerprint = digest.hexdigest()[:16]
        return self._fingerprint

    # -- one decoder layer, functional --------------------------------------------------------
    # Projections sharing an input run as one matmul (q/k/v, gate/up): packed for oneDNN in CPU
    # inference (packed_linear.py), the modules themselves elsewhere.
    def layer_qkv(self, layer: int, hidden: Tensor, cos: Tensor, sin: Tensor) -> tuple[Tensor, Tensor, Tensor]:
        """hidden [B, T, E] entering `layer` -> q [B, H, T, d], k, v [B, H_kv, T, d] (q, k post-RoPE)."""
        block = self.layers[layer]
        attn = block.self_attn
        x = block.input_layernorm(hidden)
        b, t, _ = x.shape
        q, k, v = linear(x, attn.q_proj, attn.k_proj, attn.v_proj)
        q = q.reshape(b, t, self.num_heads, self.head_dim).transpose(1, 2)
        k = k.reshape(b, t, self.num_kv_heads, self.head_dim).transpose(1, 2)
        v = v.reshape(b, t, self.num_kv_heads, self.head_dim).transpose(1, 2)
        return apply_rotary(q, cos, sin), apply_rotary(k, cos, sin), v

    def layer_finish(self, layer: int, hidden: Tensor, attn_out: Tensor) -> Tensor:
        """Residual stream after attention [B, H, T, d] -> hidden leaving `layer` [B, T, E]."""
        block = self.layers[layer]
        b, _, t, _ = attn_out.shape
        hidden = hidden + linear(attn_out.transpose(1, 2).reshape(b, t, -1), block.self_attn.o_proj)
        mlp = block.mlp  # gate / up / down with act_fn: Llama, Qwen2 and Mistral alike
        gate, up = linear(block.post_attention_layernorm(hidden), mlp.gate_proj, mlp.up_proj)
        return hidden + linear(mlp.act_fn(gate) * up, mlp.down_proj)

    # -- whole forward ------------------------------------------------------------------------
    @torch.no_grad()
    def forward(
        self,
        input_ids: Tensor,
        cache: LayeredKVCache | None = None,
        positions: Tensor | None = None,
        attn_mask: Tensor | None = None,
    ) -> TargetOutput:
        """Run the target over new tokens `input_ids` [B, T] after `cache` (if any).

        Default: positions continue the cache, causal attention. A tree verification passes its own
        `positions` [B, T] and `attn_mask` [B, 1, T, T_cache + T] (True = may attend).
        """
        b, t = input_ids.shape
        past = cache.length if cache is not None else 0
        if positions is None:
            positions = torch.arange(past, past + t, device=input_ids.device).expand(b, t)
        if attn_mask is None:
            attn_mask = causal_mask_after(past, t, input_ids.device)
        cos, sin = self.rotary(positions)
        hidden = self.embed(input_ids)
        hidden_states, keys, values = [], [], []
        for layer in range(self.num_layers):
            hidden_states.append(hidden)
            q, k, v = self.layer_qkv(layer, hidden, cos, sin)
            keys.append(k)
            values.append(v)
            if cache is not None:
                k, v = cache.append(layer, k, v)
            hidden = self.layer_finish(layer, hidden, attend(q, k, v, attn_mask))
        hidden = self.final_norm(hidden)
        hidden_states.append(hidden)
        return TargetOutput(self.lm_head(hidden), hidden_states, keys, values)

    # -- TLI: the last N layers on predicted hidden states ------------------------------------
    def run_last_layers(
        self,
        num_layers: int,
        hidden: Tensor,
        positions: Tensor,
        true_keys: list[Tensor],
        true_values: list[Tensor],
        attn_mask: Tensor,
        pred_cache: LayeredKVCache | None = None,
    ) -> Tensor:
        """Run the target's last `num_layers` layers + final norm on predicted hidden states.

        hidden:      [B, T, E] entering layer L - num_layers (drafter predictions)
        true_*:      per last layer, the target's own K/V [B, H_kv, S, d] of verified tokens
        attn_mask:   [B, 1, T, S + P] over [true rows; predicted rows (pred_cache then new)]
        pred_cache:  K/V of earlier predicted positions for these layers (incremental drafting);
                     layer index inside it is 0..num_layers-1. Appended to in place.
        Returns the final post-norm hidden [B, T, E].
        """
        cos, sin = self.rotary(positions)
        first = self.num_layers - num_layers
        for i in range(num_layers):
            layer = first + i
            q, k, v = self.layer_qkv(layer, hidden, cos, sin)
            if pred_cache is not None:
                k, v = pred_cache.append(i, k, v)
            keys = torch.cat([true_keys[i], k], dim=2)
            values = torch.cat([true_values[i], v], dim=2)
            hidden = self.layer_finish(layer, hidden, attend(q, keys, values, attn_mask))
        return self.final_norm(hidden)


def stack_layer_kv(keys: list[Tensor], values: list[Tensor]) -> Tensor:
    """Per-layer K/V -> LSA input rows.

    keys, values: L tensors [B, H_kv, T, d]  ->  [B, T, L, 2 * H_kv * d], where each layer's row
    is the concatenation over KV heads h of (k_h, v_h). This per-head interleave is the layout the
    LSA kernels read from paged caches; keep them in sync.
    """
    k = torch.stack(keys, dim=0)  # [L, B, H_kv, T, d]
    v = torch.stack(values, dim=0)
    kv = torch.cat([k, v], dim=-1)  # [L, B, H_kv, T, 2d]
    num_layers, b, h_kv, t, two_d = kv.shape
    return kv.permute(1, 3, 0, 2, 4).reshape(b, t, num_layers, h_kv * two_d)

