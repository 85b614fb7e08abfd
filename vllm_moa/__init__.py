"""vllm-moa: Mixture of Attentions (MoA) speculative decoding.

Core (torch + transformers): the MoA drafter and baselines (`vllm_moa.models`), the target
adapter (`vllm_moa.target`), training (`vllm_moa.training`), decoding (`vllm_moa.decoding`).
The vLLM plugin and Ray scale-out are optional extras, imported lazily.
"""

__version__ = "0.1.0"
