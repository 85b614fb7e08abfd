"""The long recipe's card records what a run added: a run that goes on past a checkpoint shipped
before counts only the steps and CPU time after it (smollm2_long.shipped_earlier)."""

import torch

from vllm_moa.recipes.smollm2 import long_run_sentence
from vllm_moa.recipes.smollm2_long import shipped_earlier


def _checkpoint(directory, step, cpu):
    (directory / f"step-{step:06d}").mkdir(parents=True)
    torch.save({"step": step, "train_seconds": cpu * 1.5, "train_cpu_seconds": cpu},
               directory / f"step-{step:06d}" / "trainer_state.pt")
    return directory / f"step-{step:06d}"


def test_a_continued_run_counts_from_the_checkpoint_shipped_before(tmp_path):
    earlier, newer = _checkpoint(tmp_path, 3805, 3600.04), _checkpoint(tmp_path, 6459, 6120.7)
    runs = [{"checkpoint": earlier.name, "train_cpu_seconds": 3600.0}]
    assert shipped_earlier(newer, runs) == {"step": 3805, "train_seconds": 3600.04 * 1.5, "train_cpu_seconds": 3600.04}
    assert shipped_earlier(newer, []) is None
    assert shipped_earlier(earlier, runs) is None  # the shipped checkpoint itself
    # another run whose checkpoint has the same name: its recorded CPU time differs
    assert shipped_earlier(newer, [{"checkpoint": earlier.name, "train_cpu_seconds": 1441.0}]) is None


def test_the_card_sentence_counts_the_added_steps():
    run = {"steps": 6459, "from_step": 3805, "batch_size": 8, "sequences": 2969, "target_tokens": 3177883,
           "lr": 0.001, "schedule_steps": 20000, "precision": "auto", "cores": 2, "train_cpu_seconds": 2520.3,
           "train_seconds_recorded": 3446.3, "recorded_since_step": 3805, "heldout_agreement_before": [0.5] * 7}
    sentence = long_run_sentence("eagle", run, 1)
    assert "+2,654 steps" in sentence and "step-3805 checkpoint shipped before" in sentence
    assert "0.70 CPU-hours" in sentence and "at step 6459" in sentence


def test_an_accelerator_run_is_told_as_one():
    """A run of recipes/smollm2_accelerator.py names the device and its new data, and no CPU cores."""
    run = {"steps": 7597, "from_step": 0, "batch_size": 64, "sequences": 2985, "target_tokens": 72957553,
           "lr": 0.0006, "schedule_steps": 8259, "precision": "bf16", "accelerator": "NVIDIA H200", "cores": None,
           "train_seconds_recorded": 372.1, "recorded_since_step": 0, "data": {"new_sequences": 16},
           "heldout_agreement_before": [0.5] * 7}
    sentence = long_run_sentence("eagle", run, 1)
    assert sentence.startswith("eagle then trained on one NVIDIA H200 (vllm_moa/recipes/smollm2_accelerator.py")
    assert "(16 of them new)" in sentence and "372 s of training" in sentence and "over 8,259 steps" in sentence
    assert "cores" not in sentence and "nice 19" not in sentence and "at the end of the run (step 7597)" in sentence
