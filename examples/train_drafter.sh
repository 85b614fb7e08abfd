#!/usr/bin/env bash
# Train a MoA drafter and the two baselines for a target, on the target's own responses to a
# prompt set (Spec-Bench format works) plus an optional raw corpus. Same data, same budget.
#   examples/train_drafter.sh path/to/target prompts.jsonl [steps]
set -euo pipefail
target="$1"; prompts="$2"; steps="${3:-2000}"
common=(--target "$target" --prompts "$prompts" --temperatures 0,0.8 --steps "$steps" --batch-size 16)
vllm-moa train "${common[@]}" --drafter moa --tli 0 --output-dir runs/moa-tli0
vllm-moa train "${common[@]}" --drafter moa --tli 1 --output-dir runs/moa-tli1
vllm-moa train "${common[@]}" --drafter eagle --output-dir runs/eagle
vllm-moa train "${common[@]}" --drafter independent --output-dir runs/independent
for run in moa-tli0 moa-tli1 eagle independent; do
  echo "$run: $(python -c "import json;print(json.load(open('runs/$run/summary.json'))['eval_agreement_by_depth'])")"
done
