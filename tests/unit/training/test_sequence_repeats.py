"""Short sequences weighted up (TrainConfig short_repeats / short_length): an epoch draws each
short sequence that many times and each long one once, the trainer draws by it, and a run's
token count (the model card's) follows the same order."""

from collections import Counter

import pytest
import torch
from tiny_models import make_target

from vllm_moa.recipes.smollm2_long import run_tokens
from vllm_moa.training.data import DraftExample, global_batch_indices, sequence_repeats
from vllm_moa.training.trainer import TrainConfig, Trainer

SMALL = dict(lsa_intermediate_size=64, sa_intermediate_size=64, ca_intermediate_size=64)


def _examples(lengths):
    gen = torch.Generator().manual_seed(0)
    return [DraftExample(tuple(torch.randint(0, 97, (n,), generator=gen).tolist()), 4) for n in lengths]


def test_short_sequences_are_counted_as_trained_cut_at_max_length():
    examples = _examples([10, 20, 40, 60])
    assert sequence_repeats(examples, max_length=64, short_length=20, short_repeats=3) == (3, 3, 1, 1)
    assert sequence_repeats(examples, max_length=16, short_length=20, short_repeats=3) == (3, 3, 3, 3)
    assert sequence_repeats(examples, max_length=64, short_length=20, short_repeats=1) is None


def test_an_epoch_draws_short_sequences_their_repeats_and_long_ones_once():
    repeats = (3, 1, 3, 1, 3, 1)  # 12 draws an epoch: 4 batches of 3
    epoch = [i for step in range(4) for i in global_batch_indices(6, 3, step, seed=5, repeats=repeats)]
    assert Counter(epoch) == {i: n for i, n in enumerate(repeats)}
    nxt = [i for step in range(4, 8) for i in global_batch_indices(6, 3, step, seed=5, repeats=repeats)]
    assert Counter(nxt) == Counter(epoch) and nxt != epoch  # the next epoch: the same counts, another order
    with pytest.raises(ValueError, match="3 counts for 6 examples"):
        global_batch_indices(6, 3, 0, seed=5, repeats=(1, 1, 1))


def test_without_repeats_the_order_is_the_plain_permutation():
    """Runs without the option (and their checkpoints) keep their data order."""
    plain = [global_batch_indices(10, 2, step, seed=3) for step in range(5)]
    assert plain == [global_batch_indices(10, 2, step, seed=3, repeats=None) for step in range(5)]
    assert sorted(i for batch in plain for i in batch) == list(range(10))


def test_the_trainer_draws_short_sequences_more_often(tmp_path):
    examples = _examples([12, 12, 12, 40])
    config = TrainConfig(steps=4, batch_size=2, warmup_steps=1, progress=False, seed=1, max_length=64,
                         short_repeats=3, short_length=20, output_dir=str(tmp_path / "run"), drafter_options=SMALL)
    trainer = Trainer(config, make_target("llama"), examples)
    drawn = Counter(i for step in range(5) for i in trainer._local_indices(step))  # one epoch: 10 draws
    assert drawn == {0: 3, 1: 3, 2: 3, 3: 1}
    # the card's token count replays the same order: 5 steps drew 9 short sequences of 12 tokens and one of 40
    assert run_tokens(examples, config.model_dump(), 5) == 9 * 12 + 40
