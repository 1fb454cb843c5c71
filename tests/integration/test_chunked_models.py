"""Llama 4's chunked-attention layers on one RocketKVCache, against the oracle: the same weights on transformers'
eager attention and its own cache (a ``DynamicSlidingWindowLayer`` of the chunk size per chunked layer).

- nothing evicted: greedy tokens equal the oracle's (one row of several chunks, a left-padded batch, chunked prefill,
  a ``keep_all`` second turn, plain forwards with ``model_config``); the NoPE layer scales its queries by the
  position it reads from ``cache.get_seq_length(layer)``, so wrong lengths change the tokens;
- compression on: the chunked layers hold at most ``chunk - 1`` tokens, only the full-attention layer is
  compressed, and every layer's length is the tokens seen;
- on a pool: the same tokens as without one (the rings in the pool's slab), a prefix hit the tokens of a cold run,
  every page and slot back after close;
- the batching engine (generate_batch on a pool): transformers' tokens for rows at different positions, a prefix hit;
- generate()'s captured decode (the CPU standing in for a graph device) and torch.compile'd decode (dynamo on the
  CPU, with and without batch buckets): the tokens of eager decode, the NoPE layers' scale moving with every step
  (a device counter);
- what is not supported for chunked layers is refused with one clear line: tensor parallelism, a cache not told the
  layer types.
"""

from __future__ import annotations

import inspect

import pytest
import torch
from transformers import masking_utils

from hf_rocketkv import RocketKVCache, SlidingWindowLayer
from hf_rocketkv.integration.attention import check_supported
from hf_rocketkv.selection.logit_features import PLAIN
from tests.support.hybrid_models import CHUNK, make_llama4_models
from tests.support.decode_runners import StandInBackend, eager_compile_config, graphed_cache
from tests.support.tiny_models import (
    check_padded_batch_and_chunked_prefill,
    compressed_padded_batch,
    compressing_config,
    cpu_pool,
    greedy,
    keep_all_config,
    left_pad,
    random_ids,
)
from hf_rocketkv.integration.compat import cache_kwargs

CHUNKED, FULL = [0, 1, 2], 3

# transformers 5.17's generate() passes block_sequence_ids to create_chunked_causal_mask, which does not take it:
# Llama 4 cannot generate there with any attention (plain forwards work)
GENERATE_BROKEN = "block_sequence_ids" not in inspect.signature(masking_utils.create_chunked_causal_mask).parameters
needs_generate = pytest.mark.skipif(GENERATE_BROKEN, reason="this transformers' generate() cannot run Llama 4 "
                                    "(create_chunked_causal_mask takes no block_sequence_ids)")


@pytest.fixture(scope="module")
def pair():
    return make_llama4_models()


@needs_generate
def test_keep_all_equals_the_oracle(pair):
    rocket, oracle = pair
    ids = random_ids(1, 5 * CHUNK + 3, seed=3)
    expected = greedy(oracle, ids, max_new_tokens=16)
    cache = RocketKVCache(keep_all_config())
    assert torch.equal(greedy(rocket, ids, cache=cache, max_new_tokens=16), expected)
    for index in CHUNKED:
        layer = cache.layers[index]
        assert isinstance(layer, SlidingWindowLayer) and layer.chunked and layer.window == CHUNK
    assert not cache.layers[FULL].is_sliding
    # no cache passed: generate() makes one from the model's config
    assert torch.equal(greedy(rocket, ids, max_new_tokens=16), expected)


@needs_generate
def test_padded_batch_and_chunked_prefill_equal_the_oracle(pair):
    rocket, oracle = pair
    check_padded_batch_and_chunked_prefill(rocket, oracle)


@needs_generate
def test_a_keep_all_conversation_equals_the_oracle(pair):
    rocket, oracle = pair
    cache = RocketKVCache(keep_all_config(multi_turn="keep_all"))
    first = greedy(rocket, random_ids(1, 30, seed=1), cache=cache, max_new_tokens=6)
    conversation = torch.cat([first, random_ids(1, 13, seed=2)], dim=1)
    second = greedy(rocket, conversation, cache=cache, max_new_tokens=6)
    assert torch.equal(second, greedy(oracle, conversation, max_new_tokens=6))
    assert cache.get_seq_length() == conversation.shape[1] + 5


def test_plain_forwards_with_model_config_equal_the_oracle(pair):
    """Prefill, then decode steps across two chunk boundaries; each layer's length is the tokens seen."""
    rocket, oracle = pair
    ids = random_ids(1, 2 * CHUNK + 5, seed=5)
    cache = RocketKVCache(keep_all_config(), model_config=rocket.config)
    with torch.no_grad():
        logits = rocket(ids, **cache_kwargs(cache)).logits[:, -1]
        torch.testing.assert_close(logits, oracle(ids).logits[:, -1], rtol=1e-4, atol=1e-4)
        for _ in range(CHUNK + 2):
            token = logits.argmax(-1, keepdim=True)
            ids = torch.cat([ids, token], dim=1)
            logits = rocket(token, **cache_kwargs(cache)).logits[:, -1]
            torch.testing.assert_close(logits, oracle(ids).logits[:, -1], rtol=1e-4, atol=1e-4)
    assert [cache.get_seq_length(i) for i in range(4)] == [ids.shape[1]] * 4


def test_plain_forward_without_layer_types_is_refused(pair):
    rocket, _ = pair
    with pytest.raises(ValueError, match=r"chunked attention \(layer_types\).*model_config=model.config"):
        with torch.no_grad():
            rocket(random_ids(1, 12), **cache_kwargs(RocketKVCache(keep_all_config())))


@needs_generate
def test_compression_keeps_chunks_and_compresses_the_full_layer(pair):
    rocket, _ = pair
    kv_heads = rocket.config.num_key_value_heads
    rows, ids, mask, cache, batch = compressed_padded_batch(rocket)
    config = cache.config
    seen = ids.shape[1] + 7
    for index in CHUNKED:
        layer = cache.layers[index]
        assert isinstance(layer, SlidingWindowLayer) and layer.chunked and not getattr(layer, "compressed", False)
        assert layer.ring and layer.keys.shape[2] == CHUNK  # decode's ring of chunk slots
        assert layer.stored == CHUNK - 1  # what the next query can see at most
        assert cache.kept_tokens(index).tolist() == [[CHUNK - 1] * kv_heads] * 2
    assert cache.layers[FULL].compressed
    assert cache.kept_tokens(FULL).tolist() == [[24 + 7] * kv_heads] * 2
    # the NoPE layer reads its length as the position of the next query: tokens seen, not tokens kept
    assert [cache.get_seq_length(i) for i in range(4)] == [seen] * 4
    # the unpadded row gets the tokens it gets alone (a padded row does not, in transformers' own model either: the
    # NoPE layer's temperature counts input columns, padding included)
    alone = greedy(rocket, rows[0][None], cache=RocketKVCache(config), max_new_tokens=8)
    assert torch.equal(batch[0, ids.shape[1]:], alone[0, len(rows[0]):])
    chunked = greedy(rocket, rows[0][None], cache=RocketKVCache(config), max_new_tokens=8,
                     prefill_chunk_size=10)
    assert torch.equal(chunked, alone)


# ------------------------------------------------------------------------------------------------ on a pool
def _on_pool(model, config, pool, ids, mask=None, new=8):
    """Greedy tokens on a pool-backed cache, closed afterwards, and the cache's stats."""
    cache = RocketKVCache(config, pool=pool)
    out = greedy(model, ids, attention_mask=mask, cache=cache, max_new_tokens=new)
    stats = cache.stats
    cache.close()
    return out, stats


def _all_back(pool) -> bool:
    return pool.free_pages() == pool.total_pages() and pool.free_slots() == pool.total_slots()


@needs_generate
@pytest.mark.parametrize("make_config", [keep_all_config, compressing_config])
def test_a_pool_backed_cache_gives_the_tokens_of_one_without_a_pool(pair, make_config):
    """One row across several chunks and a left-padded batch: the chunked layers' rings in the pool's slab, the
    full layer in its pages; nothing evicted, the oracle's tokens too."""
    rocket, oracle = pair
    config = make_config(kt_cache_dtype="float32")
    pool = cpu_pool(rocket, config, page_size=8)
    ids = random_ids(1, 4 * CHUNK + 5, seed=7)
    alone = greedy(rocket, ids, cache=RocketKVCache(config), max_new_tokens=12)
    pooled, _ = _on_pool(rocket, config, pool, ids, new=12)
    assert torch.equal(pooled, alone)
    if make_config is keep_all_config:
        assert torch.equal(pooled, greedy(oracle, ids, max_new_tokens=12))
    assert _all_back(pool)


@needs_generate
@pytest.mark.parametrize("shared_len", [3 * CHUNK + 3, 4 * CHUNK, CHUNK - 2])
def test_a_prefix_hit_gives_the_tokens_of_a_cold_run(pair, shared_len):
    """A second prompt sharing ``shared_len`` tokens with a first one on the same pool (a hit, replayed over the
    chunked layers' windows), against the same prompt on a fresh pool (cold); the hit pages are counted as reused."""
    rocket, _ = pair
    config = keep_all_config(kt_cache_dtype="float32")
    first = random_ids(1, 5 * CHUNK + 1, seed=11)
    second = torch.cat([first[:, :shared_len], random_ids(1, 2 * CHUNK + 3, seed=12)], dim=1)
    pool = cpu_pool(rocket, config, page_size=8)
    _on_pool(rocket, config, pool, first)
    hot, hot_stats = _on_pool(rocket, config, pool, second)
    cold, cold_stats = _on_pool(rocket, config, cpu_pool(rocket, config, page_size=8), second)
    assert torch.equal(hot, cold)
    assert cold_stats.reused_tokens == 0
    assert hot_stats.reused_tokens == (shared_len // 8) * 8  # whole pages of the shared prompt
    assert _all_back(pool)


# ------------------------------------------------------------------------------------------------ refusals
@needs_generate
def test_the_batching_engine_gives_transformers_tokens_and_reuses_a_prefix(pair):
    """generate_batch on a pool (the batching engine: rows at different positions in one decode step, crossing chunk
    boundaries, the NoPE layer's queries scaled per row) with nothing evicted: each prompt gets the tokens of
    transformers' own cache; a second call sharing a prompt's first chunks hits its pages and still gets them."""
    from hf_rocketkv.serving import SamplingParams, generate_batch

    rocket, oracle = pair
    config = keep_all_config(kt_cache_dtype="float32")
    pool = cpu_pool(rocket, config, page_size=8)
    prompts = [random_ids(1, n, seed=40 + n)[0].tolist() for n in (3 * CHUNK + 5, 5, 2 * CHUNK, CHUNK + 3)]
    expected = [greedy(oracle, torch.tensor([p]), max_new_tokens=11)[0, len(p):].tolist() for p in prompts]
    results = generate_batch(rocket, prompts, config=config, pool=pool, sampling=SamplingParams.greedy(11))
    assert [list(r.token_ids) for r in results] == expected
    shared = prompts[0][: 2 * CHUNK + 2] + random_ids(1, 9, seed=99)[0].tolist()
    hits = pool.stats().hit_pages
    again = generate_batch(rocket, [shared], config=config, pool=pool, sampling=SamplingParams.greedy(11))
    assert list(again[0].token_ids) == greedy(oracle, torch.tensor([shared]), max_new_tokens=11)[0, len(shared):].tolist()
    assert pool.stats().hit_pages - hits >= 2  # the shared prompt's whole pages were reused
    assert _all_back(pool)


@needs_generate
@pytest.mark.parametrize("make_config", [keep_all_config, compressing_config])
@pytest.mark.parametrize("overrides", [dict(decode_runner="torch_compile"),
                                       dict(decode_runner="torch_compile", batch_buckets=(1, 4))])
def test_compiled_decode_gives_the_tokens_of_eager_decode(pair, make_config, overrides):
    """generate()'s torch.compile'd decode (dynamo on the CPU), with and without batch buckets: a left-padded batch of
    three rows, one shorter than a chunk, across several chunk boundaries; the eager tokens (with nothing evicted,
    transformers' own)."""
    rocket, oracle = pair
    config = make_config(kt_cache_dtype="float32")
    ids, mask = left_pad([random_ids(1, 3 * CHUNK + 5, seed=21)[0], random_ids(1, 2 * CHUNK + 2, seed=22)[0],
                          random_ids(1, CHUNK - 3, seed=23)[0]])
    eager = greedy(rocket, ids, attention_mask=mask, cache=RocketKVCache(config), max_new_tokens=3 * CHUNK,
                   disable_compile=True)
    cache = RocketKVCache(config.replace(**overrides))
    out = greedy(rocket, ids, attention_mask=mask, cache=cache, max_new_tokens=3 * CHUNK,
                 compile_config=eager_compile_config())
    assert torch.equal(out, eager)
    assert [cache.get_seq_length(i) for i in range(4)] == [ids.shape[1] + 3 * CHUNK - 1] * 4
    if make_config is keep_all_config:
        assert torch.equal(out, greedy(oracle, ids, attention_mask=mask, max_new_tokens=3 * CHUNK))


@needs_generate
@pytest.mark.parametrize("make_config", [keep_all_config, compressing_config])
def test_captured_decode_gives_the_tokens_of_eager_decode(pair, make_config):
    """decode_runner='cuda_graphs' (the CPU standing in for a graph device): a left-padded batch across several
    chunk boundaries, one capture, the eager tokens (with nothing evicted, transformers' own), the same state."""
    rocket, oracle = pair
    config = make_config(kt_cache_dtype="float32")
    ids, mask = left_pad([random_ids(1, 3 * CHUNK + 5, seed=21)[0], random_ids(1, 2 * CHUNK + 2, seed=22)[0]])
    eager_cache = RocketKVCache(config)
    eager = greedy(rocket, ids, attention_mask=mask, cache=eager_cache, max_new_tokens=3 * CHUNK,
                   disable_compile=True)
    backend = StandInBackend()
    cache = graphed_cache(config, backend)
    out = greedy(rocket, ids, attention_mask=mask, cache=cache, max_new_tokens=3 * CHUNK,
                 compile_config=eager_compile_config())
    assert torch.equal(out, eager)
    assert backend.captures == 1 and backend.replays == 3 * CHUNK - 2
    assert [cache.get_seq_length(i) for i in range(4)] == [eager_cache.get_seq_length(i) for i in range(4)]
    if make_config is keep_all_config:
        assert torch.equal(out, greedy(oracle, ids, attention_mask=mask, max_new_tokens=3 * CHUNK))


@needs_generate
def test_disable_compile_decodes_eagerly_under_any_runner(pair):
    rocket, oracle = pair
    ids = random_ids(1, 20, seed=4)
    cache = RocketKVCache(keep_all_config(decode_runner="torch_compile"))
    out = greedy(rocket, ids, cache=cache, max_new_tokens=6, disable_compile=True)
    assert torch.equal(out, greedy(oracle, ids, max_new_tokens=6))


@needs_generate
@pytest.mark.parametrize("runner", ["cuda_graphs", "torch_compile"])
def test_temperature_tuning_alone_decodes_under_every_runner(runner):
    """A Llama 4 whose layers are all full attention still reads the cache's length in its NoPE layers' forward: a
    device counter inside the captured or compiled step, so the scale moves with every step."""
    rocket, oracle = make_llama4_models(layer_types=["full_attention"] * 4)
    assert "chunked_attention" not in rocket.config.layer_types
    config = keep_all_config(decode_runner=runner)
    ids = random_ids(1, 20, seed=13)
    cache = graphed_cache(config, StandInBackend()) if runner == "cuda_graphs" else RocketKVCache(config)
    read = []  # what the NoPE layer reads inside a captured step (a host int would be frozen at capture on a GPU)
    hook = rocket.model.layers[FULL].self_attn.register_forward_pre_hook(
        lambda module, args: read.append(cache.get_seq_length(FULL)) if cache.hints.in_graph else None)
    try:
        out = greedy(rocket, ids, cache=cache, max_new_tokens=12, compile_config=eager_compile_config())
    finally:
        hook.remove()
    assert torch.equal(out, greedy(oracle, ids, max_new_tokens=12))
    if runner == "cuda_graphs":
        assert read and all(isinstance(length, torch.Tensor) and length.dim() == 0 for length in read)


def test_tensor_parallel_shards_and_mismatched_layers_are_refused(pair):
    rocket, _ = pair
    module = rocket.model.layers[0].self_attn
    layer = SlidingWindowLayer(CHUNK, chunked=True)
    check_supported(module, {}, layer, torch.zeros(1, 2, 4, 16), PLAIN)  # every KV head: served
    with pytest.raises(NotImplementedError, match="chunked-attention layers .* under tensor parallelism"):
        check_supported(module, {}, layer, torch.zeros(1, 1, 4, 16), PLAIN)
    with pytest.raises(ValueError, match="sliding_window=8, but its RocketKVCache holds a chunked-attention layer"):
        check_supported(module, {"sliding_window": CHUNK}, layer, torch.zeros(1, 2, 4, 16), PLAIN)
    full = rocket.model.layers[FULL].self_attn
    with pytest.raises(ValueError, match="attends with full attention .layer_types., but its RocketKVCache holds a "
                                         "chunked-attention layer"):
        check_supported(full, {}, layer, torch.zeros(1, 2, 4, 16), PLAIN)
