"""Helpers of the cache tests (the fixtures they share, such as ``model``, live in tests/conftest.py)."""

from __future__ import annotations

from hf_rocketkv import RocketKVCache


def kept(cache: RocketKVCache) -> list[list[list[list[int]]]]:
    """Kept input columns per (layer, row, KV head), in slot order."""
    out = []
    for layer in cache.layers:
        lengths = layer.lengths.tolist()
        out.append([[layer.positions[b, h, :n].tolist() for h in range(layer.num_kv_heads)]
                    for b, n in enumerate(lengths)])
    return out
