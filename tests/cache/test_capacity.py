"""Slots per row of a compressed store (hf_rocketkv/cache/capacity.py): the capacity buckets of the config, the
ladder above the largest bucket, whole KT pages."""

from __future__ import annotations

from hf_rocketkv import RocketKVConfig
from hf_rocketkv.cache.capacity import bucket_capacity


def test_bucket_capacity_follows_the_decode_runner_and_the_configured_buckets():
    graphs = RocketKVConfig(prompt_budget=100, capacity_headroom=28)
    assert bucket_capacity(graphs, 37, 4) == 40  # exact: nothing to compile
    compiled = graphs.replace(decode_runner="torch_compile")
    assert [bucket_capacity(compiled, n, 4) for n in (1, 37, 128, 129, 300, 385)] == [128, 128, 128, 256, 384, 512]
    explicit = RocketKVConfig(capacity_buckets=[30, 64], batch_buckets=[2, 6])
    assert [bucket_capacity(explicit, n, 8) for n in (3, 31, 65)] == [32, 64, 256]  # whole pages; then the ladder
    off = compiled.replace(capacity_buckets=(), batch_buckets=())
    assert bucket_capacity(off, 37, 4) == 40
