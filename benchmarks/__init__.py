"""Benchmarks: each module is a script run from the repository root as `python -m benchmarks.<name>`;
every one writes a results file under benchmarks/results with provenance (benchmarks/provenance.py)."""
