"""Benchmarks importable by the CLI (``hf-rocketkv bench`` runs ``hf_rocketkv.bench.decode.main``)."""
