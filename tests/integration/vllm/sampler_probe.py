"""Child side of test_vllm_draftless_steps.py: vLLM's engine core in this process
(VLLM_ENABLE_V1_MULTIPROCESSING=0), an engine without speculation and a "moa" engine that drafts
nothing (vLLM's own schedule at K = 0), side by side; counts the calls of vLLM's sampler and of
its rejection sampler while each generates, and prints one JSON line: per engine, the counts and
the outputs (greedy, and seeded at T = 0.7).

    python sampler_probe.py TARGET
"""

from __future__ import annotations

import json
import os
import sys

os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"


def main(target: str) -> None:
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt
    from vllm.v1.sample.rejection_sampler import RejectionSampler
    from vllm.v1.sample.sampler import Sampler

    calls = {"sampler": 0, "rejection_sampler": 0}

    def counted(cls, name):
        original = cls.forward

        def forward(self, *args, **kwargs):
            calls[name] += 1
            return original(self, *args, **kwargs)

        cls.forward = forward

    counted(Sampler, "sampler")
    counted(RejectionSampler, "rejection_sampler")
    engine = {"dtype": "float32", "max_model_len": 512, "enforce_eager": True, "skip_tokenizer_init": True}
    configs = {"none": None,
               "moa, no drafts": {"method": "moa", "num_speculative_tokens_per_batch_size": [[1, 1024, 0]]}}
    prompts = [TokensPrompt(prompt_token_ids=[10 + i, 20 + 3 * i, 30, 40 + i, 50]) for i in range(8)]
    greedy = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
    seeded = [SamplingParams(temperature=0.7, max_tokens=12, ignore_eos=True, seed=100 + i) for i in range(8)]
    # both engines alive until the end (an in-process engine that is collected takes vLLM's
    # distributed groups with it, and the next one's first step fails)
    engines = {name: LLM(model=target, speculative_config=config, **engine) for name, config in configs.items()}
    report = {}
    for name, llm in engines.items():
        calls.update(sampler=0, rejection_sampler=0)
        outputs = [list(o.outputs[0].token_ids) for o in llm.generate(prompts, greedy, use_tqdm=False)]
        sampled = [list(o.outputs[0].token_ids) for o in llm.generate(prompts, seeded, use_tqdm=False)]
        report[name] = {"calls": dict(calls), "greedy": outputs, "seeded": sampled}
    print("PROBE " + json.dumps(report), flush=True)


if __name__ == "__main__":
    main(sys.argv[1])
