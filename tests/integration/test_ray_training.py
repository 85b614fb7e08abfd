"""Ray Train with 2 CPU workers (gloo) takes the same steps as one process on the same data."""

import json

import pytest
import torch
from tiny_models import make_hf_target

from vllm_moa.target import TargetModel
from vllm_moa.training.data import DraftExample
from vllm_moa.training.trainer import TrainConfig, Trainer

ray = pytest.importorskip("ray")

# gloo sums fp32 gradients in a different order than one process does; over 4 AdamW steps the
# loss trajectories agree to well within this (measured: ~1e-6 relative).
REL_TOL = 1e-4


def _losses(path):
    return [json.loads(line)["loss"] for line in path.read_text().splitlines()]


def test_two_ray_workers_match_single_process(tmp_path):
    from vllm_moa.training.distributed import train_with_ray

    target_dir = tmp_path / "target"
    make_hf_target("llama").save_pretrained(target_dir)
    gen = torch.Generator().manual_seed(0)
    # ragged lengths and prompt lengths: token counts differ between the two workers' shares
    examples = [DraftExample(tuple(torch.randint(0, 97, (int(n),), generator=gen).tolist()), int(p))
                for n, p in zip(torch.randint(12, 30, (16,), generator=gen), torch.randint(0, 6, (16,), generator=gen))]
    # fp32 on every CPU: this checks the distributed algorithm, not bf16 rounding of split batches
    common = dict(steps=4, batch_size=4, warmup_steps=1, log_every=1, checkpoint_every=4, seed=3, progress=False,
                  lr=3e-3, precision="fp32", drafter_options=dict(lsa_intermediate_size=64, sa_intermediate_size=64,
                                                ca_intermediate_size=64))
    single = TrainConfig(output_dir=str(tmp_path / "single"), **common)
    Trainer(single, TargetModel.from_pretrained(target_dir), examples).train()
    distributed = TrainConfig(output_dir=str(tmp_path / "ray"), **common)
    metrics = train_with_ray(distributed, target_dir, examples, num_workers=2)
    ray.shutdown()

    want = _losses(tmp_path / "single" / "metrics.jsonl")
    got = _losses(tmp_path / "ray" / "metrics.jsonl")
    assert len(want) == len(got) == 4
    assert want[0] != want[-1]  # training moved
    for step, (a, b) in enumerate(zip(want, got)):
        assert abs(a - b) <= REL_TOL * abs(a), f"step {step}: single {a} vs ray {b}"
    assert metrics["steps"] == 4
