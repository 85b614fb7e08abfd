"""Masks, data validation, the training loop, checkpoints and resume."""

import hashlib
import json
import math
import time

import pytest
import torch
from tiny_models import make_target

from vllm_moa.models.masks import (
    anchor_flags,
    cross_attention_mask,
    draft_depth,
    last_anchor,
    self_attention_mask,
    target_layers_mask,
)
from vllm_moa.training.data import DatasetError, DraftExample, collate
from vllm_moa.training.trainer import CheckpointError, TrainConfig, Trainer, build_drafter

SMALL = dict(lsa_intermediate_size=64, sa_intermediate_size=64, ca_intermediate_size=64)


def test_anchors_and_masks_on_a_small_example():
    flags = anchor_flags(10, prompt_length=3, every=4)
    # the prompt, then every 4th position counted from the last prompt token (position 2): the
    # first response token (3) is drafted one step past the prompt, as after a prefill
    assert flags.tolist() == [True, True, True, False, False, False, True, False, False, False]
    s = last_anchor(flags[None])
    assert s.tolist() == [[0, 1, 2, 2, 2, 2, 6, 6, 6, 6]]
    assert draft_depth(s).tolist() == [[0, 0, 0, 1, 2, 3, 0, 1, 2, 3]]
    ca = cross_attention_mask(s)[0, 0]
    assert ca[5].tolist() == [True] * 3 + [False] * 7  # depth 3 reads target rows 0..2 only
    stair = self_attention_mask(s, torch.tensor([True]))[0, 0]
    assert stair[5].tolist() == [False] * 3 + [True] * 3 + [False] * 4  # tokens s+1..i
    assert stair[6].tolist() == [False] * 6 + [True] + [False] * 3  # an anchor sees itself
    causal = self_attention_mask(s, torch.tensor([False]))[0, 0]
    assert causal[6].tolist() == [True] * 7 + [False] * 3
    tli = target_layers_mask(s)[0, 0]
    assert tli[5, :10].tolist() == [True] * 3 + [False] * 7  # true rows <= s
    assert tli[5, 10:].tolist() == [False] * 3 + [True] * 3 + [False] * 4  # predicted s < j <= i


def test_collate_trains_response_positions_only():
    batch = collate([DraftExample((5, 6, 7, 8, 9), prompt_length=3), DraftExample((1, 2), 0)])
    assert batch.input_ids.tolist() == [[5, 6, 7, 8, 9], [1, 2, 0, 0, 0]]
    # position i predicts token i+1: trained iff token i+1 is a response token
    assert batch.loss_mask.tolist() == [[False, False, True, True, False], [True, False, False, False, False]]


def _config(tmp_path, **overrides):
    base = dict(steps=6, batch_size=2, warmup_steps=1, checkpoint_every=3, log_every=1, progress=False, seed=1,
                output_dir=str(tmp_path / "run"), drafter_options=SMALL)
    return TrainConfig(**{**base, **overrides})


def _examples(n=8, length=20):
    gen = torch.Generator().manual_seed(0)
    return [DraftExample(tuple(torch.randint(0, 97, (length,), generator=gen).tolist()), 4) for _ in range(n)]


@pytest.mark.parametrize("examples,match", [
    ([], "empty"),
    ([DraftExample((1,), 0)], "at least 2"),
])
def test_bad_data_is_refused_before_training(tmp_path, examples, match):
    with pytest.raises(DatasetError, match=match):
        Trainer(_config(tmp_path), make_target("llama"), examples)
    assert not (tmp_path / "run").exists()


def test_bad_options_are_refused(tmp_path):
    with pytest.raises(ValueError, match="'sa_num_heds'"):
        Trainer(_config(tmp_path, drafter_options={"sa_num_heds": 2}), make_target("llama"), _examples())
    with pytest.raises(ValueError, match="'lsa_num_heads'"):
        Trainer(_config(tmp_path, drafter_options={"lsa_num_heads": 5}), make_target("llama"), _examples())
    with pytest.raises(ValueError, match="anchor_min"):
        TrainConfig(anchor_min=9, anchor_max=3)
    with pytest.raises(ValueError, match="extra"):
        TrainConfig(stepz=3)


@pytest.mark.parametrize("drafter,tli", [("moa", 0), ("moa", 1), ("eagle", 0), ("independent", 0)])
def test_every_drafter_trains_and_logs(tmp_path, drafter, tli):
    """Eight steps on one fixed batch: every logged number is finite and the loss goes down."""
    options = SMALL if drafter == "moa" else dict(intermediate_size=64)
    trainer = Trainer(_config(tmp_path, drafter=drafter, tli=tli, steps=8, drafter_options=options),
                      make_target("llama"), _examples(2),
                      eval_examples=_examples(2))
    result = trainer.train()
    lines = [json.loads(x) for x in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert [x["step"] for x in lines] == list(range(1, 9))
    assert {"loss", "kl", "feature", "lr", "grad_norm", "agreement"} <= set(lines[0])
    for line in lines:
        assert all(math.isfinite(line[key]) for key in ("loss", "kl", "feature", "grad_norm")), line
    losses = [line["loss"] for line in lines]
    assert losses[-1] < losses[0] and sum(losses[4:]) < sum(losses[:4]), losses
    assert math.isfinite(result.final_loss) and result.final_loss == losses[-1]
    assert len(lines[0]["agreement"]) == 7 and len(result.eval_agreement) == 7
    assert (tmp_path / "run" / "drafter" / "model.safetensors").is_file()


def test_resume_continues_exactly(tmp_path):
    target = make_target("llama")
    data = _examples()
    whole = Trainer(_config(tmp_path / "a"), target, data)
    whole.train()
    interrupted = Trainer(_config(tmp_path / "b"), target, data)
    for _ in range(3):
        interrupted.train_step()
    interrupted.save_checkpoint()
    resumed = Trainer(_config(tmp_path / "b"), target, data)
    resumed.load_checkpoint()
    assert resumed.timed_steps == 3 and resumed.train_seconds == interrupted.train_seconds > 0  # carried over
    assert resumed.train_cpu_seconds == interrupted.train_cpu_seconds > 0
    resumed.train(resume=True)
    assert resumed.step == 6 and resumed.timed_steps == 6
    for (name, a), (_, b) in zip(whole.drafter.state_dict().items(), resumed.drafter.state_dict().items()):
        torch.testing.assert_close(a, b, msg=name)


def test_time_based_checkpoints_and_a_past_deadline(tmp_path):
    """checkpoint_minutes checkpoints by wall time (here: after every step, though checkpoint_every
    is 100); a deadline already past runs and writes nothing."""
    target, data = make_target("llama"), _examples()
    config = _config(tmp_path, checkpoint_every=100, checkpoint_minutes=1e-9, keep_checkpoints=6)
    assert Trainer(config, target, data).train(deadline=0.0).steps == 0
    assert not (tmp_path / "run" / "checkpoints").exists()
    result = Trainer(config, target, data).train(deadline=time.time() + 3600)
    assert result.steps == 6
    assert sorted(p.name for p in (tmp_path / "run" / "checkpoints").glob("step-*")) == \
        [f"step-{i:06d}" for i in range(1, 7)]


def _digest(path):
    return {p.name: hashlib.sha256(p.read_bytes()).hexdigest() for p in sorted(path.rglob("*")) if p.is_file()}


def test_missing_or_corrupt_checkpoint(tmp_path):
    target = make_target("llama")
    trainer = Trainer(_config(tmp_path), target, _examples())
    with pytest.raises(CheckpointError, match="no checkpoint"):
        trainer.load_checkpoint()
    with pytest.raises(CheckpointError, match="missing or incomplete"):
        trainer.load_checkpoint(tmp_path / "nowhere")
    trainer.train_step()
    good = trainer.save_checkpoint()
    good_digest = _digest(good)
    trainer.train_step()
    bad = trainer.save_checkpoint()
    state = bad / "trainer_state.pt"
    state.write_bytes(state.read_bytes()[:100])
    fresh = Trainer(_config(tmp_path), target, _examples())
    with pytest.raises(CheckpointError, match="corrupt"):
        fresh.load_checkpoint()
    assert _digest(good) == good_digest
    fresh.load_checkpoint(good)
    assert fresh.step == 1


def test_resume_with_another_drafter_shape_is_refused(tmp_path):
    target = make_target("llama")
    trainer = Trainer(_config(tmp_path), target, _examples())
    trainer.train_step()
    trainer.save_checkpoint()
    other = Trainer(_config(tmp_path, drafter_options={**SMALL, "sa_intermediate_size": 32}), target, _examples())
    with pytest.raises(CheckpointError, match="drafter_options"):
        other.load_checkpoint()
    other_tli = Trainer(_config(tmp_path, tli=1), target, _examples())
    with pytest.raises(CheckpointError, match="tli"):
        other_tli.load_checkpoint()


def test_prompts_longer_than_max_length_are_refused(tmp_path):
    long_prompt = [DraftExample(tuple(range(1, 40)), prompt_length=30)]
    with pytest.raises(DatasetError, match="max_length=16"):
        Trainer(_config(tmp_path, max_length=16), make_target("llama"), long_prompt)


def test_drafter_option_types_are_checked(tmp_path):
    with pytest.raises(ValueError, match="'sa_num_heads'"):
        Trainer(_config(tmp_path, drafter_options={"sa_num_heads": 4.0}), make_target("llama"), _examples())


def test_a_fresh_moa_drafter_starts_its_output_norm_at_the_targets_final_norm(tmp_path):
    """TLI = 0 predicts the target's post-norm hidden state: its output norm starts at the target's
    final norm weights (not at 1.0, a scale a short run cannot reach); TLI = 1 has none."""
    target = make_target("llama")
    with torch.no_grad():
        target.decoder.norm.weight.uniform_(1.5, 2.5)
    drafter = build_drafter(_config(tmp_path), target)
    torch.testing.assert_close(drafter.out_norm.weight, target.decoder.norm.weight)
    assert build_drafter(_config(tmp_path, tli=1), target).out_norm is None


def test_a_cpu_budget_stops_with_a_checkpoint_and_counts_resumed_time(tmp_path):
    """cpu_budget_s bounds the run's recorded training CPU time, resumed runs included: a run stops
    at the first step past it (with a checkpoint), and a resumed run with the same budget does not
    train again; a paused process accrues no CPU time, so pauses do not count."""
    target, data = make_target("llama"), _examples()
    config = _config(tmp_path, steps=1000, checkpoint_every=1000)
    first = Trainer(config, target, data)
    first.train_step()
    budget = 3 * first.train_cpu_seconds  # a few steps' worth
    first.train(cpu_budget_s=budget)
    assert 1 < first.step < 1000 and first.train_cpu_seconds >= budget
    checkpoints = sorted((tmp_path / "run" / "checkpoints").glob("step-*"))
    assert checkpoints[-1].name == f"step-{first.step:06d}"
    again = Trainer(config, target, data)
    again.train(resume=True, cpu_budget_s=budget)
    assert again.step == first.step and again.train_cpu_seconds == first.train_cpu_seconds
    lines = [json.loads(x) for x in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    cpu = [line["train_cpu_seconds"] for line in lines]  # cumulative, logged with every line
    assert cpu == sorted(cpu) and cpu[-1] > 0


@pytest.mark.parametrize("drafter", ["moa", "eagle"])
def test_evaluation_by_sequence_adds_up_to_the_evaluation(tmp_path, drafter):
    """Per-sequence counts (for resampling intervals) sum to `evaluate`'s figures: the same anchors."""
    options = SMALL if drafter == "moa" else dict(intermediate_size=64)
    data = _examples(11, length=24)
    trainer = Trainer(_config(tmp_path, drafter=drafter, drafter_options=options), make_target("llama"), data, data)
    trainer.train_step()
    per_sequence = trainer.evaluate_by_sequence(batch_size=4)
    assert len(per_sequence) == len(data)
    hits = torch.tensor([h for h, _ in per_sequence]).sum(0)
    counts = torch.tensor([c for _, c in per_sequence]).sum(0)
    assert [round((h / c).item(), 4) for h, c in zip(hits, counts)] == trainer.evaluate(batch_size=4)
    assert len({tuple(c) for _, c in per_sequence}) > 1  # sequences differ: not one count copied


@pytest.mark.parametrize("drafter", ["moa", "eagle"])
def test_a_trained_moa_drafter_is_servable_by_its_directory(tmp_path, drafter):
    """The final drafter of a run on a target loaded from its folder names that folder as its
    verifier (vllm_moa/speculators_format.py): `vllm serve <drafter>` serves the target with it.
    Only MoA drafters: vLLM serves no other kind."""
    from vllm_moa.shipped import SHIPPED
    from vllm_moa.speculators_format import read_speculators_section
    from vllm_moa.target import TargetModel

    target = TargetModel.from_pretrained(SHIPPED / "target")
    options = SMALL if drafter == "moa" else dict(intermediate_size=64)
    result = Trainer(_config(tmp_path, drafter=drafter, steps=2, drafter_options=options), target, _examples(2)).train()
    section = read_speculators_section(result.drafter_dir)
    if drafter == "eagle":
        assert section is None
        return
    assert section.verifier.name_or_path == str((SHIPPED / "target").resolve())
    assert section.verifier.architectures == [target.architecture] and section.algorithm == "moa"
