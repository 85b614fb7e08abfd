"""The plugin as vLLM loads it: found through the `vllm.general_plugins` entry point, idempotent,
lazy, CUDA-free, version-gated. Fresh interpreters, so nothing here depends on import order."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from importlib.metadata import entry_points

import pytest

pytest.importorskip("vllm.config", reason="vLLM is not installed (the vLLM plugin tests need it)")

from vllm_env import REPO  # noqa: E402

from vllm_moa.integration.shell import compat, plugin  # noqa: E402

pytestmark = pytest.mark.vllm


def run_python(code: str, **env: str) -> dict:
    """Run `code` in a fresh interpreter; it prints one JSON object on its last line."""
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=600,
                         env=dict(os.environ, **env))
    assert out.returncode == 0, out.stderr[-3000:]
    return json.loads(out.stdout.strip().splitlines()[-1])


def test_entry_point_is_declared():
    found = [ep for ep in entry_points(group="vllm.general_plugins") if ep.name == "moa"]
    assert len(found) == 1 and found[0].value == "vllm_moa.integration.shell.plugin:register"
    assert found[0].load() is plugin.register


LOAD_THROUGH_VLLM = """
import json, sys, typing
import torch
before = [m for m in ("vllm", "vllm_moa.integration.shell.patches") if m in sys.modules]
from vllm.plugins import load_general_plugins
load_general_plugins()
load_general_plugins()  # vLLM guards this; register() is idempotent on its own as well
import vllm_moa.integration.shell.plugin as p
again = p.register()
from vllm.config.speculative import SpeculativeConfig
from vllm.model_executor.models.registry import ModelRegistry
from transformers import AutoConfig
from vllm_moa.integration.shell import patches
try:
    auto_config = type(AutoConfig.for_model("moa_drafter")).__name__
except ValueError:
    auto_config = None
field = SpeculativeConfig.__dataclass_fields__["method"].type
literal = [a for a in typing.get_args(field) if typing.get_origin(a) is typing.Literal][0]
print(json.dumps({
    "before": before,
    "again": again,
    "moa_accepted": "moa" in typing.get_args(literal),
    "registered": "MoADraftModel" in ModelRegistry.get_supported_archs(),
    "auto_config": auto_config,
    "applied": [patch.applied() for patch in patches.patches_for_installed_vllm()],
    "cuda_initialized": torch.cuda.is_initialized(),
}))
"""


def test_vllm_loads_the_plugin_through_its_entry_point():
    got = run_python(LOAD_THROUGH_VLLM)
    assert got["before"] == []  # nothing imported before vLLM asks
    assert got["again"] is True and got["moa_accepted"] and got["registered"]
    assert got["auto_config"] == "MoAVllmConfig"
    assert all(got["applied"])
    assert got["cuda_initialized"] is False


def test_switched_off_plugin_leaves_vllm_untouched():
    got = run_python(LOAD_THROUGH_VLLM.replace('"applied": [patch.applied() for patch in patches.PATCHES],', ""),
                     VLLM_MOA_PLUGIN="0")
    assert got["again"] is False and not got["moa_accepted"] and not got["registered"]
    assert got["auto_config"] is None


UNSUPPORTED = """
import json, typing
from vllm_moa.integration.shell import compat, plugin
compat.installed_vllm_version = lambda: "0.27.1"
ok = plugin.register()
from vllm.config.speculative import SpeculativeConfig
print(json.dumps({"ok": ok, "patched": "__vllm_moa_patches__" in SpeculativeConfig.__dict__}))
"""


def test_unsupported_vllm_version_is_not_patched_and_is_named():
    out = subprocess.run([sys.executable, "-c", UNSUPPORTED], capture_output=True, text=True, timeout=600,
                         env=dict(os.environ, VLLM_PLUGINS=""))  # vLLM itself loads no plugin here
    assert out.returncode == 0, out.stderr[-3000:]
    got = json.loads(out.stdout.strip().splitlines()[-1])
    assert got == {"ok": False, "patched": False}
    assert "supports vLLM >=0.26.0,<0.27" in out.stderr and "installed is 0.27.1" in out.stderr
    assert compat.ALLOW_UNTESTED_ENV in out.stderr


def test_installed_vllm_is_supported():
    assert compat.unsupported_reason(compat.installed_vllm_version()) is None


@pytest.mark.parametrize("version", ["0.33.0", "0.26.0"])
def test_client_server_backend_outside_its_vllm_series_is_refused_in_one_line(monkeypatch, version):
    """The vLLM client-server backend's hooks fit vLLM 0.32 only (compat.VERIFY_SERIES: 0.33's
    scheduler asserts on a live session cut back to its verified tokens); elsewhere it is refused
    before anything loads, naming both versions and the other backend."""
    from vllm_moa.integration.serve.vllm_backend import VLLMBackend
    from vllm_moa.serving.backend import BackendError

    monkeypatch.setattr(compat, "installed_vllm_version", lambda: version)
    with pytest.raises(BackendError, match=rf"runs inside vLLM 0\.32 .* this is vLLM {version}: serve with --backend "
                                           "transformers"):
        VLLMBackend(REPO / "vllm_moa" / "assets" / "demo" / "target")
