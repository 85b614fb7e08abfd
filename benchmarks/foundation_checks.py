"""Numbers behind the foundation's claims, measured on this machine:

1. training-mode vs incremental-drafting logits of the MoA drafter: worst absolute difference over
   every anchor and depth, Llama and Qwen2 tiny targets, TLI 0/1/2, fp32;
2. a drafter trained by `vllm-moa train` (200 steps, on-policy data) on a tiny random 4-layer
   target with a 320-token BPE: held-out top-1 agreement per draft depth, against chance.

    python -m benchmarks.foundation_checks   -> benchmarks/results/foundation_checks.json
"""

from __future__ import annotations

import json
import platform
import subprocess
import sys
import tempfile
from pathlib import Path

import torch
import transformers
from transformers import LlamaConfig, LlamaForCausalLM, Qwen2Config, Qwen2ForCausalLM

from vllm_moa.kinds.moa import MoAConfig, MoADrafter
from vllm_moa.models import TrainingBatchView
from vllm_moa.models.masks import anchor_flags, last_anchor
from vllm_moa.recipes.stdlib_demo import stdlib_files, train_tokenizer
from vllm_moa.target import TargetModel

ROOT = Path(__file__).resolve().parents[1]
TINY = dict(vocab_size=97, hidden_size=64, intermediate_size=128, num_hidden_layers=4, num_attention_heads=4,
            num_key_value_heads=2)


@torch.no_grad()
def equivalence_worst_diff() -> dict:
    worst = {}
    for family, cls, config_cls in (("llama", LlamaForCausalLM, LlamaConfig), ("qwen2", Qwen2ForCausalLM, Qwen2Config)):
        torch.manual_seed(0)
        target = TargetModel(cls(config_cls(**TINY)).eval())
        for tli in (0, 1, 2):
            torch.manual_seed(123)
            drafter = MoADrafter(MoAConfig(target=target.signature, tli=tli)).eval()
            ids = torch.randint(0, 97, (1, 40), generator=torch.Generator().manual_seed(7))
            flags = anchor_flags(40, 9, 7)[None]
            s = last_anchor(flags)
            out = target(ids)
            train = drafter.training_forward(TrainingBatchView(ids, s, torch.zeros(1, dtype=torch.bool)), target, out).logits
            diff = 0.0
            for anchor in [a for a in flags[0].nonzero().flatten().tolist() if a >= 2]:
                state = drafter.new_state()
                drafter.extend_verified(state, [k[:, :, : anchor + 1] for k in out.keys],
                                        [v[:, :, : anchor + 1] for v in out.values])
                drafter.feed(state, ids[:, : anchor + 1], target)
                k = 1
                while anchor + k < 40 and s[0, anchor + k] == anchor:
                    step = drafter.draft_step(state, ids[:, anchor + k : anchor + k + 1], target)
                    diff = max(diff, (step[0, 0] - train[0, anchor + k]).abs().max().item())
                    k += 1
            worst[f"{family}/tli={tli}"] = diff
    return worst


def cli_trained_agreement() -> dict:
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        texts = [f.read_text(encoding="utf-8", errors="replace") for f in stdlib_files(0, 12)]
        tokenizer = train_tokenizer(texts, 320, root / "target")
        torch.manual_seed(0)
        LlamaForCausalLM(LlamaConfig(**{**TINY, "vocab_size": len(tokenizer)})).save_pretrained(root / "target")
        lines = [json.dumps({"turns": [t[i : i + 60]]}) for t in texts for i in range(0, 600, 120)]
        (root / "prompts.jsonl").write_text("\n".join(lines[:48]) + "\n")
        (root / "corpus.py").write_text(texts[0][:3000])
        subprocess.run([sys.executable, "-m", "vllm_moa.cli", "train", "--target", str(root / "target"),
                        "--prompts", str(root / "prompts.jsonl"), "--corpus", str(root / "corpus.py"),
                        "--seq-len", "64", "--response-tokens", "48", "--temperatures", "0,1.0", "--steps", "200",
                        "--batch-size", "8", "--lr", "3e-3", "--warmup-steps", "20", "--eval-fraction", "0.15",
                        "--output-dir", str(root / "run"), "--no-progress", "--drafter-config",
                        json.dumps({"lsa_intermediate_size": 64, "sa_intermediate_size": 128,
                                    "ca_intermediate_size": 128})], check=True, capture_output=True)
        summary = json.loads((root / "run" / "summary.json").read_text())
    return {"vocab_size": len(tokenizer), "chance": 1 / len(tokenizer), "steps": 200,
            "heldout_agreement_by_depth_0_to_6": summary["eval_agreement_by_depth"]}


def main() -> None:
    result = {
        "equivalence_worst_abs_logit_diff_fp32": equivalence_worst_diff(),
        "cli_trained_drafter_on_tiny_random_target": cli_trained_agreement(),
        "provenance": {"device": "cpu", "threads": torch.get_num_threads(), "python": platform.python_version(),
                       "torch": torch.__version__, "transformers": transformers.__version__,
                       "machine": platform.machine()},
    }
    out = ROOT / "benchmarks" / "results" / "foundation_checks.json"
    out.write_text(json.dumps(result, indent=2))
    print(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
