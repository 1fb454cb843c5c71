"""Eviction and host offload (offload.py): the exact eviction order, held hit pages never evicted, bit-exact round
trips of every byte of a page (K, V, KT, fp8 scales), host eviction, counters."""

import pytest
import torch

from tests.memory.helpers import fill_pages, make_pool, page_bytes, page_bytes_of, reused, rocket_config, warm

CFG = rocket_config(prompt_budget=32, window_size=8)


def warm_random(pool, ids, seed, priority=None):
    """A committed, released prompt whose pages hold random bytes; returns {page index in chain: bytes}."""
    adm = pool.admit(len(ids), 0, CFG, token_ids=ids)
    fill_pages(pool, adm.prompt.pages, seed)
    pool.commit_prompt(adm, priority=priority)
    contents = {i: page_bytes_of(pool, page) for i, page in enumerate(adm.prompt.pages[: len(ids) // pool.page_size])}
    pool.release(adm)
    return contents


def scramble_free_device_pages(pool, seed):
    """Overwrite every free page, so an onload that copied nothing would be caught."""
    filler = pool.new_table("view")
    pool.allocate(filler, pool.free_pages())
    fill_pages(pool, filler.pages, seed)
    pool.release(filler)


@pytest.mark.parametrize("dtype, granularity", [(torch.bfloat16, "page"), (torch.float32, "page"),
                                                (torch.float8_e4m3fn, "page"), (torch.float8_e4m3fn, "head")])
def test_offload_onload_round_trip_is_bit_exact(dtype, granularity):
    pool = make_pool(24, host_pages=10, dtype=dtype, scale_granularity=granularity)
    ids = list(range(7, 7 + 60))  # 7 full pages; the hit cap is floor((60 - 8) / 8) = 6
    original = warm_random(pool, ids, seed=1)
    assert pool.evict() == 7
    stats = pool.stats()
    assert stats.host_cached == 7 and stats.cached_pages == 0 and stats.dropped_pages == 0
    assert stats.offloaded_bytes == 7 * page_bytes(dtype, scale_granularity=granularity)
    assert pool.copied_bytes() == (stats.offloaded_bytes, 0)
    assert [info.tier for info in pool.resident_prefix(ids)] == ["host"] * 7
    scramble_free_device_pages(pool, seed=2)
    adm = pool.admit(60, 0, CFG, token_ids=ids)
    assert adm.reused_tokens == 48 and adm.onloaded_pages == 6
    for i in range(6):
        assert page_bytes_of(pool, adm.prompt.pages[i]) == original[i], f"page {i} changed in the round trip"
    assert pool.stats().onloaded_bytes == 6 * page_bytes(dtype, scale_granularity=granularity)
    assert pool.copied_bytes() == (stats.offloaded_bytes, 6 * page_bytes(dtype, scale_granularity=granularity))
    tiers = [info.tier for info in pool.resident_prefix(ids)]
    assert tiers == ["device"] * 6 + ["host"]  # a page lives in exactly one tier
    assert pool.stats().host_cached == 1
    pool.release(adm)
    assert pool.free_pages() == 24 and pool.free_page_ids("host").__len__() == 10


def test_host_tier_keeps_the_most_valuable_pages_when_full():
    pool = make_pool(16, host_pages=4)
    a = list(range(0, 24))  # 3 pages each
    b = list(range(100, 124))
    c = list(range(200, 216))  # 2 pages
    warm_random(pool, a, seed=1, priority=50)
    warm_random(pool, b, seed=2)
    # device eviction order: b2 b1 b0 (prio 35), then a2 a1 a0 (prio 50); 4 host slots. a1 and a0 displace b2 and
    # b1 (lower priority) before their copies are issued: those two are dropped, never copied
    pool.evict()
    assert [i.tier for i in pool.resident_prefix(a)] == ["host"] * 3
    assert [i.tier for i in pool.resident_prefix(b)] == ["host"]  # b0 only: its chain ends where b1 was dropped
    stats = pool.stats()
    assert (stats.evictions, stats.dropped_pages, stats.host_evictions, stats.host_cached) == (6, 2, 0, 4)
    assert stats.offloaded_bytes == 4 * page_bytes()
    warm_random(pool, c, seed=3, priority=50)
    pool.evict()  # c takes b0's slot (lowest priority), then a2's (same priority, least recently used)
    assert [i.tier for i in pool.resident_prefix(c)] == ["host"] * 2
    assert [i.tier for i in pool.resident_prefix(a)] == ["host"] * 2 and pool.resident_prefix(b) == []
    assert pool.stats().host_evictions == 2
    low = list(range(300, 308))
    warm_random(pool, low, seed=4, priority=36)
    pool.evict()  # every host page is worth more (50): the newcomer is dropped, nothing is displaced
    assert pool.resident_prefix(low) == [] and pool.stats().host_evictions == 2


def test_below_offload_priority_is_dropped_and_unbound_layers_drop():
    pool = make_pool(16, host_pages=8, offload_min_priority=40)
    ids = list(range(24))
    warm_random(pool, ids, seed=1, priority=39)
    pool.evict()
    assert pool.stats().dropped_pages == 3 and pool.stats().host_cached == 0
    unbound = make_pool(16, host_pages=8, bind=False)
    adm = unbound.admit(24, 0, CFG, token_ids=ids)
    unbound.commit_prompt(adm)
    unbound.release(adm)
    assert unbound.evict() == 3 and unbound.stats().dropped_pages == 3  # nothing was ever written: no record


def test_device_copy_replaces_host_copy():
    pool = make_pool(16, host_pages=8)
    ids = list(range(24))
    warm_random(pool, ids, seed=1)
    pool.evict()
    assert pool.stats().host_cached == 3
    table = pool.new_table("prompt")
    pool.allocate(table, 2)
    assert pool.register(table, pool.hash_pages(ids)[:2]) == 2  # recomputed elsewhere: the device copy wins
    assert [i.tier for i in pool.resident_prefix(ids)] == ["device", "device", "host"]
    assert pool.stats().host_cached == 1
    pool.release(table)


def test_onload_when_device_is_full_offloads_others_first():
    pool = make_pool(10, host_pages=8)
    a = list(range(0, 40))  # 5 pages, cap floor(32 / 8) = 4
    b = list(range(100, 140))
    original = warm_random(pool, a, seed=1)
    pool.evict()
    warm_random(pool, b, seed=2)  # b's 5 cached pages sit on the device
    adm = pool.admit(40, 0, CFG, token_ids=a)  # 4 onload targets + 1 new prompt page + view (ceil(32/8) = 4)
    assert adm.reused_tokens == 32
    assert [page_bytes_of(pool, p) for p in adm.prompt.pages[:4]] == [original[i] for i in range(4)]
    assert len(pool.resident_prefix(b)) > 0 and pool.resident_prefix(b)[0].tier in ("device", "host")
    pool.release(adm)
    assert pool.free_pages() == 10


def test_exact_eviction_order_priority_then_lru_tail_first():
    pool = make_pool(40)
    chains = {}
    for name, start, priority in (("a", 0, None), ("b", 100, 80), ("c", 200, 10), ("d", 300, None)):
        chains[name] = warm(pool, list(range(start, start + 28)), priority=priority)[:3]  # 3 full pages + partial
    a, b, c, d = (chains[n] for n in "abcd")
    rev = lambda pages: list(reversed(pages))  # noqa: E731
    cached_order = [p for p in pool.free_page_ids() if pool.page_info(p).hash is not None]
    assert cached_order == rev(c) + rev(a) + rev(d) + rev(b)
    # a hit on chain a (cap: floor((28 - 1) / 8) = 3 pages, budget not exceeded) refreshes a: it moves behind d
    assert reused(pool, list(range(0, 28))) == 24
    cached_order = [p for p in pool.free_page_ids() if pool.page_info(p).hash is not None]
    assert cached_order == rev(c) + rev(d) + rev(a) + rev(b)
    assert [pool.page_info(p).priority for p in cached_order] == [10] * 3 + [35] * 6 + [80] * 3
    # allocation takes unhashed pages first, then evicts exactly in that order
    table = pool.new_table("view")
    uncached = pool.free_pages() - len(cached_order)
    pool.allocate(table, uncached)
    for expected in cached_order:
        pool.allocate(table, 1)
        assert table.pages[-1] == expected and pool.page_info(expected).hash is None
    assert pool.stats().evictions == 12
    pool.release(table)


def test_hit_pages_are_not_evicted_while_held():
    pool = make_pool(16)
    ids = list(range(48))  # 6 full pages, cap 5
    pages = warm(pool, ids)
    adm = pool.admit(48, 0, CFG, token_ids=ids)
    assert adm.prompt.pages[:5] == pages[:5]
    filler = pool.new_table("view")
    pool.allocate(filler, pool.free_pages())  # takes every free page, evicting the one cached page left (page 5)
    assert all(pool.page_info(p).hash is not None and pool.page_info(p).ref == 1 for p in pages[:5])
    assert pool.page_info(pages[5]).hash is None
    pool.release(filler)
    pool.release(adm)
    assert reused(pool, ids) == 40
