"""Continuous batching over a ``KVBlockPool``: ``BatchingEngine`` (engine.py), its scheduler, admission, prefill
(chunked, graphed, beside decode) and the batched decode step.
"""
