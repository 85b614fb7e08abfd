"""Paged KV caches as vLLM lays them out, and PyTorch helpers to read and write them.

Layout (per target attention layer; one tensor per layer, as vLLM binds ``layer.kv_cache``)
------------------------------------------------------------------------------------------
``"flash_attn"`` (the default here; FlashAttention in some vLLM releases)::

    kv_cache: [2, num_blocks, block_size, num_kv_heads, head_dim]   kv_cache[0] = K, kv_cache[1] = V

``"blocks_first"`` (FlashInfer / TRITON_ATTN in some vLLM releases, which unbind dimension 1)::

    kv_cache: [num_blocks, 2, block_size, num_kv_heads, head_dim]   kv_cache[:, 0] = K, kv_cache[:, 1] = V

or any callable ``layout(kv_cache) -> (k, v)`` that returns two strided views
``[num_blocks, block_size, num_kv_heads, head_dim]`` -- vLLM 0.26.0 packs K and V as
``[num_blocks, num_kv_heads, block_size, 2 * head_dim]``, read by
``vllm_moa.integration.shell.compat.packed_kv_layout`` (a callable reads a cache whose first dimension
is the block: ``gather_blocks`` copies blocks out along it). Only strides are used, so caches that vLLM
allocates in another physical order and permutes back to the logical shape (``HND`` stride
orders) work unchanged. Verify the layout against the installed vLLM's
``AttentionBackend.get_kv_cache_shape`` before relying on it; fp8 KV caches are not supported.

K in the cache is post-RoPE (the target applied its rotary embedding before writing it).

Addressing: the token at position ``p`` of a sequence whose block-table row is ``bt`` lives at
``slot = bt[p // block_size] * block_size + p % block_size``; its K for head ``h`` is
``K[slot // block_size, slot % block_size, h, :]``. vLLM's ``slot_mapping`` holds the slots of
the tokens scheduled in a step; ``block_table_tensor`` and ``seq_lens`` give the rest.

LSA row layout (must match ``vllm_moa.target.stack_layer_kv``): for token slot ``s`` and target
layer ``l`` the row is the concatenation over KV heads ``h`` of ``(K_l[s, h], V_l[s, h])``, width
``2 * num_kv_heads * head_dim``; column ``c`` is head ``c // (2d)``, K if ``c % (2d) < d`` else V,
element ``c % d``.

Layers: a sequence of L per-layer cache tensors (what vLLM has: separate allocations), or one
stacked tensor with a leading layer dimension. The Triton kernels address every layer from layer
0's base pointer plus an int64 element offset per layer (``PagedLayers.layer_offsets``), so no
copy or stacking of the caches is ever made.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Union

import torch
from torch import Tensor

Layout = Union[str, Callable[[Tensor], "tuple[Tensor, Tensor]"]]
LAYOUTS = ("flash_attn", "blocks_first")


def split_kv_cache(kv_cache: Tensor, layout: Layout = "flash_attn") -> tuple[Tensor, Tensor]:
    """One layer's cache -> (K, V) views, each [num_blocks, block_size, num_kv_heads, head_dim]."""
    if callable(layout):
        k, v = layout(kv_cache)
    elif layout == "flash_attn":
        if kv_cache.dim() != 5 or kv_cache.shape[0] != 2:
            raise ValueError(f"flash_attn layout wants [2, num_blocks, block_size, H_kv, d], "
                             f"got {tuple(kv_cache.shape)}")
        k, v = kv_cache[0], kv_cache[1]
    elif layout == "blocks_first":
        if kv_cache.dim() != 5 or kv_cache.shape[1] != 2:
            raise ValueError(f"blocks_first layout wants [num_blocks, 2, block_size, H_kv, d], "
                             f"got {tuple(kv_cache.shape)}")
        k, v = kv_cache[:, 0], kv_cache[:, 1]
    else:
        raise ValueError(f"unknown KV cache layout {layout!r}; use one of {LAYOUTS} or a callable")
    if k.dim() != 4 or k.shape != v.shape:
        raise ValueError(f"layout must give K and V views [num_blocks, block_size, H_kv, d], "
                         f"got {tuple(k.shape)}, {tuple(v.shape)}")
    return k, v


def new_kv_cache(num_blocks: int, block_size: int, num_kv_heads: int, head_dim: int, *,
                 layout: str = "flash_attn", dtype: torch.dtype = torch.float32,
                 device: torch.device | str = "cpu") -> Tensor:
    """An empty (zeroed) one-layer cache in `layout` (for tests and benchmarks)."""
    if layout == "flash_attn":
        shape = (2, num_blocks, block_size, num_kv_heads, head_dim)
    elif layout == "blocks_first":
        shape = (num_blocks, 2, block_size, num_kv_heads, head_dim)
    else:
        raise ValueError(f"new_kv_cache supports the named layouts {LAYOUTS}, got {layout!r}")
    return torch.zeros(shape, dtype=dtype, device=device)


def slot_mapping(block_table: Tensor, positions: Tensor, block_size: int) -> Tensor:
    """Slots of positions [..., n] in sequences with block-table rows [..., max_blocks] (int64)."""
    block_table = block_table.long()
    positions = positions.long()
    blocks = torch.gather(block_table, -1, positions // block_size)
    return blocks * block_size + positions % block_size


def write_slots(kv_cache: Tensor, slots: Tensor, k: Tensor, v: Tensor, layout: Layout = "flash_attn") -> None:
    """Write tokens into one layer's cache in place (what vLLM's reshape_and_cache_flash does).

    slots [n] (int), k/v [n, num_kv_heads, head_dim].
    """
    kc, vc = split_kv_cache(kv_cache, layout)
    block_size = kc.shape[1]
    slots = slots.long()
    blk, off = slots // block_size, slots % block_size
    kc[blk, off] = k.to(kc.dtype)
    vc[blk, off] = v.to(vc.dtype)


def gather_slots(kv_cache: Tensor, slots: Tensor, layout: Layout = "flash_attn") -> tuple[Tensor, Tensor]:
    """Read tokens from one layer's cache: slots [n] -> k, v [n, num_kv_heads, head_dim]."""
    kc, vc = split_kv_cache(kv_cache, layout)
    block_size = kc.shape[1]
    slots = slots.long()
    blk, off = slots // block_size, slots % block_size
    return kc[blk, off], vc[blk, off]


def gather_blocks(kv_cache: Tensor, blocks: Tensor, layout: Layout = "flash_attn") -> tuple[Tensor, Tensor]:
    """Copy whole blocks out of one layer's cache in one index_select: blocks [nb] -> k, v
    [nb, block_size, num_kv_heads, head_dim], views of the copy in the cache's own layout. A callable
    layout must read caches whose first dimension is the block (vLLM's packed CPU and GPU ones do)."""
    raw = kv_cache.index_select(1 if layout == "flash_attn" else 0, blocks.long())
    return split_kv_cache(raw, layout)


def layer_caches(caches: Sequence[Tensor] | Tensor) -> list[Tensor]:
    """Per-layer caches as a list (a stacked tensor is split along its leading layer dim)."""
    if isinstance(caches, Tensor):
        return list(caches.unbind(0))
    return list(caches)


def gather_layer_rows(caches: Sequence[Tensor] | Tensor, slots: Tensor, layout: Layout = "flash_attn") -> Tensor:
    """The PyTorch twin of the kernels' gather: LSA input rows of token slots.

    caches: L per-layer caches (or a stacked [L, ...] tensor), slots [N] ->
    rows [N, L, 2 * H_kv * d], each layer's row the concatenation over KV heads of (k_h, v_h),
    exactly `vllm_moa.target.stack_layer_kv` of the same tokens.
    """
    rows = []
    for cache in layer_caches(caches):
        k, v = gather_slots(cache, slots, layout)  # [N, H_kv, d]
        rows.append(torch.cat([k, v], dim=-1).flatten(1))  # [N, H_kv * 2d]
    return torch.stack(rows, dim=1)


@dataclass(frozen=True)
class PagedLayers:
    """L per-layer paged caches seen as one strided object (what the Triton kernels take).

    base:           K view of layer 0, [num_blocks, block_size, H_kv, d]; kernels get its pointer
    layer_offsets:  int64 [L] on the caches' device: element offset of layer l's K from `base`
    v_offset:       element offset of a layer's V from its K (the same for every layer)
    strides:        element strides of a K/V view (block, offset in block, head, dim)
    """

    base: Tensor
    layer_offsets: Tensor
    v_offset: int
    strides: tuple[int, int, int, int]

    @property
    def num_layers(self) -> int:
        return self.layer_offsets.shape[0]

    @property
    def num_blocks(self) -> int:
        return self.base.shape[0]

    @property
    def block_size(self) -> int:
        return self.base.shape[1]

    @property
    def num_kv_heads(self) -> int:
        return self.base.shape[2]

    @property
    def head_dim(self) -> int:
        return self.base.shape[3]

    @property
    def row_width(self) -> int:
        return 2 * self.num_kv_heads * self.head_dim

    @classmethod
    def from_caches(cls, caches: Sequence[Tensor] | Tensor, layout: Layout = "flash_attn") -> PagedLayers:
        layers = layer_caches(caches)
        if not layers:
            raise ValueError("need at least one layer cache")
        views = [split_kv_cache(c, layout) for c in layers]
        k0, v0 = views[0]
        item = k0.element_size()
        strides = tuple(k0.stride())

        def offset(a: Tensor, b: Tensor) -> int:
            delta = a.data_ptr() - b.data_ptr()
            if delta % item:
                raise ValueError("KV caches are not aligned to their element size")
            return delta // item

        v_off = offset(v0, k0)
        offsets = []
        for i, (k, v) in enumerate(views):
            if k.shape != k0.shape or k.dtype != k0.dtype or k.device != k0.device:
                raise ValueError(f"layer {i} cache {tuple(k.shape)} {k.dtype} {k.device} differs from layer 0 "
                                 f"{tuple(k0.shape)} {k0.dtype} {k0.device}")
            if tuple(k.stride()) != strides or tuple(v.stride()) != tuple(v0.stride()) or strides != tuple(v0.stride()):
                raise ValueError(f"layer {i} cache strides differ from layer 0's (or K's from V's)")
            if offset(v, k) != v_off:
                raise ValueError(f"layer {i}: V is not at the same offset from K as in layer 0")
            offsets.append(offset(k, k0))
        key = (k0.device, tuple(offsets))
        layer_offsets = _OFFSETS.get(key)
        if layer_offsets is None:  # small H2D copy, once per set of caches
            layer_offsets = torch.tensor(offsets, dtype=torch.int64).to(k0.device)
            if len(_OFFSETS) >= 16:
                _OFFSETS.pop(next(iter(_OFFSETS)))
            _OFFSETS[key] = layer_offsets
        return cls(k0, layer_offsets, v_off, strides)  # type: ignore[arg-type]


# (device, offsets) -> int64 tensor on device. Holds no reference to the caches themselves.
_OFFSETS: dict[tuple, Tensor] = {}
