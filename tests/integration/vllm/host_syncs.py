"""Ops that make the host wait for the device (a CUDA sync), recorded while code runs: the
dispatcher sees them on CPU tensors too, so a CPU test can show that a draft step's tap reads
nothing back. `.tolist()` and `.cpu()` of a CPU tensor are invisible here (no op on CPU); the
ops below are what `.item()`, `int(t)`, `bool(t)`, `nonzero` and data-dependent shapes go through."""

from __future__ import annotations

from torch.utils._python_dispatch import TorchDispatchMode

SYNCING = frozenset({
    "aten::_local_scalar_dense",  # .item(), int(t), float(t), bool(t)
    "aten::is_nonzero",  # bool(t)
    "aten::nonzero", "aten::nonzero_static", "aten::masked_select",  # data-dependent output sizes
    "aten::_unique2", "aten::unique_consecutive", "aten::unique_dim",
})


class HostSyncs(TorchDispatchMode):
    """with HostSyncs() as syncs: ...; syncs.seen lists the syncing ops in call order."""

    def __init__(self) -> None:
        super().__init__()
        self.seen: list[str] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        name = func._schema.name
        if name in SYNCING:
            self.seen.append(name)
        return func(*args, **(kwargs or {}))
