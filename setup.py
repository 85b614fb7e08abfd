"""Thin shim: the package's metadata, dependencies and entry points are in pyproject.toml.

What stays here is the one thing pyproject.toml cannot say next to automatic discovery:
`kernels/` is a top-level folder of the repository (the layout's), but it is installed as
`vllm_moa.kernels` (another PyPI distribution owns the top-level name `kernels`, and transformers
imports it when present).
"""

from setuptools import find_packages, setup

setup(
    packages=[*find_packages(include=["vllm_moa", "vllm_moa.*"]), "vllm_moa.kernels"],
    package_dir={"vllm_moa.kernels": "kernels"},
)
