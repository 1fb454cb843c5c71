"""Prefix reuse: hits and misses, salt isolation, exact eviction order, reset, duplicates, block tables."""

import pytest
import torch

from hf_rocketkv.memory import PoolStateError, PrefixKeys

from .helpers import make_pool, rocket_config

CFG = rocket_config(prompt_budget=32, window_size=8)  # pool pages of 8 tokens


def warm(pool, ids, keys=None, priority=None):
    """Admit, 'compute', index and release a prompt: its full pages become cached. Returns its prompt pages."""
    adm = pool.admit(len(ids), 0, CFG, token_ids=ids, keys=keys)
    pool.commit_prompt(adm, priority=priority)
    pages = adm.prompt.pages
    pool.release(adm)
    return pages


def reused(pool, ids, keys=None):
    adm = pool.admit(len(ids), 0, CFG, token_ids=ids, keys=keys)
    tokens = adm.reused_tokens
    pool.release(adm)
    return tokens


def test_hit_miss_and_partial_hit():
    pool = make_pool(64)
    ids = list(range(100, 164))  # 64 tokens: 8 full pages; cap floor((64 - 8) / 8) = 7 pages
    assert reused(pool, ids) == 0  # cold, and nothing committed
    pages = warm(pool, ids)
    assert reused(pool, ids) == 56
    longer = ids + list(range(900, 940))  # 104 tokens: cap 12 pages, 8 of them cached
    adm = pool.admit(len(longer), 0, CFG, token_ids=longer)
    assert adm.reused_tokens == 64 and adm.prompt.pages[:8] == pages[:8]
    pool.release(adm)
    edited = list(ids)
    edited[20] = 7  # page 2 changes: pages 0 and 1 still hit
    assert reused(pool, edited) == 16
    assert reused(pool, list(range(64))) == 0
    stats = pool.stats()
    assert stats.hit_pages == 7 + 8 + 2 and stats.free_pages == 64


def test_hit_cap_when_prompt_fits_the_budget():
    pool = make_pool(32)
    ids = list(range(24))  # 24 <= prompt_budget: only the last token is recomputed -> cap floor(23 / 8) = 2 pages
    warm(pool, ids)
    assert reused(pool, ids) == 16


def test_salt_isolation_paired():
    pool = make_pool(64)
    ids = list(range(40, 80))
    salt_a, salt_b = PrefixKeys(cache_salt="tenant-a"), PrefixKeys(cache_salt="tenant-b")
    warm(pool, ids, salt_a)
    assert reused(pool, ids, salt_a) == 32  # same salt hits: caching works ...
    assert reused(pool, ids, salt_b) == 0  # ... so these misses are isolation, not a broken cache
    assert reused(pool, ids) == 0
    warm(pool, ids)
    assert reused(pool, ids) == 32
    assert reused(pool, ids, salt_a) == 32 and reused(pool, ids, salt_b) == 0
    adapter = PrefixKeys(cache_salt="tenant-a", adapter="lora-1")
    assert reused(pool, ids, adapter) == 0


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


def test_duplicate_registration_keeps_one_indexed_copy():
    pool = make_pool(32)
    ids = list(range(33))
    first = pool.admit(33, 0, CFG, token_ids=ids)
    second = pool.admit(33, 0, CFG, token_ids=ids)  # admitted before the first committed: both compute
    assert second.reused_tokens == 0
    assert pool.commit_prompt(first) == 4
    assert pool.commit_prompt(second) == 0  # same content already indexed: these pages stay private
    assert all(pool.page_info(p).hash is None for p in second.prompt.pages)
    pool.release(first)
    pool.release(second)
    assert pool.cached_pages() == 4 and pool.free_pages() == 32


def test_commit_partial_then_rest_and_after_release():
    pool = make_pool(32)
    ids = list(range(40))
    adm = pool.admit(40, 2, CFG, token_ids=ids)
    assert pool.commit_prompt(adm, num_tokens=20) == 2  # a chunked prefill indexes pages as they fill
    assert pool.commit_prompt(adm, num_tokens=20) == 0
    assert pool.commit_prompt(adm) == 3
    pool.release(adm.prompt)
    adm2 = pool.admit(40, 2, CFG, token_ids=ids)
    pool.release(adm2.prompt)
    with pytest.raises(PoolStateError, match="commit_prompt must come before release"):
        pool.commit_prompt(adm2)
    with pytest.raises(ValueError, match="num_tokens=41 exceeds the prompt"):
        pool.commit_prompt(adm, num_tokens=41)
    pool.release(adm)
    pool.release(adm2)
    pool.release(adm2)  # releasing an empty table again is a no-op
    assert pool.free_pages() == 32


def test_reset_refused_while_held_then_clears_everything():
    pool = make_pool(16)
    ids = list(range(40))
    warm(pool, ids)
    held = pool.admit(10, 0, CFG)
    with pytest.raises(PoolStateError, match=r"reset: \d+ pages are still held"):
        pool.reset()
    pool.release(held)
    pool.reset()
    assert pool.cached_pages() == 0 and pool.free_pages() == 16
    assert all(pool.page_info(i).hash is None for i in range(16))
    assert reused(pool, ids) == 0


def test_keep_all_and_registering_generated_pages():
    pool = make_pool(32)
    prompt = list(range(20))
    adm = pool.admit(20, 12, CFG, token_ids=prompt, keep_all=True)
    assert len(adm.prompt) == 4  # ceil((20 + 12) / 8): the conversation's tokens stay in the prompt table
    pool.commit_prompt(adm)
    conversation = prompt + list(range(500, 512))  # the model generated 12 tokens
    assert pool.register(adm.prompt, pool.hash_pages(conversation)[2:], start_page=2) == 2
    pool.release(adm)
    turn2 = conversation + [1, 2, 3]  # 35 tokens > prompt_budget: the last window_size=8 are recomputed
    assert reused(pool, turn2) == 24 and pool.resident_prefix(turn2)[-1].depth == 3  # generated pages hit too


def test_truncate_returns_tail_pages():
    pool = make_pool(16)
    table = pool.new_table("prompt")
    pool.allocate(table, 6)
    pages = table.pages
    pool.truncate(table, 2)
    assert table.pages == pages[:2] and pool.free_pages() == 14
    assert pool.free_page_ids()[:4] == list(pages[2:])  # unhashed pages are reused first (hot)
    pool.release(table)


def test_block_table_tensor_is_padded_and_fixed():
    pool = make_pool(16)
    table = pool.new_table("view", max_pages=6)
    pool.allocate(table, 2)
    tensor = table.as_tensor("cpu")
    assert tensor.dtype == torch.int32 and tensor.tolist() == list(table.pages) + [-1] * 4
    pool.allocate(table, 3)
    assert table.as_tensor() is tensor and tensor.tolist() == list(table.pages) + [-1]
    pool.release(table)
    assert tensor.tolist() == [-1] * 6
    with pytest.raises(ValueError, match="BlockTable.kind"):
        pool.new_table("decode")
