"""Packed linear layers (vllm_moa/packed_linear.py): the oneDNN path gives F.linear's values,
fused projections split back into each module's output, gradients and other dtypes take the
plain path, and a changed weight is re-packed, never served stale."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from vllm_moa import packed_linear
from vllm_moa.packed_linear import Linear, linear

pytestmark = pytest.mark.skipif(not packed_linear.available(), reason="this torch build has no oneDNN")


def _modules(*shapes, bias=False):
    torch.manual_seed(0)
    return [nn.Linear(i, o, bias=bias) for i, o in shapes]


def _used_packs(module) -> int:
    return sum(pack.weight is not None for pack in packed_linear._packs.get(module, {}).values())


@pytest.mark.parametrize("rows", [1, 2, 7, 17, 300])
@pytest.mark.parametrize("bias", [False, True])
def test_packed_equals_plain_linear(rows, bias):
    (m,) = _modules((576, 1536), bias=bias)
    x = torch.randn(rows, 576)
    with torch.no_grad():
        got = linear(x, m)
    torch.testing.assert_close(got, torch.nn.functional.linear(x, m.weight, m.bias), rtol=1e-5, atol=1e-5)
    assert _used_packs(m) == 1  # it really took the packed path


def test_fused_projections_split_into_each_output_any_leading_shape():
    q, k, v = _modules((576, 576), (576, 192), (576, 192), bias=True)
    k.bias = None  # a mix of biases and none (Qwen2 has q/k/v biases, Llama none)
    x = torch.randn(2, 5, 576)
    with torch.no_grad():
        outs = linear(x, q, k, v)
    for module, out in zip((q, k, v), outs):
        assert out.shape == (2, 5, module.out_features)
        torch.testing.assert_close(out, module(x), rtol=1e-5, atol=1e-5)


def test_a_changed_weight_is_repacked():
    (m,) = _modules((1024, 640))
    x = torch.randn(3, 1024)
    with torch.no_grad():
        before = linear(x, m)
        m.weight.mul_(2.0)  # in place, as an optimizer step does
        after = linear(x, m)
    torch.testing.assert_close(after, 2.0 * before, rtol=1e-5, atol=1e-5)
    m.weight = nn.Parameter(torch.zeros_like(m.weight))  # replaced, as load_state_dict / .to() may
    with torch.no_grad():
        assert linear(x, m).abs().max() == 0


def test_gradients_flow_through_the_plain_path():
    (m,) = _modules((1024, 640))
    x = torch.randn(4, 1024, requires_grad=True)
    linear(x, m).sum().backward()
    assert x.grad is not None and m.weight.grad is not None
    assert _used_packs(m) == 0  # training never packs


def test_other_dtypes_and_the_switch_take_the_plain_path():
    (m,) = _modules((1024, 640))
    with torch.no_grad():
        linear(torch.randn(2, 1024, dtype=torch.float64), m.double())
        with packed_linear.enabled(False):
            linear(torch.randn(2, 1024), m.float())
    assert _used_packs(m) == 0


def test_small_layers_stay_on_the_plain_path():
    (m,) = _modules((256, 512))
    with torch.no_grad():
        torch.testing.assert_close(linear(torch.randn(3, 256), m).shape, torch.Size([3, 512]))
    assert _used_packs(m) == 0


def test_linear_module_keeps_nn_linear_state_dict():
    torch.manual_seed(0)
    fast, plain = Linear(20, 10), nn.Linear(20, 10)
    plain.load_state_dict(fast.state_dict())
    x = torch.randn(3, 20)
    with torch.no_grad():
        torch.testing.assert_close(fast(x), plain(x), rtol=1e-5, atol=1e-5)
    assert set(fast.state_dict()) == {"weight", "bias"}


def test_inference_mode_weights_are_packed_too():
    """vLLM loads and runs the drafter's LSA (our modules) under inference mode."""
    with torch.inference_mode():
        (m,) = _modules((1024, 600))
        x = torch.randn(5, 1024)
        torch.testing.assert_close(linear(x, m), torch.nn.functional.linear(x, m.weight), rtol=1e-5, atol=1e-5)
    assert _used_packs(m) == 1


def test_compiled_code_takes_the_plain_path(monkeypatch):
    """Under torch.compile (the trainer's compiled blocks, evaluated without grad) the packed op
    stays out of the graph: inductor failed to lower its packed weight."""
    def refuse(*_):
        raise AssertionError("the packed op was traced into a compiled graph")

    monkeypatch.setattr(packed_linear, "_packed_op", lambda: refuse)
    (m,) = _modules((1024, 640))
    x = torch.randn(3, 1024)
    with torch.no_grad():
        got = torch.compile(lambda t: linear(t, m), backend="eager", fullgraph=True)(x)
    torch.testing.assert_close(got, torch.nn.functional.linear(x, m.weight, m.bias), rtol=1e-5, atol=1e-5)


# -- int8 and bf16 weights (drafters only) ---------------------------------------------------------
def _low_precision_packs(module, fmt: str) -> int:
    """Packs of `module` that really hold `fmt` weights (not an fp32 pack, not the plain path)."""
    packs = packed_linear._packs.get(module, {}).values()
    if fmt == "int8":
        return sum(isinstance(p, packed_linear._Int8Pack) and p.weight is not None for p in packs)
    return sum(isinstance(p, packed_linear._Pack) and p.weight is not None and p.bf16_weights
               and p.weight.dtype == (torch.bfloat16 if p.bf16_kernel else torch.float32) for p in packs)


@pytest.mark.parametrize("fmt", ["int8", "int8-int_mm", "bf16", "bf16-rounded"])
@pytest.mark.parametrize("rows", [1, 3, 17])
def test_low_precision_weights_stay_close_to_fp32_and_fuse_projections(rows, fmt, monkeypatch):
    """int8 runs fbgemm's dynamic linear on x86 builds; "int8-int_mm" the fallback (torch._int_mm).
    bf16 runs oneDNN's bf16 matmul where this CPU has one; "bf16-rounded" the fallback of CPUs
    without (AVX2 only): bf16-rounded weights in fp32."""
    if fmt == "int8":
        assert packed_linear.fbgemm_available() == ("x86" in torch.backends.quantized.supported_engines)
    fmt, _, backend = fmt.partition("-")
    if backend == "int_mm":
        monkeypatch.setattr(packed_linear, "fbgemm_available", lambda: False)
    if backend == "rounded":
        monkeypatch.setattr(packed_linear.cpu_flags, "onednn_bf16", lambda: False)
    q, k, v = _modules((576, 576), (576, 192), (576, 192), bias=True)
    x = torch.randn(rows, 576)
    with torch.no_grad():
        want = [torch.nn.functional.linear(x, m.weight, m.bias) for m in (q, k, v)]
        for m in (q, k, v):
            packed_linear.weight_format(m, fmt)
        got = linear(x, q, k, v)
    assert _low_precision_packs(q, fmt) == 1
    if fmt == "int8":
        (pack,) = packed_linear._packs[q].values()
        assert (pack.fbgemm is None) == (backend == "int_mm" or not packed_linear.fbgemm_available())
    if fmt == "bf16":
        (pack,) = packed_linear._packs[q].values()
        assert pack.bf16_kernel == (backend != "rounded" and packed_linear.cpu_flags.onednn_bf16())
    for g, w in zip(got, want, strict=True):
        assert g.shape == w.shape and g.dtype == torch.float32
        error = (g - w).norm() / w.norm()
        assert 1e-5 < error < 0.02, error  # int8 / bf16 for real (not fp32), and close to it
    with torch.no_grad():  # unmarked again: exact fp32
        for m in (q, k, v):
            packed_linear.weight_format(m, "fp32")
        torch.testing.assert_close(linear(x, q, k, v)[0], want[0], rtol=1e-5, atol=1e-5)


def test_the_cpu_flags_tell_where_onednn_multiplies_bf16():
    """cpu_flags.onednn_bf16 (read from the flags) agrees with what oneDNN does on this CPU: a bf16
    weight reorders where it says so, and is refused where it does not (AVX2-only CPUs)."""
    weight = torch.randn(64, 64).to(torch.bfloat16)
    try:
        torch.ops.mkldnn._reorder_linear_weight(weight, packed_linear.BATCH_HINT)
        runs = True
    except RuntimeError as error:
        assert "bf16" in str(error)
        runs = False
    assert packed_linear.cpu_flags.onednn_bf16() == runs


def test_an_unknown_weight_format_is_refused_by_name():
    with pytest.raises(ValueError, match="'fp8'.*fp32, bf16, int8"):
        packed_linear.weight_format(torch.nn.Linear(8, 8), "fp8")


@pytest.mark.parametrize("fmt", ["int8", "bf16"])
def test_a_low_precision_drafter_changes_drafts_never_outputs(fmt, monkeypatch):
    """The shipped demo MoA on int8 / bf16 weights: the output stays the target's greedy one (the
    target is not marked: the drafter only borrows it, its LM head rows included), acceptance
    stays near the fp32 drafter's. The demo's layers are below MIN_WEIGHTS (they would stay fp32
    in bf16, as small layers do): packed here whatever their size."""
    from vllm_moa.decoding.chain import plain_greedy_generate
    from vllm_moa.decoding.engine import SpeculativeEngine
    from vllm_moa.decoding.tree import DraftSpec
    from vllm_moa.models import load_drafter
    from vllm_moa.shipped import SHIPPED
    from vllm_moa.target import TargetModel

    target = TargetModel.from_pretrained(SHIPPED / "target")
    drafter = load_drafter(SHIPPED / "moa-tli0", target).eval()
    prompt = list(range(5, 60))
    monkeypatch.setattr(packed_linear, "MIN_WEIGHTS", 0)
    plain = plain_greedy_generate(target, prompt, 48).token_ids
    fp32 = SpeculativeEngine(target, drafter, DraftSpec.chain(3)).generate([prompt], 48)[0]
    packed_linear.weight_format(drafter, fmt)
    low = SpeculativeEngine(target, drafter, DraftSpec.chain(3)).generate([prompt], 48)[0]
    assert fp32.token_ids == low.token_ids == plain
    assert all(packed_linear.marked_format((m,)) == "fp32" for m in target.hf_model.modules())
    assert any(_low_precision_packs(m, fmt) for m in drafter.modules())  # the drafter really ran on fmt
    assert abs(low.acceptance_length - fp32.acceptance_length) <= 0.15 * fp32.acceptance_length


def test_auto_weights_are_the_fastest_format_this_machine_runs():
    from vllm_moa.cpu_flags import native_bf16

    expected = "int8" if packed_linear.fbgemm_available() else "bf16" if native_bf16() else "fp32"
    (m,) = _modules((576, 576))
    packed_linear.weight_format(m, "auto")
    assert packed_linear.marked_format((m,)) == packed_linear.fastest_format() == expected
    with pytest.raises(ValueError, match="drafter weights 'fp16': expected one of auto, fp32, bf16, int8"):
        packed_linear.check_drafter_weights("fp16")
