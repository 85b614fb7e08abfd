"""The embedded default: a small Llama target trained on this Python's standard library, and its
MoA drafters trained on the target's own continuations.

`vllm-moa demo` uses the models shipped in vllm_moa/assets/demo (built by
vllm_moa/recipes/stdlib_demo.py); a package without them builds a smaller target + drafter on the
fly (a few minutes on CPU, cached under ~/.cache/vllm-moa). It generates from a held-out stdlib
prompt with MoA speculative decoding and with plain decoding, checks that both agree token for
token, and reports the acceptance length and the speedup.
"""

from __future__ import annotations

import hashlib
import json
import random
import shutil
import sysconfig
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import torch
from tqdm.auto import tqdm

from vllm_moa.recipes.stdlib_demo import stdlib_files, train_tokenizer

SHIPPED = Path(__file__).parent / "assets" / "demo"


@dataclass(frozen=True)
class DemoRecipe:
    seed: int = 0
    num_files: int = 400
    vocab_size: int = 2048
    hidden_size: int = 192
    num_layers: int = 6
    num_heads: int = 6
    num_kv_heads: int = 2
    intermediate_size: int = 512
    seq_len: int = 128
    target_steps: int = 700
    target_batch: int = 16
    target_lr: float = 2e-3
    num_prompts: int = 96
    prompt_tokens: int = 48
    response_tokens: int = 64
    drafter_steps: int = 300
    drafter_batch: int = 8
    drafter_lr: float = 2e-3

    def key(self) -> str:
        return hashlib.sha256(json.dumps(asdict(self), sort_keys=True).encode()).hexdigest()[:10]


def train_target(recipe: DemoRecipe, token_stream: list[int], path: Path, progress: bool = True):
    """A small Llama trained with next-token cross-entropy on windows of the token stream."""
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(recipe.seed)
    config = LlamaConfig(vocab_size=recipe.vocab_size, hidden_size=recipe.hidden_size,
                         intermediate_size=recipe.intermediate_size, num_hidden_layers=recipe.num_layers,
                         num_attention_heads=recipe.num_heads, num_key_value_heads=recipe.num_kv_heads,
                         max_position_embeddings=1024, tie_word_embeddings=False, bos_token_id=0, eos_token_id=0)
    model = LlamaForCausalLM(config)
    optimizer = torch.optim.AdamW(model.parameters(), lr=recipe.target_lr, betas=(0.9, 0.95), weight_decay=0.01)
    schedule = torch.optim.lr_scheduler.OneCycleLR(optimizer, recipe.target_lr, total_steps=recipe.target_steps,
                                                   pct_start=0.05)
    data = torch.tensor(token_stream)
    windows = (len(data) - 1) // recipe.seq_len
    gen = torch.Generator().manual_seed(recipe.seed)
    model.train()
    bar = tqdm(range(recipe.target_steps), desc="train demo target", disable=not progress)
    for _ in bar:
        starts = torch.randint(0, windows, (recipe.target_batch,), generator=gen) * recipe.seq_len
        batch = torch.stack([data[s : s + recipe.seq_len + 1] for s in starts.tolist()])
        loss = model(batch[:, :-1], labels=batch[:, :-1]).loss
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        schedule.step()
        optimizer.zero_grad(set_to_none=True)
        bar.set_postfix(loss=f"{loss.item():.3f}")
    model.eval()
    model.save_pretrained(str(path))
    return model, float(loss.item())


def build_demo(cache_dir: str | Path | None = None, recipe: DemoRecipe = DemoRecipe(), progress: bool = True) -> Path:
    """Build (or reuse) tokenizer + target + MoA drafter. Returns the demo directory."""
    from vllm_moa.target import TargetModel
    from vllm_moa.training.data import corpus_examples, regenerate_responses
    from vllm_moa.training.trainer import TrainConfig, Trainer

    root = Path(cache_dir or Path.home() / ".cache" / "vllm-moa") / f"demo-{recipe.key()}"
    if (root / "drafter" / "model.safetensors").is_file():
        return root
    root.mkdir(parents=True, exist_ok=True)
    started = time.time()
    files = stdlib_files(recipe.seed, recipe.num_files)
    held_out, train_files = files[:20], files[20:]
    texts = [f.read_text(encoding="utf-8", errors="replace") for f in train_files]
    tokenizer = train_tokenizer(texts, recipe.vocab_size, root / "target")
    eos = tokenizer.eos_token_id
    stream: list[int] = []
    for text in texts:
        stream.extend(tokenizer(text)["input_ids"] + [eos])
    model, target_loss = train_target(recipe, stream, root / "target", progress)
    tokenizer.save_pretrained(str(root / "target"))
    # on-policy data: the target continues prompts cut from the training files
    rng = random.Random(recipe.seed)
    prompts = []
    while len(prompts) < recipe.num_prompts:
        start = rng.randrange(0, len(stream) - recipe.prompt_tokens)
        prompts.append(stream[start : start + recipe.prompt_tokens])
    examples = regenerate_responses(model, prompts, recipe.response_tokens, temperatures=(0.0, 0.8),
                                    seed=recipe.seed, eos_token_id=None, progress=progress)
    examples += corpus_examples(texts[:40], tokenizer, recipe.seq_len)[:200]
    target = TargetModel(model, name=f"demo-stdlib-llama-{recipe.key()}")
    config = TrainConfig(drafter="moa", tli=0, steps=recipe.drafter_steps, batch_size=recipe.drafter_batch,
                         lr=recipe.drafter_lr, warmup_steps=30, output_dir=str(root / "drafter-run"),
                         checkpoint_every=recipe.drafter_steps, seed=recipe.seed, progress=progress,
                         drafter_options=dict(lsa_num_heads=4, lsa_intermediate_size=256, sa_num_heads=6,
                                              sa_num_kv_heads=2, sa_head_dim=32, sa_intermediate_size=512,
                                              ca_num_heads=6, ca_num_kv_heads=2, ca_head_dim=32,
                                              ca_intermediate_size=512))
    result = Trainer(config, target, examples).train()
    shutil.copytree(result.drafter_dir, root / "drafter", dirs_exist_ok=True)
    held_prompts = [f.read_text(encoding="utf-8", errors="replace") for f in held_out]
    (root / "held_out_prompts.json").write_text(json.dumps([p[:400] for p in held_prompts if len(p) > 400]))
    (root / "card.json").write_text(json.dumps({
        "recipe": asdict(recipe), "target_final_train_loss": target_loss, "drafter_final_loss": result.final_loss,
        "build_seconds": round(time.time() - started, 1), "device": "cpu",
    }, indent=2))
    return root


def demo_models(cache_dir: str | Path | None = None, drafter: str = "moa-tli0",
                progress: bool = True) -> tuple[Path, Path, list[str]]:
    """(target dir, drafter dir, held-out prompts): the shipped models when the package has them,
    else the small on-the-fly build (cached)."""
    if (SHIPPED / "target" / "model.safetensors").is_file():
        drafter_dir = SHIPPED / drafter
        if not drafter_dir.is_dir():
            names = sorted(p.name for p in SHIPPED.iterdir() if (p / "config.json").is_file() and p.name != "target")
            raise ValueError(f"no shipped drafter {drafter!r}; shipped: {', '.join(names)}")
        prompts = [p["text"] for p in json.loads((SHIPPED / "heldout_prompts.json").read_text())]
        return SHIPPED / "target", drafter_dir, prompts
    if drafter != "moa-tli0":
        raise ValueError("only the moa-tli0 drafter can be built on the fly; install a package with shipped models")
    root = build_demo(cache_dir, progress=progress)
    return root / "target", root / "drafter", json.loads((root / "held_out_prompts.json").read_text())


def run_demo(cache_dir: str | Path | None = None, max_new_tokens: int = 128, num_draft: int = 4,
             prompt: str | None = None, drafter: str = "moa-tli0", progress: bool = True) -> dict:
    """Generate with MoA speculative decoding and with plain decoding; return what was measured."""
    from transformers import AutoTokenizer

    from vllm_moa.decoding.chain import plain_greedy_generate, speculative_greedy_generate
    from vllm_moa.models import MoADrafter
    from vllm_moa.target import TargetModel

    target_dir, drafter_dir, prompts = demo_models(cache_dir, drafter, progress)
    tokenizer = AutoTokenizer.from_pretrained(str(target_dir))
    target = TargetModel.from_pretrained(target_dir)
    target.name = json.loads((drafter_dir / "config.json").read_text())["target"]["name"]
    model = MoADrafter.from_pretrained(drafter_dir, target).eval()
    prompt = prompt if prompt is not None else prompts[0]
    prompt_ids = tokenizer(prompt)["input_ids"]
    if not prompt_ids:
        raise ValueError("prompt is empty after tokenisation")
    plain_greedy_generate(target, prompt_ids, 8)  # warm-up
    plain = plain_greedy_generate(target, prompt_ids, max_new_tokens)
    spec = speculative_greedy_generate(target, model, prompt_ids, max_new_tokens, num_draft=num_draft)
    if spec.token_ids != plain.token_ids:
        raise AssertionError("speculative output differs from greedy decoding: this is a bug, please report it")
    return {
        "prompt": prompt,
        "text": tokenizer.decode(spec.token_ids),
        "new_tokens": len(spec.token_ids),
        "acceptance_length": spec.acceptance_length,
        "num_draft": num_draft,
        "drafter": drafter,
        "speculative_tokens_per_s": spec.tokens_per_second,
        "plain_tokens_per_s": plain.tokens_per_second,
        "speedup": plain.seconds / spec.seconds,
        "drafter_time_share": spec.drafter_seconds / spec.seconds,
        "models": str(target_dir.parent),
    }
