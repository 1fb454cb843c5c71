"""Evaluation harness: needle/passkey grids, RULER-style synthetic tasks, fidelity metrics, method comparison."""
