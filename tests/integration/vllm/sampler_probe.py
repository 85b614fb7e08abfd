"""Child side of test_vllm_draftless_steps.py: vLLM's engine core in this process
(VLLM_ENABLE_V1_MULTIPROCESSING=0), an engine without speculation, a "moa" engine that drafts
nothing (vLLM's own schedule at K = 0) and one as `{"method": "moa"}` writes it, side by side; counts the calls of vLLM's sampler, of
its rejection sampler and of its preparation of a drafter's inputs while each generates, and prints one JSON line: per engine, the counts and
the outputs (greedy, and seeded at T = 0.7); then the first and last take turns at one pass
(engine_turns).

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
    from vllm.v1.spec_decode.llm_base_proposer import SpecDecodeBaseProposer

    calls = {"sampler": 0, "rejection_sampler": 0, "drafter_inputs": 0}

    def counted(cls, name):
        original = cls.forward

        def forward(self, *args, **kwargs):
            calls[name] += 1
            return original(self, *args, **kwargs)

        cls.forward = forward

    counted(Sampler, "sampler")
    counted(RejectionSampler, "rejection_sampler")
    original_prepare = SpecDecodeBaseProposer.prepare_next_token_ids_padded

    def prepare_next_token_ids_padded(self, *args, **kwargs):  # vLLM's preparation of a drafter's inputs
        calls["drafter_inputs"] += 1
        return original_prepare(self, *args, **kwargs)

    SpecDecodeBaseProposer.prepare_next_token_ids_padded = prepare_next_token_ids_padded
    engine = {"dtype": "float32", "max_model_len": 512, "enforce_eager": True, "skip_tokenizer_init": True}
    configs = {"none": None,
               "moa, no drafts": {"method": "moa", "num_speculative_tokens_per_batch_size": [[1, 1024, 0]]},
               "moa": {"method": "moa"}}  # K by measured speed: engine turns attach their clock to it
    prompts = [TokensPrompt(prompt_token_ids=[10 + i, 20 + 3 * i, 30, 40 + i, 50]) for i in range(8)]
    greedy = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
    seeded = [SamplingParams(temperature=0.7, max_tokens=12, ignore_eos=True, seed=100 + i) for i in range(8)]
    # both engines alive until the end (an in-process engine that is collected takes vLLM's
    # distributed groups with it, and the next one's first step fails)
    engines = {name: LLM(model=target, speculative_config=config, **engine) for name, config in configs.items()}
    report = {}
    for name, llm in engines.items():
        calls.update(sampler=0, rejection_sampler=0, drafter_inputs=0)
        outputs = [list(o.outputs[0].token_ids) for o in llm.generate(prompts, greedy, use_tqdm=False)]
        sampled = [list(o.outputs[0].token_ids) for o in llm.generate(prompts, seeded, use_tqdm=False)]
        report[name] = {"calls": dict(calls), "greedy": outputs, "seeded": sampled}
    report["turns"] = engine_turns(engines, prompts, greedy)
    print("PROBE " + json.dumps(report), flush=True)


def engine_turns(engines: dict, prompts: list, greedy) -> dict:
    """The engines without speculation and with K by measured speed running one pass at once,
    taking turns on their own clocks (integration/serve/engine_turns.py): per engine its tokens,
    own seconds and steps, whether the clock was attached to its K table and whether that table
    reads it (a paused clock stands still); the wall time of the whole."""
    import time

    from vllm_moa.integration.serve.engine_turns import EngineTurns, OwnClock, attach_clock, scheduler_of, take_turns

    names = ["none", "moa"]
    clocks = {name: OwnClock() for name in names}
    attached = {name: attach_clock(engines[name], clocks[name]) for name in names}
    turns = [EngineTurns(engines[name], prompts, [greedy] * len(prompts), clocks[name], group=4, tag="turns")
             for name in names]
    start = time.perf_counter()
    done = take_turns(turns)
    wall = time.perf_counter() - start
    table = scheduler_of(engines["moa"]).dynamic_sd_lookup
    before = table.clock()
    time.sleep(0.05)
    return {"wall": wall, "table_clock_still": table.clock() == before == clocks["moa"](),
            **{name: {"outputs": d.outputs, "seconds": d.seconds, "steps": len(d.step_seconds),
                      "attached": attached[name]} for name, d in zip(names, done)},
            "in_flight": passes_in_flight(engines["none"], prompts)}


def passes_in_flight(llm, prompts: list) -> dict:
    """One engine's pass of answers of different lengths (4 to 18 tokens) in groups of 3 and with 3
    in flight: per pass its tokens and the requests in flight at each step."""
    from vllm import SamplingParams

    from vllm_moa.integration.serve.engine_turns import EngineTurns, OwnClock, take_turns

    sampling = [SamplingParams(temperature=0.0, max_tokens=4 + 2 * i, ignore_eos=True) for i in range(len(prompts))]
    report = {}
    for name, in_flight in (("groups", False), ("in_flight", True)):
        (done,) = take_turns([EngineTurns(llm, prompts, sampling, OwnClock(), group=3, in_flight=in_flight,
                                          tag=name)])
        report[name] = {"outputs": done.outputs, "step_requests": done.step_requests}
    return report


if __name__ == "__main__":
    main(sys.argv[1])
