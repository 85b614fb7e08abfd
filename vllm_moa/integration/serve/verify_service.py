"""The worker side of the vLLM client-server backend (vllm_backend.py): what the target saw at
the last positions of a flagged request's prompt, taken inside vLLM's worker after the forward.

A verification round is one vLLM request whose prompt is the session's verified tokens, the
round's root and the client's draft, generating one token; prefix caching makes its cost the new
tokens. vLLM computes logits at a prompt's last position only, so the request asks for more:

    SamplingParams.extra_args["moa_verify"] = {       # chunk_args.py
        "key": str,           # where its capture is kept (vLLM renames request ids internally)
        "rows_from": int,     # per-layer K/V and the final hidden state of positions rows_from..P-1
        "logits_from": int,   # the target's next-token argmax at positions logits_from..P-1
        "logits": bool,       # ... and the float32 logits there (sampled acceptance)
        "cached_rows": bool,  # optional: K/V (no hidden state) of wanted positions the prefix cache served
        "tree": {...},        # optional: the positions from its root on are a draft tree (session_trees.py)
    }

`RunnerVerifyTapPatch` wraps `GPUModelRunner.sample_tokens` (the CPU runner's too): at its start
the step's hidden states [N, E], its per-layer slot mapping and the request order are at hand
(`execute_model_state`), the target's K/V are in the paged caches, and nothing has moved yet.
Positions are gathered as they are computed, so chunked prefill and recomputation after a
preemption are covered; positions served from the prefix cache are never computed here, and a
capture lists the positions it has (the backend asks again without reading the prefix cache for
what no request of the round computed). With "cached_rows", the K/V of wanted positions the prefix
cache served are read from the paged caches through the request's block table (their slots
checked against the step's own slot mapping), without a hidden state (`rows_without_hidden`): a
MoA client's open over a prompt other sessions computed then runs only the prompt's last block.

A live session's tree chunk is computed under the tree mask (session_trees.py, planned in the
runner's `_prepare_inputs`); its capture is read here alike, and says `tree_split` when the
scheduler split the chunk across steps (its node rows then lack the mask).

The backend reads captures through `VerifyWorkerExtension.moa_verify_take` (vLLM's
`worker_extension_cls` and `collective_rpc`, public API): each is taken once. Captures are
bounded (`MAX_CAPTURES`; the oldest go first), so requests the backend abandoned cannot pile up.
Tensor parallelism is refused by the backend (each rank holds a share of the KV heads).
"""

from __future__ import annotations

import functools
from collections import OrderedDict
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import Tensor

from vllm_moa.integration.serve.chunk_args import verify_spec
from vllm_moa.integration.serve.session_trees import SessionTrees, tree_chunks_unavailable
from vllm_moa.integration.shell import compat
from vllm_moa.integration.shell.patches import VllmPatch
from vllm_moa.kernels.paged import gather_slots

MAX_CAPTURES = 4096


@dataclass
class Capture:
    """One flagged request's positions, filled step by step (position -> row)."""

    prompt_len: int
    rows_from: int
    logits_from: int
    want_logits: bool
    hidden: dict[int, Tensor] = field(default_factory=dict)  # [E]
    keys: dict[int, Tensor] = field(default_factory=dict)  # [L, H_kv, d]
    values: dict[int, Tensor] = field(default_factory=dict)
    argmax: dict[int, int] = field(default_factory=dict)
    logits: dict[int, Tensor] = field(default_factory=dict)  # [V]
    tree_split: bool = False  # a tree chunk split across steps: its node rows lack the tree mask
    cached_rows: bool = False  # wanted positions the prefix cache served are read from it (K/V only)

    def result(self) -> dict[str, Any]:
        """What was computed, in position order: `row_positions` with their hidden states [n, E]
        and K/V [L, n, H_kv, d]; `head_positions` with the argmax there (and logits [m, V]).
        A wanted position served from the prefix cache is missing from both lists, unless read from
        the cache (`cached_rows`): then its row is listed, its hidden state zero, and its position
        in `rows_without_hidden`."""
        rows = [p for p in range(self.rows_from, self.prompt_len) if p in self.keys]
        heads = [p for p in range(self.logits_from, self.prompt_len)
                 if p in self.argmax and (not self.want_logits or p in self.logits)]
        out: dict[str, Any] = {"row_positions": rows, "head_positions": heads,
                               "argmax": [self.argmax[p] for p in heads]}
        if rows:
            width = next(iter(self.hidden.values())).shape[0] if self.hidden else 0
            out["hidden"] = pack(torch.stack([self.hidden.get(p, torch.zeros(width)) for p in rows]))  # [n, E]
            out["rows_without_hidden"] = [p for p in rows if p not in self.hidden]
            out["keys"] = pack(torch.stack([self.keys[p] for p in rows], dim=1))  # [L, n, H_kv, d]
            out["values"] = pack(torch.stack([self.values[p] for p in rows], dim=1))
        if self.want_logits and heads:
            out["logits"] = pack(torch.stack([self.logits[p] for p in heads]))  # [m, V]
        if self.tree_split:
            out["tree_split"] = True
        return out


def pack(x: Tensor) -> dict[str, Any]:
    """A float32 CPU tensor as plain values (vLLM's RPC results carry bytes, not tensors)."""
    return {"shape": list(x.shape), "data": x.contiguous().numpy().tobytes()}


def unpack(packed: dict[str, Any]) -> Tensor:
    return torch.frombuffer(bytearray(packed["data"]), dtype=torch.float32).view(*packed["shape"])


class _TargetLayers:
    """The target's attention layers in order and how to read their caches."""

    def __init__(self, runner: Any) -> None:
        from vllm.config import get_layers_from_vllm_config
        from vllm.model_executor.layers.attention_layer_base import AttentionLayerBase
        from vllm.model_executor.models.utils import extract_layer_index

        layers = get_layers_from_vllm_config(runner.vllm_config, AttentionLayerBase)  # type: ignore[type-abstract]
        self.names = sorted(layers, key=extract_layer_index)
        self.layers = [layers[name] for name in self.names]
        backends = {layer.get_attn_backend().get_name() for layer in self.layers}
        isas = {getattr(layer, "isa", None) for layer in self.layers}
        if len(backends) != 1:
            raise RuntimeError(f"the target's layers run on several attention backends: {sorted(backends)}")
        self.backend = backends.pop()
        self.layout = compat.kv_layout_for_backend(self.backend, isas.pop() if len(isas) == 1 else None)
        from vllm.v1.kv_cache_interface import FullAttentionSpec

        # each layer's KV-cache group, for reading positions the prefix cache served (cached_rows);
        # None when a layer has no group or one whose blocks do not hold every position (sliding windows)
        full = {name: g for g, group in enumerate(runner.kv_cache_config.kv_cache_groups)
                if isinstance(group.kv_cache_spec, FullAttentionSpec) for name in group.layer_names}
        self.groups: list[int] | None = [full[name] for name in self.names] if set(self.names) <= set(full) else None

    @classmethod
    def of(cls, runner: Any) -> _TargetLayers:
        """The runner's (read once)."""
        layers = runner.__dict__.get("_moa_verify_layers")
        if layers is None:
            layers = runner._moa_verify_layers = cls(runner)
        return layers


_CAPTURES: OrderedDict[str, Capture] = OrderedDict()
_FAILED: OrderedDict[str, str] = OrderedDict()  # key -> why its capture failed


def collect(runner: Any) -> None:
    """Gather this step's wanted positions of every flagged request (sample_tokens' start)."""
    trees: SessionTrees | None = runner.__dict__.get(compat.STEP_PLANNER_ATTR)
    if trees is not None:
        trees.finish(runner.positions)  # the forward is done: tree nodes' positions back to the chain's
    state = runner.execute_model_state
    if state is None:
        return
    flagged = []
    for req_id, count in state.scheduler_output.num_scheduled_tokens.items():
        request = runner.requests.get(req_id)
        spec = verify_spec(getattr(request, "sampling_params", None))
        if spec:
            flagged.append((req_id, count, request, spec))
    if not flagged:
        return
    for req_id, count, request, spec in flagged:
        try:  # a failure fails this round only (its capture says why), never vLLM's engine
            if not isinstance(state.slot_mappings, dict):
                raise RuntimeError("the step has no per-layer slot mapping (micro-batching is not supported)")
            _collect_request(runner, state, _TargetLayers.of(runner), trees, req_id, count, request, spec)
        except Exception as err:  # noqa: BLE001 - reported to the backend through take()
            _FAILED[str(spec.get("key"))] = f"{type(err).__name__}: {err}"
            while len(_FAILED) > MAX_CAPTURES:
                _FAILED.popitem(last=False)


def _collect_request(runner: Any, state: Any, layers: _TargetLayers, trees: SessionTrees | None, req_id: str,
                     count: int, request: Any, spec: dict) -> None:
    key, prompt_len = str(spec["key"]), len(request.prompt_token_ids)
    rows_from, logits_from = int(spec["rows_from"]), int(spec["logits_from"])
    index = runner.input_batch.req_id_to_index[req_id]
    start = int(runner.query_start_loc.cpu[index])
    computed = int(runner.input_batch.num_computed_tokens_cpu[index])
    first = max(min(rows_from, logits_from), computed)
    last = min(prompt_len, computed + count)  # prompt positions computed this step: [first, last)
    capture = _CAPTURES.get(key)
    if capture is None:
        capture = _CAPTURES[key] = Capture(prompt_len, rows_from, logits_from, bool(spec.get("logits")),
                                           cached_rows=bool(spec.get("cached_rows")))
        while len(_CAPTURES) > MAX_CAPTURES:
            _CAPTURES.popitem(last=False)
    if trees is not None and trees.was_split(key):
        capture.tree_split = True
    if first >= last:
        return
    if capture.cached_rows and computed > capture.rows_from:  # then first == computed: its flat index is start
        _read_cached_rows(runner, state, layers, index, computed, start, capture)
    positions = list(range(first, last))
    flat = torch.arange(start + first - computed, start + last - computed, device=state.hidden_states.device)
    hidden = state.hidden_states.index_select(0, flat)  # [m, E]
    heads = [i for i, p in enumerate(positions) if p >= capture.logits_from]
    if heads:
        logits = runner.model.compute_logits(hidden[heads]).float()  # [h, V]
        for i, token, row in zip(heads, logits.argmax(-1).tolist(), logits):
            capture.argmax[positions[i]] = int(token)
            if capture.want_logits:
                capture.logits[positions[i]] = row.cpu()
    rows = [i for i, p in enumerate(positions) if p >= capture.rows_from]
    if rows:
        keys, values, slots_of = [], [], {}  # layers of one KV-cache group share one slot mapping
        for name, layer in zip(layers.names, layers.layers):
            mapping = state.slot_mappings[name]
            if id(mapping) not in slots_of:
                slots_of[id(mapping)] = mapping.index_select(0, flat[rows])
            k, v = gather_slots(layer.kv_cache, slots_of[id(mapping)], layers.layout)  # [r, H_kv, d]
            keys.append(k.float().cpu())
            values.append(v.float().cpu())
        keys_t, values_t = torch.stack(keys, dim=1), torch.stack(values, dim=1)  # [r, L, H_kv, d]
        hidden_rows = hidden[rows].float().cpu()
        for j, i in enumerate(rows):
            p = positions[i]
            capture.hidden[p], capture.keys[p], capture.values[p] = hidden_rows[j], keys_t[j], values_t[j]


def _read_cached_rows(runner: Any, state: Any, layers: _TargetLayers, index: int, computed: int, first_flat: int,
                      capture: Capture) -> None:
    """K/V of the wanted positions before `computed` (the prefix cache served them) that the capture
    lacks, read through the request's block table. Nothing is read (the backend then runs the round
    again without the cache) where a layer's group may not hold every position (`groups` None), a
    wanted position's block is vLLM's null block (0), or the table does not give the step's first
    computed position the slot the step wrote."""
    missing = [p for p in range(capture.rows_from, computed) if p not in capture.keys]
    if not missing or layers.groups is None:
        return
    wanted = torch.tensor([*missing, computed])
    keys, values, slots_of = [], [], {}
    for name, layer, group in zip(layers.names, layers.layers, layers.groups):
        if group not in slots_of:
            table = runner.input_batch.block_table[group]
            row = torch.from_numpy(table.get_numpy_array()[index])  # [max_blocks] block ids
            blocks = row[wanted // table.block_size].long()
            slots = blocks * table.block_size + wanted % table.block_size
            if bool((blocks == 0).any()) or int(slots[-1]) != int(state.slot_mappings[name][first_flat]):
                return
            slots_of[group] = slots[:-1].to(layer.kv_cache.device)
        k, v = gather_slots(layer.kv_cache, slots_of[group], layers.layout)  # [m, H_kv, d]
        keys.append(k.float().cpu())
        values.append(v.float().cpu())
    keys_t, values_t = torch.stack(keys, dim=1), torch.stack(values, dim=1)  # [m, L, H_kv, d]
    for j, p in enumerate(missing):
        capture.keys[p], capture.values[p] = keys_t[j], values_t[j]


def take(keys: list[str]) -> dict[str, dict[str, Any]]:
    """The captures of `keys` (each taken once; an unknown key is absent from the answer; a
    capture that failed in the worker is {"error": why})."""
    out: dict[str, dict[str, Any]] = {}
    for key in keys:
        capture, failed = _CAPTURES.pop(key, None), _FAILED.pop(key, None)
        if failed is not None:
            out[key] = {"error": failed}
        elif capture is not None:
            out[key] = capture.result()
    return out


class VerifyWorkerExtension:
    """Mixed into vLLM's worker class (`worker_extension_cls`): called with `collective_rpc`."""

    def moa_verify_install(self) -> dict[str, Any]:
        """Install the capture hook, and the tree-chunk hooks where the engine can mask trees:
        {"tree_chunks": None, or why a live session's tree runs as requests instead}."""
        RunnerVerifyTapPatch.apply()
        runner = self.model_runner  # type: ignore[attr-defined]
        layers = _TargetLayers.of(runner)
        why = tree_chunks_unavailable(layers.backend, runner.compilation_config.cudagraph_mode)
        if why is None:
            SessionTrees(layers.names, layers.layout).attach(runner, layers.layers, layers.backend)
        return {"tree_chunks": why}

    def moa_verify_take(self, keys: list[str]) -> dict[str, dict[str, Any]]:
        return take(keys)


class RunnerVerifyTapPatch(VllmPatch):
    """Before the V1 runner's `sample_tokens`, flagged requests' positions are gathered (collect)."""

    symbol = "runner_sample_tokens"

    @classmethod
    def _patch(cls, owner: Any, attr: str) -> None:
        original = getattr(owner, attr)

        @functools.wraps(original)
        def sample_tokens(self, grammar_output):
            collect(self)
            return original(self, grammar_output)

        setattr(owner, attr, sample_tokens)
