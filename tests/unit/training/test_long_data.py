"""The long-answer dataset's recipe (vllm_moa/recipes/smollm2_long_data.py): which prompts it
continues and how, and the committed file when it is there."""

import pytest

from vllm_moa.recipes.smollm2_long import LONG_DATASET, load_dataset
from vllm_moa.recipes.smollm2_long_data import SAMPLE_TEMPERATURE, distinct_prompts, temperatures
from vllm_moa.training.data import DraftExample


def test_prompts_are_the_first_distinct_ones_without_their_answers():
    examples = [DraftExample((1, 2, 9, 9), 2), DraftExample((1, 2, 8), 2), DraftExample((3, 4, 5, 7), 3)]
    assert distinct_prompts(examples, 2) == [[1, 2], [3, 4, 5]]
    with pytest.raises(ValueError, match="2 distinct prompts"):
        distinct_prompts(examples, 3)


def test_training_prompts_alternate_greedy_and_sampled_and_held_out_ones_are_greedy():
    assert temperatures(4, 2) == [0.0, SAMPLE_TEMPERATURE, 0.0, SAMPLE_TEMPERATURE, 0.0, 0.0]


@pytest.mark.skipif(not LONG_DATASET.is_file(), reason="the long dataset is not built")
def test_the_committed_long_sequences_are_long_and_come_from_the_training_prompts():
    train, held = load_dataset(LONG_DATASET)
    short_train, short_held = load_dataset()
    assert train and held
    assert min(len(e.input_ids) - e.prompt_length for e in train + held) >= 1024
    assert [list(e.input_ids[: e.prompt_length]) for e in train] == distinct_prompts(short_train, len(train))
    assert [list(e.input_ids[: e.prompt_length]) for e in held] == distinct_prompts(short_held, len(held))
