"""The drafter-kind registry (vllm_moa/kinds): every registered kind, end to end (trained for a
step when it has weights, saved and loaded back, drafting in the runtime, drafting against a real
server on loopback), and the worked example of docs/drafter-kinds.md: a new kind is one module."""

from __future__ import annotations

import pytest
import torch
from serving_utils import running_server
from tiny_models import make_target

from vllm_moa import kinds, registry
from vllm_moa.decoding.chain import plain_greedy_generate
from vllm_moa.decoding.engine import SpeculativeEngine
from vllm_moa.decoding.tree import DraftSpec, DraftTree
from vllm_moa.serving.client import RemoteDraftingClient
from vllm_moa.training.data import DraftExample
from vllm_moa.training.trainer import TrainConfig, Trainer

PROMPT = [11, 12, 13, 14, 15, 11, 12, 13]
NEW_TOKENS = 24


@pytest.fixture(scope="module")
def target():
    return make_target("llama")


@pytest.fixture(scope="module")
def greedy(target):
    return plain_greedy_generate(target, PROMPT, NEW_TOKENS).token_ids


def _examples(n: int = 4, length: int = 20) -> list[DraftExample]:
    gen = torch.Generator().manual_seed(0)
    return [DraftExample(tuple(torch.randint(0, 97, (length,), generator=gen).tolist()), 4) for _ in range(n)]


def _obtain(kind: kinds.DrafterKind, target, tmp_path):
    """A drafter of `kind` the way a user gets one: trained (one step), saved and loaded by its
    directory; a model-free kind by its name."""
    if kind.model_free:
        return kinds.load(kind.name, target)
    config = TrainConfig(drafter=kind.name, steps=1, batch_size=2, warmup_steps=0, max_length=32, eval_depth=2,
                         progress=False, output_dir=str(tmp_path / kind.name))
    result = Trainer(config, target, _examples(), _examples(2)).train()
    return kinds.load(str(result.drafter_dir), target)


@pytest.mark.parametrize("name", registry.names())
def test_every_kind_trains_drafts_and_serves(name, target, greedy, tmp_path):
    kind = kinds.get(name)
    drafter = _obtain(kind, target, tmp_path)
    assert kinds.kind_of(drafter) is kind
    # the runtime: chain and tree, output equal to the target's greedy decoding
    for spec in (DraftSpec.chain(3), DraftSpec.tree(depth=3, top_k=2, budget=6)):
        result = SpeculativeEngine(target, drafter, spec).generate([PROMPT], NEW_TOKENS)[0]
        assert result.token_ids == greedy
        assert (sum(result.drafted_per_forward) > 0) == (kind.runtime_session is not None)
    # client-server over real HTTP: the kind's client session and its server sync payload
    served = {} if kind.model_free else {name: drafter}
    with running_server(target, served) as (url, _app, _backend):
        with RemoteDraftingClient(url, drafter, target, num_draft=3) as client:
            remote = client.generate(PROMPT, NEW_TOKENS)
    assert remote.token_ids == greedy
    assert (remote.verify_calls > 0) == (kind.client_session is not None)


def test_lookups_name_the_problem(target):
    with pytest.raises(ValueError, match="unknown drafter kind 'medusa'; known: moa, eagle, independent, ngram, none"):
        kinds.get("medusa")
    with pytest.raises(ValueError, match="drafter must be a loaded drafter, None, or one of ngram, none"):
        kinds.as_drafter("moa")
    with pytest.raises(TypeError, match="not a drafter: int"):
        kinds.kind_of(3)
    with pytest.raises(ValueError, match="'moa' is already registered"):
        kinds.register(kinds.get("moa"))
    with pytest.raises(ValueError, match="'ngram' is not a trainable drafter kind; trainable: moa, eagle, independent"):
        TrainConfig(drafter="ngram")


# -- the worked example of docs/drafter-kinds.md ---------------------------------------------------

class RepeatDrafter(kinds.ModelFreeDrafter):
    """Drafts the pending token `times` more times (right on runs like '....' or '0000')."""

    def __init__(self, times: int = 3) -> None:
        self.times = times


class RepeatSession:
    def __init__(self, drafter: RepeatDrafter, target) -> None:
        self.times = drafter.times

    def start(self, prompt, prefill) -> None:
        pass

    def propose(self, pending, spec, sampling=None, generator=None) -> DraftTree:
        return DraftTree.chain(pending, [pending] * min(self.times, spec.depth), torch.device("cpu"))

    def accept(self, tree, path, verified) -> None:
        pass


def test_a_new_kind_is_one_module_and_its_registration(target, greedy, monkeypatch):
    monkeypatch.setattr(registry, "_KINDS", dict(registry._registered()))  # the registration ends with the test
    kind = kinds.register(kinds.DrafterKind(name="repeat", summary="repeat the last token", drafter_class=RepeatDrafter,
                                            runtime_session=RepeatSession, declares_target=False))
    assert kinds.kind_of(RepeatDrafter()) is kind and "repeat" in registry.names()
    result = SpeculativeEngine(target, RepeatDrafter(), DraftSpec.chain(3)).generate([[7] * 12], NEW_TOKENS)[0]
    assert result.token_ids == plain_greedy_generate(target, [7] * 12, NEW_TOKENS).token_ids
    # its session drafted every round; the target's output ends in a run of one token, where every
    # repeat is accepted: 24 tokens in 8 target forwards, not 24
    assert result.drafted_per_forward == [3] * 8 and result.accepted_per_forward == [1, 1] + [4] * 6
    with pytest.raises(ValueError, match="a repeat drafter does not draft on a client"):
        RemoteDraftingClient("http://127.0.0.1:9", RepeatDrafter(), target)
