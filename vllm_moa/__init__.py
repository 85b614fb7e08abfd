"""vllm-moa: Mixture of Attentions (MoA) speculative decoding.

Core (torch + transformers): the MoA drafter and baselines (`vllm_moa.models`), the target
adapter (`vllm_moa.target`), training (`vllm_moa.training`), decoding (`vllm_moa.decoding`).
The vLLM plugin and Ray scale-out are optional extras, imported lazily.
"""

__version__ = "0.1.0"

__all__ = ["Speculator", "generate"]


def __getattr__(name: str):
    """`vllm_moa.Speculator` / `vllm_moa.generate` without importing torch at package import."""
    if name in __all__:
        from vllm_moa import api

        return getattr(api, name)
    raise AttributeError(f"module 'vllm_moa' has no attribute {name!r}")
