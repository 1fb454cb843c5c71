"""The lifetime of a cache's pool pages (cache/pool_pages.py): no leaked or double-held pages under random request
sequences (hypothesis state machine on a tiny model).

Requests start (generate on a fresh pool-backed cache, sharing prefixes often), continue (a later turn), finish
(close), are reset, or are dropped and garbage collected, in any order, with keep_all or evict caches. After every
step each page's reference count equals the number of live tables holding it, the used pages are exactly those,
and once every request is gone every page is free again. Requests the pool cannot hold are refused before anything
changes.
"""

from __future__ import annotations

import gc
from collections import Counter

import pytest
import torch
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from hf_rocketkv import KVBlockPool, RocketKVCache
from hf_rocketkv.memory import PoolExhaustedError
from tests.support.tiny_models import compressing_config, greedy, left_pad, make_models, random_ids

CFG = compressing_config(kt_cache_dtype="float32")
MODEL = None


def model():
    global MODEL
    if MODEL is None:
        MODEL = make_models("llama")[0]
    return MODEL


BASES = [random_ids(1, 90, seed=s)[0] for s in (1, 2)]


class PoolRequests(RuleBasedStateMachine):
    def __init__(self):
        super().__init__()
        m = model()
        # small enough that some requests do not fit
        self.pool = KVBlockPool(m.config, max_gpu_bytes=70 * 5120, page_size=8, dtype=torch.float32, device="cpu",
                                kt_page_size=4, kt_dtype="float32")
        self.live: list[tuple[RocketKVCache, torch.Tensor]] = []
        self.refused = 0

    def _tables(self):
        tables = {}
        for cache, _ in self.live:
            for row in cache.pages.rows:
                for table in row.tables():
                    tables[id(table)] = table
        return tables.values()

    @rule(base=st.integers(0, 1), length=st.integers(20, 90), new=st.integers(1, 6), keep_all=st.booleans(),
          salt=st.sampled_from([None, "a"]))
    def start(self, base, length, new, keep_all, salt):
        cfg = CFG.replace(multi_turn="keep_all") if keep_all else CFG
        cache = RocketKVCache(cfg, pool=self.pool, cache_salt=salt)
        ids = BASES[base][:length][None]
        free = self.pool.free_pages()
        try:
            out = greedy(model(), ids, max_new_tokens=new, cache=cache)
        except PoolExhaustedError:
            assert self.pool.free_pages() == free and cache.stats.pages_held == 0  # refused before any change
            assert cache.get_seq_length() == 0
            self.refused += 1
            return
        assert cache.stats.reused_tokens + cache.stats.computed_tokens == length
        self.live.append((cache, out))

    @rule(lengths=st.lists(st.integers(20, 90), min_size=2, max_size=3), rows_per_group=st.integers(1, 2),
          keep_all=st.booleans())
    def start_row_groups(self, lengths, rows_per_group, keep_all):
        """A padded batch prefilled in row groups: reserved up front, admitted group by group."""
        cfg = CFG.replace(prefill_batch_size=rows_per_group, multi_turn="keep_all" if keep_all else "evict")
        cache = RocketKVCache(cfg, pool=self.pool)
        ids, mask = left_pad([BASES[i % 2][:n] for i, n in enumerate(lengths)])
        free = self.pool.free_pages()
        try:
            out = greedy(model(), ids, attention_mask=mask, max_new_tokens=3, cache=cache)
        except PoolExhaustedError:
            assert self.pool.free_pages() == free and cache.stats.pages_held == 0  # refused before any change
            self.refused += 1
            return
        assert self.pool.reserved_pages() == 0
        self.live.append((cache, None))

    @precondition(lambda self: any(out is not None for _, out in self.live))
    @rule(index=st.integers(0, 7), extra=st.integers(1, 12), data=st.data())
    def next_turn(self, index, extra, data):
        candidates = [i for i, (_, out) in enumerate(self.live) if out is not None]  # single-row conversations
        position = candidates[index % len(candidates)]
        cache, out = self.live[position]
        ids = torch.cat([out, random_ids(1, extra, seed=extra)], dim=1)
        free, held = self.pool.free_pages(), cache.stats.pages_held
        try:
            out = greedy(model(), ids, max_new_tokens=data.draw(st.integers(1, 4)), cache=cache)
        except PoolExhaustedError:
            assert self.pool.free_pages() == free and cache.stats.pages_held == held  # refused before any change
            self.refused += 1
            self.live.pop(position)
            cache.close()
            return
        self.live[position] = (cache, out)

    @precondition(lambda self: self.live)
    @rule(index=st.integers(0, 7), how=st.sampled_from(["close", "reset", "drop"]))
    def finish(self, index, how):
        cache, _ = self.live.pop(index % len(self.live))
        if how == "close":
            cache.close()
        elif how == "reset":
            cache.reset()
        else:
            del cache
            gc.collect()

    @invariant()
    def every_page_is_held_exactly_by_its_tables(self):
        held = Counter(page for table in self._tables() for page in table.pages)
        assert self.pool.used_pages() == len(held)  # (also drains releases queued by finalizers)
        for page in range(self.pool.total_pages()):
            assert self.pool.page_info(page).ref == held.get(page, 0), page

    def teardown(self):
        for cache, _ in self.live:
            cache.close()
        self.live.clear()
        gc.collect()
        assert self.pool.free_pages() == self.pool.total_pages() and self.pool.reserved_pages() == 0


PoolRequests.TestCase.settings = settings(
    max_examples=8, stateful_step_count=6, deadline=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
)
test_pool_requests = PoolRequests.TestCase


@pytest.mark.parametrize("row_groups", [False, True])
def test_admission_collects_unreachable_caches_before_refusing(row_groups):
    """A pool that holds one request (two rows prefilled one group at a time with ``row_groups``: the reservation
    path). The first request's cache becomes unreachable inside a reference cycle (a
    user's, or one torch.compile makes while tracing a cache) with the garbage collector off: its pages are not back.
    The next admission collects garbage once before refusing, so it succeeds; when nothing can be collected, the
    refusal is unchanged."""
    m = model()
    cfg = CFG.replace(prefill_batch_size=1) if row_groups else CFG
    rows = 2 if row_groups else 1
    probe = KVBlockPool(m.config, max_gpu_bytes=1 << 20, page_size=8, dtype=torch.float32, device="cpu",
                        kt_page_size=4, kt_dtype="float32")
    one = probe.pages_needed(90, 4, cfg)
    # a row-group prefill of two rows reserves both rows' steady pages plus one group's prompt pages
    pages = one.prefill_peak + (one.steady_state if row_groups else 0)
    pool = KVBlockPool(m.config, max_gpu_bytes=pages * probe.bytes_per_page, page_size=8, dtype=torch.float32,
                       device="cpu", kt_page_size=4, kt_dtype="float32")
    gc.collect()
    gc.disable()
    try:
        cache = RocketKVCache(cfg, pool=pool)
        greedy(model(), BASES[0][None].repeat(rows, 1), max_new_tokens=4, cache=cache)
        cycle = {"cache": cache}
        cycle["self"] = cycle
        del cache, cycle
        assert pool.free_pages() < pages  # the unreachable request still holds its view pages
        second = RocketKVCache(cfg, pool=pool)
        greedy(model(), BASES[1][None].repeat(rows, 1), max_new_tokens=4, cache=second)  # after a collection
        assert second.stats.reused_tokens + second.stats.computed_tokens == 90 * rows
        third = RocketKVCache(cfg, pool=pool)  # the second is alive: nothing to collect, refused as before
        free = pool.free_pages()
        try:
            greedy(model(), BASES[0][None].repeat(rows, 1), max_new_tokens=4, cache=third)
        except PoolExhaustedError as err:
            assert "pages" in str(err) and pool.free_pages() == free
        else:
            raise AssertionError("a pool holding one live request admitted a second")
        second.close()
        assert pool.free_pages() == pool.total_pages()
    finally:
        gc.enable()
