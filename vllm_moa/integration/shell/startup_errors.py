"""A clear refusal instead of a traceback when a vLLM command line is started with an invalid
"moa" speculative config.

`vllm serve --speculative-config '{"method": "moa", ...}'` builds its SpeculativeConfig in the API
server process; our checks (draft_config.py, behind patches.SpeculativePostInitPatch) and pydantic's
field validation raise a ValidationError there, which vLLM's CLI does not catch: Python prints a
40-line traceback ending in a pydantic dump of every config field. This hook, installed by the
plugin's register(), prints instead

    vllm-moa: --speculative-config is invalid: moa_tree.depth: Input should be a valid integer, ...

and the process still exits with status 1. It acts only on an uncaught ValidationError for
SpeculativeConfig in a process whose command line asks for method "moa", and on a MoA drafter
directory that cannot be served by its path (speculators_checkpoints.SpeculatorsCheckpointError)
in a `vllm` command; everything else goes to the previous hook unchanged (LLM(...) in a script
keeps its ordinary traceback).
"""

from __future__ import annotations

import json
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from vllm_moa.integration.shell.compat import METHOD
from vllm_moa.integration.shell.speculators_checkpoints import SpeculatorsCheckpointError

FLAGS = ("--speculative-config", "--speculative_config", "-sc")
_HOOK_ATTR = "__vllm_moa_startup_errors__"


def speculative_config_in_argv(argv: Sequence[str]) -> dict | None:
    """The --speculative-config JSON of a command line, if it has one that parses to an object."""
    for i, arg in enumerate(argv):
        value = None
        if arg in FLAGS and i + 1 < len(argv):
            value = argv[i + 1]
        elif arg.startswith(tuple(f"{flag}=" for flag in FLAGS)):
            value = arg.split("=", 1)[1]
        if value is not None:
            try:
                parsed = json.loads(value)
            except ValueError:
                return None
            return parsed if isinstance(parsed, dict) else None
    return None


def vllm_command(argv: Sequence[str]) -> bool:
    """Whether this process is vLLM's command line (`vllm ...`, or its OpenAI server's module)."""
    return bool(argv) and (Path(argv[0]).name == "vllm" or argv[0].endswith("api_server.py"))


def refusal_message(error: BaseException, moa_config: bool = True) -> str | None:
    """One line for a MoA drafter that cannot be served by its path; one line per problem of a
    SpeculativeConfig ValidationError (where the command line asks for "moa": `moa_config`); None
    for any other error."""
    if isinstance(error, SpeculatorsCheckpointError):
        return f"vllm-moa: {error}"
    if not moa_config or type(error).__name__ != "ValidationError" \
            or getattr(error, "title", None) != "SpeculativeConfig":
        return None
    problems = []
    for item in error.errors():
        where = ".".join(str(part) for part in item.get("loc", ()))
        message = str(item.get("msg", "")).removeprefix("Value error, ")
        problems.append(f"{where}: {message}" if where else message)
    return "vllm-moa: --speculative-config is invalid: " + "; ".join(problems)


def install(argv: Sequence[str] | None = None) -> bool:
    """Wrap sys.excepthook when this command line asks for method "moa" or is vLLM's own
    (idempotent); whether the hook is in place."""
    argv = sys.argv if argv is None else argv
    moa_config = (speculative_config_in_argv(argv) or {}).get("method") == METHOD
    if not (moa_config or vllm_command(argv)):
        return False
    if getattr(sys.excepthook, _HOOK_ATTR, False):
        return True
    previous = sys.excepthook

    def hook(kind: type[BaseException], error: BaseException, traceback: Any) -> None:
        message = refusal_message(error, moa_config)
        if message is None:
            previous(kind, error, traceback)
        else:
            print(message, file=sys.stderr, flush=True)

    setattr(hook, _HOOK_ATTR, True)
    sys.excepthook = hook
    return True
