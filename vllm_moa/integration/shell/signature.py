"""The target's `TargetSignature` read from its HF config and checkpoint files, without loading
the model: what lets vLLM refuse a drafter trained for another target before any GPU memory is
taken. Same values as `vllm_moa.target.TargetModel.signature` (a test holds the two together).
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path
from typing import Any

import torch

from vllm_moa.config import TargetSignature

EMBED_KEY = "model.embed_tokens.weight"
LM_HEAD_KEY = "lm_head.weight"
SAMPLE_ROWS = 256  # TargetModel.fingerprint hashes every (V // 256)-th row


def signature_from_hf_config(hf_config: Any, model_path: str | Path | None = None) -> TargetSignature:
    """Shapes from a transformers config; the fingerprint from the safetensors files under
    `model_path` when it is a local directory holding them (else left empty: shapes only)."""
    architectures = getattr(hf_config, "architectures", None) or []
    heads = hf_config.num_attention_heads
    fingerprint = ""
    if model_path is not None and Path(model_path).is_dir():
        fingerprint = checkpoint_fingerprint(model_path, bool(getattr(hf_config, "tie_word_embeddings", False)))
    return TargetSignature(
        architecture=architectures[0] if architectures else "",
        num_layers=hf_config.num_hidden_layers,
        hidden_size=hf_config.hidden_size,
        num_attention_heads=heads,
        num_kv_heads=getattr(hf_config, "num_key_value_heads", None) or heads,
        head_dim=getattr(hf_config, "head_dim", None) or hf_config.hidden_size // heads,
        vocab_size=hf_config.vocab_size,
        name=Path(str(model_path)).name if model_path is not None else "",
        fingerprint=fingerprint,
    )


def _weight_files(directory: Path) -> dict[str, Path]:
    """tensor name -> safetensors file, for single-file and sharded checkpoints."""
    index = directory / "model.safetensors.index.json"
    if index.is_file():
        weight_map = json.loads(index.read_text(encoding="utf-8")).get("weight_map", {})
        return {name: directory / file for name, file in weight_map.items()}
    single = directory / "model.safetensors"
    if single.is_file():
        from safetensors import safe_open

        with safe_open(str(single), framework="pt") as f:
            return {name: single for name in f.keys()}
    return {}


def _sampled_rows(path: Path, name: str) -> torch.Tensor:
    """Rows 0, s, 2s, ... (s = max(1, V // 256)) of a [V, E] tensor, read row by row (mmap)."""
    from safetensors import safe_open

    with safe_open(str(path), framework="pt") as f:
        sl = f.get_slice(name)
        num_rows = sl.get_shape()[0]
        step = max(1, num_rows // SAMPLE_ROWS)
        return torch.cat([sl[i : i + 1] for i in range(0, num_rows, step)])


def checkpoint_fingerprint(directory: str | Path, tie_word_embeddings: bool) -> str:
    """`TargetModel.fingerprint()` computed from the checkpoint: sha256 over the bf16 bits of the
    sampled embedding rows, then the sampled LM-head rows; "" if the files are not safetensors."""
    files = _weight_files(Path(directory))
    if EMBED_KEY not in files:
        return ""
    lm_key = LM_HEAD_KEY if LM_HEAD_KEY in files and not tie_word_embeddings else EMBED_KEY
    digest = hashlib.sha256()
    for key in (EMBED_KEY, lm_key):
        rows = _sampled_rows(files[key], key)
        digest.update(rows.to(torch.float32).to(torch.bfloat16).view(torch.int16).numpy().tobytes())
    return digest.hexdigest()[:16]
