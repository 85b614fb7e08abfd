"""Triton kernels for MoA inside a serving engine, each with a PyTorch twin.

Installed as ``vllm_moa.kernels`` (the folder is the repository's top-level ``kernels/``).

The switch (one, documented in kernels/_backend.py)::

    VLLM_MOA_KERNELS = auto | triton | torch     auto: Triton on CUDA tensors, the twins otherwise

Public API
----------
LSA over the target's paged per-layer KV (kernels/lsa.py)
    lsa_attention(lsa, caches, slots, layout=, chunk_tokens=, backend=) -> [N, E]   (dispatch)
    lsa_rows_from_paged(...)        the Triton path (gather-GEMM + layer attention + residual)
    lsa_attention_reference(...)    the twin: gather_layer_rows + the LayerSelfAttention module
Tree attention over a paged KV cache (kernels/tree.py)
    tree_attention_paged(q, kv_cache, block_tables, prefix_lens, cu_seqlens_q, ancestor_masks,
                         layout=, sm_scale=, backend=) -> [T, H, d]                  (dispatch)
    tree_attention_triton(...)      the Triton kernel
    tree_attention_reference(...)   the twin: dense boolean mask + F.scaled_dot_product_attention
    tree_ancestor_masks(parents, cu_seqlens) -> int64 [T]
    plan_tree_attention(block_tables, prefix_lens, cu_seqlens_q, ancestor_masks, block_size)
    tree_attention_planned(q, kv_cache, plan, layout=, sm_scale=) -> [T, H, d]
                                    CPU: what a step's layers share read once (kernels/tree_cpu.py)
    Called by draft-tree verification inside vLLM's engine (vllm_moa/integration/moa/tree_verification.py,
    CPU_ATTN: the planned CPU path; GPU backends are refused until the Triton path is tested on a GPU).
Paged caches (kernels/paged.py; the layout is documented there)
    split_kv_cache, gather_slots, gather_blocks, write_slots, slot_mapping, gather_layer_rows, new_kv_cache,
    PagedLayers
Backend
    use_triton(device=None, backend=None) -> bool, kernel_backend(), HAS_TRITON

Everything imports without Triton; only calls that resolve to Triton need it.

Imported as a top-level ``kernels`` (the repository's root on sys.path: pytest's ``pythonpath``,
``python -m`` from a checkout) while Hugging Face's ``kernels`` distribution is installed, this
folder hands over to that package (``_shadow.hand_over``): transformers (>= 5.2x, at import) and
vLLM import it by that name, and this folder must not shadow it.
"""

from ._shadow import hand_over

if not (__name__ == "kernels" and hand_over(__file__)):
    from ._backend import BACKENDS, ENV_VAR, HAS_TRITON, interpreting, kernel_backend, lsa_triton_max_tokens, use_triton
    from .lsa import lsa_attention, lsa_attention_reference, lsa_rows_from_paged
    from .paged import (
        LAYOUTS,
        PagedLayers,
        gather_blocks,
        gather_layer_rows,
        gather_slots,
        new_kv_cache,
        slot_mapping,
        split_kv_cache,
        write_slots,
    )
    from .tree import (
        MAX_TREE_NODES,
        tree_ancestor_masks,
        tree_attention_paged,
        tree_attention_reference,
        tree_attention_triton,
    )
    from .tree_cpu import (
        TreeAttentionPlan,
        plan_tree_attention,
        tree_attention_planned,
    )

__all__ = [
    "BACKENDS",
    "ENV_VAR",
    "HAS_TRITON",
    "LAYOUTS",
    "MAX_TREE_NODES",
    "PagedLayers",
    "gather_layer_rows",
    "gather_slots",
    "interpreting",
    "kernel_backend",
    "lsa_attention",
    "lsa_attention_reference",
    "lsa_rows_from_paged",
    "new_kv_cache",
    "slot_mapping",
    "split_kv_cache",
    "tree_ancestor_masks",
    "tree_attention_paged",
    "tree_attention_reference",
    "TreeAttentionPlan",
    "plan_tree_attention",
    "tree_attention_planned",
    "gather_blocks",
    "tree_attention_triton",
    "use_triton",
    "lsa_triton_max_tokens",
    "write_slots",
]
