"""Binning of verification rounds by output position (benchmarks/long_generation_acceptance.py):
each round counts in the bin of the position it starts at, and `ends` drops the rounds that start
at or after a sequence's first end of turn."""

from __future__ import annotations

from benchmarks.long_generation_acceptance import acceptance_by_bin
from vllm_moa.decoding.results import GenerationResult


def test_rounds_count_where_they_start():
    # rounds start at output positions 0, 3, 4, 6 (each gains its accepted drafts + 1)
    results = [GenerationResult(list(range(10)), accepted_per_forward=[3, 1, 2, 4]),
               GenerationResult(list(range(5)), accepted_per_forward=[5])]
    assert acceptance_by_bin(results, 4) == [
        {"start": 0, "rounds": 3, "acceptance_length": 3.0},  # 3 + 1 + 5 over three rounds
        {"start": 4, "rounds": 2, "acceptance_length": 3.0},
    ]


def test_rounds_from_the_first_end_of_turn_on_are_dropped():
    results = [GenerationResult(list(range(10)), accepted_per_forward=[3, 1, 2, 4])]
    # the answer is the first 4 tokens: the round that starts at position 4 is past its end
    assert acceptance_by_bin(results, 4, ends=[4]) == [{"start": 0, "rounds": 2, "acceptance_length": 2.0}]
    assert acceptance_by_bin(results, 4, ends=[5]) == [
        {"start": 0, "rounds": 2, "acceptance_length": 2.0},
        {"start": 4, "rounds": 1, "acceptance_length": 2.0},
    ]
