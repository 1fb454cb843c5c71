"""Timing and measurement scripts, run from the repository root as modules: ``python -m benchmarks.<name> --help``
(benchmarks/README.md lists them)."""
