"""Converting a llama.cpp GGUF checkpoint into a plain Hugging Face model folder.

transformers reads the GGUF itself (`from_pretrained(folder, gguf_file=...)`): it maps the
llama.cpp tensor names, dequantizes every tensor (Q4_1, Q8_0, ...) with the `gguf` package, undoes
the row permutation llama.cpp applies to Llama's Q and K projections, builds the config from the
metadata and the tokenizer (vocabulary, merges, special tokens, chat template). What it loads is
marked GGUF-quantized, so `save_pretrained` refuses it; this module writes the folder instead:

    model.safetensors        fp32 weights, tied LM head stored once (as transformers does)
    config.json              architectures set, no quantization_config
    generation_config.json   bos / eos / pad ids
    tokenizer.json, tokenizer_config.json (+ chat_template.jinja on transformers >= 4.51)

The folder loads with `AutoModelForCausalLM` / `AutoTokenizer` (any transformers >= 4.45), with
`TargetModel.from_pretrained`, and with vLLM.
"""

from __future__ import annotations

import errno
import json
import shutil
from pathlib import Path

WEIGHTS_FILE = "model.safetensors"
_TOKENIZER_CONFIG = "tokenizer_config.json"
# keys transformers records about how *this* process loaded the tokenizer, not about the tokenizer
_LOAD_TIME_KEYS = ("is_local", "local_files_only", "name_or_path")
_SPACE_MARGIN_BYTES = 64 << 20


def convert_gguf_to_hf(gguf_file: Path, out_dir: Path) -> None:
    """Write the Hugging Face folder of the causal LM in `gguf_file` into `out_dir` (created)."""
    import torch
    import transformers
    from packaging.version import Version
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from vllm_moa.target import SUPPORTED_ARCHITECTURES
    from vllm_moa.targets.errors import ConversionError

    out_dir.mkdir(parents=True, exist_ok=True)
    # transformers renamed `torch_dtype` to `dtype` in 4.56
    dtype_key = "dtype" if Version(transformers.__version__) >= Version("4.56") else "torch_dtype"
    try:
        tokenizer = AutoTokenizer.from_pretrained(str(gguf_file.parent), gguf_file=gguf_file.name)
        model = AutoModelForCausalLM.from_pretrained(str(gguf_file.parent), gguf_file=gguf_file.name,
                                                     **{dtype_key: torch.float32})
    except (ImportError, OSError, ValueError, KeyError) as err:
        if isinstance(err, OSError) and err.errno is not None:
            raise  # a real I/O failure (disk full, ...): the caller reports it
        raise ConversionError(f"transformers could not load {gguf_file.name} as a causal LM: {err}") from None
    architecture = type(model).__name__
    if architecture not in SUPPORTED_ARCHITECTURES:
        raise ConversionError(f"{gguf_file.name} holds a {architecture}, not one of {', '.join(SUPPORTED_ARCHITECTURES)}")

    _align_special_tokens(tokenizer, model.config)
    _write_weights(model, out_dir / WEIGHTS_FILE)
    _write_config(model, out_dir)
    model.generation_config.save_pretrained(str(out_dir))
    tokenizer.save_pretrained(str(out_dir))
    _make_tokenizer_config_portable(out_dir / _TOKENIZER_CONFIG, tokenizer, model.config.max_position_embeddings)


def _align_special_tokens(tokenizer, config) -> None:
    """Give the tokenizer the model's BOS / EOS (the GGUF metadata's, which the config holds).
    transformers 5.17 reads SmolLM2's llama.cpp tokenizer with EOS = <|im_start|> while the
    config keeps <|im_end|>: generation that stops at the tokenizer's EOS then runs past the end
    of every turn."""
    for name in ("bos", "eos"):
        wanted = getattr(config, f"{name}_token_id", None)
        if isinstance(wanted, int) and getattr(tokenizer, f"{name}_token_id") != wanted:
            setattr(tokenizer, f"{name}_token", tokenizer.convert_ids_to_tokens(wanted))


def _write_weights(model, path: Path) -> None:
    """The state dict as fp32 safetensors; a tensor sharing storage with an earlier one (the tied
    LM head) is left out, as `save_pretrained` does. Written through Python's own file I/O so that
    a full disk raises OSError(ENOSPC)."""
    from safetensors.torch import save

    tensors: dict = {}
    stored: set[tuple[int, tuple[int, ...]]] = set()
    for name, tensor in model.state_dict().items():
        key = (tensor.untyped_storage().data_ptr(), tuple(tensor.shape))
        if key in stored:
            continue
        stored.add(key)
        tensors[name] = tensor.detach().contiguous()
    needed = sum(t.numel() * t.element_size() for t in tensors.values()) + _SPACE_MARGIN_BYTES
    free = shutil.disk_usage(path.parent).free
    if free < needed:
        raise OSError(errno.ENOSPC, f"{needed >> 20} MiB needed, {free >> 20} MiB free", str(path.parent))
    payload = save(tensors, metadata={"format": "pt"})
    with open(path, "wb") as file:
        file.write(payload)


def _write_config(model, out_dir: Path) -> None:
    config = model.config
    if "quantization_config" in vars(config):
        del config.quantization_config
    config.architectures = [type(model).__name__]
    config.save_pretrained(str(out_dir))


def _make_tokenizer_config_portable(path: Path, tokenizer, context_length: int) -> None:
    """Name a tokenizer class every transformers release knows (5.x writes its own
    `TokenizersBackend`), carry the chat template inline (older releases do not read
    chat_template.jinja), bound the length by the context window, drop load-time keys."""
    config = json.loads(path.read_text(encoding="utf-8"))
    for key in _LOAD_TIME_KEYS:
        config.pop(key, None)
    config["tokenizer_class"] = "PreTrainedTokenizerFast"
    config["model_max_length"] = context_length
    if tokenizer.chat_template and "chat_template" not in config:
        config["chat_template"] = tokenizer.chat_template
    path.write_text(json.dumps(config, indent=2, ensure_ascii=False) + "\n", encoding="utf-8")
