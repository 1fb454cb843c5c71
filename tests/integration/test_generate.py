"""generate()/pipeline() integration (integration/generate.py) on a tiny random Llama: equivalence with sdpa when
nothing is evicted, compression engaged, padding, beams, chunked prefill, multi-turn, automatic cache creation and
the misuse errors (the deferred stop check: test_deferred_stop_check.py).
"""

from __future__ import annotations

import pytest
import torch
from transformers import DynamicCache, pipeline

import hf_rocketkv
from hf_rocketkv import RocketKVCache
from tests.support.tiny_models import (
    compressing_config,
    dynamic_cache_bytes,
    greedy,
    keep_all_config,
    left_pad,
    make_models,
    random_ids,
    teacher_forced_logits,
)
from hf_rocketkv.integration.compat import cache_kwargs, output_cache


@pytest.fixture
def spy_caches(monkeypatch):
    """Records every RocketKVCache constructed during the test (generate() makes one when no cache is passed)."""
    created = []
    original_init = RocketKVCache.__init__

    def init(self, *args, **kwargs):
        original_init(self, *args, **kwargs)
        created.append(self)

    monkeypatch.setattr(RocketKVCache, "__init__", init)
    return created


# ------------------------------------------------------------------------------------------------ equivalence


@pytest.mark.parametrize("kt_dtype", ["float32", "float8_e5m2"])
def test_keep_all_greedy_equals_sdpa(llama_pair, kt_dtype):
    rocket, sdpa = llama_pair
    ids = random_ids(1, 40)
    cache = RocketKVCache(keep_all_config(kt_cache_dtype=kt_dtype))
    out = greedy(rocket, ids, cache=cache, max_new_tokens=20, output_logits=True,
                 return_dict_in_generate=True)
    ref = greedy(sdpa, ids, max_new_tokens=20, output_logits=True, return_dict_in_generate=True)
    assert torch.equal(out.sequences, ref.sequences)
    torch.testing.assert_close(torch.stack(out.logits), torch.stack(ref.logits), rtol=1e-4, atol=1e-4)
    assert cache.is_compressed and cache.kept_tokens(0).tolist() == [[59, 59]]  # nothing evicted


def test_keep_all_padded_batch_equals_sdpa(llama_pair):
    rocket, sdpa = llama_pair
    ids, mask = left_pad([random_ids(1, n, seed=n)[0] for n in (33, 20, 41)])
    out = greedy(rocket, ids, attention_mask=mask, cache=RocketKVCache(keep_all_config()))
    ref = greedy(sdpa, ids, attention_mask=mask)
    assert torch.equal(out, ref)


def test_plain_forward_without_cache_is_sdpa(llama_pair):
    rocket, sdpa = llama_pair
    ids = random_ids(2, 30)
    with torch.no_grad():
        assert torch.equal(rocket(ids).logits, sdpa(ids).logits)
        assert torch.equal(rocket(ids, use_cache=False).logits, sdpa(ids, use_cache=False).logits)


# ------------------------------------------------------------------------------------------------ compression


@pytest.mark.parametrize("kt_dtype", ["bfloat16", "float8_e5m2"])
def test_compression_engaged(llama_pair, kt_dtype):
    rocket, sdpa = llama_pair
    ids = random_ids(1, 80)
    config = compressing_config(kt_cache_dtype=kt_dtype)
    cache = RocketKVCache(config)
    greedy(rocket, ids, cache=cache, max_new_tokens=1)
    assert cache.is_compressed
    for layer_idx in range(rocket.config.num_hidden_layers):
        assert cache.kept_tokens(layer_idx).tolist() == [[config.prompt_budget] * 2]  # right after prefill
        assert cache.layers[layer_idx].kt.dtype == config.kt_torch_dtype

    new = 10
    cache = RocketKVCache(config)
    out = greedy(rocket, ids, cache=cache, max_new_tokens=new)
    assert out.shape == (1, 80 + new)
    assert cache.get_seq_length() == 80 + new - 1  # logical length (the last token is never fed back)
    for layer_idx in range(rocket.config.num_hidden_layers):
        assert cache.kept_tokens(layer_idx).tolist() == [[config.prompt_budget + new - 1] * 2]
        positions = cache.kept_positions(layer_idx)[0, :, : config.prompt_budget + new - 1]
        assert torch.all(positions[:, config.prompt_budget :] == torch.arange(80, 80 + new - 1))

    ref = greedy(sdpa, ids, max_new_tokens=new, return_dict_in_generate=True)
    assert cache.memory_bytes() < dynamic_cache_bytes(output_cache(ref)) / 2


def test_left_padded_batch_equals_rows_alone_with_compression(llama_pair):
    rocket, _ = llama_pair
    rows = [random_ids(1, n, seed=n)[0] for n in (60, 45, 20, 31)]  # 20 < budget: kept whole
    ids, mask = left_pad(rows)
    config = compressing_config()
    cache = RocketKVCache(config)
    batch = greedy(rocket, ids, attention_mask=mask, cache=cache, max_new_tokens=10)
    assert cache.kept_tokens(0)[:, 0].tolist() == [24 + 9, 24 + 9, 20 + 9, 24 + 9]
    for b, row in enumerate(rows):
        alone = greedy(rocket, row[None], cache=RocketKVCache(config), max_new_tokens=10)
        assert torch.equal(batch[b, ids.shape[1] :], alone[0, len(row) :]), f"row {b}"


def test_right_padding_rejected(llama_pair):
    rocket, _ = llama_pair
    ids = random_ids(2, 30)
    mask = torch.ones_like(ids)
    mask[1, -5:] = 0
    with pytest.raises(ValueError, match="left"):
        greedy(rocket, ids, attention_mask=mask, cache=RocketKVCache(compressing_config()))


def test_sampling_with_compression_draws_from_the_compressed_model(llama_pair):
    """Fixed-seed oracle: replaying the sampled tokens teacher-forced through a fresh cache and re-drawing each token
    with the same generator state and the same top-k rule reproduces the sample exactly; the first token's empirical
    distribution over many rows matches softmax of the exact prefill logits."""
    rocket, _ = llama_pair
    config = compressing_config()
    ids = random_ids(2, 50)
    torch.manual_seed(1234)
    out = greedy(rocket, ids, cache=RocketKVCache(config), do_sample=True, top_k=20, max_new_tokens=6)
    new = out[:, 50:]
    logits = teacher_forced_logits(rocket, ids, new, config)
    torch.manual_seed(1234)
    for step in range(new.shape[1]):
        scores = logits[:, step].float()
        threshold = scores.topk(20, dim=-1).values[:, -1:]
        probs = torch.softmax(scores.masked_fill(scores < threshold, float("-inf")), dim=-1)
        drawn = torch.multinomial(probs, num_samples=1)[:, 0]
        assert torch.equal(drawn, new[:, step]), f"step {step}"

    rows, temperature = 1000, 0.2
    many = random_ids(1, 50).expand(rows, -1)
    torch.manual_seed(7)
    first = greedy(rocket, many, cache=RocketKVCache(config), do_sample=True, top_k=0,
                   temperature=temperature, max_new_tokens=1)[:, -1]
    with torch.no_grad():
        expected = torch.softmax(rocket(many[:1]).logits[0, -1].double() / temperature, dim=-1)
    observed = torch.bincount(first, minlength=expected.shape[0]).double() / rows
    with torch.no_grad():
        untempered = torch.softmax(rocket(many[:1]).logits[0, -1].double(), dim=-1)  # a temperature bug
    distance = float((observed - expected).abs().sum())  # L1; sampling noise alone gives ~0.2 at 1000 draws
    wrong = float((observed - untempered).abs().sum())
    assert distance < 0.35 < wrong, (distance, wrong)


def test_greedy_with_page_selection_attends_exactly_the_oracle_pages(llama_pair, monkeypatch):
    """A budget where pages really are selected (3 of ~7 per step): at every decode step of every layer, the
    attention output equals dense float64 attention over exactly the pages an independent brute-force oracle picks."""
    from hf_rocketkv import RocketKVLayer

    from tests.support.stage2_oracle import brute_force_pages, ref_sparse_attention

    rocket, _ = llama_pair
    config = compressing_config(kt_cache_dtype="float32")
    checked = []
    original = RocketKVLayer.attend_decode

    def checked_decode(layer, query, scaling):
        out = original(layer, query, scaling)
        batch, heads, _, dim = query.shape
        q = query.reshape(batch, layer.keys.shape[1], heads // layer.keys.shape[1], dim)
        page_idx, valid = brute_force_pages(q, layer.kt, layer.lengths.tolist(), config.page_size, config.topr,
                                            config.topk)
        assert int(valid.sum(-1).min()) == config.topk  # pages really are selected
        ref = ref_sparse_attention(q, layer.keys, layer.values, page_idx, valid, layer.lengths, config.page_size,
                                   scaling)
        got = out.transpose(1, 2).reshape(q.shape).double()
        torch.testing.assert_close(got, ref, rtol=1e-4, atol=1e-4)
        checked.append(int(layer.lengths.max()))
        return out

    monkeypatch.setattr(RocketKVLayer, "attend_decode", checked_decode)
    greedy(rocket, random_ids(2, 60), cache=RocketKVCache(config), max_new_tokens=6)
    assert len(checked) == 5 * rocket.config.num_hidden_layers and max(checked) > 4 * config.topk


# ------------------------------------------------------------------------------------------------ beams


def test_beam_search_keep_all_equals_sdpa(llama_pair):
    rocket, sdpa = llama_pair
    ids = random_ids(1, 35)
    kwargs = dict(num_beams=3, num_return_sequences=3, max_new_tokens=10)
    out = greedy(rocket, ids, cache=RocketKVCache(keep_all_config()), **kwargs)
    ref = greedy(sdpa, ids, **kwargs)
    assert torch.equal(out, ref)


def test_beam_search_with_compression_scores_match_a_replay_of_each_beam(llama_pair):
    """Oracle: each returned beam, replayed teacher-forced through a fresh RocketKVCache, has exactly the log
    probability beam search reports for it. A wrong reorder_cache (a beam decoding on another beam's cache) breaks
    this."""
    rocket, _ = llama_pair
    config = compressing_config()
    ids = random_ids(2, 50)
    cache = RocketKVCache(config)
    out = greedy(rocket, ids, cache=cache, num_beams=3, num_return_sequences=3, max_new_tokens=8,
                 length_penalty=0.0, output_scores=True, return_dict_in_generate=True)
    assert out.sequences.shape == (6, 58)
    assert torch.all(cache.kept_tokens(0) == 24 + 7)
    for row in range(6):
        prompt, beam = ids[row // 3 : row // 3 + 1], out.sequences[row : row + 1, 50:]
        logits = teacher_forced_logits(rocket, prompt, beam, config)
        logprob = torch.log_softmax(logits[0].double(), dim=-1).gather(1, beam[0, :, None]).sum()
        torch.testing.assert_close(out.sequences_scores[row].double(), logprob, rtol=1e-4, atol=1e-4)
    assert len({tuple(r) for r in out.sequences[:3, 50:].tolist()}) == 3  # three different beams


# ------------------------------------------------------------------------------------------------ automatic cache


def test_generate_without_cache_uses_rocketkv(spy_caches):
    rocket, _ = make_models("llama")
    config = compressing_config(prompt_budget=16, window_size=4)
    hf_rocketkv.set_config(rocket, config)
    assert hf_rocketkv.get_config(rocket) == config
    ids = random_ids(1, 50)
    out = greedy(rocket, ids, max_new_tokens=8)
    assert len(spy_caches) == 1
    cache = spy_caches[0]
    assert cache.config == config
    assert cache.is_compressed and cache.kept_tokens(0).tolist() == [[16 + 7, 16 + 7]]
    greedy(rocket, ids, max_new_tokens=8)
    assert len(spy_caches) == 2 and spy_caches[1] is not cache  # a fresh cache per call
    explicit = greedy(rocket, ids, cache=RocketKVCache(config), max_new_tokens=8)
    assert torch.equal(out, explicit)


def test_enable_sets_config_and_default_config():
    rocket, sdpa = make_models("llama")
    assert hf_rocketkv.get_config(sdpa) == hf_rocketkv.RocketKVConfig()
    config = compressing_config()
    assert hf_rocketkv.enable(sdpa, config) is sdpa
    assert sdpa.config._attn_implementation == "rocketkv"
    assert hf_rocketkv.get_config(sdpa) == config
    with pytest.raises(TypeError):
        hf_rocketkv.set_config(rocket, config.to_dict())


def test_pipeline_single_and_list(smollm2_tokenizer, spy_caches):
    tok = smollm2_tokenizer
    rocket, sdpa = make_models(
        "llama", vocab_size=len(tok), pad_token_id=tok.pad_token_id, bos_token_id=tok.bos_token_id,
        eos_token_id=tok.eos_token_id,
    )
    prompts = [
        "The quick brown fox jumps over the lazy dog while the cat watches from the old wooden fence nearby.",
        "RocketKV keeps a small budget of tokens from the prompt and attends a few pages at every decoding step.",
        "Short prompt.",
    ]
    gen = dict(max_new_tokens=6, min_new_tokens=6, do_sample=False, return_full_text=False)

    # nothing evicted: identical text to sdpa
    hf_rocketkv.set_config(rocket, keep_all_config())
    pipe = pipeline("text-generation", model=rocket, tokenizer=tok)
    ref_pipe = pipeline("text-generation", model=sdpa, tokenizer=tok)
    single = pipe(prompts[0], **gen)
    assert single[0]["generated_text"] == ref_pipe(prompts[0], **gen)[0]["generated_text"]
    assert len(spy_caches) == 1

    # compressing: every prompt of a list gets its own fresh cache; batched (left-padded) == one by one
    config = compressing_config(prompt_budget=12, window_size=4)
    hf_rocketkv.set_config(rocket, config)
    spy_caches.clear()
    listed = pipe(prompts, **gen)
    assert len(listed) == 3 and len(spy_caches) == 3
    lengths = [len(tok(p)["input_ids"]) for p in prompts]
    for cache, n in zip(spy_caches, lengths):
        assert cache.is_compressed
        assert cache.kept_tokens(0).tolist() == [[min(n, 12) + 5] * 2]
    alone = [pipe(p, **gen)[0]["generated_text"] for p in prompts]
    assert [r[0]["generated_text"] for r in listed] == alone
    batched = pipe(prompts, batch_size=3, **gen)
    assert [r[0]["generated_text"] for r in batched] == alone


# ------------------------------------------------------------------------------------------------ reuse / turns


def test_reusing_filled_cache_for_unrelated_prompt_raises(llama_pair):
    rocket, _ = llama_pair
    cache = RocketKVCache(compressing_config())
    greedy(rocket, random_ids(1, 40, seed=1), cache=cache)
    for ids in (random_ids(1, 20, seed=2), random_ids(1, 40, seed=1), random_ids(1, 90, seed=3)):
        with pytest.raises(ValueError, match="fresh RocketKVCache"):
            greedy(rocket, ids, cache=cache)
    with pytest.raises(ValueError, match="RocketKVCache"):
        greedy(rocket, random_ids(2, 90, seed=4), cache=cache)  # other batch size


def test_reusing_cache_with_same_prompt_but_other_continuation_raises(llama_pair):
    rocket, _ = llama_pair
    cache = RocketKVCache(compressing_config())
    ids = random_ids(1, 40, seed=1)
    greedy(rocket, ids, cache=cache, max_new_tokens=12)
    other = torch.cat([ids, random_ids(1, 20, seed=9)], dim=1)  # not the generated tokens
    with pytest.raises(ValueError):
        greedy(rocket, other, cache=cache)


def test_continuing_conversation_keep_all_equals_sdpa(llama_pair):
    rocket, sdpa = llama_pair
    cache = RocketKVCache(keep_all_config())
    first = greedy(rocket, random_ids(1, 30), cache=cache, max_new_tokens=8)
    turn2 = torch.cat([first, random_ids(1, 12, seed=5)], dim=1)
    second = greedy(rocket, turn2, cache=cache, max_new_tokens=8)
    assert torch.equal(second, greedy(sdpa, turn2, max_new_tokens=8))
    assert cache.get_seq_length() == turn2.shape[1] + 7


def test_multi_turn_after_compression_keeps_bounded(llama_pair):
    rocket, _ = llama_pair
    config = compressing_config()
    cache = RocketKVCache(config)
    out = greedy(rocket, random_ids(1, 60), cache=cache, max_new_tokens=6)
    for turn in range(3):
        ids = torch.cat([out, random_ids(1, 15, seed=10 + turn)], dim=1)
        out = greedy(rocket, ids, cache=cache, max_new_tokens=6)
        assert out.shape[1] == ids.shape[1] + 6
        assert torch.equal(out[:, : ids.shape[1]], ids)
        assert cache.get_seq_length() == out.shape[1] - 1
        for layer_idx in range(rocket.config.num_hidden_layers):
            kept = cache.kept_tokens(layer_idx)
            assert torch.all(kept == config.prompt_budget + 5), kept  # re-evicted to the budget, then 5 decoded
            positions = cache.kept_positions(layer_idx)[0, 0, : kept[0, 0]].tolist()
            assert positions == sorted(positions) and positions[-1] == out.shape[1] - 2
    # later turns never rewrite earlier tokens: the first turn alone reproduces the start of the conversation
    cache2 = RocketKVCache(config)
    again = greedy(rocket, random_ids(1, 60), cache=cache2, max_new_tokens=6)
    assert torch.equal(again, out[:, : again.shape[1]])


# ------------------------------------------------------------------------------------------------ chunked prefill


@pytest.mark.parametrize("chunk", [8, 7, 16, 60])
def test_chunked_prefill_equals_unchunked(llama_pair, chunk):
    rocket, _ = llama_pair
    ids = random_ids(1, 56)
    config = compressing_config()
    reference_cache = RocketKVCache(config)
    reference = greedy(rocket, ids, cache=reference_cache, max_new_tokens=10)
    cache = RocketKVCache(config)
    out = greedy(rocket, ids, cache=cache, prefill_chunk_size=chunk, max_new_tokens=10)
    assert torch.equal(out, reference)
    assert cache.kept_tokens(0).tolist() == [[24 + 9, 24 + 9]]
    for layer_idx in range(rocket.config.num_hidden_layers):
        assert torch.equal(cache.kept_positions(layer_idx), reference_cache.kept_positions(layer_idx))


@pytest.mark.parametrize("chunk", [11, 5])
def test_chunked_prefill_last_chunk_of_one_token(llama_pair, chunk):
    rocket, _ = llama_pair
    ids = random_ids(1, 56)  # 56 % 11 == 1, 56 % 5 == 1
    config = compressing_config()
    reference_cache = RocketKVCache(config)
    reference = greedy(rocket, ids, cache=reference_cache, max_new_tokens=10)
    cache = RocketKVCache(config)
    out = greedy(rocket, ids, cache=cache, prefill_chunk_size=chunk, max_new_tokens=10)
    assert torch.equal(cache.kept_positions(0), reference_cache.kept_positions(0))
    assert torch.equal(out, reference)


def test_chunked_prefill_padded_batch(llama_pair):
    rocket, _ = llama_pair
    ids, mask = left_pad([random_ids(1, n, seed=n)[0] for n in (48, 40)])  # row 1 has 8 pads
    config = compressing_config()
    reference = greedy(rocket, ids, attention_mask=mask, cache=RocketKVCache(config))
    out = greedy(rocket, ids, attention_mask=mask, cache=RocketKVCache(config), prefill_chunk_size=16)
    assert torch.equal(out, reference)


def test_chunked_prefill_padding_longer_than_first_chunk(llama_pair):
    """The padding offset comes from every chunk, not the first one only (which would keep a padding column)."""
    rocket, _ = llama_pair
    ids, mask = left_pad([random_ids(1, n, seed=n)[0] for n in (48, 30)])  # row 1 has 18 pads
    config = compressing_config()
    reference_cache = RocketKVCache(config)
    reference = greedy(rocket, ids, attention_mask=mask, cache=reference_cache)
    cache = RocketKVCache(config)
    out = greedy(rocket, ids, attention_mask=mask, cache=cache, prefill_chunk_size=8)
    stored = cache.kept_positions(0)[1, :, : cache.layers[0].lengths[1]]
    assert stored.min() >= 18, "a padding column was kept"
    assert torch.equal(out, reference)


# ------------------------------------------------------------------------------------------------ row-group prefill


def _same_cache_state(cache, reference, layers):
    for layer_idx in range(layers):
        got, want = cache.layers[layer_idx], reference.layers[layer_idx]
        assert torch.equal(got.lengths, want.lengths), f"layer {layer_idx}"
        for b, n in enumerate(want.lengths.tolist()):
            assert torch.equal(got.positions[b, :, :n], want.positions[b, :, :n]), f"layer {layer_idx} row {b}"
            assert torch.equal(got.keys[b, :, :n], want.keys[b, :, :n]), f"layer {layer_idx} row {b}"


@pytest.mark.parametrize("rows_per_group", [1, 2, 3])
def test_row_group_prefill_equals_one_forward(llama_pair, rows_per_group):
    """Rows of different lengths (20 < budget is kept whole, so group capacities differ), left-padded."""
    rocket, _ = llama_pair
    ids, mask = left_pad([random_ids(1, n, seed=n)[0] for n in (60, 45, 20, 31)])
    reference_cache = RocketKVCache(compressing_config())
    reference = greedy(rocket, ids, attention_mask=mask, cache=reference_cache, max_new_tokens=10)
    cache = RocketKVCache(compressing_config(prefill_batch_size=rows_per_group))
    out = greedy(rocket, ids, attention_mask=mask, cache=cache, max_new_tokens=10)
    assert torch.equal(out, reference)
    assert cache.kept_tokens(0)[:, 0].tolist() == [24 + 9, 24 + 9, 20 + 9, 24 + 9]
    _same_cache_state(cache, reference_cache, rocket.config.num_hidden_layers)


def test_row_group_prefill_with_chunked_prefill_and_beams(llama_pair):
    rocket, _ = llama_pair
    ids, mask = left_pad([random_ids(1, n, seed=n)[0] for n in (48, 40, 52)])
    kwargs = dict(attention_mask=mask, num_beams=2, num_return_sequences=2, max_new_tokens=6)
    reference = greedy(rocket, ids, cache=RocketKVCache(compressing_config()), **kwargs)
    cache = RocketKVCache(compressing_config(prefill_batch_size=2))
    out = greedy(rocket, ids, cache=cache, prefill_chunk_size=16, **kwargs)
    assert torch.equal(out, reference)
    assert cache.kept_tokens(0).shape == (6, 2)


def test_row_group_prefill_unknown_batch_input_raises():
    from hf_rocketkv.integration.row_groups import slice_rows

    kwargs = dict(attention_mask=torch.ones(4, 9), pixel_values=torch.zeros(4, 3, 8, 8), cache_position=torch.arange(4))
    sliced = slice_rows({k: v for k, v in kwargs.items() if k != "pixel_values"}, slice(0, 2), 4)
    assert sliced["attention_mask"].shape == (2, 9) and sliced["cache_position"].shape == (4,)
    with pytest.raises(ValueError, match="prefill_batch_size.*'pixel_values'"):
        slice_rows(kwargs, slice(0, 2), 4)


# ------------------------------------------------------------------------------------------------ misuse errors


def test_rocketkv_cache_on_sdpa_model_raises(llama_pair):
    _, sdpa = llama_pair
    ids = random_ids(1, 30)
    with pytest.raises(ValueError, match="attn_implementation") as info:
        greedy(sdpa, ids, cache=RocketKVCache(compressing_config()))
    assert "rocketkv" in str(info.value) and "sdpa" in str(info.value)
    with pytest.raises(RuntimeError, match="rocketkv"):
        with torch.no_grad():
            sdpa(ids, **cache_kwargs(RocketKVCache(compressing_config())))
    # the failed forward leaves nothing behind: the next legitimate run works
    greedy(llama_pair[0], ids, cache=RocketKVCache(compressing_config()), max_new_tokens=2)


@pytest.mark.parametrize("layers", [1, 2])
def test_rocketkv_cache_on_an_sdpa_model_refuses_before_running_dense(layers):
    """A plain forward (generate() refuses up front) of an sdpa model on a RocketKVCache: refused at the first
    layer's update, before anything is stored or attended, whatever the number of layers (a one-layer model has no
    later layer to notice the unconsumed keys). No global state: the cache stays empty and usable, and the same
    weights on 'rocketkv' then run as on a fresh cache."""
    rocket, sdpa = make_models("llama", num_hidden_layers=layers)
    ids = random_ids(1, 30)
    cache = RocketKVCache(compressing_config())
    forwards = []
    hooks = [layer.self_attn.register_forward_hook(lambda *_: forwards.append(1)) for layer in sdpa.model.layers]
    with pytest.raises(RuntimeError, match="runs the 'sdpa' attention.*refuses before anything is written"):
        with torch.no_grad():
            sdpa(ids, **cache_kwargs(cache))
    for hook in hooks:
        hook.remove()
    assert forwards == [] and cache.get_seq_length() == 0
    assert torch.equal(greedy(rocket, ids, cache=cache, max_new_tokens=2),
                       greedy(rocket, ids, cache=RocketKVCache(compressing_config()), max_new_tokens=2))


def test_a_direct_update_is_not_taken_for_another_attention():
    """``update`` called by code that is no transformers module (here, this test) is not refused for it."""
    cache = RocketKVCache(keep_all_config())
    keys = torch.zeros(1, 2, 3, 16)
    out_keys, _ = cache.update(keys, keys, 0)
    assert out_keys.shape[2] == 3


@pytest.mark.parametrize("name, value", [("max_new_tokens", 1.5), ("prefill_chunk_size", 0), ("prefill_chunk_size", -2),
                                         ("prefill_chunk_size", 2.5), ("prefill_chunk_size", "4"), ("num_beams", 0),
                                         ("prefill_chunk_size", True)])
def test_counts_that_are_no_whole_numbers_are_refused_naming_the_argument(llama_pair, name, value):
    """Where transformers itself lets the value through to a TypeError, RuntimeError or ZeroDivisionError inside
    the cache or the model (or, for max_new_tokens=1.5, to a run), a RocketKV call refuses it first, naming it."""
    rocket, _ = llama_pair
    kwargs = {"max_new_tokens": 3, name: value}
    with pytest.raises(ValueError, match=rf"generate\({name}={value!r}\): RocketKV needs a whole number .* >= 1"):
        greedy(rocket, random_ids(1, 12), cache=RocketKVCache(keep_all_config()), **kwargs)
    with pytest.raises(ValueError, match=rf"generate\({name}="):
        greedy(rocket, random_ids(1, 12), **kwargs)  # no cache given: generate() makes one


def test_other_cache_on_rocketkv_model_raises(llama_pair):
    rocket, _ = llama_pair
    with pytest.raises(ValueError, match="RocketKVCache"):
        greedy(rocket, random_ids(1, 30), cache=DynamicCache())


def test_use_cache_false_raises(llama_pair):
    rocket, _ = llama_pair
    with pytest.raises(ValueError, match="use_cache"):
        greedy(rocket, random_ids(1, 30), use_cache=False)


@pytest.mark.parametrize("implementation", ["static", "dynamic", "offloaded"])
def test_cache_implementation_with_rocketkv_raises(llama_pair, implementation):
    rocket, _ = llama_pair
    with pytest.raises(ValueError, match="cache_implementation"):
        greedy(rocket, random_ids(1, 30), cache_implementation=implementation)
    with pytest.raises(ValueError, match="cache_implementation"):
        greedy(rocket, random_ids(1, 30), cache_implementation=implementation,
               cache=RocketKVCache(compressing_config()))


def test_assisted_decoding_not_implemented(llama_pair):
    rocket, _ = llama_pair
    assistant, _ = make_models("llama", seed=3)
    assistant.set_attn_implementation("sdpa")
    ids = random_ids(1, 40)
    with pytest.raises(NotImplementedError, match="assisted"):
        greedy(rocket, ids, cache=RocketKVCache(compressing_config()), prompt_lookup_num_tokens=3)
    with pytest.raises(NotImplementedError, match="assisted"):
        greedy(rocket, ids, cache=RocketKVCache(compressing_config()), assistant_model=assistant)
    with pytest.raises(NotImplementedError, match="crop"):
        greedy(rocket, ids, prompt_lookup_num_tokens=3)  # automatic cache too


# ------------------------------------------------------------------------------------------ batched turns, mixed paths


def _turn_two_inputs(first_out, first_mask, new_rows):
    """A batched second turn: each row's new tokens left-padded to the longest (padding sits between the turns)."""
    segment, segment_mask = left_pad(new_rows)
    ids = torch.cat([first_out, segment], dim=1)
    ones = torch.ones(first_out.shape[0], first_out.shape[1] - first_mask.shape[1], dtype=first_mask.dtype)
    mask = torch.cat([first_mask, ones, segment_mask], dim=1)
    return ids, mask


@pytest.mark.parametrize("new_lengths", [(9, 3), (2, 14), (1, 6)])  # fewer than, more than, around the window (8)
def test_batched_multi_turn_with_padding_equals_each_row_alone(llama_pair, new_lengths):
    rocket, _ = llama_pair
    config = compressing_config()
    prompts = [random_ids(1, n, seed=n)[0] for n in (44, 31)]
    turn2 = [random_ids(1, n, seed=100 + n)[0] for n in new_lengths]
    ids, mask = left_pad(prompts)
    cache = RocketKVCache(config)
    first = greedy(rocket, ids, attention_mask=mask, cache=cache, max_new_tokens=5)
    ids2, mask2 = _turn_two_inputs(first, mask, turn2)
    second = greedy(rocket, ids2, attention_mask=mask2, cache=cache, max_new_tokens=6)
    for b in range(2):
        alone_cache = RocketKVCache(config)
        alone1 = greedy(rocket, prompts[b][None], cache=alone_cache, max_new_tokens=5)
        alone2 = greedy(rocket, torch.cat([alone1, turn2[b][None]], 1), cache=alone_cache, max_new_tokens=6)
        assert torch.equal(second[b, ids2.shape[1] :], alone2[0, -6:]), f"row {b}"
        kept = cache.kept_positions(0)[b, 0, : cache.layers[0].lengths[b]]
        pad_columns = set(range(first.shape[1], first.shape[1] + max(new_lengths) - new_lengths[b]))
        assert not pad_columns & set(kept.tolist()), f"row {b} stored a padding column"


def test_chunked_prefill_then_one_token_then_next_turn(llama_pair):
    """max_new_tokens=1 means no decode step: the ids a later turn must start with come from the prefill itself."""
    rocket, _ = llama_pair
    config = compressing_config()
    ids = random_ids(1, 56)
    follow = random_ids(1, 10, seed=4)
    results = []
    for chunk in (16, None):
        cache = RocketKVCache(config)
        out = greedy(rocket, ids, cache=cache, prefill_chunk_size=chunk, max_new_tokens=1)
        results.append(greedy(rocket, torch.cat([out, follow], 1), cache=cache, max_new_tokens=4))
    assert torch.equal(results[0], results[1])


def test_streaming_cache_keeps_its_policy_with_row_group_prefill(llama_pair):
    """Row-group prefill builds its parts with the cache's own policy (plain RocketKVCache parts would silently turn
    StreamingLLM into SnapKV)."""
    from hf_rocketkv.eval.streaming import StreamingCache

    rocket, _ = llama_pair
    rows = [random_ids(1, n, seed=n)[0] for n in (50, 41, 20)]
    ids, mask = left_pad(rows)
    budget, sinks = 24, 4
    for rows_per_group in (None, 1, 2):
        cache = StreamingCache(compressing_config(prefill_batch_size=rows_per_group), sink_tokens=sinks)
        greedy(rocket, ids, attention_mask=mask, cache=cache, max_new_tokens=1)
        for b, row in enumerate(rows):
            pad = ids.shape[1] - len(row)
            n = len(row)
            expected = list(range(pad, pad + n)) if n <= budget else (
                list(range(pad, pad + sinks)) + list(range(pad + n - (budget - sinks), pad + n))
            )
            for layer_idx in range(rocket.config.num_hidden_layers):
                kept = cache.kept_positions(layer_idx)[b, :, : len(expected)]
                assert kept.tolist() == [expected] * kept.shape[0], f"{rows_per_group=} row {b}"


def test_enable_leaves_a_model_sharing_the_config_on_its_own_attention():
    """transformers hands one config object to every model built from it; enable() copies it first, so a dense model
    built from the same config keeps its attention, its config and its tokens."""
    from transformers import LlamaForCausalLM

    from tests.support.tiny_models import tiny_config

    shared = tiny_config("llama")
    shared._attn_implementation = "sdpa"
    torch.manual_seed(0)
    dense = LlamaForCausalLM(shared).eval()
    rocket = LlamaForCausalLM(shared).eval()
    rocket.load_state_dict(dense.state_dict())
    assert dense.config is rocket.config is shared  # what transformers does: the premise of the test
    ids = torch.randint(3, shared.vocab_size, (1, 40), generator=torch.Generator().manual_seed(1))
    before = greedy(dense, ids, max_new_tokens=6)
    hf_rocketkv.enable(rocket, compressing_config())
    assert rocket.config is not shared and rocket.config._attn_implementation == "rocketkv"
    assert dense.config is shared and shared._attn_implementation == "sdpa"
    assert not hasattr(shared, "rocketkv")  # the RocketKV config went to the copy only
    # the switched model's attention modules read the copy (attention dispatch reads its module's config)
    attention = [m for m in rocket.modules() if type(m).__name__ == "LlamaAttention"]
    assert attention and all(m.config is rocket.config for m in attention)
    assert all(m.config is shared for m in dense.modules() if type(m).__name__ == "LlamaAttention")
    assert torch.equal(greedy(dense, ids, max_new_tokens=6), before)
    assert hf_rocketkv.get_config(rocket) == compressing_config()
