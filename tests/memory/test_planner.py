"""The planner (planner.py, accounting.py): page counts from the formulas, equal to what admission really takes;
refusals change nothing; config and input errors name the field; reservations set free pages aside."""

import pytest
import torch

from hf_rocketkv.memory import (
    BlockTable,
    KVBlockPool,
    PoolExhaustedError,
    PrefixKeys,
    Reservation,
)
from tests.memory.helpers import (
    fill_pages,
    make_pool,
    model_config,
    rocket_config,
    snapshot,
)

CFG = rocket_config(prompt_budget=32, window_size=8)


def ceil(a, b):
    return -(-a // b)


@pytest.mark.parametrize(
    "prompt, new, reuse, keep_all, expected",
    [
        # (prefill_peak, steady_state, prompt_pages, view_pages), page 8, budget 32, computed by hand
        (100, 10, True, False, (13 + 6, 6, 13, 6)),
        (20, 5, True, False, (3 + 4, 4, 3, 4)),  # shorter than the budget: kept whole
        (32, 0, True, False, (4 + 4, 4, 4, 4)),
        (100, 10, True, True, (14 + 6, 14 + 6, 14, 6)),  # keep_all: the prompt table grows by the new tokens
        (100, 10, False, False, (13, 6, 13, 0)),  # reuse off: compaction in place, max(13, 6)
        (20, 30, False, False, (7, 7, 7, 0)),  # reuse off, view larger than the prompt
    ],
)
def test_formulas(prompt, new, reuse, keep_all, expected):
    pool = make_pool(64, prefix_reuse=reuse)
    needed = pool.pages_needed(prompt, new, CFG, keep_all=keep_all)
    assert (needed.prefill_peak, needed.steady_state, needed.prompt_pages, needed.view_pages) == expected
    assert needed.hit_pages == 0 and needed.rows == 1


@pytest.mark.parametrize("prompt, new", [(100, 10), (64, 3), (8, 1), (33, 0), (20, 40)])
def test_prediction_equals_observed_cold(prompt, new):
    pool = make_pool(64)
    needed = pool.pages_needed(prompt, new, CFG, token_ids=list(range(prompt)))
    before = pool.free_pages()
    adm = pool.admit(prompt, new, CFG, token_ids=list(range(prompt)))
    assert before - pool.free_pages() == needed.prefill_peak
    assert len(adm.prompt) + len(adm.view) == needed.prefill_peak
    assert adm.reused_tokens == 0 and adm.computed_tokens == prompt
    pool.commit_prompt(adm)
    pool.release(adm.prompt)
    assert pool.used_pages() == needed.steady_state
    pool.release(adm)
    assert pool.free_pages() == pool.total_pages()


def test_prediction_with_hits_counts_evictable_hits():
    pool = make_pool(64)
    ids = list(range(1000, 1100))  # 100 tokens: 12 full pages, cap floor((100 - 8) / 8) = 11 pages
    first = pool.admit(100, 10, CFG, token_ids=ids)
    pool.commit_prompt(first)
    # while the first request holds its prompt, hits are not free pages: no extra cost
    held = pool.pages_needed(100, 10, CFG, token_ids=ids)
    assert (held.hit_pages, held.hit_pages_free, held.prefill_peak) == (11, 0, 13 - 11 + 6)
    first_prompt = first.prompt.pages
    pool.release(first.prompt)
    cached = pool.pages_needed(100, 10, CFG, token_ids=ids)
    assert (cached.hit_pages, cached.hit_pages_free, cached.hit_tokens) == (11, 11, 88)
    assert cached.prefill_peak == 13 - 11 + 6 + 11
    before = pool.free_pages()
    second = pool.admit(100, 10, CFG, token_ids=ids)
    assert before - pool.free_pages() == cached.prefill_peak
    assert second.reused_tokens == 88 and second.computed_tokens == 12
    assert second.prompt.pages[:11] == first_prompt[:11]
    pool.release(second)
    pool.release(first)
    assert pool.free_pages() == pool.total_pages()


def test_batch_sums_rows_and_counts_shared_hits_once():
    pool = make_pool(64)
    ids = list(range(64))
    warm = pool.admit(64, 0, CFG, token_ids=ids)
    pool.commit_prompt(warm)
    pool.release(warm)  # 8 cached pages; the cap allows floor((64 - 8) / 8) = 7
    other = list(range(500, 540))
    needed = pool.pages_needed([64, 64, 40], [4, 4, 4], CFG, token_ids=[ids, ids, other])
    assert needed.rows == 3 and needed.hit_pages == 14 and needed.hit_pages_free == 7
    per_row_cold = [8 + 5, 8 + 5, 5 + 5]
    assert needed.prefill_peak == sum(per_row_cold) - 14 + 7
    before = pool.free_pages()
    rows = pool.admit_batch([64, 64, 40], 4, CFG, token_ids=[ids, ids, other])
    assert before - pool.free_pages() == needed.prefill_peak
    shared = rows[0].prompt.pages[:7]
    assert rows[1].prompt.pages[:7] == shared and all(pool.page_info(p).ref == 2 for p in shared)
    for row in rows:
        pool.release(row)
    assert pool.free_pages() == pool.total_pages()


def test_can_admit_exact_fit_and_one_short():
    needed = make_pool(64).pages_needed(100, 10, CFG).prefill_peak  # 19
    fits = make_pool(needed)
    assert fits.can_admit(100, 10, CFG)
    fits.admit(100, 10, CFG)
    assert fits.free_pages() == 0
    short = make_pool(needed - 1)
    assert not short.can_admit(100, 10, CFG)
    before = snapshot(short)
    with pytest.raises(PoolExhaustedError, match=rf"needs {needed} pages but only {needed - 1} of {needed - 1} are free") as err:
        short.admit(100, 10, CFG)
    assert (err.value.pages_needed, err.value.pages_free) == (needed, needed - 1)
    assert snapshot(short) == before


def test_refused_batch_with_device_and_host_hits_changes_nothing():
    pool = make_pool(24, host_pages=8)
    ids_a, ids_b = list(range(40)), list(range(100, 140))
    for ids in (ids_a, ids_b):
        adm = pool.admit(40, 0, CFG, token_ids=ids)
        fill_pages(pool, adm.prompt.pages, seed=ids[0])
        pool.commit_prompt(adm)
        pool.release(adm)
    pool.evict(3)  # some of the cached pages go to the host
    assert pool.stats().host_cached == 3
    needed = pool.pages_needed([40, 40, 90], 50, CFG, token_ids=[ids_a, ids_b, list(range(90))])
    assert needed.hit_pages_host == 3 and needed.hit_pages_free > 0 and needed.prefill_peak > pool.free_pages()
    before = snapshot(pool)
    with pytest.raises(PoolExhaustedError, match=rf"needs {needed.prefill_peak} pages but only 24 of 24"):
        pool.admit_batch([40, 40, 90], 50, CFG, token_ids=[ids_a, ids_b, list(range(90))])
    assert snapshot(pool) == before


def test_config_and_input_errors_name_the_field():
    with pytest.raises(ValueError, match=r"KVBlockPool.page_size \(tokens per pool page\) must be a multiple of "
                                         r"KVBlockPool.kt_page_size \(tokens per KT page\): got page_size=6"):
        KVBlockPool(model_config(), max_gpu_bytes=1 << 20, page_size=6, dtype="bfloat16")
    pool = make_pool(8)
    with pytest.raises(ValueError, match=r"RocketKVConfig.page_size \(tokens per KT page\) is 8.*"
                                         r"KVBlockPool.kt_page_size=4.*KVBlockPool.page_size, tokens per pool page"):
        pool.pages_needed(10, 1, rocket_config(page_size=8))
    with pytest.raises(ValueError, match="RocketKVConfig.kt_cache_dtype is 'bfloat16'.*float8_e5m2"):
        pool.can_admit(10, 1, rocket_config(kt_cache_dtype="bfloat16"))
    with pytest.raises(ValueError, match="token_ids has 3 ids but prompt_len is 4"):
        pool.pages_needed(4, 1, CFG, token_ids=[1, 2, 3])
    with pytest.raises(ValueError, match="prompt_len must be an integer >= 1, got 0"):
        pool.admit(0, 1, CFG)
    with pytest.raises(ValueError, match=r"max_new_tokens\[1\] must be an integer >= 0, got -1"):
        pool.pages_needed([4, 4], [1, -1], CFG)
    with pytest.raises(ValueError, match="cfg must be a RocketKVConfig"):
        pool.pages_needed(4, 1, object())
    with pytest.raises(ValueError, match="KVBlockPool.dtype must be one of"):
        KVBlockPool(model_config(), max_gpu_bytes=1 << 20, dtype="float64")
    with pytest.raises(ValueError, match="KVBlockPool.dtype is None and the model/config names no dtype"):
        KVBlockPool(model_config(), max_gpu_bytes=1 << 20)
    assert KVBlockPool(model_config(dtype="float16"), max_gpu_bytes=1 << 20).dtype == torch.float16


def test_reservation_sets_pages_aside_without_holding_them():
    pool = make_pool(num_pages=16)
    cfg = rocket_config()
    table = BlockTable("view")
    pool.allocate(table, 4)
    pool.register(table, pool.hash_pages(list(range(16)))[:2])  # two pages that will be cached once released
    pool.release(table)
    assert pool.cached_pages() == 2
    res = pool.reserve(10)
    assert isinstance(res, Reservation) and res.count == 10
    assert pool.free_pages() == 6 and pool.reserved_pages() == 10 and pool.used_pages() == 0
    assert pool.cached_pages() == 2  # nothing evicted: a reservation holds no page
    with pytest.raises(PoolExhaustedError, match="needs 7 pages but only 6 of 16"):
        pool.allocate(BlockTable("view"), 7)
    with pytest.raises(PoolExhaustedError):
        pool.reserve(7)
    # an admission naming the reservation may use it; what it takes comes off the reservation
    adm = pool.admit_batch([16], 8, cfg, reservation=res)[0]
    taken = len(adm.prompt) + len(adm.view)
    assert res.count == 10 - taken and pool.reserved_pages() == 10 - taken
    assert pool.free_pages() == 16 - taken - res.count
    pool.release(adm)
    pool.add_to_reservation(res, taken)
    assert res.count == 10 and pool.free_pages() == 6
    pool.unreserve(res, 3)
    assert res.count == 7 and pool.free_pages() == 9
    pool.unreserve(res)
    assert res.count == 0 and pool.free_pages() == 16 and pool.reserved_pages() == 0


def test_reservation_boundaries_and_refusals():
    """A reservation may take every free page and no more; 0 pages is a valid request; a refusal names the
    counts (needed, free, total) and changes nothing; bad counts are ValueErrors naming ``num_pages``."""
    pool = make_pool(num_pages=16)
    empty = pool.reserve(0)
    assert empty.count == 0 and pool.free_pages() == 16
    before = snapshot(pool)
    with pytest.raises(PoolExhaustedError, match=r"^KVBlockPool: reserving pages needs 17 pages but only 16 of 16 "
                                                 r"are free") as err:
        pool.reserve(17)
    assert (err.value.pages_needed, err.value.pages_free, err.value.pages_total) == (17, 16, 16)
    assert snapshot(pool) == before
    whole = pool.reserve(16)  # exactly the free pages
    assert whole.count == 16 and pool.free_pages() == 0
    pool.unreserve(whole)
    for bad in (-1, True, 1.5):
        with pytest.raises(ValueError, match=rf"^num_pages must be an integer >= 0, got {bad!r}$"):
            pool.reserve(bad)
    res = pool.reserve(4)
    pool.add_to_reservation(res, 0)
    assert res.count == 4
    pool.add_to_reservation(res, 12)  # exactly the 12 pages still free
    assert res.count == 16 and pool.free_pages() == 0
    pool.unreserve(res, 12)
    before = snapshot(pool)
    with pytest.raises(PoolExhaustedError, match=rf"^KVBlockPool: adding to {res.name} needs 13 pages but only 12 of "
                                                 r"16 are free") as err:
        pool.add_to_reservation(res, 13)
    assert (err.value.pages_needed, err.value.pages_free, err.value.pages_total) == (13, 12, 16)
    assert snapshot(pool) == before and res.count == 4
    for call in (lambda: pool.add_to_reservation(res, -1), lambda: pool.unreserve(res, -1)):
        with pytest.raises(ValueError, match=r"^num_pages must be an integer >= 0, got -1$"):
            call()
    pool.unreserve(res, 100)  # more than it holds: all of it
    assert res.count == 0 and pool.free_pages() == 16 and pool.reserved_pages() == 0


def test_admission_records_the_request_and_counts_hits_and_misses():
    """Page 8, budget 32: a 40-token prompt has 5 full pages (prompt table 5 pages) and a view of 32 + 10 tokens
    (6 pages); each table has room for exactly its pages. A hit leaves the last window (8 tokens) to recompute, so
    it covers at most (40 - 8) // 8 = 4 pages. Cold, the 5 full pages are looked up and missed; the same ids and salt
    again hit 4 and miss 1; the same ids with another salt miss all 5: hits 0 + 4 + 0, misses 5 + 1 + 5."""
    pool = make_pool(64)
    ids, salt = list(range(40)), PrefixKeys(cache_salt="a")
    first = pool.admit(40, 10, CFG, token_ids=ids, keys=salt)
    assert (first.prompt.max_pages, first.view.max_pages) == (5, 6) == (len(first.prompt), len(first.view))
    assert (first.max_new_tokens, first.keys, first.hit_pages) == (10, salt, 0)
    pool.commit_prompt(first)
    again = pool.admit(40, 10, CFG, token_ids=ids, keys=salt)
    other = pool.admit(40, 10, CFG, token_ids=ids, keys=PrefixKeys(cache_salt="b"))
    assert (again.hit_pages, other.hit_pages) == (4, 0)
    assert (again.committed_pages, other.committed_pages) == (4, 0)  # hit pages are in the index already
    assert (pool.stats().hit_pages, pool.stats().missed_pages) == (4, 11)


def test_can_admit_and_pages_needed_see_ids_keys_and_keep_all():
    """A request whose prompt pages are held by another one (hits at ref > 0 take no free page; 4 of its 5 can
    hit, see above) needs 5 - 4 + 6 = 7 pages; cold it needs 5 + 6 = 11. With 8 pages free, only the hit fits, and only under the same salt.
    keep_all grows the prompt table by the new tokens: ceil(50 / 8) = 7 + 6 = 13 pages, over 12 free."""
    pool = make_pool(19)
    ids, salt = list(range(40)), PrefixKeys(cache_salt="a")
    holder = pool.admit(40, 10, CFG, token_ids=ids, keys=salt)
    pool.commit_prompt(holder)
    assert pool.free_pages() == 8
    assert pool.pages_needed(40, 10, CFG, token_ids=ids, keys=salt).prefill_peak == 7
    assert pool.pages_needed(40, 10, CFG, token_ids=ids, keys=PrefixKeys(cache_salt="b")).prefill_peak == 11
    assert pool.can_admit(40, 10, CFG, token_ids=ids, keys=salt)
    assert not pool.can_admit(40, 10, CFG, token_ids=ids, keys=PrefixKeys(cache_salt="b"))
    assert not pool.can_admit(40, 10, CFG, keys=salt)  # no ids: nothing to hit
    fresh = make_pool(12)
    assert fresh.can_admit(40, 10, CFG) and not fresh.can_admit(40, 10, CFG, keep_all=True)
    assert not fresh.reclaim_unreachable()  # nothing unreachable holds a page of this pool


def test_admitted_pages_carry_the_newest_clock():
    """Pages taken by an admission are stamped later than anything before it (the pool's logical clock only
    grows), hits included."""
    pool = make_pool(16)
    ids = list(range(17))  # within the budget: hits leave the last token, (17 - 1) // 8 = 2 pages
    first = pool.admit(17, 0, CFG, token_ids=ids)
    pool.commit_prompt(first)
    pool.release(first)
    stamp = max(pool.page_info(i).last_access for i in range(16))
    second = pool.admit(17, 0, CFG, token_ids=ids)
    assert second.hit_pages == 2
    assert all(pool.page_info(i).last_access > stamp for i in second.prompt.pages + second.view.pages)


def test_refusals_say_what_was_asked_and_reservations_count_for_their_owner():
    """One row of 40 tokens + 10 new: 5 prompt + 6 view pages = 11; two rows: 10 + 12 = 22 (no hit). With 10 of
    16 pages reserved, 6 are free to others, but an admission naming the reservation may use all 16."""
    small = make_pool(10)
    with pytest.raises(PoolExhaustedError, match=r"^KVBlockPool: admitting 5 prompt \+ 6 view pages \(0 hit\) needs 11 "
                                                 r"pages but only 10 of 10 are free"):
        small.admit(40, 10, CFG)
    with pytest.raises(PoolExhaustedError, match=r"^KVBlockPool: admitting 2 row\(s\), 10 prompt \+ 12 view pages "
                                                 r"\(0 hit\) needs 22 pages but only 10 of 10 are free"):
        small.admit_batch([40, 40], 10, CFG)
    pool = make_pool(16)
    res = pool.reserve(10)
    with pytest.raises(PoolExhaustedError, match=r"needs 11 pages but only 6 of 16 are free"):
        pool.admit(40, 10, CFG)
    adm = pool.admit_batch([40], 10, CFG, reservation=res)[0]
    assert len(adm.prompt) + len(adm.view) == 11 and res.count == 0 and pool.free_pages() == 5


def test_row_inputs_of_a_batch():
    """A batch's ids as a 2-D tensor, one PrefixKeys per row, and each mistake named with its row."""
    pool = make_pool(64)
    ids = torch.arange(80).view(2, 40)
    keys = [PrefixKeys(cache_salt="a"), PrefixKeys(cache_salt="b")]
    first = pool.admit_batch([40, 40], 0, CFG, token_ids=ids, keys=keys)
    for adm in first:
        pool.commit_prompt(adm)
    # row 0's prefix under row 0's salt hits; row 1's ids under row 0's salt do not
    needed = pool.pages_needed([40, 40], 0, CFG, token_ids=ids, keys=[keys[0], keys[0]])
    assert needed.hit_pages == 4
    with pytest.raises(ValueError, match=r"^prompt_len must name at least one row$"):
        pool.pages_needed([], 1, CFG)
    with pytest.raises(ValueError, match=r"^max_new_tokens has 3 entries for 2 rows$"):
        pool.pages_needed([4, 4], [1, 1, 1], CFG)
    with pytest.raises(ValueError, match=r"^token_ids has 1 rows, prompt_len has 2$"):
        pool.pages_needed([4, 4], 1, CFG, token_ids=[[1, 2, 3, 4]])
    for bad in ([keys[0]], [keys[0], "b"]):
        with pytest.raises(ValueError, match=r"^keys must be a PrefixKeys or a list of 2 PrefixKeys, got \["):
            pool.pages_needed([4, 4], 1, CFG, keys=bad)
    with pytest.raises(ValueError, match=r"token_ids\[1\]"):
        pool.pages_needed([2, 2], 1, CFG, token_ids=[[1, 2], [1, 2.5]])
    with pytest.raises(ValueError, match=r"^keep_all must be True or False, got 1$"):
        pool.pages_needed(4, 1, CFG, keep_all=1)


def test_host_hits_take_a_device_page_each():
    """40 tokens, no new ones: 5 prompt pages, view ceil(32 / 8) = 4. Once its pages sit on the host, the same
    prompt hits 4 of them there: prefill_peak = 5 - 4 + 4 + 0 free hits + 4 host hits = 9, and new_pages = the 1
    prompt page not hit + 4 view pages + 4 onload targets = 9."""
    pool = make_pool(24, host_pages=8)
    ids = list(range(40))
    adm = pool.admit(40, 0, CFG, token_ids=ids)
    fill_pages(pool, adm.prompt.pages, seed=1)
    pool.commit_prompt(adm)
    pool.release(adm)
    pool.evict()
    needed = pool.pages_needed(40, 0, CFG, token_ids=ids)
    assert (needed.hit_pages, needed.hit_pages_host, needed.hit_pages_free) == (4, 4, 0)
    assert (needed.prefill_peak, needed.new_pages) == (9, 9)
