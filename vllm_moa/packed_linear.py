"""Linear layers for small batches on CPU: oneDNN's pre-packed weights, several projections of
one input fused into one matmul.

Speculative decoding on a CPU multiplies a handful of rows (the 1..25 nodes of a draft tree, a
drafter's frontier) by every weight of the target. PyTorch's default fp32 path (MKL GEMM) is
tuned for large matrices: on our 2-core AVX2 machines a 2-row product costs twice a 1-row one and
a 17-row product over SmolLM2's LM head three times (benchmarks/results/packed_linear_cpu.json).
With oneDNN's linear on weights reordered once into its blocked layout, SmolLM2's whole forward
over 2 / 8 / 16 new tokens costs 1.06 / 1.38 / 1.71x its 1-token cost (default: 1.63 / 1.66 /
1.88x), and every token count we measured is faster than the default (a single small layer at 1
row, its weights hot in cache, can be slower). So verifying a tree costs much less than before.

`linear(x, *modules)` computes every module's output for the same input x:

    x [..., in] -> module_i(x) [..., out_i] for each module (a tuple when several)

Packed (oneDNN, one fused matmul) when x is fp32 on a CPU, oneDNN is available and no gradient
flows (x does not require one, or grad mode is off); otherwise each module runs as itself, so
training and GPUs are untouched. Modules marked with `int8_weights(module)` (a drafter: never the
target, whose logits decide what is accepted) run the same fused matmul on int8 weights instead
(per-output-channel scales, inputs quantised on the fly; fbgemm's dynamic int8 linear on x86,
torch._int_mm elsewhere): a drafter's draft steps read a quarter of the bytes, which is what they
cost at batch 1 on a CPU. Modules marked with
`weight_format(module, "bf16")` run oneDNN's packed matmul on bf16 weights (inputs rounded to bf16, outputs
and biases fp32): half the bytes, and on CPUs that multiply bf16 natively (`cpu_flags.native_bf16`)
faster than fp32 (a hand timing of a 576 x 2048 layer at 1 row, cold cache, AMD EPYC with
avx512_bf16: 106 us against 246 us); elsewhere oneDNN emulates it, and where oneDNN has no bf16
matmul at all (AVX2-only CPUs: `cpu_flags.onednn_bf16`) the weights are rounded to bf16 and
multiplied in fp32 (the same weights, so the same drafts up to the inputs' rounding; fp32's speed). The packed copy is keyed by the modules (a weak reference: it
goes when they go) and rebuilt when any weight or bias changes (an optimizer step, `.to()`,
`load_state_dict`). It costs one extra copy of the packed weights in memory; `enabled(False)`
turns packing off process-wide.
"""

from __future__ import annotations

import functools
import warnings
import weakref
from collections.abc import Iterator
from contextlib import contextmanager

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from vllm_moa import cpu_flags

BATCH_HINT = 16  # oneDNN picks its blocking for this many rows; measured best for 1..32 rows
MIN_WEIGHTS = 256 * 1024  # smaller layers stay on F.linear (oneDNN's call overhead eats the gain)

_packs: weakref.WeakKeyDictionary[nn.Module, dict[tuple[int, ...], _Pack]] = weakref.WeakKeyDictionary()
_enabled = True


@functools.cache
def available() -> bool:
    """oneDNN's packed fp32 linear exists in this torch build."""
    return torch.backends.mkldnn.is_available() and hasattr(torch.ops.mkldnn, "_linear_pointwise")


@functools.cache
def _packed_op():
    return torch.ops.mkldnn._linear_pointwise.default


@contextmanager
def enabled(flag: bool) -> Iterator[None]:
    """Turn packing on or off inside the block (process-wide)."""
    global _enabled
    previous, _enabled = _enabled, flag
    try:
        yield
    finally:
        _enabled = previous


WEIGHT_FORMATS = ("fp32", "bf16", "int8")
DRAFTER_WEIGHTS = ("auto", *WEIGHT_FORMATS)  # what a user may ask for; "auto": fastest_format()


def check_drafter_weights(value: str, option: str = "drafter weights") -> str:
    """`value` if it names a drafter weight format (DRAFTER_WEIGHTS), else a ValueError naming
    `option` and the formats."""
    if value not in DRAFTER_WEIGHTS:
        raise ValueError(f"{option} {value!r}: expected one of {', '.join(DRAFTER_WEIGHTS)}")
    return value


def fastest_format() -> str:
    """The drafter weight format that runs fastest on this machine: int8 where fbgemm's dynamic
    int8 linear exists (x86 builds), else bf16 where the CPU multiplies it natively, else fp32
    (benchmarks/results/runtime_cpu_smollm2_heldout_fbgemm_int8.json: int8 takes the MoA drafter's
    share of a round from 23% to 15% at acceptance 2.31 against 2.33)."""
    if fbgemm_available():
        return "int8"
    return "bf16" if cpu_flags.native_bf16() else "fp32"


def weight_format(module: nn.Module, fmt: str) -> nn.Module:
    """Mark `module` and every nn.Linear in it to run on `fmt` weights in CPU inference (see the
    module docstring; "fp32": unmarked; "auto": fastest_format()); returns the module. Drafts
    change a little (a drafter's only effect is on acceptance), outputs never do: never mark the
    target. GPUs and training are untouched (they take the plain path)."""
    fmt = fastest_format() if check_drafter_weights(fmt, "weight format") == "auto" else fmt
    for sub in module.modules():
        sub._weight_format = fmt
    return module


def frozen_linear(weight: Tensor, fmt: str = "fp32") -> nn.Linear:
    """A bias-free, frozen nn.Linear over `weight` [out, in] (no copy), marked to run on `fmt`
    weights in CPU inference (e.g. the target LM head's rows of a draft vocabulary)."""
    module = nn.Linear(weight.shape[1], weight.shape[0], bias=False, device="meta")
    module.weight = nn.Parameter(weight, requires_grad=False)
    return weight_format(module, fmt)


def int8_weights(module: nn.Module, flag: bool = True) -> nn.Module:
    """`weight_format(module, "int8")` (flag False: back to fp32)."""
    return weight_format(module, "int8" if flag else "fp32")


def marked_format(modules: tuple[nn.Module, ...]) -> str:
    """The weight format the modules are marked with ("fp32" unless they all share one mark)."""
    formats = {getattr(m, "_weight_format", "fp32") for m in modules}
    return formats.pop() if len(formats) == 1 else "fp32"


@functools.cache
def fbgemm_available() -> bool:
    """PyTorch's x86 quantized engine (fbgemm) and its dynamic int8 linear exist in this build."""
    engines = torch.backends.quantized.supported_engines
    return ("x86" in engines or "fbgemm" in engines) and hasattr(torch.ops.quantized, "linear_dynamic")


class _Int8Pack:
    """The modules' weights concatenated along the output axis as int8 with a scale per output
    channel; `weight` is None where no int8 kernel applies. fbgemm quantises a call's input rows
    with one scale, so a row's output depends a little on the rows beside it (not the fallback's).

    Where fbgemm is available (x86 builds), the weights are prepacked for its dynamic int8 linear:
    one call quantises the input (uint8, one scale and zero point for all rows), multiplies and
    rescales, 2-3x faster than the fallback at 1-4 rows (576 x 8192 at 1 row, cold cache, AMD
    EPYC: 181 against 419 us). Without VNNI (AVX2 only), fbgemm's u8 x s8 pairwise products can
    saturate int16, so its inputs keep 7 bits there (`reduce_range`). Elsewhere: each input row
    quantised symmetrically, torch._int_mm, rescaled (sizes must be multiples of 8)."""

    def __init__(self, modules: tuple[nn.Linear, ...], key: tuple) -> None:
        self.key = key
        self.splits = [m.out_features for m in modules]
        self.weight = self.scales = self.bias = self.fbgemm = None
        weight = torch.cat([m.weight.detach() for m in modules]).float()  # [out, in]
        if weight.device.type != "cpu":
            return
        scales = (weight.abs().amax(dim=1) / 127).clamp(min=1e-12)  # [out]
        int8 = (weight / scales[:, None]).round().clamp(-127, 127).to(torch.int8)  # [out, in]
        if any(m.bias is not None for m in modules):
            self.bias = torch.cat([m.bias.detach() if m.bias is not None else m.weight.new_zeros(m.out_features)
                                   for m in modules]).float()
        if fbgemm_available():
            self.reduce_range = not cpu_flags.native_int8_dot()
            with warnings.catch_warnings():  # quantized tensors are deprecated, the kernel is not
                warnings.simplefilter("ignore")
                quantized = torch._make_per_channel_quantized_tensor(
                    int8, scales.double(), torch.zeros_like(scales, dtype=torch.long), 0)
                self.weight = self.fbgemm = torch.ops.quantized.linear_prepack(quantized, self.bias)
            return
        if weight.shape[0] % 8 or weight.shape[1] % 8 or not hasattr(torch, "_int_mm"):
            return
        self.scales = scales
        self.weight = int8.t().contiguous()  # [in, out]

    def __call__(self, flat: Tensor) -> Tensor:
        """flat [rows, in] fp32 -> [rows, out] fp32."""
        if self.fbgemm is not None:
            return torch.ops.quantized.linear_dynamic(flat, self.fbgemm, self.reduce_range)
        row_scales = (flat.abs().amax(dim=1, keepdim=True) / 127).clamp(min=1e-12)  # [rows, 1]
        quantised = (flat / row_scales).round().clamp(-127, 127).to(torch.int8)
        out = torch._int_mm(quantised, self.weight).float() * (row_scales * self.scales)
        return out if self.bias is None else out + self.bias


class _Pack:
    """The modules' weights concatenated along the output axis, reordered for oneDNN in fp32 or
    (`bf16`) bfloat16; `weight` is None where packing does not pay or does not apply (small, not
    fp32, not on a CPU). `bf16` on a CPU where oneDNN has no bf16 matmul (`cpu_flags.onednn_bf16`):
    the weights rounded to bf16, packed in fp32 (`bf16_kernel` False)."""

    def __init__(self, modules: tuple[nn.Linear, ...], key: tuple, bf16: bool = False) -> None:
        self.key = key
        self.splits = [m.out_features for m in modules]
        self.weight = self.bias = None
        self.bf16_weights = bf16
        self.bf16_kernel = bf16 and cpu_flags.onednn_bf16()
        weights = [m.weight.detach() for m in modules]
        if sum(w.numel() for w in weights) < MIN_WEIGHTS or any(
                w.dtype != torch.float32 or w.device.type != "cpu" for w in weights):
            return
        weight = torch.cat(weights) if len(weights) > 1 else weights[0]
        if bf16:  # rounded to bf16; multiplied in fp32 where oneDNN has no bf16 matmul
            weight = weight.to(torch.bfloat16) if self.bf16_kernel else weight.to(torch.bfloat16).float()
        self.weight = torch.ops.mkldnn._reorder_linear_weight(weight.contiguous(), BATCH_HINT)
        if any(m.bias is not None for m in modules):
            self.bias = torch.cat([m.bias.detach() if m.bias is not None else m.weight.new_zeros(m.out_features)
                                   for m in modules])


def _version_key(modules: tuple[nn.Linear, ...]) -> tuple:
    key = []
    for m in modules:
        for p in (m.weight, m.bias):
            key.append(None if p is None else (p.data_ptr(), _version(p), p.dtype, p.device))
    return tuple(key)


def _version(p: Tensor) -> int:
    """In-place writes bump a tensor's version; inference tensors (vLLM loads weights under
    inference mode) keep none, and only a new tensor (a new address) changes them."""
    try:
        return p._version
    except RuntimeError:
        return -1


def _plain(x: Tensor, modules: tuple[nn.Linear, ...]) -> Tensor | tuple[Tensor, ...]:
    outs = tuple(F.linear(x, m.weight, m.bias) for m in modules)
    return outs[0] if len(outs) == 1 else outs


def linear(x: Tensor, *modules: nn.Linear) -> Tensor | tuple[Tensor, ...]:
    """x [..., in] -> each module's output [..., out_i]: one tensor for one module, else a tuple."""
    if torch.compiler.is_compiling():
        # inside torch.compile: plain linears, which inductor lowers (and packs) itself. The checks
        # below would break the graph at every linear (dynamo does not trace mkldnn.is_available),
        # and a packed weight traced into the graph failed to lower (a trainer's no-grad evaluation)
        return _plain(x, modules)
    if not _enabled or x.dtype != torch.float32 or x.device.type != "cpu" or not available():
        return _plain(x, modules)
    if torch.is_grad_enabled() and (x.requires_grad or any(m.weight.requires_grad for m in modules)):
        return _plain(x, modules)  # training: autograd needs the plain path
    by_modules = _packs.get(modules[0])
    if by_modules is None:
        by_modules = _packs[modules[0]] = {}
    ids = tuple(map(id, modules))
    fmt = marked_format(modules)
    key = (fmt, *_version_key(modules))
    pack = by_modules.get(ids)
    if pack is None or pack.key != key:
        pack = by_modules[ids] = _Int8Pack(modules, key) if fmt == "int8" else _Pack(modules, key, fmt == "bf16")
    if pack.weight is None:
        return _plain(x, modules)
    flat = x.reshape(-1, x.shape[-1]).contiguous()
    if fmt == "int8":
        out = pack(flat)  # [rows, sum out_i]
    elif pack.bf16_kernel:  # bf16 in, fp32 out; the bias (fp32) added after
        out = _packed_op()(flat.to(torch.bfloat16), pack.weight, None, "none", [], "").float()
        out = out if pack.bias is None else out + pack.bias
    else:
        out = _packed_op()(flat, pack.weight, pack.bias, "none", [], "")  # [rows, sum out_i]
    out = out.view(*x.shape[:-1], out.shape[-1])
    if len(modules) == 1:
        return out
    return tuple(out.split(pack.splits, dim=-1))


class Linear(nn.Linear):
    """nn.Linear (same parameters, same state dict) that runs through `linear`: packed in CPU
    inference, plain everywhere else."""

    def forward(self, x: Tensor) -> Tensor:
        return linear(x, self)
