"""The vLLM plugin: speculative method "moa", in three wings (imports point down only:
serve -> moa -> shell, an import-linter contract in pyproject.toml):

    shell/   what patches vLLM and checks versions and configs; knows no MoA maths
             (plugin entry point, the declared patches, compat, the drafter's config as vLLM reads it)
    moa/     MoA running inside vLLM's engine: the proposer and what it drafts with (the tap, the
             vLLM-native drafter, chains, trees, lookup drafts, catch-up, tensor parallelism)
    serve/   vLLM's engine as a client-server target and as a one-shot offline run

Each wing's __init__ lists its modules. The shell names what the moa wing provides by string
(compat.MODEL_CLASS, compat.PROPOSER_CLASS), so vLLM's processes import the proposer and the
model only when they build them.
"""
