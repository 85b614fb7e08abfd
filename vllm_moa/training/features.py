"""Offline feature cache: one pass of the frozen target over the training sequences, stored on
disk (fp16, memory-mapped), so that every drafter and every epoch trains without running the
target again. Online features (the trainer runs the target each step) stay the default.

Per token it stores what the four drafter kinds read from the target:

    rows.npy     [N, L, 2*Ekv] fp16  per-layer K (post-RoPE) and V, in stack_layer_kv's layout (LSA input;
                                     TLI layers' K/V are views of it)
    final.npy    [N, E] fp16         final post-norm hidden state (EAGLE input, feature loss, target logits)
    mid_{n}.npy  [N, E] fp16         hidden state entering layer L - n, for each TLI depth n kept
    argmax.npy   [N] int32           the target's greedy next token (agreement metric, full vocabulary)
    ids.npy      [N] int32           the tokens

SmolLM2-135M: 30 x 384 x 2 B + 2 x 576 x 2 B ~ 25 KB per token. Sequences are stored one after
the other (offsets in manifest.json). The cache is built in `<dir>.partial` (resumable, a
progress file after every chunk) and renamed into place once complete: a directory named
`<dir>` with a manifest is always whole.
"""

from __future__ import annotations

import hashlib
import json
import os
from collections.abc import Sequence
from pathlib import Path

import numpy as np
import torch
from torch import Tensor

from vllm_moa.target import TargetModel, TargetOutput, stack_layer_kv
from vllm_moa.training.data import DraftExample

MANIFEST = "manifest.json"
PROGRESS = "progress.json"
FORMAT_VERSION = 1


class FeatureCacheError(RuntimeError):
    """A feature cache is missing, incomplete, or made for another target or data."""


def _plan_digest(examples: Sequence[DraftExample], max_length: int, tli_depths: Sequence[int]) -> str:
    digest = hashlib.sha256(json.dumps([max_length, list(tli_depths)]).encode())
    for e in examples:
        digest.update(np.asarray(e.input_ids[:max_length], dtype=np.int32).tobytes())
        digest.update(int(e.prompt_length).to_bytes(4, "little"))
    return digest.hexdigest()[:16]


@torch.no_grad()
def build_feature_cache(target: TargetModel, examples: Sequence[DraftExample], directory: str | Path,
                        max_length: int, tli_depths: Sequence[int] = (1,), batch_tokens: int = 4096,
                        progress: bool = True) -> FeatureCache:
    """Run the target once over `examples` (truncated to `max_length`) and store its features in
    `directory`; resumes an interrupted build of the same plan; returns the opened cache."""
    from tqdm.auto import tqdm

    directory = Path(directory)
    digest = _plan_digest(examples, max_length, tli_depths)
    # stored shortest first (stable), so that batches of similar lengths waste little on padding;
    # `source_index` in the manifest maps each stored sequence back to its place in `examples`
    order = sorted(range(len(examples)), key=lambda i: min(len(examples[i].input_ids), max_length))
    examples = [examples[i] for i in order]
    if (directory / MANIFEST).is_file():
        cache = FeatureCache(directory)
        if cache.manifest["plan"] != digest:
            raise FeatureCacheError(f"{directory} holds features of other data (plan {cache.manifest['plan']}, "
                                    f"want {digest}): remove it or use another directory")
        return cache
    lengths = [min(len(e.input_ids), max_length) for e in examples]
    offsets = np.concatenate([[0], np.cumsum(lengths)]).tolist()
    total, sig = offsets[-1], target.signature
    partial = directory.with_name(directory.name + ".partial")
    partial.mkdir(parents=True, exist_ok=True)
    width = 2 * sig.kv_width
    shapes = {"rows": ((total, sig.num_layers, width), np.float16), "final": ((total, sig.hidden_size), np.float16),
              "argmax": ((total,), np.int32), "ids": ((total,), np.int32),
              **{f"mid_{n}": ((total, sig.hidden_size), np.float16) for n in tli_depths}}
    progress_path = partial / PROGRESS
    done = 0
    if progress_path.is_file():
        state = json.loads(progress_path.read_text())
        done = state["done"] if state.get("plan") == digest else 0
    arrays = {}
    for name, (shape, dtype) in shapes.items():
        path = partial / f"{name}.npy"
        mode = "r+" if done and path.is_file() else "w+"
        arrays[name] = np.lib.format.open_memmap(path, mode=mode, dtype=dtype, shape=shape)
    # batches of sequences in their stored order (resume = skip `done` sequences)
    batches, current, current_tokens = [], [], 0
    for index, length in enumerate(lengths):
        if current and (current_tokens + length > batch_tokens):
            batches.append(current)
            current, current_tokens = [], 0
        current.append(index)
        current_tokens += length
    if current:
        batches.append(current)
    bar = tqdm(total=total, initial=offsets[done], desc="feature cache", unit="tok", disable=not progress)
    for batch in batches:
        if batch[-1] < done:
            continue
        width_t = max(lengths[i] for i in batch)
        ids = torch.zeros(len(batch), width_t, dtype=torch.long)
        for row, i in enumerate(batch):
            ids[row, : lengths[i]] = torch.tensor(examples[i].input_ids[: lengths[i]])
        out = target(ids.to(target.device))  # right padding: causal, so real tokens never see it
        rows = stack_layer_kv(out.keys, out.values)  # [B, T, L, 2*Ekv]
        argmax = out.logits.argmax(-1)
        for row, i in enumerate(batch):
            a, n = offsets[i], lengths[i]
            arrays["rows"][a : a + n] = rows[row, :n].to(torch.float16).cpu().numpy()
            arrays["final"][a : a + n] = out.hidden_states[-1][row, :n].to(torch.float16).cpu().numpy()
            for depth in tli_depths:
                mid = out.hidden_states[sig.num_layers - depth][row, :n]
                arrays[f"mid_{depth}"][a : a + n] = mid.to(torch.float16).cpu().numpy()
            arrays["argmax"][a : a + n] = argmax[row, :n].cpu().numpy()
            arrays["ids"][a : a + n] = ids[row, :n].numpy()
        for array in arrays.values():
            array.flush()
        done = batch[-1] + 1
        progress_path.write_text(json.dumps({"plan": digest, "done": done}))
        bar.update(sum(lengths[i] for i in batch))
    bar.close()
    manifest = {"format": FORMAT_VERSION, "plan": digest, "signature": sig.to_dict(), "max_length": max_length,
                "tli_depths": list(tli_depths), "num_sequences": len(examples), "num_tokens": total,
                "offsets": offsets, "prompt_lengths": [min(e.prompt_length, n - 1) for e, n in zip(examples, lengths)],
                "source_index": order,
                "dtype": "float16"}
    (partial / MANIFEST).write_text(json.dumps(manifest))
    progress_path.unlink()
    del arrays
    os.replace(partial, directory)
    return FeatureCache(directory)


class FeatureCache:
    """A built cache, memory-mapped read-only."""

    def __init__(self, directory: str | Path) -> None:
        self.directory = Path(directory)
        path = self.directory / MANIFEST
        if not path.is_file():
            raise FeatureCacheError(f"{self.directory} is not a complete feature cache (no {MANIFEST})")
        self.manifest = json.loads(path.read_text())
        if self.manifest.get("format") != FORMAT_VERSION:
            raise FeatureCacheError(f"{path}: format {self.manifest.get('format')}, this version reads {FORMAT_VERSION}")
        names = ["rows", "final", "argmax", "ids", *(f"mid_{n}" for n in self.manifest["tli_depths"])]
        self.arrays = {name: np.load(self.directory / f"{name}.npy", mmap_mode="r") for name in names}
        self.offsets: list[int] = self.manifest["offsets"]

    def __len__(self) -> int:
        return self.manifest["num_sequences"]

    def check_target(self, target: TargetModel) -> None:
        from vllm_moa.config import DrafterTargetMismatch, TargetSignature

        try:
            TargetSignature.from_dict(self.manifest["signature"]).check_compatible(target.signature)
        except DrafterTargetMismatch as err:
            raise FeatureCacheError(f"feature cache {self.directory} was built for another target: {err}") from None

    def examples(self) -> list[DraftExample]:
        """The cached sequences (as truncated when the cache was built), in stored order (shortest
        first; manifest["source_index"][i] is sequence i's index in the examples given to the build)."""
        ids = self.arrays["ids"]
        return [DraftExample(tuple(ids[a:b].tolist()), p)
                for a, b, p in zip(self.offsets[:-1], self.offsets[1:], self.manifest["prompt_lengths"])]

    def target_output(self, indices: Sequence[int], width: int, device: torch.device | str,
                      dtype: torch.dtype = torch.float32) -> TargetOutput:
        """What the target's forward would give for sequences `indices`, right-padded to `width`
        tokens (pads are zeros): layer_rows [B, T, L, 2*Ekv], hidden_states with the final and the
        cached TLI entries filled (others None), keys/values of the cached TLI layers, argmax;
        no logits (the trainer computes the ones it needs from the final hidden state)."""
        sig = self.manifest["signature"]
        num_layers, b = sig["num_layers"], len(indices)

        def gather(name: str) -> Tensor:
            array = self.arrays[name]
            out = np.zeros((b, width, *array.shape[1:]), dtype=array.dtype)
            for row, i in enumerate(indices):
                a = self.offsets[i]
                n = min(self.offsets[i + 1] - a, width)
                out[row, :n] = array[a : a + n]
            tensor = torch.from_numpy(out).to(device)
            return tensor.to(dtype) if tensor.is_floating_point() else tensor.long()

        rows = gather("rows")  # [B, T, L, 2*Ekv]
        hidden_states: list[Tensor | None] = [None] * (num_layers + 1)
        hidden_states[-1] = gather("final")
        keys: list[Tensor | None] = [None] * num_layers
        values: list[Tensor | None] = [None] * num_layers
        h_kv, d = sig["num_kv_heads"], sig["head_dim"]
        for depth in self.manifest["tli_depths"]:
            hidden_states[num_layers - depth] = gather(f"mid_{depth}")
        for layer in range(num_layers - max(self.manifest["tli_depths"], default=0), num_layers):
            kv = rows[:, :, layer].view(b, width, h_kv, 2 * d).transpose(1, 2)  # [B, H_kv, T, 2d]
            keys[layer], values[layer] = kv[..., :d].contiguous(), kv[..., d:].contiguous()
        return TargetOutput(None, hidden_states, keys, values, layer_rows=rows, argmax=gather("argmax"))
