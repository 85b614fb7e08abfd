"""The accelerator recipe's batched generation (recipes/smollm2_accelerator.py): left-padded
batches of mixed prompt lengths must give each prompt the continuation it gets alone."""

from __future__ import annotations

import torch

from tests.tiny_models import make_hf_target
from vllm_moa.recipes.smollm2_accelerator import generate_batched
from vllm_moa.training.data import regenerate_responses


def test_batched_greedy_equals_one_prompt_at_a_time():
    model = make_hf_target(seed=3).eval()
    eos = 5
    g = torch.Generator().manual_seed(0)
    prompts = [torch.randint(6, 97, (n,), generator=g).tolist() for n in (3, 9, 1, 14, 6, 11, 2)]
    batched = generate_batched(model, prompts, 12, 0.0, seed=0, eos_token_id=eos, batch_size=3)
    with torch.no_grad():
        alone = [model.generate(torch.tensor([p]), attention_mask=torch.ones(1, len(p), dtype=torch.long),
                                max_new_tokens=12, do_sample=False, eos_token_id=eos, pad_token_id=eos)[0, len(p):].tolist()
                 for p in prompts]
    assert alone == batched
    # regenerate_responses, in the runtime's own batches, gives the same
    runtime = regenerate_responses(model, prompts, 12, (0.0,), eos_token_id=eos, progress=False, batch_size=4)
    assert [list(e.input_ids[len(p):]) for e, p in zip(runtime, prompts)] == batched
    for out in batched:  # cut after the first EOS, which is kept
        assert eos not in out[:-1]


def test_deadline_leaves_unreached_prompts_out():
    model = make_hf_target(seed=3).eval()
    prompts = [[7, 8, 9]] * 4
    assert generate_batched(model, prompts, 4, 0.0, seed=0, eos_token_id=5, batch_size=2, deadline=0.0) == [None] * 4


def test_consecutive_seeds_sample_different_batches():
    """Run 3 asked again half the prompts of the run before it (seeds 2 and 1): batch b of seed
    s + 1 drew from the stream of batch b + 1 of seed s."""
    model = make_hf_target(seed=3).eval()
    prompts = [[7, 8, 9]] * 4
    first = generate_batched(model, prompts, 8, 1.0, seed=1, eos_token_id=5, batch_size=1)
    second = generate_batched(model, prompts, 8, 1.0, seed=2, eos_token_id=5, batch_size=1)
    assert not set(map(tuple, first)) & set(map(tuple, second))


def test_batch_probe_moves_to_a_bigger_batch_only_for_enough_more_tokens_per_second():
    from vllm_moa.recipes.accelerator_training import pick_batch

    # the second H200 run's probe (64 included its warm-up): 128 and then 256 pay
    assert pick_batch([(64, 14_894.0), (128, 69_859.0), (256, 106_480.0)]) == 256
    assert pick_batch([(64, 50_000.0), (128, 60_000.0), (256, 62_000.0)]) == 64  # 1.2x, 1.24x: not enough
    assert pick_batch([(64, 50_000.0), (128, 60_000.0), (256, 80_000.0)]) == 256  # 1.6x over 64
    assert pick_batch([(8, 1.0)]) == 8


def test_prompts_an_earlier_run_holds_are_not_asked_again(tmp_path):
    """--earlier: a second run that samples the same prompts keeps none of them (no repeats)."""
    from tests.sampling_stats import smollm2
    from vllm_moa.recipes.smollm2_accelerator import build_prompts
    from vllm_moa.training.data import DraftExample

    _, model, tokenizer = smollm2()
    first_report, again_report = {}, {}
    for folder in ("first", "again"):
        (tmp_path / folder).mkdir()
    first = build_prompts(tmp_path / "first", model, tokenizer, 6, 6, 60.0, [], 4, first_report)
    assert first and first_report["prompts"]["dropped_as_earlier"] == 0
    earlier = [DraftExample(tuple(ids + [tokenizer.eos_token_id]), len(ids)) for ids in first]
    again = build_prompts(tmp_path / "again", model, tokenizer, 6, 6, 60.0, [], 4, again_report, earlier)
    assert again == []
    assert again_report["prompts"]["dropped_as_earlier"] == len(first)
