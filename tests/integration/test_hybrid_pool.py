"""Models with sliding-window layers on a KVBlockPool (``RocketKVCache(cfg, pool=pool)``): gpt-oss, Gemma 3 and
Mistral with a window (every layer slides), tiny random configs, fp32 on the CPU.

- the same cache without a pool is the reference: greedy tokens equal for one row, a left-padded batch whose rows'
  slots are not consecutive (the ring is gathered), chunked prefill, beams, row groups, a later turn; and, budget
  above the prompt with every page attended, equal to transformers' eager attention with its own cache;
- the sliding layers hold exactly the window: between forwards the rows' slots of the pool's slab hold the same
  tokens as the private ring of the cache without a pool, and the layer reports a window's bytes per row;
- every page and slot goes back when the cache closes (or is collected).
"""

from __future__ import annotations

import gc

import pytest
import torch

from hf_rocketkv import KVBlockPool, RocketKVCache, SlidingWindowLayer
from hf_rocketkv.integration.call_state import call_state
from hf_rocketkv.memory import RowDemand
from tests.support.hybrid_models import WINDOW, make_hybrid_models
from tests.support.tiny_models import compressing_config, cpu_pool, greedy, keep_all_config, left_pad, random_ids
from hf_rocketkv.integration.compat import cache_kwargs

ARCHS = ["gpt_oss", "gemma3", "mistral"]


@pytest.fixture(scope="module", params=ARCHS)
def pair(request):
    return request.param, *make_hybrid_models(request.param)


def all_back(pool: KVBlockPool) -> bool:
    return pool.free_pages() == pool.total_pages() and pool.free_slots() == pool.total_slots()


def sliding(cache: RocketKVCache) -> list[int]:
    return [i for i, layer in enumerate(cache.layers) if isinstance(layer, SlidingWindowLayer)]


def test_one_row_equals_the_cache_without_a_pool_and_the_oracle(pair):
    arch, rocket, oracle = pair
    ids = random_ids(1, 40, seed=3)
    for config in (compressing_config(), keep_all_config()):
        pool = cpu_pool(rocket, config)
        assert pool.has_sliding_layers
        private = RocketKVCache(config)
        expected = greedy(rocket, ids, cache=private, max_new_tokens=12)
        cache = RocketKVCache(config, pool=pool)
        out = greedy(rocket, ids, cache=cache, max_new_tokens=12)
        assert torch.equal(out, expected)
        if config.prompt_budget > ids.shape[1]:
            assert torch.equal(out, greedy(oracle, ids, max_new_tokens=12))
        assert cache.stats.slots_held == 1
        for i in sliding(cache):  # the window, exactly: the slab's slot holds what the private ring holds
            mine, theirs = cache.layers[i], private.layers[i]
            assert mine.ring and theirs.ring
            # (bit-equal in the first layer; later ones see the full-attention layers' output, whose paged reductions
            # on pool pages may round differently)
            torch.testing.assert_close(mine.keys, theirs.keys, rtol=1e-5, atol=1e-5)
            torch.testing.assert_close(mine.values, theirs.values, rtol=1e-5, atol=1e-5)
            assert mine.keys.shape[2] == WINDOW
            assert mine.kept_tokens().tolist() == [[WINDOW - 1] * mine.num_kv_heads]
            assert mine.memory_bytes() == 2 * mine.num_kv_heads * WINDOW * mine.head_dim * 4
        cache.close()
        assert all_back(pool)


def test_a_batch_on_scattered_slots_equals_the_cache_without_a_pool(pair):
    arch, rocket, oracle = pair
    config = compressing_config()
    pool = cpu_pool(rocket, config)
    demand = RowDemand(prompt_tokens=4, new_tokens=1, view_tokens=5, hit_cap_tokens=0)
    first, second = pool.admit(4, 1, demand), pool.admit(4, 1, demand)  # slots 0 and 1
    pool.release(first)  # slot 0 free again: the batch gets 0, 2, 3
    ids, mask = left_pad([random_ids(1, n, seed=n)[0] for n in (37, 21, 30)])
    expected = greedy(rocket, ids, attention_mask=mask, cache=RocketKVCache(config), max_new_tokens=10)
    cache = RocketKVCache(config, pool=pool)
    out = greedy(rocket, ids, attention_mask=mask, cache=cache, max_new_tokens=10)
    assert torch.equal(out, expected)
    assert cache.pages._slot_ids[1] == [0, 2, 3]
    chunked = RocketKVCache(config, pool=pool, cache_salt="chunked")  # no prefix hit: a cold chunked prefill
    out = greedy(rocket, ids, attention_mask=mask, cache=chunked, max_new_tokens=10, prefill_chunk_size=6)
    assert torch.equal(out, expected)
    cache.close()
    chunked.close()
    pool.release(second)
    assert all_back(pool)


def test_beams_row_groups_and_a_later_turn_equal_the_cache_without_a_pool(pair):
    arch, rocket, oracle = pair
    config = compressing_config()
    pool = cpu_pool(rocket, config)
    ids = random_ids(1, 30, seed=7)
    kwargs = dict(num_beams=2, max_new_tokens=6)
    beams = greedy(rocket, ids, cache=RocketKVCache(config, pool=pool), **kwargs)
    assert torch.equal(beams, greedy(rocket, ids, cache=RocketKVCache(config), **kwargs))
    ids, mask = left_pad([random_ids(1, n, seed=n)[0] for n in (31, 17, 24)])
    grouped = RocketKVCache(compressing_config(prefill_batch_size=1), pool=pool)
    groups = greedy(rocket, ids, attention_mask=mask, max_new_tokens=6, cache=grouped)
    assert torch.equal(groups, greedy(rocket, ids, attention_mask=mask, max_new_tokens=6,
                                      cache=RocketKVCache(config)))
    grouped.close()
    cache, private = RocketKVCache(config, pool=pool), RocketKVCache(config)
    first = greedy(rocket, random_ids(1, 20, seed=11), cache=cache, max_new_tokens=5)
    greedy(rocket, random_ids(1, 20, seed=11), cache=private, max_new_tokens=5)
    turn = torch.cat([first, random_ids(1, 9, seed=12)], dim=1)
    second = greedy(rocket, turn, cache=cache, max_new_tokens=6)
    assert torch.equal(second, greedy(rocket, turn, cache=private, max_new_tokens=6))
    del cache
    gc.collect()
    assert all_back(pool)  # a cache dropped without close(): its pages and slot go back at the pool's next call


def test_plain_forwards_on_the_pool_equal_the_oracle(pair):
    arch, rocket, oracle = pair
    config = keep_all_config()
    pool = cpu_pool(rocket, config)
    ids = random_ids(1, 30, seed=5)
    cache = RocketKVCache(config, pool=pool, model_config=rocket.config)
    with torch.no_grad():
        logits = rocket(ids, **cache_kwargs(cache)).logits[:, -1]
        torch.testing.assert_close(logits, oracle(ids).logits[:, -1], rtol=1e-4, atol=1e-4)
        for _ in range(WINDOW + 2):  # past the window: the ring wraps
            token = logits.argmax(-1, keepdim=True)
            ids = torch.cat([ids, token], dim=1)
            logits = rocket(token, **cache_kwargs(cache)).logits[:, -1]
            torch.testing.assert_close(logits, oracle(ids).logits[:, -1], rtol=1e-4, atol=1e-4)
    assert cache.stats.slots_held == 1
    cache.close()
    assert all_back(pool)


def test_a_pool_built_for_another_model_is_refused(pair):
    arch, rocket, oracle = pair
    config = compressing_config()
    other = make_hybrid_models("gemma3" if arch != "gemma3" else "gpt_oss")[0]
    pool = cpu_pool(other, config)
    with pytest.raises(ValueError, match="not those the KVBlockPool was built for"):
        RocketKVCache(config, pool=pool, model_config=rocket.config)
    mistral = make_hybrid_models("mistral")[0]  # every layer slides: the slab's dtype is checked at the first step
    wrong = cpu_pool(mistral, config, dtype=torch.bfloat16)
    with pytest.raises(ValueError, match="KVBlockPool.dtype is torch.bfloat16"):
        greedy(mistral, random_ids(1, 12), cache=RocketKVCache(config, pool=wrong), max_new_tokens=3)


def test_graphed_decode_on_the_pool_equals_eager_and_reads_nothing_back(pair):
    """Decode steps captured as graphs (the CPU stand-in for torch.cuda graphs, tests/support/decode_runners.py) on
    a pool-backed cache, the Triton backend (interpreted) as on a GPU: the tokens of eager decode on the same pool,
    and no op of a replayed step reads the device back (the slot writes and the ring reads are device ops)."""
    from tests.integration.test_hybrid_decode_graphs import SyncCountingBackend
    from tests.support.decode_runners import eager_compile_config

    arch, rocket, oracle = pair
    ids, mask = left_pad([random_ids(1, n, seed=n)[0] for n in (37, 12)])
    config = compressing_config(kt_cache_dtype="float32", backend="triton")
    pool = cpu_pool(rocket, config)
    eager_cache = RocketKVCache(config, pool=pool)
    eager = greedy(rocket, ids, attention_mask=mask, cache=eager_cache, max_new_tokens=8,
                   disable_compile=True)
    eager_cache.close()
    backend = SyncCountingBackend()
    cache = RocketKVCache(config, pool=pool)
    call_state(cache).use_graphs_on(("cpu",), backend)
    out = greedy(rocket, ids, attention_mask=mask, cache=cache, max_new_tokens=8,
                 compile_config=eager_compile_config())
    assert torch.equal(out, eager)
    assert backend.replays == 6
    assert backend.reads.total == 0, dict(backend.reads.counts)
    cache.close()
    assert all_back(pool)
