"""MoA's client-side session (serving/local.py): the runtime session fed by the server's Ekv2E
rows (+ the target's last-TLI-layer K/V) instead of a local target forward."""

from __future__ import annotations

import torch
from torch import Tensor

from vllm_moa.decoding.tree import DraftTree
from vllm_moa.kinds.moa.model import MoADrafter
from vllm_moa.kinds.moa.session import MoASession
from vllm_moa.serving.local import LocalDrafting, SyncTensors
from vllm_moa.serving.payload import PayloadError
from vllm_moa.serving.protocol import DrafterDecl
from vllm_moa.target import TargetModel


class LocalMoA(MoASession, LocalDrafting):
    kind = "moa"

    def __init__(self, drafter: MoADrafter, target: TargetModel) -> None:
        super().__init__(drafter, target)
        self._init_local()
        self.fingerprint = drafter.lsa_fingerprint()

    def declaration(self) -> DrafterDecl:
        return DrafterDecl(kind="moa", target=self.drafter.config.target_signature.to_dict(),
                           lsa_fingerprint=self.fingerprint, tli=self.drafter.tli)

    def _check(self, sync: SyncTensors) -> None:
        if sync.rows is None or (self.drafter.tli > 0 and sync.tli_keys is None):
            raise PayloadError("the server sent no MoA rows (or no TLI K/V) for verified tokens")
        if len(sync.tli_keys or []) != self.drafter.tli:
            raise PayloadError(f"the server sent K/V of {len(sync.tli_keys or [])} target layers; the drafter runs "
                               f"the last {self.drafter.tli}")

    def _extend(self, sync: SyncTensors) -> None:
        if sync.count == 0:
            return
        self._check(sync)
        self.drafter.extend_rows(self.state, sync.rows, sync.tli_keys or [], sync.tli_values or [])
        self.verified = self.state.num_verified

    def rows_wanted_from(self, prompt_len: int) -> int:
        """With an attention window W (and TLI = 0: the TLI layers read every position), CA reads
        only the last W verified rows, and the rows only grow: rows before prompt_len - W are never read
        (zeros stand in for them: the drafter's window must not widen during the session)."""
        window = self.drafter.attention_window
        return max(0, prompt_len - window) if window and self.drafter.tli == 0 else 0

    def start(self, prompt: list[int], sync: SyncTensors) -> None:
        if sync.start > self.state.num_verified and sync.count:  # rows no query reads (rows_wanted_from): zeros,
            self._check(sync)  # so that every row keeps its position
            skipped = torch.zeros(1, sync.start - self.state.num_verified, sync.rows.shape[-1],
                                  dtype=sync.rows.dtype, device=sync.rows.device)
            self.drafter.extend_rows(self.state, skipped, [], [])
        self._extend(sync)
        self.drafter.feed(self.state, torch.tensor([prompt], device=self.device), self.target)

    def accept(self, tree: DraftTree, path: list[int], sync: SyncTensors) -> None:
        self._check(sync)
        self.accept_rows(tree, path, sync.rows, sync.tli_keys or [], sync.tli_values or [])
        self.verified = self.state.num_verified
        self.fed = []

    def rollback(self) -> None:
        self.drafter.rollback(self.state, self.state.num_verified)
        self.fed = []

    def _chain_logits(self, tokens: list[int]) -> Tensor:
        ids = torch.tensor([tokens], device=self.device)
        return self.drafter.draft_step(self.state, ids, self.target)[0, -1]  # chain at the next SA positions
