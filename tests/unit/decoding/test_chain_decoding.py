"""Greedy speculative decoding with MoA equals the target's own greedy decoding, token for token."""

import pytest
import torch
from tiny_models import make_target

from vllm_moa.decoding.chain import plain_greedy_generate, speculative_greedy_generate
from vllm_moa.kinds.moa import MoAConfig, MoADrafter


@pytest.mark.parametrize("family,tli,num_draft", [("llama", 0, 3), ("qwen2", 1, 4), ("llama", 2, 1)])
def test_speculative_equals_plain_greedy(family, tli, num_draft):
    target = make_target(family)
    torch.manual_seed(0)
    drafter = MoADrafter(MoAConfig(target=target.signature, tli=tli)).eval()
    gen = torch.Generator().manual_seed(1)
    for _ in range(5):
        prompt = torch.randint(0, 97, (int(torch.randint(1, 12, (1,), generator=gen)),), generator=gen).tolist()
        plain = plain_greedy_generate(target, prompt, 24)
        spec = speculative_greedy_generate(target, drafter, prompt, 24, num_draft=num_draft)
        assert spec.token_ids == plain.token_ids
        assert 1 <= spec.acceptance_length <= num_draft + 1


def test_all_drafts_accepted_when_target_is_constant():
    """A target whose LM head is zero predicts token 0 everywhere, and so does any drafter reading
    that LM head: every draft is accepted, acceptance length is K + 1 (the loop's bookkeeping for
    the all-accepted case, where the last draft is fed to SA after verification)."""
    target = make_target("llama")
    with torch.no_grad():
        target.hf_model.lm_head.weight.zero_()
    drafter = MoADrafter(MoAConfig(target=target.signature, tli=1)).eval()
    spec = speculative_greedy_generate(target, drafter, [1, 2, 3], 21, num_draft=4)
    assert spec.token_ids == plain_greedy_generate(target, [1, 2, 3], 21).token_ids == [0] * 21
    assert spec.accepted_per_forward == [5, 5, 5, 5]


@pytest.mark.parametrize("kwargs,match", [
    (dict(prompt_ids=[], max_new_tokens=4), "prompt_ids"),
    (dict(prompt_ids=[1], max_new_tokens=0), "max_new_tokens"),
    (dict(prompt_ids=[1], max_new_tokens=4, num_draft=0), "num_draft"),
])
def test_bad_requests_are_refused(kwargs, match):
    target = make_target("llama")
    drafter = MoADrafter(MoAConfig(target=target.signature))
    with pytest.raises(ValueError, match=match):
        speculative_greedy_generate(target, drafter, **kwargs)


def test_streaming_adds_up_to_the_result_and_stops_at_eos():
    target = make_target("llama")
    drafter = MoADrafter(MoAConfig(target=target.signature)).eval()
    plain = plain_greedy_generate(target, [4, 5, 6], 30)
    eos = plain.token_ids[7]  # a token the target will emit: generation must stop right after it
    chunks = []
    from vllm_moa.decoding.chain import speculative_generate

    out = speculative_generate(target, drafter, [4, 5, 6], 30, num_draft=4, eos_token_id=eos, on_tokens=chunks.append)
    assert [t for chunk in chunks for t in chunk] == out.token_ids
    assert out.token_ids == plain_greedy_generate(target, [4, 5, 6], 30, eos_token_id=eos).token_ids
    assert out.token_ids[-1] == eos and eos not in out.token_ids[:-1]
    positions = out.acceptance_by_position(4)
    assert len(positions) == 4 and all(0 <= p <= 1 for p in positions)
