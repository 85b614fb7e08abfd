"""The drafter-kind registry: one `DrafterKind` per kind, registered once by its own folder in
vllm_moa/kinds/ (moa/, eagle/, independent/, ngram/, none/: config, model, sessions, sync).

A kind declares everything the rest of the package dispatches on:

    name              what users and the wire protocol call it ("moa", "ngram", ...)
    drafter_class     the object a user holds: an nn.Module drafter (models/base.Drafter) or a
                      ModelFreeDrafter
    config_class      its config.json schema (a config.DrafterConfigBase); None: nothing to load or train
    runtime_session   (drafter, target) -> DraftSession, the runtime's drafter (decoding/drafters.py);
                      None: plain decoding
    client_session    (drafter, target | None) -> the client-side session (a serving/local.py
                      LocalDrafting); None: the client calls the server's plain generation instead
    server_sync       fills the SyncPayload the server sends after each verification from the
                      target's output (serving/backend.py); None: the client needs nothing back
    client_needs_target  the client-side session reads the target's embedding / LM head
    declares_target   the client declares the target signature the drafter was trained for
    declares_lsa      the client declares its LSA weights' fingerprint (the server serves only LSA
                      weights it holds itself)
    training_options  TrainConfig -> extra config options (MoA: its TLI depth)
    prepare_training  (drafter, TrainConfig) -> None, after a fresh drafter is built (EAGLE: rollout)
    evaluation_options  depth -> keyword arguments of training_forward when agreement at that depth
                      is measured (EAGLE: as many feature-autoregression passes as it drafts)
    display_name      how messages to users name it ("MoA"; default: the name)

This module is the bottom of the package: it imports none of it, so every layer can dispatch on
kinds without importing the layer that composes them (vllm_moa/kinds/, at the top). Kinds are
filled in by registration: the entry point group `vllm_moa.drafter_kinds` of the installed
distributions (pyproject.toml names the built-in ones) is loaded on the first lookup, the way vLLM loads
its plugins, so another package can add a kind without touching this one; `register` also takes
a kind directly (tests, notebooks).
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass
from importlib.metadata import entry_points
from typing import Any, Union

logger = logging.getLogger(__name__)
ENTRY_POINT_GROUP = "vllm_moa.drafter_kinds"


class ModelFreeDrafter:
    """A drafter with no weights and no config.json (n-gram lookup, no drafter at all): built from
    its name, never trained, loaded or shipped."""


AnyDrafter = Union[Any, ModelFreeDrafter]  # a drafter object of any kind: a models.Drafter or a ModelFreeDrafter
DrafterArg = Union[AnyDrafter, str, None]  # what the runtime's entry points take (see `as_drafter`)


def _no_options(config: Any) -> dict[str, Any]:
    return {}


def _nothing(drafter: Any, config: Any) -> None:
    return None


def _reads_hidden_states(drafter: Any) -> bool:
    return True


@dataclass(frozen=True)
class DrafterKind:
    name: str
    summary: str
    drafter_class: type
    config_class: type | None = None
    runtime_session: Callable[[Any, Any], Any] | None = None
    client_session: Callable[[Any, Any], Any] | None = None
    server_sync: Callable[..., None] | None = None
    # whether server_sync reads the target's final hidden states for this drafter (a server can
    # make the sync rows of positions the prefix cache served, whose hidden states it never saw,
    # only for a drafter that reads nothing but their K/V)
    sync_reads_hidden: Callable[[Any], bool] = _reads_hidden_states
    client_needs_target: bool = False
    declares_target: bool = True
    declares_lsa: bool = False
    training_options: Callable[[Any], dict[str, Any]] = _no_options
    prepare_training: Callable[[Any, Any], None] = _nothing
    evaluation_options: Callable[[int], dict[str, Any]] = _no_options
    display_name: str | None = None  # in messages to users (default: the name)

    @property
    def label(self) -> str:
        return self.display_name or self.name

    @property
    def trainable(self) -> bool:
        return self.config_class is not None

    @property
    def model_free(self) -> bool:
        return issubclass(self.drafter_class, ModelFreeDrafter)


_KINDS: dict[str, DrafterKind] = {}
_entry_points_loaded = False


def register(kind: DrafterKind) -> DrafterKind:
    """Register a kind under its name (once: a second registration of a name is a bug)."""
    if kind.name in _KINDS:
        raise ValueError(f"drafter kind {kind.name!r} is already registered")
    if kind.model_free != (kind.config_class is None):
        raise ValueError(f"drafter kind {kind.name!r}: a model drafter needs a config_class, a model-free one none")
    _KINDS[kind.name] = kind
    return kind


def _registered() -> dict[str, DrafterKind]:
    """The registered kinds, after loading the installed distributions' kind entry points once
    (a kind module registers itself when it is imported)."""
    global _entry_points_loaded
    if not _entry_points_loaded:
        _entry_points_loaded = True
        for point in entry_points(group=ENTRY_POINT_GROUP):
            point.load()
        if not _KINDS:
            logger.warning("no drafter kinds registered: is vllm-moa installed (pip install -e .)? "
                           "The entry point group %s names them.", ENTRY_POINT_GROUP)
    return _KINDS


def all_kinds() -> list[DrafterKind]:
    return list(_registered().values())


def names(where: Callable[[DrafterKind], bool] = lambda kind: True) -> list[str]:
    return [kind.name for kind in _registered().values() if where(kind)]


def get(name: str) -> DrafterKind:
    kinds = _registered()
    if name not in kinds:
        raise ValueError(f"unknown drafter kind {name!r}; known: {', '.join(kinds)}")
    return kinds[name]


def kind_of(drafter: AnyDrafter) -> DrafterKind:
    """The kind of a drafter object (a loaded model drafter or a ModelFreeDrafter)."""
    for kind in _registered().values():
        if isinstance(drafter, kind.drafter_class):
            return kind
    raise TypeError(f"not a drafter: {type(drafter).__name__}")


def for_config(model_type: Any) -> DrafterKind | None:
    """The kind whose config.json has this `model_type` (None if no kind has it)."""
    for kind in _registered().values():
        if kind.config_class is not None and kind.config_class.model_type == model_type:
            return kind
    return None


def as_drafter(drafter: DrafterArg) -> AnyDrafter:
    """A drafter object from what the runtime's entry points accept: a drafter object, None (no
    drafter: plain decoding) or a model-free kind's name ("ngram", "none")."""
    if drafter is None:
        return get("none").drafter_class()
    if isinstance(drafter, str):
        if drafter in _registered() and get(drafter).model_free:
            return get(drafter).drafter_class()
        raise ValueError(f"drafter must be a loaded drafter, None, or one of "
                         f"{', '.join(names(lambda k: k.model_free))}; got {drafter!r}")
    kind_of(drafter)  # a TypeError for anything else
    return drafter


def open_runtime_session(drafter: AnyDrafter, target: Any) -> Any:
    """The runtime's drafting session for a drafter object (None: plain decoding)."""
    kind = kind_of(drafter)
    return None if kind.runtime_session is None else kind.runtime_session(drafter, target)
