"""Which of vLLM's attention layers are the target's, and the checks MoA needs of them before it
taps their paged KV cache: one layer per layer the drafter was trained on, this rank's share of
the KV heads, one KV-cache group shared with the drafter, one attention backend (with the tree
mask's limits when drafting trees), and the decoder-layer call TLI runs.
"""

from __future__ import annotations

import inspect
from typing import Any

from torch import nn

from vllm_moa.integration.moa import tree_verification
from vllm_moa.integration.shell import compat, tp_layout
from vllm_moa.integration.shell.draft_config import TREE_FIELD, UnsupportedMoASetup


def target_attention_layers(layers: dict[str, Any], draft_layer_names: set[str], signature: Any,
                            layer_index: Any) -> list[Any]:
    """The target's attention layers in layer order, checked against the drafter's signature.
    layers: vLLM's attention layers by name (target's and drafter's); layer_index: name -> index."""
    target_names = sorted(set(layers) - draft_layer_names, key=layer_index)
    if len(target_names) != signature.num_layers:
        raise UnsupportedMoASetup(
            f"the drafter was trained on {signature.num_layers} target layers; vLLM's target has "
            f"{len(target_names)} attention layers ({target_names[:3]}...)"
        )
    tp = tp_layout.tp_size()
    kv_heads = tp_layout.local_kv_heads(signature.num_kv_heads, tp)  # this rank's share (the tap gathers)
    for name in target_names:
        layer = layers[name]
        if (layer.num_kv_heads, layer.head_size) != (kv_heads, signature.head_dim):
            raise UnsupportedMoASetup(
                f"target layer {name} has {layer.num_kv_heads} KV heads of {layer.head_size} on this rank; "
                f"the drafter needs {kv_heads} of {signature.head_dim} (the target's {signature.num_kv_heads} "
                f"at tensor_parallel_size={tp})"
            )
    return [layers[name] for name in target_names]


def kv_layout_of(target_layers: list[Any], group: Any, group_id: int, drafts_trees: bool) -> tuple[compat.KVLayout, str]:
    """The target's KV-cache layout reader and backend name, after checking that every target layer
    shares the drafter's KV-cache `group` and one backend (and, for trees, one the tree mask covers)."""
    target_names = {layer.layer_name for layer in target_layers}
    if not target_names <= set(group.layer_names):
        raise UnsupportedMoASetup(
            "MoA addresses the target's KV cache with the drafter's block table, so every target "
            "attention layer must share the drafter's KV-cache group; vLLM split them "
            f"(drafter group {group_id}: {sorted(group.layer_names)[:4]}...)"
        )
    backends = {layer.get_attn_backend().get_name() for layer in target_layers}
    if len(backends) != 1:
        raise UnsupportedMoASetup(f"target layers run on several attention backends: {sorted(backends)}")
    backend = backends.pop()
    if drafts_trees:
        if backend not in tree_verification.TREE_BACKENDS:
            raise UnsupportedMoASetup(
                f"draft trees ({TREE_FIELD}) are verified with the {', '.join(tree_verification.TREE_BACKENDS)} "
                f"attention backend so far; this target runs on {backend} (drop {TREE_FIELD} to draft chains)")
        for layer in target_layers:
            for feature in ("logits_soft_cap", "sinks", "alibi_slopes"):
                if getattr(layer.impl, feature, None):
                    raise UnsupportedMoASetup(
                        f"draft trees ({TREE_FIELD}): the tree mask does not apply the target's {feature} "
                        f"(layer {layer.layer_name}); drop {TREE_FIELD} to draft chains")
    isas = {getattr(layer, "isa", None) for layer in target_layers}  # CPU_ATTN's kernel choice
    return compat.kv_layout_for_backend(backend, isas.pop() if len(isas) == 1 else None), backend


def tli_decoder_layers(target_language_model: nn.Module, tli: int) -> tuple[nn.Module, ...]:
    """The target's own last `tli` decoder layers (shared, never copied), checked for the call
    TLI makes: (positions, hidden_states, residual)."""
    layers = tuple(target_language_model.model.layers[-tli:])
    for layer in layers:
        params = list(inspect.signature(layer.forward).parameters)
        if params[:3] != ["positions", "hidden_states", "residual"]:
            raise UnsupportedMoASetup(
                f"TLI={tli} runs the target's decoder layers as (positions, hidden_states, residual); "
                f"{type(layer).__name__}.forward takes {params}")
    return layers
