"""Command-line flags derived from a pydantic model, so a command never restates an option the
model declares (type, default, help, bounds): `vllm-moa train` takes TrainConfig's fields,
`vllm-moa serve` ServerLimits'. The model is the one declaration; the command receives the
values as keyword arguments and builds the model from them (the model validates)."""

from __future__ import annotations

import inspect
from collections.abc import Callable, Iterable
from typing import Any, Literal, get_origin

import typer
from pydantic import BaseModel

FLAG_KEY = "cli_flag"  # Field(json_schema_extra={FLAG_KEY: "name"}): the flag's name when it differs


def flag_name(field_name: str, field: Any) -> str:
    extra = field.json_schema_extra if isinstance(field.json_schema_extra, dict) else {}
    return extra.get(FLAG_KEY, field_name)


def with_model_flags(model: type[BaseModel], skip: Iterable[str] = ()) -> Callable:
    """Decorate a typer command that takes `**options`: one --flag per field of `model` (but
    `skip`), keyword-only, after the command's own parameters. `model_values(model, options)`
    turns what the command received back into field values."""
    skipped = set(skip)

    def decorate(command: Callable) -> Callable:
        signature = inspect.signature(command)
        own = [p for p in signature.parameters.values() if p.kind is not inspect.Parameter.VAR_KEYWORD]
        derived = []
        for name, field in model.model_fields.items():
            if name in skipped:
                continue
            annotation = str if get_origin(field.annotation) is Literal else field.annotation
            default = field.get_default(call_default_factory=True)
            flag = flag_name(name, field)
            derived.append(inspect.Parameter(flag, inspect.Parameter.KEYWORD_ONLY, annotation=annotation,
                                             default=typer.Option(default, help=field.description)))
            command.__annotations__[flag] = annotation
        command.__signature__ = signature.replace(parameters=[
            *[p.replace(kind=inspect.Parameter.KEYWORD_ONLY) for p in own], *derived])
        return command

    return decorate


def model_values(model: type[BaseModel], options: dict[str, Any]) -> dict[str, Any]:
    """The field values among a command's keyword arguments (flag names mapped back to fields)."""
    return {name: options[flag_name(name, field)] for name, field in model.model_fields.items()
            if flag_name(name, field) in options}


def drafter_weights_option() -> Any:
    """--drafter-weights, for every command that drafts on this machine (values checked by
    models.load_named against packed_linear.DRAFTER_WEIGHTS)."""
    return typer.Option("auto", help="The drafter's weights in CPU inference: auto (int8 where PyTorch's x86 int8 "
                                     "kernels exist, else bf16 on CPUs that multiply it natively, else fp32) | fp32 | "
                                     "bf16 | int8. Outputs never change; drafts (acceptance) barely.")


def lookup_option() -> Any:
    """--lookup/--no-lookup, for every command that drafts with a model on this machine
    (decoding.retrieval.lookup_options)."""
    return typer.Option(True, help="Merge lookup (n-gram matches in the prompt and the text so far) into a model "
                                   "drafter's drafts (ignored for 'ngram' and 'none').")


def chat_option() -> Any:
    """--chat/--raw, for every command that takes prompt text (vllm_moa.chat.encode_prompt)."""
    return typer.Option(True, "--chat/--raw", help="Wrap each prompt in the target's chat template (one user turn, "
                                                   "the assistant's turn opened) when its tokenizer has one; --raw "
                                                   "sends the text as it is.")
