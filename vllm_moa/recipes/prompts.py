"""Training prompts built offline, with no dataset download and never from Spec-Bench.

Two sources, both deterministic given a seed:
* Magpie-style: the instruct target writes user turns itself. It is given only its chat
  template's prefix up to the start of a user turn and samples what a user would say, until its
  end-of-turn token (Xu et al., 2024, "Magpie"). Turns that hit the length limit are dropped.
* coding tasks from the running Python's standard library: public functions with a docstring
  become "write a function with this signature that does <first sentence of the docstring>".

`dedupe` removes near-identical prompts (case, whitespace and punctuation folded).
"""

from __future__ import annotations

import ast
import random
import re
import sysconfig
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import Any

USER_MARKER = "\x00USER\x00"

CODING_TEMPLATES = (
    "Write a Python function `{name}({args})`. What it does: {what}",
    "Implement `{name}({args})` in Python. Its docstring says: \"{what}\"",
    "How would I write a Python function `{name}({args})`? It is documented as: {what}",
    "Show me Python code for `{name}({args})`, with a short explanation. Purpose: {what}",
)


def user_turn_prefix(tokenizer: Any) -> list[int]:
    """Token ids of the chat template up to where a user's message begins (system prompt included,
    as the template writes it)."""
    if not getattr(tokenizer, "chat_template", None):
        raise ValueError("Magpie-style prompts need a tokenizer with a chat template")
    text = tokenizer.apply_chat_template([{"role": "user", "content": USER_MARKER}], add_generation_prompt=False,
                                         tokenize=False)
    return list(tokenizer(text[: text.index(USER_MARKER)], add_special_tokens=False)["input_ids"])


def clean_user_turns(texts: Iterable[str], min_chars: int = 12, max_chars: int = 800) -> list[str]:
    """Keep finished user turns of a sensible length, stripped."""
    out = []
    for text in texts:
        text = text.strip()
        if min_chars <= len(text) <= max_chars and "<|" not in text:
            out.append(text)
    return out


def _first_sentence(docstring: str) -> str:
    paragraph = docstring.strip().split("\n\n")[0]
    sentence = re.split(r"(?<=[.!?])\s", " ".join(paragraph.split()), maxsplit=1)[0]
    return sentence.rstrip(".") + "."


def stdlib_coding_tasks(count: int, seed: int = 0, stdlib: Path | None = None) -> list[str]:
    """Up to `count` coding prompts from public, documented stdlib functions (tests excluded)."""
    root = Path(stdlib or sysconfig.get_paths()["stdlib"])
    skip = {"test", "tests", "idlelib", "site-packages", "dist-packages", "lib2to3", "__pycache__", "turtledemo"}
    tasks = []
    for path in sorted(root.rglob("*.py")):
        if skip & set(path.relative_to(root).parts):
            continue
        try:
            tree = ast.parse(path.read_text(encoding="utf-8"))
        except (SyntaxError, UnicodeDecodeError, ValueError):
            continue
        for node in tree.body:
            if not isinstance(node, ast.FunctionDef) or node.name.startswith("_"):
                continue
            doc = ast.get_docstring(node)
            if not doc:
                continue
            what = _first_sentence(doc)
            if not 15 <= len(what) <= 200 or what.lower().startswith(("deprecated", "internal", "helper")):
                continue
            args = ast.unparse(node.args)
            if len(args) > 80:
                continue
            tasks.append((node.name, args, what[0].upper() + what[1:]))
    rng = random.Random(seed)
    rng.shuffle(tasks)
    return [rng.choice(CODING_TEMPLATES).format(name=n, args=a, what=w) for n, a, w in tasks[:count]]


def fold(text: str) -> str:
    """Case, whitespace and punctuation folded: the key `dedupe` compares."""
    return re.sub(r"[\W_]+", " ", text.lower()).strip()


def dedupe(prompts: Iterable[str]) -> list[str]:
    """Drop prompts equal to an earlier one after folding case, whitespace and punctuation."""
    seen, out = set(), []
    for prompt in prompts:
        key = fold(prompt)
        if key and key not in seen:
            seen.add(key)
            out.append(prompt)
    return out


def disjoint_from(prompts: Sequence[str], forbidden: Iterable[str]) -> list[str]:
    """`prompts` without any that (folded) equals one of `forbidden` (e.g. an evaluation set)."""
    banned = {fold(p) for p in forbidden}
    return [p for p in prompts if fold(p) not in banned]
