"""Binning of verification rounds by output position (benchmarks/long_generation_acceptance.py):
each round counts in the bin of the position it starts at, and `ends` drops the rounds that start
at or after a sequence's first end of turn."""

from __future__ import annotations

import json

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


def test_a_run_log_keeps_finished_runs_and_refuses_another_configuration(tmp_path):
    """A benchmark of hours resumes from its log: finished runs (and shared values) read back as
    written, with the commit that made them; a log of another configuration is refused by name."""
    import pytest

    from benchmarks.run_log import RunLog

    path = tmp_path / "runs.json"
    log = RunLog(path, {"prompts": [[1, 2]], "tree": (5, 4, 16)})
    log.keep("reference", [[3, 4, 5]])
    log.add("moa/chain", {"accepted_per_forward": [[2, 1, 3]]})
    again = RunLog(path, {"prompts": [[1, 2]], "tree": [5, 4, 16]})  # a tuple reads back as a list
    assert again.has("moa/chain") and not again.has("eagle/chain")
    assert again.row("moa/chain") == {"accepted_per_forward": [[2, 1, 3]]} and again.values["reference"] == [[3, 4, 5]]
    assert len(again.commits()) == 1
    with pytest.raises(SystemExit, match=r"differs in \['tree'\]"):
        RunLog(path, {"prompts": [[1, 2]], "tree": [5, 4, 8]})


def test_prompts_spread_over_categories_take_each_in_turn(tmp_path):
    from benchmarks.long_generation_acceptance import read_questions

    path = tmp_path / "question.jsonl"
    records = [("writing", "w1"), ("writing", "w2"), ("coding", "c1"), ("writing", "w3"), ("coding", "c2")]
    path.write_text("\n".join(json.dumps({"category": c, "turns": [t]}) for c, t in records))
    assert read_questions(path, ["writing", "coding"], 3) == ["w1", "w2", "c1"]
    assert read_questions(path, ["writing", "coding"], 4, spread=True) == ["w1", "c1", "w2", "c2"]
