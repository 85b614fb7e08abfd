"""The vLLM plugin: speculative method "moa".

    plugin.py      entry point `register()` (vllm.general_plugins): version check, patches, registrations
    compat.py      everything that depends on the vLLM version (supported versions, patched
                   signatures, KV-cache layouts, method auto-detection quirks)
    patches.py     the declared patches, one per vLLM symbol
    draft_config.py  the drafter's config as vLLM reads it; the checks run before any GPU memory
    signature.py   the target's signature from its HF config and checkpoint (no vLLM needed)
    model.py       the vLLM-native MoA drafter (SA/CA from vLLM layers, LSA through vllm_moa.kernels)
    tap.py         index arithmetic of the tap on vLLM's paged caches (pure torch, no host sync)
    proposer.py    MoAProposer: taps the target's paged KV cache, drafts K tokens per sequence

plugin, compat, patches, draft_config, signature and tap import no vLLM at import time
(`register()` imports it when vLLM calls it); model and proposer are imported by vLLM itself,
inside its processes (the model class is registered by name).
"""
