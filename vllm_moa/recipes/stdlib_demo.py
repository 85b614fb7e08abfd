"""Recipe: the demo target and its drafters, trained on this Python's standard library.

    python -m vllm_moa.recipes.stdlib_demo --work runs/stdlib-demo [--ship vllm_moa/assets/demo]

Stages (each cached in --work, so an interrupted run resumes at the stage it was in):
 1. corpus: Lib/*.py of the running interpreter (tests excluded), split by file into train and
    held-out sets (seeded);
 2. tokenizer: our own byte-level BPE;
 3. target: a Llama (8 layers) trained with next-token cross-entropy; validation loss in nats per
    token and bytes per token on held-out files; greedy continuations of held-out code;
 4. on-policy data: the target continues prompts cut from training files (greedy and sampled);
    held-out data the same way from held-out files;
 5. drafters, same data and budget: MoA TLI=0, MoA TLI=1, EAGLE-style, independent small LM;
    top-1 agreement with the target per draft depth on the held-out on-policy data;
 6. ship: fp16 safetensors + tokenizer + model card into --ship (at most 20 MB in all).
Deterministic given --seed (CPU, fixed thread count).
"""

from __future__ import annotations

import argparse
import json
import math
import platform
import random
import shutil
import sysconfig
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import torch
from tqdm.auto import tqdm

from vllm_moa.config import read_drafter_config
from vllm_moa.speculators_format import write_speculators_config
from vllm_moa.training.data import DraftExample, examples_from_json, examples_to_json


@dataclass(frozen=True)
class StdlibRecipe:
    seed: int = 0
    heldout_fraction: float = 0.05
    vocab_size: int = 4096
    hidden_size: int = 192
    num_layers: int = 8
    num_heads: int = 6
    num_kv_heads: int = 2
    intermediate_size: int = 512
    seq_len: int = 128
    target_steps: int = 3000
    target_batch: int = 16
    target_lr: float = 2e-3
    num_prompts: int = 512
    num_heldout_prompts: int = 64
    prompt_tokens: int = 64
    response_tokens: int = 96
    sample_temperature: float = 0.7
    drafter_steps: int = 900
    drafter_batch: int = 16
    drafter_lr: float = 2e-3
    eval_depth: int = 6


def stdlib_files(seed: int = 0, limit: int | None = None) -> list[Path]:
    """Python files of the running interpreter's standard library (Lib/), tests excluded."""
    root = Path(sysconfig.get_paths()["stdlib"])
    skip = ("test", "tests", "idlelib", "site-packages", "dist-packages", "lib2to3", "__pycache__")
    files = sorted(p for p in root.rglob("*.py") if not any(part in skip for part in p.relative_to(root).parts))
    random.Random(seed).shuffle(files)
    return files[:limit] if limit else files


def train_tokenizer(texts: list[str], vocab_size: int, path: Path):
    """A byte-level BPE tokenizer of our own (no hub): deterministic given the texts."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=["<|endoftext|>"],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    tok.train_from_iterator(texts, trainer)
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<|endoftext|>", pad_token="<|endoftext|>")
    fast.save_pretrained(str(path))
    return fast


def token_stream(tokenizer, texts: list[str]) -> list[int]:
    stream: list[int] = []
    for text in texts:
        stream.extend(tokenizer(text)["input_ids"] + [tokenizer.eos_token_id])
    return stream


@torch.no_grad()
def validation_loss(model, stream: list[int], seq_len: int, max_windows: int = 200) -> float:
    """Mean next-token cross-entropy (nats per token) over windows of a held-out stream."""
    data = torch.tensor(stream)
    windows = min(max_windows, (len(data) - 1) // seq_len)
    total, count = 0.0, 0
    model.eval()
    for i in range(0, windows, 16):
        batch = torch.stack([data[w * seq_len : w * seq_len + seq_len] for w in range(i, min(i + 16, windows))])
        logits = model(batch).logits[:, :-1]
        loss = torch.nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]), batch[:, 1:].reshape(-1),
                                                 reduction="sum")
        total += loss.item()
        count += batch[:, 1:].numel()
    return total / count


def train_target(recipe: StdlibRecipe, stream: list[int], heldout_stream: list[int], path: Path,
                 progress: bool = True):
    """A Llama trained with next-token cross-entropy on random windows of the training stream."""
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(recipe.seed)
    config = LlamaConfig(vocab_size=recipe.vocab_size, hidden_size=recipe.hidden_size,
                         intermediate_size=recipe.intermediate_size, num_hidden_layers=recipe.num_layers,
                         num_attention_heads=recipe.num_heads, num_key_value_heads=recipe.num_kv_heads,
                         max_position_embeddings=2048, tie_word_embeddings=True, bos_token_id=0, eos_token_id=0,
                         pad_token_id=0)
    model = LlamaForCausalLM(config)
    optimizer = torch.optim.AdamW(model.parameters(), lr=recipe.target_lr, betas=(0.9, 0.95), weight_decay=0.01)
    schedule = torch.optim.lr_scheduler.OneCycleLR(optimizer, recipe.target_lr, total_steps=recipe.target_steps,
                                                   pct_start=0.05)
    data = torch.tensor(stream)
    windows = (len(data) - 1) // recipe.seq_len
    gen = torch.Generator().manual_seed(recipe.seed)
    log = []
    bar = tqdm(range(recipe.target_steps), desc="train target", disable=not progress)
    for step in bar:
        model.train()
        starts = torch.randint(0, windows, (recipe.target_batch,), generator=gen) * recipe.seq_len
        batch = torch.stack([data[s : s + recipe.seq_len] for s in starts.tolist()])
        loss = model(batch, labels=batch).loss
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        schedule.step()
        optimizer.zero_grad(set_to_none=True)
        bar.set_postfix(loss=f"{loss.item():.3f}")
        if (step + 1) % 500 == 0 or step + 1 == recipe.target_steps:
            log.append({"step": step + 1, "train_loss": loss.item(),
                        "val_loss": validation_loss(model, heldout_stream, recipe.seq_len, 48)})
    model.eval()
    model.save_pretrained(str(path))
    return model, log


@torch.no_grad()
def continue_prompts(model, prompts: list[list[int]], max_new_tokens: int, temperature: float, seed: int,
                     batch_size: int = 16, progress: bool = True) -> list[DraftExample]:
    """On-policy data: batched continuations (equal-length prompts, so no padding is needed)."""
    out = []
    for start in tqdm(range(0, len(prompts), batch_size), desc=f"continue (T={temperature})", disable=not progress):
        chunk = torch.tensor(prompts[start : start + batch_size])
        torch.manual_seed(seed + start)
        kwargs = dict(do_sample=True, temperature=temperature, top_k=0, top_p=1.0) if temperature > 0 else dict(do_sample=False)
        generated = model.generate(chunk, attention_mask=torch.ones_like(chunk), max_new_tokens=max_new_tokens,
                                   min_new_tokens=max_new_tokens, pad_token_id=0, **kwargs)
        out += [DraftExample(tuple(row.tolist()), chunk.shape[1]) for row in generated]
    return out


def cut_prompts(stream: list[int], count: int, length: int, seed: int) -> list[list[int]]:
    rng = random.Random(seed)
    return [stream[s : s + length] for s in (rng.randrange(0, len(stream) - length) for _ in range(count))]


DRAFTERS = {
    # name: (kind, tli, drafter_options)
    "moa-tli0": ("moa", 0, dict(lsa_num_heads=4, lsa_intermediate_size=256, sa_num_heads=6, sa_num_kv_heads=2,
                                sa_head_dim=32, sa_intermediate_size=512, ca_num_heads=6, ca_num_kv_heads=2,
                                ca_head_dim=32, ca_intermediate_size=512)),
    "moa-tli1": ("moa", 1, dict(lsa_num_heads=4, lsa_intermediate_size=256, sa_num_heads=6, sa_num_kv_heads=2,
                                sa_head_dim=32, sa_intermediate_size=512, ca_num_heads=6, ca_num_kv_heads=2,
                                ca_head_dim=32, ca_intermediate_size=512)),
    "eagle": ("eagle", 0, dict(num_heads=6, num_kv_heads=2, head_dim=32, intermediate_size=512)),
    "independent": ("independent", 0, dict(hidden_size=128, num_layers=2, num_heads=4, num_kv_heads=2, head_dim=32,
                                           intermediate_size=384)),
}


def _save_examples(path: Path, examples: list[DraftExample]) -> None:
    path.write_text(json.dumps(examples_to_json(examples)))


def _load_examples(path: Path) -> list[DraftExample]:
    return examples_from_json(json.loads(path.read_text()))


def run(work: Path, recipe: StdlibRecipe, progress: bool = True, only: list[str] | None = None) -> dict:
    from transformers import AutoTokenizer, LlamaForCausalLM

    from vllm_moa.target import TargetModel
    from vllm_moa.training.trainer import TrainConfig, Trainer

    torch.set_num_threads(max(1, min(torch.get_num_threads(), 2)))
    work.mkdir(parents=True, exist_ok=True)
    report_path = work / "report.json"
    report = json.loads(report_path.read_text()) if report_path.exists() else {}
    if report.get("recipe", {}).get("target_steps", recipe.target_steps) != recipe.target_steps:
        raise ValueError(f"{work} holds a target trained with another recipe; use a fresh --work directory")
    report["recipe"] = asdict(recipe)
    files = stdlib_files(recipe.seed)
    n_held = max(1, int(len(files) * recipe.heldout_fraction))
    held_files, train_files = files[:n_held], files[n_held:]
    read = lambda fs: [f.read_text(encoding="utf-8", errors="replace") for f in fs]  # noqa: E731
    target_dir = work / "target"
    if not (target_dir / "model.safetensors").is_file():
        started = time.time()
        train_texts, held_texts = read(train_files), read(held_files)
        tokenizer = train_tokenizer(train_texts, recipe.vocab_size, target_dir)
        stream, held_stream = token_stream(tokenizer, train_texts), token_stream(tokenizer, held_texts)
        model, log = train_target(recipe, stream, held_stream, target_dir, progress)
        tokenizer.save_pretrained(str(target_dir))
        val = validation_loss(model, held_stream, recipe.seq_len, 400)
        held_bytes = sum(len(t.encode()) for t in held_texts)
        report["target"] = {
            "files_train": len(train_files), "files_heldout": len(held_files),
            "train_tokens": len(stream), "heldout_tokens": len(held_stream),
            "tokens_seen": recipe.target_steps * recipe.target_batch * recipe.seq_len,
            "val_loss_nats_per_token": round(val, 4), "val_bits_per_byte": round(val / math.log(2) * len(held_stream) / held_bytes, 4),
            "bytes_per_token": round(held_bytes / len(held_stream), 3),
            "parameters": sum(p.numel() for p in model.parameters()),
            "wall_time_s": round(time.time() - started, 1), "log": log,
            "device": "cpu", "torch_threads": torch.get_num_threads(), "python": platform.python_version(),
            "torch": torch.__version__,
        }
        report_path.write_text(json.dumps(report, indent=2))
    tokenizer = AutoTokenizer.from_pretrained(str(target_dir))
    model = LlamaForCausalLM.from_pretrained(str(target_dir)).eval()
    if "samples" not in report["target"]:
        samples = []
        for text in read(held_files[:4]):
            start = max(0, text.find("\n    def "))
            prompt = text[start : start + 240]
            ids = torch.tensor([tokenizer(prompt)["input_ids"]])
            out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=80, do_sample=False,
                                 pad_token_id=0)
            samples.append({"prompt": prompt, "greedy_continuation": tokenizer.decode(out[0, ids.shape[1]:])})
        report["target"]["samples"] = samples
        report_path.write_text(json.dumps(report, indent=2))
    data_path, held_path = work / "onpolicy_train.json", work / "onpolicy_heldout.json"
    if not held_path.exists():
        stream = token_stream(tokenizer, read(train_files))
        held_stream = token_stream(tokenizer, read(held_files))
        prompts = cut_prompts(stream, recipe.num_prompts, recipe.prompt_tokens, recipe.seed)
        train = continue_prompts(model, prompts, recipe.response_tokens, 0.0, recipe.seed, progress=progress)
        train += continue_prompts(model, prompts, recipe.response_tokens, recipe.sample_temperature, recipe.seed,
                                  progress=progress)
        held_prompts = cut_prompts(held_stream, recipe.num_heldout_prompts, recipe.prompt_tokens, recipe.seed + 1)
        held = continue_prompts(model, held_prompts, recipe.response_tokens, 0.0, recipe.seed + 1, progress=progress)
        _save_examples(data_path, train)
        _save_examples(held_path, held)
    train, held = _load_examples(data_path), _load_examples(held_path)
    target = TargetModel(model, name="vllm-moa/stdlib-llama-8l")
    report.setdefault("drafters", {})
    for name, (kind, tli, options) in DRAFTERS.items():
        if (only and name not in only) or (work / name / "drafter" / "model.safetensors").is_file():
            continue
        config = TrainConfig(drafter=kind, tli=tli, drafter_options=options, steps=recipe.drafter_steps,
                             batch_size=recipe.drafter_batch, lr=recipe.drafter_lr, warmup_steps=50,
                             max_length=recipe.prompt_tokens + recipe.response_tokens, eval_depth=recipe.eval_depth,
                             output_dir=str(work / name), checkpoint_every=500, seed=recipe.seed, progress=progress)
        trainer = Trainer(config, target, train, held)
        result = trainer.train(resume=(work / name / "checkpoints" / "latest").exists())
        report["drafters"][name] = {
            "kind": kind, "tli": tli, "parameters": sum(p.numel() for p in trainer.drafter.parameters()),
            "steps": result.steps, "final_loss": result.final_loss,
            "heldout_agreement_by_depth": result.eval_agreement, "wall_time_s": round(result.wall_time_s, 1),
        }
        report_path.write_text(json.dumps(report, indent=2))
    return report


def ship(work: Path, destination: Path) -> int:
    """Copy the models as fp16 safetensors (+ tokenizer, configs, card) into `destination`."""
    from safetensors.torch import load_file, save_file

    if destination.exists():
        shutil.rmtree(destination)
    for name in ["target", *DRAFTERS]:
        src = work / "target" if name == "target" else work / name / "drafter"
        dst = destination / name
        dst.mkdir(parents=True)
        for file in src.iterdir():
            if file.suffix == ".safetensors":
                tensors = {k: v.to(torch.float16) if v.is_floating_point() else v for k, v in load_file(str(file)).items()}
                save_file(tensors, str(dst / file.name), metadata={"format": "pt"})
            elif file.is_file():
                shutil.copy(file, dst / file.name)
    # fp16 rounding moves the target's fingerprint: record the shipped target's in every drafter
    from vllm_moa.target import TargetModel

    fingerprint = TargetModel.from_pretrained(destination / "target").fingerprint()
    for name in DRAFTERS:
        config_path = destination / name / "config.json"
        config = json.loads(config_path.read_text())
        config["target"]["fingerprint"] = fingerprint
        config_path.write_text(json.dumps(config, indent=2))
        if read_drafter_config(destination / name).SPECULATORS_ALGORITHM:  # `vllm serve <demo drafter>`
            write_speculators_config(destination / name, "../target")
    report = json.loads((work / "report.json").read_text())
    (destination / "card.json").write_text(json.dumps(report, indent=2))
    prompts = []
    for file in stdlib_files(report["recipe"]["seed"])[: report["target"]["files_heldout"]]:
        text = file.read_text(encoding="utf-8", errors="replace")
        start = text.find("\n    def ")
        if start >= 0 and len(text) > start + 400:
            prompts.append({"file": file.name, "text": text[start + 1 : start + 400]})
    (destination / "heldout_prompts.json").write_text(json.dumps(prompts[:16], indent=1))
    (destination / "README.md").write_text(model_card(report))
    return sum(f.stat().st_size for f in destination.rglob("*") if f.is_file())


def model_card(report: dict) -> str:
    """A human-readable card from report.json."""
    r, t = report["recipe"], report["target"]
    lines = [
        "# vllm-moa demo models (built by vllm_moa/recipes/stdlib_demo.py)",
        "",
        f"Target `target/`: Llama, {r['num_layers']} layers, hidden {r['hidden_size']}, {r['num_heads']} heads "
        f"({r['num_kv_heads']} KV heads), MLP {r['intermediate_size']}, tied embeddings, own byte-level BPE "
        f"(vocab {r['vocab_size']}); {t['parameters']:,} parameters, stored fp16.",
        f"Corpus: the standard library (Lib/*.py, tests excluded) of Python {t.get('python', '3.11')}: "
        f"{t['files_train']} training files ({t['train_tokens']:,} tokens), {t['files_heldout']} held-out files "
        f"({t['heldout_tokens']:,} tokens).",
        f"Training: {r['target_steps']} steps x {r['target_batch']} x {r['seq_len']} tokens = {t['tokens_seen']:,} "
        f"tokens seen, AdamW one-cycle lr {r['target_lr']}, {t['wall_time_s'] / 60:.0f} min on {t['device']} "
        f"({t['torch_threads']} threads), seed {r['seed']}.",
        f"Held-out validation loss: {t['val_loss_nats_per_token']} nats/token "
        f"({t['val_bits_per_byte']} bits/byte, {t['bytes_per_token']} bytes/token).",
        "",
        "Drafters, trained on the target's own continuations of stdlib prompts "
        f"({r['num_prompts']} prompts x greedy and T={r['sample_temperature']}, {r['response_tokens']} tokens each), "
        f"same data and budget ({r['drafter_steps']} steps x {r['drafter_batch']} sequences):",
        "",
        f"| drafter | parameters | top-1 agreement with the target at depth 1..{r['eval_depth']} (held-out) | train time |",
        "|---|---|---|---|",
    ]
    for name, d in report["drafters"].items():
        agreement = " / ".join(f"{a:.3f}" for a in d["heldout_agreement_by_depth"][1:])
        lines.append(f"| {name} | {d['parameters']:,} | {agreement} | {d['wall_time_s'] / 60:.1f} min |")
    lines += ["", "Greedy continuations of held-out code:", ""]
    for sample in t.get("samples", [])[:2]:
        lines += ["```python", sample["prompt"] + sample["greedy_continuation"], "```", ""]
    return "\n".join(lines) + "\n"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--work", type=Path, default=Path("runs/stdlib-demo"), help="working directory (resumable)")
    parser.add_argument("--ship", type=Path, default=None, help="copy the fp16 models here when done")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--target-steps", type=int, default=StdlibRecipe.target_steps)
    parser.add_argument("--drafter-steps", type=int, default=StdlibRecipe.drafter_steps)
    parser.add_argument("--only", nargs="*", help="train only these drafters: " + ", ".join(DRAFTERS))
    parser.add_argument("--no-progress", action="store_true")
    args = parser.parse_args()
    recipe = StdlibRecipe(seed=args.seed, target_steps=args.target_steps, drafter_steps=args.drafter_steps)
    report = run(args.work, recipe, progress=not args.no_progress, only=args.only)
    print(json.dumps({k: v for k, v in report.items() if k != "recipe"}, indent=2)[:4000])
    if args.ship:
        size = ship(args.work, args.ship)
        print(f"shipped {size / 2**20:.1f} MiB to {args.ship}")


if __name__ == "__main__":
    main()
