import pytest
import torch
from tiny_models import make_target

from vllm_moa.decoding.cache import SlotKVCache
from vllm_moa.target import LayeredKVCache, TargetKVCache, TargetModel, UnsupportedTargetError


@pytest.mark.parametrize("family", ["llama", "qwen2"])
def test_functional_forward_matches_transformers(family):
    target = make_target(family)
    ids = torch.randint(0, 97, (2, 11))
    out = target(ids)
    ref = target.hf_model(ids, output_hidden_states=True)
    torch.testing.assert_close(out.logits, ref.logits, atol=1e-5, rtol=1e-5)
    assert len(out.hidden_states) == target.num_layers + 1
    torch.testing.assert_close(out.hidden_states[-1], ref.hidden_states[-1], atol=1e-5, rtol=1e-5)


def test_incremental_cache_matches_full_forward():
    target = make_target("llama")
    ids = torch.randint(0, 97, (1, 12))
    full = target(ids)
    cache = TargetKVCache()
    first = target(ids[:, :7], cache)
    second = target(ids[:, 7:], cache)
    torch.testing.assert_close(torch.cat([first.logits, second.logits], 1), full.logits, atol=1e-5, rtol=1e-5)
    cache.crop(9)
    assert cache.length == 9
    again = target(ids[:, 9:], cache)
    torch.testing.assert_close(again.logits, full.logits[:, 9:], atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("cache_class", [TargetKVCache, SlotKVCache])
def test_both_target_caches_keep_the_layered_cache_contract(cache_class):
    """Whichever LayeredKVCache the target writes through, an incremental forward equals the full one."""
    target = make_target("llama")
    ids = torch.randint(0, 97, (1, 12))
    cache = TargetKVCache() if cache_class is TargetKVCache else SlotKVCache(target.num_layers, [0])
    assert isinstance(cache, LayeredKVCache)
    outputs = []
    for chunk in (ids[:, :5], ids[:, 5:]):
        if isinstance(cache, SlotKVCache):
            cache.begin_round(chunk.shape[1], ids.device)
        outputs.append(target(chunk, cache).logits)
        if isinstance(cache, SlotKVCache):
            cache.commit(0, list(range(chunk.shape[1])))
    assert cache.length == 12
    torch.testing.assert_close(torch.cat(outputs, 1), target(ids).logits, atol=1e-5, rtol=1e-5)


def test_signature_and_fingerprint_are_dtype_independent():
    target = make_target("llama")
    sig = target.signature
    assert sig.num_layers == 4 and sig.num_kv_heads == 2 and sig.head_dim == 16 and sig.vocab_size == 97
    bf16 = TargetModel(make_target("llama").hf_model.to(torch.bfloat16))
    assert bf16.fingerprint() == target.fingerprint()
    assert make_target("llama", seed=1).fingerprint() != target.fingerprint()


def test_unsupported_architecture_is_refused():
    from transformers import GPT2Config, GPT2LMHeadModel

    with pytest.raises(UnsupportedTargetError, match="GPT2LMHeadModel"):
        TargetModel(GPT2LMHeadModel(GPT2Config(n_layer=1, n_embd=32, n_head=2, vocab_size=50)))
