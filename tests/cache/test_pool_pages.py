"""RocketKVCache(cfg, pool=KVBlockPool(...)) (cache/pool_pages.py): pages from a shared pool, prefix reuse,
accounting, lifetime.

Everything runs a tiny random Llama in float32 on CPU, where a prefix hit must give exactly the cold run's tokens and
stage-1 kept sets. Oracles: the same request without a pool (the private paged store, itself checked against the
pre-paging behaviour by the rest of the suite) and a cold request on an empty pool.
"""

from __future__ import annotations

import gc
import weakref

import pytest
import torch
import transformers
from packaging.version import Version

from hf_rocketkv import KVBlockPool, RocketKVCache
from hf_rocketkv.integration.compat import cache_kwargs
from hf_rocketkv.memory import PoolExhaustedError, PrefixKeys
from tests.cache.helpers import kept
from tests.support.tiny_models import compressing_config, cpu_pool, greedy, left_pad, random_ids

PAGE = 8  # pool page size (tokens); the KT page is the config's 4


def make_pool(model, cfg, max_bytes=4 << 20, page_size=PAGE, **kwargs) -> KVBlockPool:
    """A float32 pool keyed by the model's config (no weights in the prefix fingerprint)."""
    return cpu_pool(model.config, cfg, max_bytes, page_size, **kwargs)


def run(model, ids, cfg, pool=None, new=6, mask=None, **cache_kwargs):
    cache = RocketKVCache(cfg, pool=pool, **cache_kwargs)
    out = greedy(model, ids, attention_mask=mask, max_new_tokens=new, cache=cache)
    return out, cache


CFG = compressing_config(kt_cache_dtype="float32")  # budget 24, window 8, KT page 4


# ------------------------------------------------------------------------------------------------ same tokens
@pytest.mark.parametrize("prompt_lens", [[60], [60, 37]])
def test_pool_equals_private_store(model, prompt_lens):
    """Pool pages (rows with different page counts, -1 in the table) give the private store's tokens and kept sets."""
    ids, mask = left_pad([random_ids(1, n, seed=n)[0] for n in prompt_lens])
    want, private = run(model, ids, CFG, mask=mask)
    pool = make_pool(model, CFG)
    got, cache = run(model, ids, CFG, pool=pool, mask=mask)
    assert torch.equal(got, want)
    assert kept(cache) == kept(private)
    assert cache.stats.pages_held > 0
    cache.close()
    assert pool.free_pages() == pool.total_pages()


def test_triton_backend_with_pool_equals_torch_backend(model):
    """The paged Triton kernels (interpreted on CPU) on pool pages give the PyTorch twins' tokens."""
    ids, mask = left_pad([random_ids(1, 44, seed=5)[0], random_ids(1, 30, seed=6)[0]])
    pool = make_pool(model, CFG)
    want, _ = run(model, ids, CFG, pool=pool, mask=mask, new=4)
    cfg = CFG.replace(backend="triton")
    got, cache = run(model, ids, cfg, pool=pool, mask=mask, new=4)
    assert cache.layers[0].ops.name == "triton"
    assert torch.equal(got, want)


# ------------------------------------------------------------------------------------------------ prefix reuse
def _hit_equals_cold(model, first_ids, second_ids, expect_reused):
    cold_pool = make_pool(model, CFG)
    cold, cold_cache = run(model, second_ids, CFG, pool=cold_pool)
    assert cold_cache.stats.reused_tokens == 0
    pool = make_pool(model, CFG)
    run(model, first_ids, CFG, pool=pool)[1].close()
    got, cache = run(model, second_ids, CFG, pool=pool)
    assert cache.stats.reused_tokens == expect_reused
    assert cache.stats.reused_tokens + cache.stats.computed_tokens == second_ids.numel()
    assert torch.equal(got, cold)
    assert kept(cache) == kept(cold_cache)
    return cache, pool


def test_full_repeat_reuses_up_to_the_window(model):
    """The same prompt again: every full page but the ones holding the last window_size tokens is reused."""
    ids = random_ids(1, 60, seed=11)
    _hit_equals_cold(model, ids, ids, expect_reused=(60 - 8) // PAGE * PAGE)


def test_a_hit_writes_its_new_tokens_into_the_gathered_store(model, monkeypatch):
    """A prefix hit's dense store is allocated once, by the gather, with room for the forward's own tokens: the
    prefill attention and stage 1 see that very buffer (no concatenation of the prefix with the new tokens), and the
    result is the cold run's (``_hit_equals_cold``)."""
    from hf_rocketkv.cache.layer import RocketKVLayer
    from hf_rocketkv.cache.pool_pages import PoolPages

    gathered, observed = [], []
    real_prefix_keys, real_observe = PoolPages.prefix_keys, RocketKVLayer.observe_prefill

    def prefix_keys(self, layer, key_states, room=0):
        keys, values = real_prefix_keys(self, layer, key_states, room=room)
        gathered.append((keys.data_ptr(), keys.shape[2], layer.prefix.tokens + key_states.shape[2]))
        return keys, values

    def observe_prefill(self, *args, **kwargs):
        observed.append(self.dense.keys.data_ptr())
        return real_observe(self, *args, **kwargs)

    monkeypatch.setattr(PoolPages, "prefix_keys", prefix_keys)
    monkeypatch.setattr(RocketKVLayer, "observe_prefill", observe_prefill)
    ids = random_ids(1, 60, seed=11)
    _hit_equals_cold(model, ids, ids, expect_reused=(60 - 8) // PAGE * PAGE)
    assert len(gathered) == 2  # one per layer, in the hit only
    assert all(width == expected for _, width, expected in gathered)
    assert {ptr for ptr, _, _ in gathered} <= set(observed)


def test_prompt_a_multiple_of_the_page_size(model):
    ids = random_ids(1, 64, seed=12)
    _hit_equals_cold(model, ids, ids, expect_reused=(64 - 8) // PAGE * PAGE)


def test_cached_chain_ending_inside_the_window_is_capped(model):
    """The first request cached 10 full pages; the second (a 70-token prefix of it) may reuse only what lies before
    its own window (tokens < 62): 7 pages. Tokens and kept sets equal the cold run."""
    first = random_ids(1, 80, seed=13)
    _hit_equals_cold(model, first, first[:, :70], expect_reused=56)


def test_shared_prefix_then_new_suffix(model):
    first = random_ids(1, 50, seed=14)
    second = torch.cat([first[:, :40], random_ids(1, 25, seed=15)], dim=1)
    _hit_equals_cold(model, first, second, expect_reused=40)


def test_short_prompt_kept_whole_reuses_all_but_the_last_token(model):
    """A prompt within prompt_budget is never evicted: only its last token must be recomputed."""
    ids = random_ids(1, 20, seed=16)
    _hit_equals_cold(model, ids, ids, expect_reused=16)


def test_batch_with_padding_and_different_hits(model):
    """Rows hit different lengths behind different padding: the batch reuses the columns every row can take
    (min over rows of padding + hit), the rest is recomputed; the result is the cold batch's."""
    a, b = random_ids(1, 60, seed=17)[0], random_ids(1, 45, seed=18)[0]
    pool = make_pool(model, CFG)
    run(model, a[None], CFG, pool=pool)[1].close()  # caches 7 pages of a; b misses
    run(model, b[None, :30], CFG, pool=pool)[1].close()  # caches 3 pages of b
    ids, mask = left_pad([a, b])
    cold, cold_cache = run(model, ids, CFG, pool=make_pool(model, CFG), mask=mask)
    got, cache = run(model, ids, CFG, pool=pool, mask=mask)
    # row 1 has 15 padding columns and a 24-token hit (capped from 30 at 45 - 8 = 37 -> 32, chain has 3 pages):
    # L = min(0 + 48, 15 + 24) = 39 columns; row 0 reuses 39, row 1 24
    assert cache.stats.reused_tokens == 39 + 24
    assert torch.equal(got, cold)
    assert kept(cache) == kept(cold_cache)


def test_a_hitting_request_never_writes_into_shared_pages(model):
    ids = random_ids(1, 60, seed=19)
    pool = make_pool(model, CFG)
    run(model, ids, CFG, pool=pool)[1].close()
    cached = [info.index for info in pool.resident_prefix(ids[0].tolist())]
    assert cached
    storage = [pool.layer(i) for i in range(2)]
    before = [(s.k[cached].clone(), s.v[cached].clone()) for s in storage]
    out, cache = run(model, ids, CFG, pool=pool, new=10)
    assert cache.stats.reused_tokens > 0
    for s, (k, v) in zip(storage, before):
        assert torch.equal(s.k[cached], k) and torch.equal(s.v[cached], v)


def test_salt_isolates_tenants(model):
    ids = random_ids(1, 60, seed=20)
    pool = make_pool(model, CFG)
    run(model, ids, CFG, pool=pool, cache_salt="tenant-a")[1].close()
    assert run(model, ids, CFG, pool=pool, cache_salt="tenant-b")[1].stats.reused_tokens == 0
    assert run(model, ids, CFG, pool=pool)[1].stats.reused_tokens == 0  # no salt vs salt
    assert run(model, ids, CFG, pool=pool, cache_salt="tenant-a")[1].stats.reused_tokens == 48
    adapter = PrefixKeys(adapter="lora-1")
    assert run(model, ids, CFG, pool=pool, cache_salt="tenant-a", prefix_keys=adapter)[1].stats.reused_tokens == 0


def test_h2o_never_takes_a_prefix_hit(model):
    """A policy that scores with every prompt query needs every token computed: no lookup, same tokens."""
    cfg = CFG.replace(stage1="h2o")
    ids = random_ids(1, 60, seed=21)
    pool = make_pool(model, cfg)
    first, _ = run(model, ids, cfg, pool=pool)
    again, cache = run(model, ids, cfg, pool=pool)
    assert cache.stats.reused_tokens == 0 and torch.equal(again, first)


def test_prefix_from_host_memory_equals_cold(model):
    """A cached prefix evicted to host memory comes back (onload) for the hit; same tokens as cold."""
    ids = random_ids(1, 60, seed=22)
    pool = make_pool(model, CFG, host_bytes=2 << 20)
    cold, first = run(model, ids, CFG, pool=pool)
    first.close()
    assert pool.evict() > 0  # every cached page to the host tier
    got, cache = run(model, ids, CFG, pool=pool)
    assert cache.stats.reused_tokens == 48 and cache.stats.onloaded_bytes == 6 * pool.bytes_per_page
    assert torch.equal(got, cold)


def test_prefix_file_round_trip_serves_a_hit(model, tmp_path):
    ids = random_ids(1, 60, seed=23)
    pool = make_pool(model, CFG)
    cold, first = run(model, ids, CFG, pool=pool)
    first.close()
    path = tmp_path / "prefix.safetensors"
    assert pool.save_prefix(path, ids[0]) == 56
    fresh = make_pool(model, CFG)
    fresh.load_prefix(path)
    got, cache = run(model, ids, CFG, pool=fresh)
    assert cache.stats.reused_tokens == 48 and torch.equal(got, cold)


def test_load_prefix_on_a_fresh_pool_built_from_the_model(model, tmp_path):
    ids = random_ids(1, 60, seed=42)
    plain = greedy(model, ids, max_new_tokens=6, **cache_kwargs(RocketKVCache(CFG)))  # the same config, no pool

    source = cpu_pool(model, CFG, 8 << 20, device=None)  # built from the model, no device=
    cache = RocketKVCache(CFG, pool=source)
    cold = greedy(model, ids, max_new_tokens=6, **cache_kwargs(cache))
    assert cache.stats.reused_tokens == 0
    cache.close()
    assert torch.equal(cold, plain)
    path = tmp_path / "prefix.safetensors"
    saved = source.save_prefix(path, ids[0])
    assert saved > 0 and saved % PAGE == 0

    fresh = cpu_pool(model, CFG, 8 << 20, device=None)  # a new pool from the same model, still no device=
    loaded = fresh.load_prefix(path)
    assert loaded.num_tokens == saved and loaded.pages_loaded == saved // PAGE
    warm_cache = RocketKVCache(CFG, pool=fresh)
    warm = greedy(model, ids, max_new_tokens=6, **cache_kwargs(warm_cache))
    assert warm_cache.stats.reused_tokens > 0
    warm_cache.close()
    assert torch.equal(warm, cold)


# ------------------------------------------------------------------------------------------------ accounting
def test_request_that_does_not_fit_raises_before_anything_is_written(model):
    cfg = CFG
    ids = random_ids(2, 60, seed=24)
    per_page = make_pool(model, cfg).bytes_per_page
    need = make_pool(model, cfg).pages_needed([60, 60], 6, cfg).prefill_peak
    pool = make_pool(model, cfg, max_bytes=(need - 1) * per_page)
    cache = RocketKVCache(cfg, pool=pool)
    with pytest.raises(PoolExhaustedError, match=f"needs {need} pages but only {need - 1} of {need - 1} are free"):
        greedy(model, ids, max_new_tokens=6, cache=cache)
    assert pool.free_pages() == pool.total_pages() and cache.get_seq_length() == 0
    assert not any(layer.is_initialized for layer in cache.layers)  # no forward ran
    assert pool.can_admit([60, 60], 6, cfg) is False
    bigger = make_pool(model, cfg, max_bytes=need * per_page)
    assert bigger.can_admit([60, 60], 6, cfg)
    out, cache = run(model, ids, cfg, pool=bigger)
    assert cache.stats.pages_held == pool.pages_needed([60, 60], 6, cfg).steady_state


def test_pages_needed_equals_what_generate_takes(model):
    pool = make_pool(model, CFG)
    need = pool.pages_needed(60, 6, CFG)
    seen = []
    original = pool.commit_prompt

    def commit(adm, *args, **kwargs):  # the prefill peak: every page taken, prompt pages not released yet
        seen.append(pool.total_pages() - pool.free_pages())
        return original(adm, *args, **kwargs)

    pool.commit_prompt = commit
    _, cache = run(model, random_ids(1, 60, seed=25), CFG, pool=pool)
    assert seen[0] == need.prefill_peak
    assert pool.total_pages() - pool.free_pages() == need.steady_state == cache.stats.pages_held


# ------------------------------------------------------------------------------------------------ lifetime
def test_close_reset_and_garbage_collection_give_pages_back(model):
    pool = make_pool(model, CFG)
    ids = random_ids(1, 60, seed=26)
    _, cache = run(model, ids, CFG, pool=pool)
    assert pool.free_pages() < pool.total_pages()
    cache.close()
    assert pool.free_pages() == pool.total_pages() and cache.stats.pages_held == 0
    _, cache = run(model, ids, CFG, pool=pool)
    cache.reset()
    assert pool.free_pages() == pool.total_pages()
    _, cache = run(model, ids, CFG, pool=pool)
    ref = weakref.ref(cache)
    del cache, _
    gc.collect()
    assert ref() is None
    assert pool.free_pages() == pool.total_pages()  # the queued release happens at this call
    with RocketKVCache(CFG, pool=pool) as cache:  # a with block closes the cache on the way out
        greedy(model, ids, max_new_tokens=3, cache=cache)
        assert pool.free_pages() < pool.total_pages()
    assert pool.free_pages() == pool.total_pages() and cache.stats.pages_held == 0


@pytest.mark.parametrize("host", [False, True])
def test_a_dropped_pool_frees_its_pages_at_once(model, host):
    """The last reference to a used pool gone (its caches closed or dropped), its page tensors go at once, without
    waiting for the cyclic garbage collector: a pool in a reference cycle kept a 24 GiB pool of the issue-13
    benchmark alive through the next step (a full collection runs rarely), 24 GiB of its 70 GiB peak."""
    gc.collect()
    gc.disable()
    try:
        pool = make_pool(model, CFG, host_bytes=(1 << 20) if host else 0)
        ids = random_ids(2, 60, seed=29)
        _, cache = run(model, ids, CFG.replace(prefill_batch_size=1), pool=pool)
        if host:
            pool.evict()
        cache.close()
        _, dropped = run(model, ids, CFG, pool=pool)  # dropped without close: its finalizer queues its pages
        pages = weakref.ref(pool.layer(0).tensors()["k"].untyped_storage())
        refs = weakref.ref(pool), weakref.ref(cache), weakref.ref(dropped)
        del pool, cache, dropped, _
        assert [ref() for ref in refs] == [None, None, None]
        assert pages() is None
    finally:
        gc.enable()


def test_finalizer_inside_a_pool_call_only_queues(model, monkeypatch):
    """A cache collected while the pool is in the middle of an allocation (same thread, lock held) must not touch
    the pool's lists: its release is queued and runs at the pool's next call."""
    pool = make_pool(model, CFG)
    ids = random_ids(1, 60, seed=27)
    _, cache = run(model, ids, CFG, pool=pool)
    held = cache.stats.pages_held
    victim = [cache]
    del cache
    original = pool._core.take_pages

    def take(count):
        if victim:
            victim.clear()
            gc.collect()  # the finalizer fires here, inside admit -> take_pages, under the lock
            assert pool.pending_releases() == 1  # queued, not released
        return original(count)

    monkeypatch.setattr(pool._core, "take_pages", take)
    free_before = pool.free_pages()
    _, other = run(model, random_ids(1, 40, seed=28), CFG, pool=pool)
    assert not victim and pool.pending_releases() == 0  # released at a later call of that request
    other.close()
    assert pool.free_pages() == pool.total_pages() and free_before + held == pool.total_pages()


# ------------------------------------------------------------------------------------------------ generate paths
def test_row_group_prefill_with_pool(model):
    rows = [random_ids(1, n, seed=30 + n)[0] for n in (60, 41, 52)]
    ids, mask = left_pad(rows)
    cfg = CFG.replace(prefill_batch_size=2)
    want, private = run(model, ids, cfg, mask=mask)
    pool = make_pool(model, cfg)
    got, cache = run(model, ids, cfg, pool=pool, mask=mask)
    assert torch.equal(got, want) and kept(cache) == kept(private)
    cache.close()
    again, cache = run(model, ids, cfg, pool=pool, mask=mask)  # the groups hit the first run's prefixes
    assert cache.stats.reused_tokens > 0 and torch.equal(again, want)
    cache.close()
    assert pool.free_pages() == pool.total_pages()


def test_beam_search_with_pool_equals_private(model):
    ids = random_ids(1, 50, seed=40)
    kwargs = dict(num_beams=3, num_return_sequences=2, max_new_tokens=6, do_sample=False, eos_token_id=None,
                  pad_token_id=0)
    want = model.generate(ids, cache=RocketKVCache(CFG), **kwargs)
    pool = make_pool(model, CFG)
    cache = RocketKVCache(CFG, pool=pool)
    got = model.generate(ids, cache=cache, **kwargs)
    assert torch.equal(got, want)
    cache.close()
    assert pool.free_pages() == pool.total_pages()


def test_multi_turn_with_pool_equals_private(model):
    """A later turn reserves a fresh view before its forward and gives the old one back after stage 1."""
    first = random_ids(1, 50, seed=41)
    private = RocketKVCache(CFG)
    pool = make_pool(model, CFG)
    pooled = RocketKVCache(CFG, pool=pool)
    outs = []
    for cache in (private, pooled):
        out = greedy(model, first, max_new_tokens=5, cache=cache)
        out = torch.cat([out, random_ids(1, 12, seed=42)], dim=1)
        outs.append(greedy(model, out, max_new_tokens=5, cache=cache))
    assert torch.equal(outs[0], outs[1])
    assert kept(pooled) == kept(private)
    assert pooled.stats.pages_held == pool.total_pages() - pool.free_pages()
    pooled.close()
    assert pool.free_pages() == pool.total_pages()


def test_pool_checks(model):
    pool = make_pool(model, CFG)
    with pytest.raises(ValueError, match="kt_page_size"):
        RocketKVCache(CFG.replace(page_size=8), pool=pool)
    with pytest.raises(NotImplementedError, match="token_budget"):
        RocketKVCache(CFG.replace(token_budget=64), pool=pool)
    with pytest.raises(TypeError, match="KVBlockPool"):
        RocketKVCache(CFG, pool="pool")
    with pytest.raises(ValueError, match="pool="):
        RocketKVCache(CFG, cache_salt="a")
    bf16 = KVBlockPool(model.config, max_gpu_bytes=1 << 20, page_size=PAGE, dtype=torch.bfloat16, device="cpu",
                       kt_page_size=4, kt_dtype="float32")
    with pytest.raises(ValueError, match="KVBlockPool.dtype"):
        run(model, random_ids(1, 30), CFG, pool=bf16)


@pytest.mark.xfail(
    Version(transformers.__version__) < Version("5.23"), raises=ValueError, strict=False,
    reason="known limitation: on transformers 5.17 chunked prefill after a prefix hit is refused with a ValueError "
           "(the chunk's attention mask reads as padded); verified on 5.23",
)
def test_chunked_prefill_after_a_prefix_hit_equals_cold(model):
    ids = random_ids(1, 70, seed=43)
    pool = make_pool(model, CFG)
    cold, first = run(model, ids, CFG, pool=pool)
    first.close()
    cache = RocketKVCache(CFG, pool=pool)
    got = greedy(model, ids, max_new_tokens=6, cache=cache, prefill_chunk_size=5)
    assert cache.stats.reused_tokens == 56 and cache.stats.computed_tokens == 14
    assert torch.equal(got, cold)
    _, cold_cache = run(model, ids, CFG, pool=make_pool(model, CFG))
    assert kept(cache) == kept(cold_cache)


def test_eviction_to_host_and_back_through_generate(model, monkeypatch):
    """A small pool with a host tier: the second request's admission pushes the first one's cached prefix to host
    memory (its offloaded_bytes), the third request repeats the first prompt and onloads it (onloaded_bytes); tokens
    equal the first request's. The requests count their copies without ``pool.stats()`` (a walk over every page,
    ~10 ms per admission with a 24 GiB pool at 8B shapes)."""
    ids, other = random_ids(1, 60, seed=44), random_ids(1, 60, seed=45)
    need = make_pool(model, CFG).pages_needed(60, 6, CFG).prefill_peak
    per_page = make_pool(model, CFG).bytes_per_page
    pool = make_pool(model, CFG, max_bytes=need * per_page, host_bytes=need * per_page * 2)
    monkeypatch.setattr(pool, "stats", lambda: pytest.fail("a request called pool.stats()"))
    first, cache = run(model, ids, CFG, pool=pool)
    cache.close()
    _, cache = run(model, other, CFG, pool=pool)
    assert cache.stats.offloaded_bytes == 7 * per_page  # the first prompt's 7 full pages went to the host
    cache.close()
    again, cache = run(model, ids, CFG, pool=pool)
    assert cache.stats.reused_tokens == 48 and cache.stats.onloaded_bytes == 6 * per_page
    assert torch.equal(again, first)
    cache.close()
    assert pool.free_pages() == pool.total_pages()


def test_row_groups_are_admitted_group_by_group_out_of_one_reservation(model):
    """prefill_batch_size with a pool: the batch reserves every row's steady pages plus one group's prompt pages (not
    every row's prompt at once), admits each group when it starts (so later groups reuse an earlier group's
    prefix), and a pool one page short refuses the batch before anything runs."""
    prefix = random_ids(1, 48, seed=50)[0]
    ids = torch.stack([torch.cat([prefix, random_ids(1, 12, seed=51 + i)[0]]) for i in range(3)])
    cfg = CFG.replace(prefill_batch_size=1)
    want, private = run(model, ids, cfg)
    one = make_pool(model, cfg).pages_needed(60, 5, cfg)  # generate(max_new_tokens=6) feeds 5 tokens back
    per_page = make_pool(model, cfg).bytes_per_page
    reservation = 3 * one.steady_state + one.prompt_pages
    pool = make_pool(model, cfg, max_bytes=reservation * per_page)
    assert make_pool(model, cfg).pages_needed([60] * 3, 5, cfg).prefill_peak > pool.total_pages()
    got, cache = run(model, ids, cfg, pool=pool)
    assert torch.equal(got, want) and kept(cache) == kept(private)
    assert cache.stats.reused_tokens == 2 * 48  # groups 2 and 3 reuse group 1's prefix
    assert cache.stats.pages_held == 3 * one.steady_state
    cache.close()
    assert pool.free_pages() == pool.total_pages()
    short = make_pool(model, cfg, max_bytes=(reservation - 1) * per_page)
    cache = RocketKVCache(cfg, pool=short)
    with pytest.raises(PoolExhaustedError, match=f"needs {reservation} pages"):
        greedy(model, ids, max_new_tokens=6, cache=cache)
    assert short.free_pages() == short.total_pages() and not cache.layers


def test_two_threads_share_one_pool(model):
    """Two requests in two threads on one pool (one model): each gets the tokens it gets alone, no page leaks."""
    import threading

    prompts = [random_ids(1, 60, seed=60), random_ids(1, 52, seed=61)]
    alone = [run(model, ids, CFG)[0] for ids in prompts]
    pool = make_pool(model, CFG)
    results, errors = [None, None], []

    def worker(i):
        try:
            for _ in range(2):  # the second round hits the first one's prefix
                out, cache = run(model, prompts[i], CFG, pool=pool)
                results[i] = out
                cache.close()
        except Exception as err:  # noqa: BLE001 - reported below
            errors.append(err)

    threads = [threading.Thread(target=worker, args=(i,)) for i in range(2)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert not errors, errors
    assert all(torch.equal(got, want) for got, want in zip(results, alone))
    assert pool.free_pages() == pool.total_pages()


def test_manual_decode_past_the_admitted_view_grows_it_from_the_pool(model):
    """A caller driving forwards itself may decode past the tokens its admission planned: the view takes more pool
    pages (eager growth) and every step's logits equal those of the private store, which grows by reallocation."""
    ids = random_ids(1, 60, seed=60)
    pool = make_pool(model, CFG)
    caches = {"private": RocketKVCache(CFG), "pool": RocketKVCache(CFG, pool=pool)}
    logits = {}
    for name, cache in caches.items():
        steps = []
        with torch.no_grad():
            with cache.prefill(ids, max_new_tokens=2, max_length=ids.shape[1] + 2):  # room for 2 new tokens
                out = model(ids, **cache_kwargs(cache), use_cache=True)
            token = out.logits[:, -1:].argmax(-1)
            for step in range(PAGE * 3):  # several pool pages past the admitted view
                position = torch.tensor([[ids.shape[1] + step]])
                out = model(token, position_ids=position, **cache_kwargs(cache), use_cache=True)
                steps.append(out.logits[0, -1])
                token = out.logits[:, -1:].argmax(-1)
        logits[name] = torch.stack(steps)
    assert torch.equal(logits["pool"], logits["private"])
    assert caches["pool"].layers[0].capacity >= ids.shape[1] // 2 + PAGE * 3
    caches["pool"].close()
    assert pool.free_pages() == pool.total_pages()
