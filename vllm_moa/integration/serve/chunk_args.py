"""What the client-server backend asks of vLLM's engine for a request (or a live session's chunk),
carried in its SamplingParams.extra_args, which the scheduler and the worker read back:

    "moa_verify": {                # verify_service.py: capture what the target saw
        "key": str, "rows_from": int, "logits_from": int, "logits": bool,
        "cached_rows": bool,       # K/V of wanted positions the prefix cache served, read from it
        "tree": {"root": int, "parents": [int, ...]},   # session_trees.py: the chunk ends in a tree
    }
    "moa_rollback_to": int         # session_scheduler.py: keep the request's first n tokens first
"""

from __future__ import annotations

from typing import Any

VERIFY_ARG = "moa_verify"
ROLLBACK_ARG = "moa_rollback_to"
TREE_KEY = "tree"


def verify_spec(params: Any) -> dict | None:
    """The "moa_verify" spec of a request's sampling parameters (None: not a verification)."""
    extra = getattr(params, "extra_args", None) if params is not None else None
    return (extra or {}).get(VERIFY_ARG) or None


def tree_spec(params: Any) -> dict | None:
    """The tree a verification chunk ends in ({"root", "parents"}), or None."""
    spec = verify_spec(params)
    return None if spec is None else spec.get(TREE_KEY)
