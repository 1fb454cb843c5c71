"""Prefix reuse on models with sliding-window layers (gpt-oss, Gemma 3, Gemma 2, Cohere 2: tiny random configs,
window 8, pool pages of 8 tokens, fp32 on the CPU), by replay (docs/memory.md, "Layer kinds").

A request that hits ``P`` prompt tokens left in the pool by an earlier request sharing them takes the full-attention
layers' K/V of ``[0, P)`` from the pages and runs the model over ``[S, P)`` again (``S = max(0, P - R)``, ``R`` the sum
of the sliding windows) to rebuild the sliding layers' windows. The oracle is the same prompt run cold (a fresh pool:
no hit) and, budget above the prompt, transformers' eager attention with its own cache:

- greedy tokens equal and logits close in fp32, for a hit longer than ``R`` (real saving: ``computed_tokens`` is
  ``prompt_len - S``, ``reused_tokens`` is ``P``), a hit within ``R`` (``S = 0``), a prefix ending mid-window, a
  chunked prefill after the hit (chunks inside the replay, across ``P``, after it), a left-padded batch;
- the batching engine and ``generate_batch`` serve two requests sharing a prefix, each with the tokens it has alone;
- the hit pages are never written, and every page and slot is back in the pool after close;
- the replay is needed and must be long enough: with ``R`` forced too small, or with the full-attention layers
  storing the replayed (inexact) K/V over the hit's, the logits differ.
"""

from __future__ import annotations

import pytest
import torch
import transformers
from packaging.version import Version

from hf_rocketkv import KVBlockPool, RocketKVCache
from hf_rocketkv.cache import pool_pages
from hf_rocketkv.cache.layer import RocketKVLayer
from hf_rocketkv.memory.layer_kinds import replay_tokens
from tests.support.hybrid_models import WINDOW, make_hybrid_models
from tests.support.tiny_models import (
    PAD,
    compressing_config,
    cpu_pool,
    keep_all_config,
    left_pad,
    random_ids,
)

ARCHS = ["gpt_oss", "gemma3", "gemma2", "cohere2"]
PAGE = 8
NEW = 6


@pytest.fixture(scope="module", params=ARCHS)
def pair(request):
    return request.param, *make_hybrid_models(request.param)


def all_back(pool: KVBlockPool) -> bool:
    return pool.free_pages() == pool.total_pages() and pool.free_slots() == pool.total_slots()


def run(model, config, pool, ids, mask=None, **kwargs):
    """Greedy generate on a pool-backed cache, closed afterwards: ``(sequences, logits [steps, B, V], stats)``."""
    cache = RocketKVCache(config, pool=pool)
    with torch.no_grad():
        out = model.generate(ids, attention_mask=mask, max_new_tokens=NEW, do_sample=False, eos_token_id=None,
                             pad_token_id=PAD, cache=cache, output_logits=True, return_dict_in_generate=True,
                             **kwargs)
    stats = cache.stats
    cache.close()
    return out.sequences, torch.stack(out.logits), stats


def shared(first_len: int, shared_len: int, second_len: int, seed: int = 5):
    """Two prompts whose first ``shared_len`` tokens are equal."""
    first = random_ids(1, first_len, seed=seed)
    second = torch.cat([first[:, :shared_len], random_ids(1, second_len - shared_len, seed=seed + 100)], dim=1)
    return first, second


def hit_then_cold(model, config, first, second, **kwargs):
    """The second prompt after the first on one pool (a hit), and alone on a fresh pool (cold)."""
    pool = cpu_pool(model, config, page_size=PAGE)
    run(model, config, pool, first)
    hot = run(model, config, pool, second, **kwargs)
    assert all_back(pool)
    cold_pool = cpu_pool(model, config, page_size=PAGE)
    cold = run(model, config, cold_pool, second, **kwargs)
    assert cold[2].reused_tokens == 0 and all_back(cold_pool)
    return hot, cold


def assert_same(hot, cold):
    assert torch.equal(hot[0], cold[0])
    torch.testing.assert_close(hot[1], cold[1], rtol=1e-4, atol=1e-4)  # fp32: other reduction orders


def windows(model) -> tuple:
    return cpu_pool(model.config, compressing_config(), page_size=PAGE).layer_windows


@pytest.mark.parametrize("config_of", [compressing_config, keep_all_config], ids=["compressing", "keep_all"])
def test_a_hit_longer_than_the_replay_equals_a_cold_run(pair, config_of):
    _, rocket, oracle = pair
    config = config_of()
    replay = replay_tokens(windows(rocket))
    assert replay == WINDOW * sum(w is not None for w in windows(rocket))
    first, second = shared(70, 59, 72)  # the hit: 56 tokens (7 pages), the prompt's last 16 recomputed at least
    hot, cold = hit_then_cold(rocket, config, first, second)
    assert_same(hot, cold)
    hit = 56
    start = hit - replay
    assert start > 0
    assert hot[2].reused_tokens == hit
    assert hot[2].computed_tokens == second.shape[1] - start  # the replayed tokens are computed, [0, S) is not
    assert cold[2].computed_tokens == second.shape[1]
    if config.prompt_budget > second.shape[1]:  # nothing evicted: transformers' own cache is the oracle too
        with torch.no_grad():
            expected = oracle.generate(second, max_new_tokens=NEW, do_sample=False, eos_token_id=None,
                                       pad_token_id=PAD)
        assert torch.equal(hot[0], expected)


def test_a_hit_within_the_replay_recomputes_from_the_start(pair):
    _, rocket, _ = pair
    config = compressing_config()
    first, second = shared(40, 17, 40)  # a hit of 16 tokens (2 pages) <= R: S = 0
    assert replay_tokens(windows(rocket)) >= 16
    hot, cold = hit_then_cold(rocket, config, first, second)
    assert_same(hot, cold)
    assert hot[2].reused_tokens == 16 and hot[2].computed_tokens == 40


@pytest.mark.parametrize("shared_len", [45, 52, 61])
def test_a_prefix_ending_mid_window_equals_a_cold_run(pair, shared_len):
    """The shared part ends inside a page and inside a sliding window; the hit is its whole pages."""
    _, rocket, _ = pair
    config = compressing_config()
    first, second = shared(75, shared_len, 80, seed=shared_len)
    hot, cold = hit_then_cold(rocket, config, first, second)
    assert_same(hot, cold)
    hit = shared_len // PAGE * PAGE
    assert hot[2].reused_tokens == hit
    assert hot[2].computed_tokens == 80 - max(0, hit - replay_tokens(windows(rocket)))


@pytest.mark.xfail(
    Version(transformers.__version__) < Version("5.23"), raises=ValueError, strict=False,
    reason="known limitation: on transformers 5.17 chunked prefill after a prefix hit is refused with a ValueError "
           "(the chunk's attention mask reads as padded), as on models without sliding layers; verified on 5.23",
)
@pytest.mark.parametrize("chunk", [3, 5, 16])
def test_a_chunked_prefill_after_a_hit_equals_a_cold_run(pair, chunk):
    """Chunks that lie inside the replay (their keys all the hit's), that cross the hit's end, and after it."""
    _, rocket, _ = pair
    config = compressing_config()
    first, second = shared(70, 60, 71)
    hot, cold = hit_then_cold(rocket, config, first, second, prefill_chunk_size=chunk)
    assert_same(hot, cold)
    assert hot[2].reused_tokens == 56
    assert hot[2].computed_tokens == 71 - (56 - replay_tokens(windows(rocket)))


def _padded_batch_after_a_hit(rocket, config, shared_lens: tuple[int, int], own_lens: tuple[int, int]):
    """A 70-token prompt fills the pool; then a left-padded batch of two rows, row ``i`` the first ``shared_lens[i]``
    of its tokens and ``own_lens[i]`` of its own, runs on that pool (hot) and on a fresh one (cold)."""
    first, _ = shared(70, 0, 70)
    rows = [torch.cat([first[0, :shared_lens[i]], random_ids(1, own_lens[i], seed=31 + i)[0]]) for i in range(2)]
    ids, mask = left_pad(rows)
    pool = cpu_pool(rocket, config, page_size=PAGE)
    run(rocket, config, pool, first)
    hot = run(rocket, config, pool, ids, mask)
    cold = run(rocket, config, cpu_pool(rocket, config, page_size=PAGE), ids, mask)
    return pool, hot, cold


def test_a_left_padded_batch_after_a_hit_equals_a_cold_run(pair):
    _, rocket, _ = pair
    pool, hot, cold = _padded_batch_after_a_hit(rocket, compressing_config(), (58, 62), (12, 3))
    assert hot[2].reused_tokens > 0
    assert_same(hot, cold)
    assert all_back(pool)


def test_row_groups_each_replay_their_own_hit(pair):
    """Row-group prefill (``prefill_batch_size=1``): each row looks its prefix up and replays from its own start."""
    _, rocket, _ = pair
    pool, hot, cold = _padded_batch_after_a_hit(rocket, compressing_config(prefill_batch_size=1), (58, 30), (12, 35))
    assert_same(hot, cold)
    replay = replay_tokens(pool.layer_windows)
    assert hot[2].reused_tokens == 56 + 24
    assert hot[2].computed_tokens == (70 - max(0, 56 - replay)) + (65 - max(0, 24 - replay))
    assert all_back(pool)


def test_hit_pages_are_never_written(pair):
    _, rocket, _ = pair
    config = compressing_config()
    first, second = shared(70, 59, 72)
    pool = cpu_pool(rocket, config, page_size=PAGE)
    run(rocket, config, pool, first)
    before = {i: (pool.layer(i).k.clone(), pool.layer(i).v.clone())
              for i, w in enumerate(pool.layer_windows) if w is None}
    cache = RocketKVCache(config, pool=pool)
    with cache.prefill(second, torch.ones_like(second), max_new_tokens=NEW) as start:
        hit = torch.tensor(list(cache.pages.rows[0].admission.prompt.pages[:7]))
        assert start == 56 - replay_tokens(pool.layer_windows)
        with torch.no_grad():
            rocket(input_ids=second[:, start:], cache=cache)
    for i, (k, v) in before.items():
        assert torch.equal(pool.layer(i).k[hit], k[hit]) and torch.equal(pool.layer(i).v[hit], v[hit])
    cache.close()
    assert all_back(pool)


def test_the_replay_must_be_long_enough(pair, monkeypatch):
    """The sum of the windows is needed: a shorter replay leaves the sliding layers' windows inexact."""
    _, rocket, _ = pair
    config = compressing_config()
    first, second = shared(70, 59, 72)
    cold = hit_then_cold(rocket, config, first, second)[1]
    monkeypatch.setattr(pool_pages, "replay_tokens", lambda windows: WINDOW - 1)
    pool = cpu_pool(rocket, config, page_size=PAGE)
    run(rocket, config, pool, first)
    short = run(rocket, config, pool, second)
    assert short[2].computed_tokens == 72 - 56 + WINDOW - 1
    assert (short[1] - cold[1]).abs().max() > 1e-3


def test_the_full_attention_layers_must_not_store_the_replayed_keys(pair, monkeypatch):
    """The replayed hidden states near S are not exact: full-attention layers that stored their K/V over the hit's
    would change the logits."""
    _, rocket, _ = pair
    config = compressing_config()
    first, second = shared(70, 59, 72)
    cold = hit_then_cold(rocket, config, first, second)[1]
    update = RocketKVLayer.update

    def leaky(self, key_states, value_states, *args, **kwargs):
        first_column = self.prefix.replay_pos
        out = update(self, key_states, value_states, *args, **kwargs)
        if first_column is not None and self.prefix.replayed_now:
            n = self.prefix.replayed_now
            self.dense.keys[:, :, first_column:first_column + n] = key_states[:, :, :n]
            self.dense.values[:, :, first_column:first_column + n] = value_states[:, :, :n]
        return out

    monkeypatch.setattr(RocketKVLayer, "update", leaky)
    pool = cpu_pool(rocket, config, page_size=PAGE)
    run(rocket, config, pool, first)
    leaked = run(rocket, config, pool, second)
    assert leaked[2].reused_tokens == 56
    assert (leaked[1] - cold[1]).abs().max() > 1e-3


def test_a_model_whose_layers_all_slide_never_hits():
    rocket, _ = make_hybrid_models("mistral")
    config = compressing_config()
    pool = cpu_pool(rocket, config, page_size=PAGE)
    with pytest.raises(NotImplementedError, match="every layer of this model slides"):
        pool.admit(16, 1, config, token_ids=list(range(16)))
    first, second = shared(40, 33, 40)
    run(rocket, config, pool, first)
    hot = run(rocket, config, pool, second)
    assert hot[2].reused_tokens == 0
    assert all_back(pool)


# ------------------------------------------------------------------------------------------------ serving
def test_the_batching_engine_serves_a_shared_prefix_with_each_request_alone(pair):
    from hf_rocketkv.serving.batching.engine import BatchingEngine
    from hf_rocketkv.serving.batching.scheduler import BatchingConfig
    from tests.serving.helpers import CFG, Events, oracle_tokens, request

    arch, rocket, _ = pair
    alone, _ = make_hybrid_models(arch)
    first, second = shared(70, 61, 66)
    third = torch.cat([first[:, :50], random_ids(1, 20, seed=77)], dim=1)
    prompts = [row[0].tolist() for row in (first, second, third)]
    pool = cpu_pool(rocket, CFG, 2 << 20, PAGE, sliding_slots=4)
    engine = BatchingEngine(rocket, CFG, pool, BatchingConfig(max_running=4, buckets=(1, 2, 4)))
    events = Events()
    engine.start(events)
    try:
        engine.submit(request("r0", prompts[0], 7))
        events.wait_finals(1)  # its prompt pages are in the prefix index now
        engine.submit(request("r1", prompts[1], 7))
        engine.submit(request("r2", prompts[2], 5))
        events.wait_finals(3)
    finally:
        engine.stop(timeout=60)
    assert pool.stats().hit_pages >= 7 + 6
    for i, n in enumerate((7, 7, 5)):
        assert events.tokens(f"r{i}") == oracle_tokens(alone, prompts[i], CFG, n), f"{arch} request {i}"
    assert all_back(pool)


def test_generate_batch_reuses_a_prefix_with_each_request_alone(pair):
    from hf_rocketkv.serving import SamplingParams, generate_batch
    from tests.serving.helpers import CFG, oracle_tokens

    arch, rocket, _ = pair
    alone, _ = make_hybrid_models(arch)
    first, second = shared(70, 60, 68, seed=11)
    pool = cpu_pool(rocket, CFG, 2 << 20, PAGE)
    prompts = [first[0].tolist(), second[0].tolist()]
    generate_batch(rocket, prompts[:1], config=CFG, pool=pool, sampling=SamplingParams.greedy(4))
    hits = pool.stats().hit_pages
    results = generate_batch(rocket, prompts[1:], config=CFG, pool=pool, sampling=SamplingParams.greedy(6))
    assert pool.stats().hit_pages - hits == 7
    assert list(results[0].token_ids) == oracle_tokens(alone, prompts[1], CFG, 6), arch
    assert all_back(pool)
