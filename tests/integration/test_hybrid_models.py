"""Models with sliding-window layers, soft-capping and sinks on one RocketKVCache (Gemma 2, Gemma 3, Cohere 2, gpt-oss,
Mistral with a window), against the oracle: the same weights on transformers' eager attention and its own cache.

- budget above the prompt and every page attended: greedy tokens equal the oracle's (one row, a padded batch,
  chunked prefill, plain forwards with ``model_config``);
- compression on: the sliding layers keep their window (``window - 1`` visible to the next query between forwards,
  as transformers' ``DynamicSlidingWindowLayer``; decode steps write a ring of ``window`` slots), the full-attention
  layers are compressed to the budget, and a padded batch gives
  every row the tokens it gets alone;
- a sliding layer's memory stays bounded by its window over a long prompt and many decode steps;
- what is not supported yet is refused with one clear line.
"""

from __future__ import annotations

import types

import pytest
import torch

from hf_rocketkv import RocketKVCache, SlidingWindowLayer
from hf_rocketkv.integration import attention
from tests.support.markers import slow_except
from tests.support.hybrid_models import HYBRID_ARCHS, WINDOW, make_hybrid_models
from tests.support.tiny_models import (
    check_padded_batch_and_chunked_prefill,
    compressing_config,
    cpu_pool,
    greedy,
    keep_all_config,
    left_pad,
    random_ids,
)
from hf_rocketkv.integration.compat import cache_kwargs

ARCHS = list(HYBRID_ARCHS)


@pytest.fixture(scope="module", params=ARCHS)
def pair(request):
    return request.param, *make_hybrid_models(request.param)


def sliding_indices(model) -> list[int]:
    windows = [getattr(layer.self_attn, "sliding_window", None) for layer in model.model.layers]
    if getattr(model.config, "layer_types", None) is None:  # Mistral: the window is the config's, on every layer
        return list(range(len(windows)))
    return [i for i, w in enumerate(windows) if w is not None]


def test_keep_all_equals_the_oracle(pair):
    arch, rocket, oracle = pair
    ids = random_ids(1, 40, seed=3)
    out = greedy(rocket, ids, cache=RocketKVCache(keep_all_config()), max_new_tokens=16)
    assert torch.equal(out, greedy(oracle, ids, max_new_tokens=16))
    # no cache passed: generate() makes one from the model's config
    assert torch.equal(greedy(rocket, ids, max_new_tokens=16), out)


def test_a_keep_all_conversation_equals_the_oracle(pair):
    """``multi_turn="keep_all"``: the second turn continues the first's cache (every token kept, the sliding layers'
    windows carried over) and gives transformers' own tokens for the whole conversation run at once."""
    arch, rocket, oracle = pair
    cache = RocketKVCache(keep_all_config(multi_turn="keep_all"))
    first = greedy(rocket, random_ids(1, 60, seed=1), cache=cache, max_new_tokens=6)
    conversation = torch.cat([first, random_ids(1, 20, seed=2)], dim=1)
    second = greedy(rocket, conversation, cache=cache, max_new_tokens=6)
    assert torch.equal(second, greedy(oracle, conversation, max_new_tokens=6)), arch
    assert cache.get_seq_length() == conversation.shape[1] + 5  # the last token is sampled, not yet stored


def test_padded_batch_and_chunked_prefill_equal_the_oracle(pair):
    arch, rocket, oracle = pair
    check_padded_batch_and_chunked_prefill(rocket, oracle)


def test_a_long_first_forward_in_spans_equals_the_oracle(pair, monkeypatch):
    """Spans shrunk to the window, prompts of several spans, one row and a left-padded batch: each span of a sliding
    layer attends only the keys its window reaches (Gemma 2's soft-capped, gpt-oss' sinks too), causal layers with
    sinks or caps only the keys up to the span's end, and the tokens stay transformers' own."""
    arch, rocket, oracle = pair
    monkeypatch.setattr(attention, "FIRST_FORWARD_QUERY_BLOCK", WINDOW)
    spans = []
    real = attention.attend_in_spans
    monkeypatch.setattr(attention, "attend_in_spans", lambda *a, **kw: spans.append(1) or real(*a, **kw))
    ids, mask = left_pad([random_ids(1, n, seed=n)[0] for n in (53, 38)])
    expected = greedy(oracle, ids, attention_mask=mask, max_new_tokens=8)
    out = greedy(rocket, ids, attention_mask=mask, cache=RocketKVCache(keep_all_config()),
                 max_new_tokens=8)
    assert torch.equal(out, expected), arch
    assert spans, f"{arch}: no layer attended in spans"


def test_beam_search_and_row_groups_equal_the_oracle(pair):
    arch, rocket, oracle = pair
    ids = random_ids(1, 30, seed=7)
    kwargs = dict(num_beams=2, max_new_tokens=6)
    beams = greedy(rocket, ids, cache=RocketKVCache(keep_all_config()), **kwargs)
    assert torch.equal(beams, greedy(oracle, ids, **kwargs))
    ids, mask = left_pad([random_ids(1, n, seed=n)[0] for n in (31, 17, 24)])
    groups = greedy(rocket, ids, attention_mask=mask, max_new_tokens=6,
                    cache=RocketKVCache(compressing_config(prefill_batch_size=1)))
    one = greedy(rocket, ids, attention_mask=mask, max_new_tokens=6, cache=RocketKVCache(compressing_config()))
    assert torch.equal(groups, one)


def test_a_later_turn_equals_the_oracle(pair):
    """A conversation continued on the same cache: the second turn's tokens are the oracle's on the whole text."""
    arch, rocket, oracle = pair
    cache = RocketKVCache(keep_all_config())
    first = greedy(rocket, random_ids(1, 20, seed=11), cache=cache, max_new_tokens=5)
    turn = torch.cat([first, random_ids(1, 9, seed=12)], dim=1)
    second = greedy(rocket, turn, cache=cache, max_new_tokens=6)
    assert torch.equal(second, greedy(oracle, turn, max_new_tokens=6))


def test_plain_forwards_with_model_config_equal_the_oracle(pair):
    arch, rocket, oracle = pair
    ids = random_ids(1, 30, seed=5)
    cache = RocketKVCache(keep_all_config(), model_config=rocket.config)
    reference = oracle(ids).logits[:, -1]
    with torch.no_grad():
        logits = rocket(ids, **cache_kwargs(cache)).logits[:, -1]
        torch.testing.assert_close(logits, reference.detach(), rtol=1e-4, atol=1e-4)
        token = logits.argmax(-1, keepdim=True)
        step = rocket(token, **cache_kwargs(cache)).logits[:, -1]
        expected = oracle(torch.cat([ids, token], dim=1)).logits[:, -1]
    torch.testing.assert_close(step, expected, rtol=1e-4, atol=1e-4)


def test_forward_without_a_rocketkv_cache_keeps_the_models_logits(pair):
    """use_cache=False: no RocketKV layer, yet soft-capping and sinks still apply (sdpa would drop them)."""
    arch, rocket, oracle = pair
    ids, mask = left_pad([random_ids(1, n, seed=n)[0] for n in (26, 19)])
    with torch.no_grad():
        logits = rocket(ids, attention_mask=mask, use_cache=False).logits
        expected = oracle(ids, attention_mask=mask, use_cache=False).logits
    real = mask.bool()
    torch.testing.assert_close(logits[real], expected[real], rtol=1e-4, atol=1e-4)


def test_plain_forward_without_layer_types_is_refused(pair):
    arch, rocket, _ = pair
    with pytest.raises(ValueError, match=r"sliding_window=8.*RocketKVCache\(config, model_config=model.config\)"):
        with torch.no_grad():
            rocket(random_ids(1, 12), **cache_kwargs(RocketKVCache(keep_all_config())))


def test_compression_keeps_windows_and_compresses_global_layers(pair):
    arch, rocket, _ = pair
    kv_heads = rocket.config.num_key_value_heads
    sliding = sliding_indices(rocket)
    rows = [random_ids(1, n, seed=n)[0] for n in (50, 33)]
    ids, mask = left_pad(rows)
    config = compressing_config()
    cache = RocketKVCache(config)
    batch = greedy(rocket, ids, attention_mask=mask, cache=cache, max_new_tokens=8)
    for index, layer in enumerate(cache.layers):
        if index in sliding:
            assert isinstance(layer, SlidingWindowLayer) and layer.window == WINDOW
            assert layer.ring and layer.keys.shape == (2, kv_heads, WINDOW, 16)  # decode's ring of window slots
            assert cache.kept_tokens(index).tolist() == [[WINDOW - 1] * kv_heads] * 2  # what the next query sees
        else:
            assert layer.compressed
            assert cache.kept_tokens(index).tolist() == [[24 + 7] * kv_heads] * 2
    assert cache.get_seq_length() == ids.shape[1] + 7
    for b, row in enumerate(rows):  # padding never changes a row's tokens
        alone = greedy(rocket, row[None], cache=RocketKVCache(config), max_new_tokens=8)
        assert torch.equal(batch[b, ids.shape[1]:], alone[0, len(row):])


def test_compressed_chunked_prefill_equals_one_forward(pair):
    arch, rocket, _ = pair
    ids = random_ids(1, 45, seed=9)
    one = greedy(rocket, ids, cache=RocketKVCache(compressing_config()), max_new_tokens=8)
    chunked = greedy(rocket, ids, cache=RocketKVCache(compressing_config()), max_new_tokens=8,
                     prefill_chunk_size=10)
    assert torch.equal(one, chunked)


def test_sliding_memory_is_bounded_by_the_window():
    rocket, _ = make_hybrid_models("gemma3")
    cache = RocketKVCache(compressing_config())
    greedy(rocket, random_ids(1, 120, seed=2), cache=cache, max_new_tokens=40)
    for layer in cache.layers:
        if isinstance(layer, SlidingWindowLayer):
            assert layer.get_seq_length() == 120 + 39
            assert layer.keys.shape[2] == WINDOW and layer.stored == WINDOW - 1
            # the storage behind the window, not only its view: the prompt's tensors are gone
            assert layer.memory_bytes() == 2 * WINDOW * 2 * 16 * 4


# ------------------------------------------------------------------------------------------------ refusals
def test_pool_settings_the_layers_cannot_serve_are_refused_naming_them():
    """A pool serves these models (tests/integration/test_hybrid_pool.py), their prefix reuse
    (tests/integration/test_hybrid_prefix_reuse.py), host offload and prefix files
    (tests/integration/test_hybrid_offload_and_files.py); fp8 pages from a config that names no dtype (the slab's)
    and a pool built for another model's layers are refused."""
    rocket, _ = make_hybrid_models("gemma3")
    config = compressing_config(kt_cache_dtype="float32")
    with pytest.raises(ValueError, match="model's dtype.*names none"):  # fp8 pages: the slab's dtype is the model's
        cpu_pool(rocket.config, config, dtype=torch.float8_e4m3fn)
    pool = cpu_pool(rocket.config, config, host_bytes=1 << 20)
    assert pool.host_slots > 0 and pool.can_admit(16, 2, config, token_ids=list(range(16)))
    full = types.SimpleNamespace(num_hidden_layers=4, num_key_value_heads=2, num_attention_heads=4, head_dim=16)
    llama_pool = cpu_pool(full, config)  # a pool for four full-attention layers
    with pytest.raises(ValueError, match="not those the KVBlockPool was built for"):
        greedy(rocket, random_ids(1, 12), cache=RocketKVCache(config, pool=llama_pool), max_new_tokens=2)


def test_hybrid_cache_is_compileable():
    """Decode steps of sliding layers run compiled: captured as CUDA graphs (the default) or through torch.compile
    (tests/integration/test_hybrid_compiled_decode.py)."""
    rocket, _ = make_hybrid_models("gpt_oss")
    cache = RocketKVCache(keep_all_config(), model_config=rocket.config)
    assert cache.has_sliding_layers and cache.is_compileable


@pytest.mark.parametrize("arch,overrides,message", [
    ("gemma2", dict(stage1="h2o"), "stage1='h2o' scores with attention logits of its own, without this model's "
                                   "logit soft-capping"),
    ("gpt_oss", dict(decode_budget=32), "decode_budget .* without this model's attention sinks"),
])
def test_scorers_without_the_models_logits_are_refused(arch, overrides, message):
    rocket, _ = make_hybrid_models(arch)
    with pytest.raises(NotImplementedError, match=message):
        greedy(rocket, random_ids(1, 30), cache=RocketKVCache(compressing_config(**overrides)),
               max_new_tokens=2)


def test_tensor_parallel_shards_of_sliding_layers_pass_and_unsharded_sinks_are_refused():
    """A process that holds only some KV heads (tensor parallelism) of a sliding or soft-capped layer is served (its
    window keeps the heads it receives; tests/integration/test_tensor_parallel_hybrid.py runs it on 2 ranks); sinks
    of every query head beside a shard of the query heads would pair heads with other heads' sinks: refused."""
    from hf_rocketkv.integration.attention import check_sinks_follow_heads, check_supported
    from hf_rocketkv.selection.logit_features import PLAIN, LogitFeatures

    rocket, _ = make_hybrid_models("gemma3")
    module = rocket.model.layers[0].self_attn
    key = torch.zeros(1, 1, 4, 16)  # one of the two KV heads
    check_supported(module, {"sliding_window": WINDOW}, SlidingWindowLayer(WINDOW), key, PLAIN)
    check_supported(module, {"sliding_window": WINDOW}, SlidingWindowLayer(WINDOW), key, LogitFeatures(softcap=5.0))
    oss, _ = make_hybrid_models("gpt_oss")
    attention = oss.model.layers[0].self_attn
    check_sinks_follow_heads(attention, attention.sinks[:2], torch.zeros(1, 2, 3, 16))  # a shard's own sinks
    with pytest.raises(NotImplementedError, match=r"attention sinks of shape \[4\] for the 2 query heads"):
        check_sinks_follow_heads(attention, attention.sinks, torch.zeros(1, 2, 3, 16))


# ------------------------------------------------------------------------------------------------ Triton backend
@pytest.mark.parametrize("arch", slow_except(["gpt_oss", "gemma2", "gemma3"], keep=["gemma2"]))  # gpt_oss: ~10 s
def test_triton_backend_gives_the_oracles_and_the_twins_tokens(arch):
    """Stage 2's attention through the Triton kernel with sinks (gpt-oss) or soft-capping (Gemma 2), and the sliding
    layers' decode through the ring kernels with them, interpreted on CPU: every page read gives the oracle's tokens;
    with eviction and page selection, the torch twin's tokens."""
    rocket, oracle = make_hybrid_models(arch)
    ids = random_ids(1, 40, seed=3)
    cache = RocketKVCache(keep_all_config(backend="triton"))
    out = greedy(rocket, ids, cache=cache, max_new_tokens=6)
    assert torch.equal(out, greedy(oracle, ids, max_new_tokens=6))
    featured = [layer for layer in cache.layers if not layer.is_sliding]
    assert featured and all(layer.ops.name == "triton" for layer in featured)
    assert arch == "gemma3" or all(not layer.features.plain for layer in featured)
    sliding = [layer for layer in cache.layers if layer.is_sliding]
    assert sliding and all(layer.ring and layer.ops.name == "triton" for layer in sliding)
    config = dict(kt_cache_dtype="float32")
    triton = greedy(rocket, ids, cache=RocketKVCache(compressing_config(backend="triton", **config)),
                    max_new_tokens=6)
    torch_ = greedy(rocket, ids, cache=RocketKVCache(compressing_config(**config)), max_new_tokens=6)
    assert torch.equal(triton, torch_)


@pytest.mark.parametrize("arch", ["gpt_oss", "gemma3"])
def test_from_pretrained_with_rocketkv_attention_and_pipeline_equal_the_oracle(arch, tmp_path, smollm2_tokenizer):
    """What a user types first: a checkpoint loaded with ``attn_implementation="rocketkv"`` and a text-generation
    pipeline over it give transformers' own text (eager attention, its own cache) when nothing is evicted."""
    from transformers import AutoModelForCausalLM, pipeline

    import hf_rocketkv

    tok = smollm2_tokenizer
    _, oracle = make_hybrid_models(arch, vocab_size=len(tok), pad_token_id=tok.pad_token_id,
                                   bos_token_id=tok.bos_token_id, eos_token_id=tok.eos_token_id)
    oracle.save_pretrained(tmp_path)
    model = AutoModelForCausalLM.from_pretrained(tmp_path, attn_implementation=hf_rocketkv.ATTN_NAME).eval()
    assert model.config._attn_implementation == hf_rocketkv.ATTN_NAME
    hf_rocketkv.set_config(model, keep_all_config())
    prompt = "RocketKV keeps a small budget of tokens from the prompt and attends a few pages at every step."
    gen = dict(max_new_tokens=8, min_new_tokens=8, do_sample=False, return_full_text=False)
    text = pipeline("text-generation", model=model, tokenizer=tok)(prompt, **gen)[0]["generated_text"]
    want = pipeline("text-generation", model=oracle, tokenizer=tok)(prompt, **gen)[0]["generated_text"]
    assert text == want, arch
