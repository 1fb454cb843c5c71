"""The prefix index (prefix_index.py): hits and misses, the hit cap, salt isolation, duplicates, partial commits,
reset, registering generated pages."""

import pytest

from hf_rocketkv.memory import PoolStateError, PrefixKeys
from tests.memory.helpers import make_pool, reused, rocket_config, warm

CFG = rocket_config(prompt_budget=32, window_size=8)  # pool pages of 8 tokens


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




def test_a_prompt_reuses_exactly_the_pages_before_its_first_edited_token():
    """Through the pool's lookup: editing the token at any position p of a cached 64-token prompt (8 pages of 8, hit
    cap 7 pages) reuses the min(p // 8, 7) pages before it, never the page holding p."""
    pool = make_pool(64)
    ids = list(range(100, 164))
    warm(pool, ids)
    for position in range(len(ids)):
        edited = list(ids)
        edited[position] += 1000
        assert reused(pool, edited) == 8 * min(position // 8, 7), position
