"""vLLM's engine serving MoA's client-server mode and one-shot offline runs.

    vllm_backend.py    `vllm-moa serve --backend vllm`: client-server rounds as vLLM requests
                       (prefix caching, batched across sessions), one engine thread
    verify_service.py  its worker side: a flagged request's argmax / logits, K/V and final hidden
                       states at its last prompt positions (RunnerVerifyTapPatch, worker extension)
    offline.py         one vLLM engine run in a child process (benchmarks, tests, data generation)
"""
