"""A prefill reads nothing back from the device per layer (the cache's prefill path: stage 1, compaction, pool pages).
On an H100, ~22 host-device syncs per layer of a pool-backed prefill would cost ~120 ms of an 8k prefill and most of a
prefix hit's time to first token.

On CPU a "sync" is any read of a tensor's value by the host: ``item`` / ``bool`` / ``int`` (``aten::
_local_scalar_dense``), ``nonzero``, ``equal`` (counted by a dispatch mode) and ``tolist`` (counted by a wrapper).
The oracle is the layer count: the same prefill on a model with 4 layers instead of 2 must read the device exactly as
often (what remains is once per forward or per request, e.g. the padding offsets of a padded batch).
"""

from __future__ import annotations

import collections
import threading

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from hf_rocketkv import KVBlockPool, RocketKVCache
from tests.support.tiny_models import compressing_config, cpu_pool, greedy, left_pad, make_models, random_ids

READS = {torch.ops.aten._local_scalar_dense.default, torch.ops.aten.nonzero.default, torch.ops.aten.equal.default}


class HostReads(TorchDispatchMode):
    """Counts the ops that make the host wait for a tensor's value, plus ``Tensor.tolist`` calls."""

    def __init__(self):
        super().__init__()
        self.counts: collections.Counter = collections.Counter()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func in READS:
            self.counts[str(func)] += 1
        return func(*args, **(kwargs or {}))

    def __enter__(self):
        original = torch.Tensor.tolist
        counts = self.counts
        thread = threading.get_ident()  # the dispatch mode is this thread's; so is the count of tolist calls

        def tolist(tensor):
            if threading.get_ident() == thread:  # another thread's host read (a batching engine's) is not this block's
                counts["tolist"] += 1
            return original(tensor)

        self._original = original
        torch.Tensor.tolist = tolist
        return super().__enter__()

    def __exit__(self, *exc):
        torch.Tensor.tolist = self._original
        return super().__exit__(*exc)

    @property
    def total(self) -> int:
        return sum(self.counts.values())


CFG = compressing_config(kt_cache_dtype="float32")


@pytest.fixture(scope="module")
def models():
    return {layers: make_models("llama", num_hidden_layers=layers)[0] for layers in (2, 4)}


def reads_of_prefill(model, ids, mask, pool: KVBlockPool | None) -> HostReads:
    cache = RocketKVCache(CFG, pool=pool)
    with HostReads() as reads:
        greedy(model, ids, attention_mask=mask, max_new_tokens=1, cache=cache)
    cache.close()
    return reads


@pytest.mark.parametrize("with_pool", [False, True], ids=["private", "pool"])
def test_cold_prefill_reads_do_not_grow_with_layers(models, with_pool):
    ids = random_ids(1, 70, seed=3)
    counts = {layers: reads_of_prefill(model, ids, torch.ones_like(ids),
                                       cpu_pool(model.config, CFG, 8 << 20) if with_pool else None)
              for layers, model in models.items()}
    assert counts[4].counts == counts[2].counts, (counts[2].counts, counts[4].counts)


def test_prefix_hit_reads_do_not_grow_with_layers(models):
    prefix = random_ids(1, 64, seed=4)
    counts = {}
    for layers, model in models.items():
        pool = cpu_pool(model.config, CFG, 8 << 20)
        reads_of_prefill(model, torch.cat([prefix, random_ids(1, 9, seed=5)], 1), None, pool)  # fills the pool
        ids = torch.cat([prefix, random_ids(1, 11, seed=6)], 1)
        cache = RocketKVCache(CFG, pool=pool)
        with HostReads() as reads:
            greedy(model, ids, attention_mask=torch.ones_like(ids), max_new_tokens=1, cache=cache)
        assert cache.stats.reused_tokens > 0  # the path under test is the hit
        cache.close()
        counts[layers] = reads
    assert counts[4].counts == counts[2].counts, (counts[2].counts, counts[4].counts)


def test_padded_batch_reads_padding_once_per_forward(models):
    """A left-padded batch reads its padding offsets once per forward, not once per layer."""
    ids, mask = left_pad([random_ids(1, 60, seed=7)[0], random_ids(1, 41, seed=8)[0]])
    counts = {layers: reads_of_prefill(model, ids, mask, None) for layers, model in models.items()}
    assert counts[4].counts == counts[2].counts, (counts[2].counts, counts[4].counts)
