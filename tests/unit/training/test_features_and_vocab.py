"""The offline feature cache (training/features.py) and the reduced draft vocabulary."""

import json

import numpy as np
import pytest
import torch
from tiny_models import make_target

from vllm_moa.config import DrafterConfigError
from vllm_moa.decoding.chain import plain_greedy_generate, speculative_greedy_generate
from vllm_moa.decoding.engine import SpeculativeEngine
from vllm_moa.decoding.tree import DraftSpec
from vllm_moa.kinds.eagle import EagleDrafter, EagleDrafterConfig
from vllm_moa.kinds.independent import IndependentDrafterConfig
from vllm_moa.kinds.moa import MoAConfig, MoADrafter
from vllm_moa.models.base import load_drafter
from vllm_moa.recipes.smollm2 import draft_vocabulary
from vllm_moa.target import stack_layer_kv
from vllm_moa.training import features as features_module
from vllm_moa.training.data import DraftExample
from vllm_moa.training.features import FeatureCache, FeatureCacheError, build_feature_cache
from vllm_moa.training.trainer import TrainConfig, Trainer

SMALL = dict(lsa_intermediate_size=64, sa_intermediate_size=64, ca_intermediate_size=64)


def _examples(n=9, seed=0):
    gen = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(n):
        length = int(torch.randint(8, 30, (1,), generator=gen))
        out.append(DraftExample(tuple(torch.randint(0, 97, (length,), generator=gen).tolist()), 3))
    return out


def test_cached_features_equal_the_target_forward(tmp_path):
    target = make_target()
    examples = _examples()
    cache = build_feature_cache(target, examples, tmp_path / "f", max_length=24, tli_depths=(1, 2),
                                batch_tokens=40, progress=False)
    source = cache.manifest["source_index"]
    stored = cache.examples()
    assert sorted(source) == list(range(len(examples)))
    assert [e.input_ids for e in stored] == [examples[i].input_ids[:24] for i in source]
    assert [len(e.input_ids) for e in stored] == sorted(len(e.input_ids) for e in stored)  # shortest first
    indices = [4, 0, 7]
    width = max(len(stored[i].input_ids) for i in indices)
    got = cache.target_output(indices, width, "cpu")
    for row, i in enumerate(indices):
        n = len(stored[i].input_ids)
        out = target(torch.tensor([stored[i].input_ids]))
        tol = dict(atol=2e-3, rtol=2e-3)  # fp16 storage
        torch.testing.assert_close(got.layer_rows[row, :n], stack_layer_kv(out.keys, out.values)[0], **tol)
        torch.testing.assert_close(got.hidden_states[-1][row, :n], out.hidden_states[-1][0], **tol)
        for depth in (1, 2):
            layer = target.num_layers - depth
            torch.testing.assert_close(got.hidden_states[layer][row, :n], out.hidden_states[layer][0], **tol)
            torch.testing.assert_close(got.keys[layer][row, :, :n], out.keys[layer][0], **tol)
            torch.testing.assert_close(got.values[layer][row, :, :n], out.values[layer][0], **tol)
        assert got.argmax[row, :n].tolist() == out.logits[0].argmax(-1).tolist()
        assert got.layer_rows[row, n:].abs().sum() == 0  # padding is zeros
    assert got.hidden_states[0] is None and got.logits is None


def test_an_interrupted_build_resumes_to_the_same_cache(tmp_path, monkeypatch):
    target = make_target()
    examples = _examples(12)
    real_forward = type(target).forward
    calls = []

    def counting_forward(self, *args, **kwargs):
        calls.append(1)
        if die_at and len(calls) == die_at:
            raise KeyboardInterrupt  # killed mid-build
        return real_forward(self, *args, **kwargs)

    monkeypatch.setattr(type(target), "forward", counting_forward)
    die_at = 0
    whole = build_feature_cache(target, examples, tmp_path / "whole", 32, batch_tokens=50, progress=False)
    batches, calls[:] = len(calls), []
    assert batches >= 4
    die_at = 3
    with pytest.raises(KeyboardInterrupt):
        build_feature_cache(target, examples, tmp_path / "resumed", 32, batch_tokens=50, progress=False)
    assert not (tmp_path / "resumed").exists()  # nothing half-written is ever opened as a cache
    with pytest.raises(FeatureCacheError, match="not a complete feature cache"):
        FeatureCache(tmp_path / "resumed.partial")
    assert json.loads((tmp_path / "resumed.partial" / "progress.json").read_text())["done"] > 0
    die_at, calls[:] = 0, []
    resumed = build_feature_cache(target, examples, tmp_path / "resumed", 32, batch_tokens=50, progress=False)
    assert len(calls) == batches - 2  # the two finished batches were not run again
    for name, array in whole.arrays.items():
        np.testing.assert_array_equal(np.asarray(resumed.arrays[name]), np.asarray(array), err_msg=name)


def test_a_cache_of_other_data_or_target_is_refused(tmp_path):
    target = make_target()
    examples = _examples()
    build_feature_cache(target, examples, tmp_path / "f", 24, progress=False)
    with pytest.raises(FeatureCacheError, match="other data"):
        build_feature_cache(target, examples[:-1], tmp_path / "f", 24, progress=False)
    other = make_target(seed=5)
    config = TrainConfig(steps=2, batch_size=2, warmup_steps=1, progress=False, output_dir=str(tmp_path / "r"),
                         drafter_options=SMALL)
    with pytest.raises(FeatureCacheError, match="another target"):
        Trainer(config, other, examples, features=FeatureCache(tmp_path / "f"))


@pytest.mark.parametrize("kind,tli,stride", [("moa", 0, 1), ("moa", 1, 1), ("moa", 0, 2), ("eagle", 0, 1)])
def test_training_on_cached_features_matches_online_training(tmp_path, kind, tli, stride):
    """The same steps from the cache and from online target forwards give the same losses (up to
    fp16 storage) and the loss falls; with an LSA layer stride, both paths read the same layers."""
    target = make_target()
    examples = _examples(16)
    cache = build_feature_cache(target, examples, tmp_path / "f", 32, progress=False)
    options = {**SMALL, "lsa_layer_stride": stride} if kind == "moa" else {}
    losses = {}
    for mode in ("online", "cached"):
        config = TrainConfig(drafter=kind, tli=tli, steps=12, batch_size=4, warmup_steps=1, lr=3e-3,
                             max_length=32, progress=False, seed=2, output_dir=str(tmp_path / mode),
                             drafter_options=options, log_every=1)
        trainer = Trainer(config, target, cache.examples(), features=cache if mode == "cached" else None)
        losses[mode] = [trainer.train_step()["loss"] for _ in range(config.steps)]
    assert all(np.isfinite(losses["cached"]))
    np.testing.assert_allclose(losses["cached"], losses["online"], rtol=2e-2)
    assert np.mean(losses["cached"][-3:]) < np.mean(losses["cached"][:3])


def _vocab_drafter(kind, target, vocab):
    torch.manual_seed(0)
    if kind == "moa":
        drafter = MoADrafter(MoAConfig(target=target.signature, tli=1, draft_vocab_size=len(vocab)))
    else:
        drafter = EagleDrafter(EagleDrafterConfig(target=target.signature, draft_vocab_size=len(vocab)))
    drafter.set_draft_vocab(torch.tensor(vocab))
    return drafter.eval()


@pytest.mark.parametrize("kind", ["moa", "eagle"])
def test_a_reduced_draft_vocabulary_drafts_only_its_tokens_and_keeps_greedy_exact(tmp_path, kind):
    target = make_target()
    vocab = list(range(0, 97, 2))  # half of the tiny target's 97 tokens
    drafter = _vocab_drafter(kind, target, vocab)
    feature = torch.randn(2, 3, target.hidden_size)
    full = drafter.draft_logits(feature, target)
    assert full.shape[-1] == target.vocab_size
    assert torch.isinf(full[..., 1::2]).all() and (full[..., 1::2] < 0).all()
    torch.testing.assert_close(full[..., ::2], target.lm_head(feature)[..., ::2])
    gen = torch.Generator().manual_seed(1)
    prompts = [torch.randint(0, 97, (int(torch.randint(2, 12, (1,), generator=gen)),), generator=gen).tolist()
               for _ in range(3)]
    greedy = [plain_greedy_generate(target, p, 16).token_ids for p in prompts]
    assert [speculative_greedy_generate(target, drafter, p, 16, num_draft=3).token_ids for p in prompts] == greedy
    engine = SpeculativeEngine(target, drafter, DraftSpec.tree(depth=3, top_k=3, budget=8))
    assert [r.token_ids for r in engine.generate(prompts, 16)] == greedy
    drafter.save_pretrained(tmp_path / "d")
    config = json.loads((tmp_path / "d" / "config.json").read_text())
    assert config["draft_vocab_size"] == len(vocab)
    loaded = load_drafter(tmp_path / "d", target)
    assert loaded.draft_vocab.tolist() == vocab
    torch.testing.assert_close(loaded.draft_logits(feature, target), full)


def test_draft_vocabulary_is_checked():
    target = make_target()
    with pytest.raises(DrafterConfigError, match="draft_vocab_size"):
        IndependentDrafterConfig(target=target.signature, draft_vocab_size=8).check_draft_vocab()
    with pytest.raises(DrafterConfigError, match="must be in 0..97"):
        MoAConfig(target=target.signature, draft_vocab_size=500).check_draft_vocab()
    drafter = MoADrafter(MoAConfig(target=target.signature, draft_vocab_size=4))
    with pytest.raises(ValueError, match="distinct"):
        drafter.set_draft_vocab(torch.tensor([1, 1, 2, 3]))
    with pytest.raises(ValueError, match="needs 4 ids"):
        drafter.set_draft_vocab(torch.tensor([1, 2]))


def test_draft_vocabulary_takes_the_most_frequent_response_tokens():
    examples = [DraftExample((50, 51, 7, 7, 7, 9, 9, 3), 2), DraftExample((50, 9, 7, 4), 1)]
    # response counts: 7 x4, 9 x3, 3 x1, 4 x1 (prompt tokens 50, 51 not counted); EOS 2 always in
    assert draft_vocabulary(examples, 4, 97, always=[2]) == [2, 3, 7, 9]
    assert draft_vocabulary(examples, 7, 97, always=[2]) == [0, 1, 2, 3, 4, 7, 9]  # padded with low ids


def test_trainer_with_a_draft_vocabulary_trains_the_reduced_head(tmp_path):
    target = make_target()
    examples = _examples(8)
    vocab = list(range(0, 97, 3))
    config = TrainConfig(steps=3, batch_size=2, warmup_steps=1, progress=False, output_dir=str(tmp_path / "r"),
                         drafter_options={**SMALL, "draft_vocab_size": len(vocab)}, checkpoint_every=3)
    with pytest.raises(ValueError, match="draft_vocab"):
        Trainer(config, target, examples)
    trainer = Trainer(config, target, examples, draft_vocab=vocab)
    result = trainer.train()
    assert np.isfinite(result.final_loss)
    assert load_drafter(result.drafter_dir, target).draft_vocab.tolist() == vocab
    resumed = Trainer(config.model_copy(update={"steps": 4}), target, examples, draft_vocab=list(range(len(vocab))))
    resumed.load_checkpoint()
    assert resumed.drafter.draft_vocab.tolist() == vocab  # the checkpoint's vocabulary wins on resume
    assert features_module.FORMAT_VERSION == 1
