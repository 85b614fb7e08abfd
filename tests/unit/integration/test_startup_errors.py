"""startup_errors.py without vLLM: which command lines get the hook, and what it prints for a
SpeculativeConfig ValidationError (a real pydantic one) and for anything else. The hook in
`vllm serve` itself: tests/integration/vllm/test_vllm_engine.py."""

from __future__ import annotations

import sys

import pydantic
import pytest

from vllm_moa.integration.shell import startup_errors


class SpeculativeConfig(pydantic.BaseModel):  # a pydantic model with vLLM's title, for a real ValidationError
    method: str
    moa_tree: dict[str, int] | None = None

    @pydantic.model_validator(mode="after")
    def check(self):
        if self.method == "moa" and self.moa_tree == {}:
            raise ValueError("moa_tree needs a depth")
        return self


def validation_error(**kwargs) -> pydantic.ValidationError:
    with pytest.raises(pydantic.ValidationError) as caught:
        SpeculativeConfig(**kwargs)
    return caught.value


@pytest.mark.parametrize("argv, method", [
    (["serve", "m", "--speculative-config", '{"method": "moa", "model": "d"}'], "moa"),
    (["serve", "m", '--speculative-config={"method": "moa"}'], "moa"),
    (["serve", "m", "-sc", '{"method": "ngram"}'], "ngram"),
    (["serve", "m", "--speculative-config", '{"method": "moa"'], None),  # not JSON: argparse refuses it
    (["serve", "m"], None),
])
def test_the_config_is_read_from_the_command_line(argv, method):
    config = startup_errors.speculative_config_in_argv(argv)
    assert (config or {}).get("method") == method


def test_the_message_names_each_problem_without_a_dump():
    field = startup_errors.refusal_message(validation_error(method="moa", moa_tree={"depth": "x"}))
    assert field.startswith("vllm-moa: --speculative-config is invalid: moa_tree.depth: Input should be a valid integer")
    assert "input_value" not in field and "\n" not in field
    ours = startup_errors.refusal_message(validation_error(method="moa", moa_tree={}))
    assert ours == "vllm-moa: --speculative-config is invalid: moa_tree needs a depth"
    assert startup_errors.refusal_message(ValueError("other")) is None


def test_the_hook_is_installed_only_for_moa_and_passes_other_errors_on(monkeypatch, capsys):
    seen = []
    monkeypatch.setattr(sys, "excepthook", lambda *args: seen.append(args[1]))
    assert not startup_errors.install(["serve", "m", "-sc", '{"method": "ngram"}'])
    assert not startup_errors.install(["serve", "m"])
    assert startup_errors.install(["serve", "m", "-sc", '{"method": "moa"}'])
    assert startup_errors.install(["serve", "m", "-sc", '{"method": "moa"}'])  # idempotent: wrapped once
    error = validation_error(method="moa", moa_tree={})
    sys.excepthook(type(error), error, None)
    assert capsys.readouterr().err == "vllm-moa: --speculative-config is invalid: moa_tree needs a depth\n"
    assert seen == []
    other = RuntimeError("not a config error")
    sys.excepthook(RuntimeError, other, None)
    assert seen == [other]
