"""fp8 (e4m3) pool pages for models with sliding-window layers (gpt-oss, Gemma 3: tiny random configs, fp32, CPU):
the full-attention layers' pages in fp8, the sliding layers' slab in the model's dtype.

Oracles, none of them the code under test:
- transformers' own run (eager attention, ``DynamicCache`` with its sliding-window layers) over the fp8 run's tokens:
  the sliding layers before the first full-attention layer hold, in the pool's slab, exactly its last window of K/V
  (no quantization; later sliding layers see the full-attention layers' fp8 reads);
- the same request on a float32 pool (exact pages), whose compacted full-attention pages, quantized page by page with
  ``memory/fp8.py``'s reference, must be exactly the fp8 run's pages read back (the rule of a Llama-style fp8 pool);
- the float32 pool's logits: the prefill's equal exactly (nothing read from fp8 yet), the decode steps' within the 5%
  (relative L2) that tests/cache/test_fp8_pool.py states for fp8 pages, greedy tokens equal (Gemma 3, whose fp8 error
  stays small on this prompt); and, both models, the first decode step within 5% of a float32 run whose full-attention
  pages an independent function (the reference quantize / dequantize) rounded before the step;
- the batching engine on an fp8 hybrid pool: each request's tokens those of the request alone (model.generate with a
  RocketKVCache on its own fp8 pool); every page and slot back.
"""

from __future__ import annotations

import copy

import pytest
import torch

from hf_rocketkv import RocketKVCache, SlidingWindowLayer
from hf_rocketkv.memory.fp8 import FP8_DTYPE, dequantize_fp8, quantize_pages
from hf_rocketkv.serving import SamplingParams, generate_batch
from tests.support.fp8_pages import relative_error, round_trip
from tests.support.hybrid_models import WINDOW, make_hybrid_models
from tests.support.tiny_models import compressing_config, cpu_pool, greedy, random_ids
from hf_rocketkv.integration.compat import cache_kwargs, output_cache

ARCHS = ["gpt_oss", "gemma3"]
PAGE = 8  # pool page size (tokens)
CFG = compressing_config(kt_cache_dtype="float32")


@pytest.fixture(scope="module", params=ARCHS)
def pair(request):
    return request.param, *make_hybrid_models(request.param)


def fp8_pool(model, granularity="page", **kwargs):
    return cpu_pool(model, CFG, 4 << 20, PAGE, FP8_DTYPE, scale_granularity=granularity, **kwargs)


def all_back(pool) -> bool:
    return pool.free_pages() == pool.total_pages() and pool.free_slots() == pool.total_slots()


def run(model, ids, pool, new):
    cache = RocketKVCache(CFG, pool=pool)
    out = greedy(model, ids, max_new_tokens=new, cache=cache, output_logits=True,
                 return_dict_in_generate=True)
    return out, cache


def first_step_logits(model, ids, pool, round_pages: str | None = None, config=CFG) -> torch.Tensor:
    """The first decode step's logits of ``ids`` on a cache of ``pool`` (closed after, every page and slot back);
    ``round_pages`` (a scale granularity): the full-attention pages are rounded first, after the prefill, by the
    reference quantize / dequantize (``memory/fp8.py``), page by page."""
    cache = RocketKVCache(config, pool=pool)
    with torch.no_grad():
        token = model(ids, **cache_kwargs(cache)).logits[:, -1].argmax(-1, keepdim=True)
        for layer_idx in pool.hybrid.global_layers if round_pages else ():
            storage = pool.layer(layer_idx)
            for pages in (storage.k, storage.v):
                pages.copy_(dequantize_fp8(*quantize_pages(pages, round_pages), pages.dtype))
        logits = model(token, **cache_kwargs(cache)).logits[:, -1]
    cache.close()
    assert all_back(pool)
    return logits


def test_the_slab_holds_the_models_kv_unquantized(pair):
    _, rocket, oracle = pair
    pool = fp8_pool(rocket)
    assert pool.sliding_dtype == torch.float32 and pool.dtype == FP8_DTYPE
    ids = random_ids(1, 40, seed=3)
    out, cache = run(rocket, ids, pool, new=12)
    with torch.no_grad():  # transformers' own cache over the same tokens (the last one is not in any cache yet)
        reference = output_cache(oracle(out.sequences[:, :-1], use_cache=True))
    first_global = rocket.config.layer_types.index("full_attention")
    for i, layer in enumerate(cache.layers):
        if not isinstance(layer, SlidingWindowLayer):
            assert layer.store.fp8 and layer.store.k.dtype == FP8_DTYPE  # the full-attention layers: fp8 pages
            continue
        assert layer.ring and layer.keys.dtype == torch.float32
        slab_k, _ = pool.sliding_slab(i, layer.keys)
        assert slab_k.dtype == torch.float32 and layer.keys.data_ptr() == slab_k[cache.pages._slot_ids[1][0]].data_ptr()
        if i >= first_global:
            continue  # its input went through fp8 reads: compared with the float32 pool below
        stored = layer.stored
        assert stored == WINDOW - 1
        order = torch.remainder(torch.arange(stored) + layer.seen_tokens - stored, WINDOW)
        ref = reference.layers[i]
        # (the oracle computes the whole sequence in one forward: equal up to the matmuls' rounding)
        torch.testing.assert_close(layer.keys[:, :, order], ref.keys[:, :, -stored:], rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(layer.values[:, :, order], ref.values[:, :, -stored:], rtol=1e-5, atol=1e-5)
        assert layer.memory_bytes() == 2 * layer.num_kv_heads * WINDOW * layer.head_dim * 4
    cache.close()
    assert all_back(pool)


@pytest.mark.parametrize("granularity", ["page", "head"])
def test_full_attention_pages_are_the_exact_pages_quantized(pair, granularity):
    """After stage 1: the same kept tokens as on a float32 pool, every full-attention page the float32 pool's page
    quantized by the reference (bit for bit once read back), the sliding rings equal."""
    rocket = pair[1]
    ids = random_ids(1, 60, seed=5)
    exact_pool, pool = cpu_pool(rocket, CFG, 4 << 20, PAGE), fp8_pool(rocket, granularity)
    _, exact = run(rocket, ids, exact_pool, new=1)
    _, fp8 = run(rocket, ids, pool, new=1)
    for ref, layer in zip(exact.layers, fp8.layers):
        if isinstance(layer, SlidingWindowLayer):
            assert torch.equal(layer._keys, ref._keys)  # not decoding yet: the ordered prompt columns
            continue
        assert layer.compressed and layer.store.fp8
        assert torch.equal(layer.positions, ref.positions) and torch.equal(layer.lengths, ref.lengths)
        ref_keys, ref_values = ref.store.gather()
        keys, values = layer.store.gather()
        assert keys.dtype == torch.float32
        torch.testing.assert_close(keys, round_trip(ref_keys, granularity, PAGE), rtol=0, atol=0)
        torch.testing.assert_close(values, round_trip(ref_values, granularity, PAGE), rtol=0, atol=0)
    fp8.close()
    exact.close()
    assert all_back(pool) and all_back(exact_pool)


def test_decode_logits_stay_within_the_fp8_rounding(pair):
    """Prefill logits equal the float32 pool's exactly (nothing read from fp8 yet); Gemma 3's decode logits stay
    within 5% of them and its greedy tokens are equal (gpt-oss' tiny random experts amplify the rounding: the next
    test bounds it against pages quantized by the reference)."""
    arch, rocket, _ = pair
    ids = random_ids(1, 40, seed=3)
    exact_pool, pool = cpu_pool(rocket, CFG, 4 << 20, PAGE), fp8_pool(rocket)
    ref_out, ref = run(rocket, ids, exact_pool, new=12)
    out, fp8 = run(rocket, ids, pool, new=12)
    torch.testing.assert_close(out.logits[0], ref_out.logits[0], rtol=0, atol=0)
    if arch == "gemma3":
        assert torch.equal(out.sequences, ref_out.sequences)
        for a, b in zip(out.logits[1:], ref_out.logits[1:]):
            assert relative_error(a, b) < 0.05
    fp8.close()
    ref.close()
    assert all_back(pool)


@pytest.mark.parametrize("granularity", ["page", "head"])
def test_the_first_decode_step_reads_the_pages_quantized_by_the_reference(pair, granularity):
    """The same tokens fed to three caches: float32 pages; float32 pages that an independent function (the reference
    quantize / dequantize, page by page) rounds before the step; fp8 pages. The first decode step reads the compacted
    pages (the rounded ones: the test above) and its own token, so the fp8 logits are within 5% of the rounded pages'
    and less than half as far from them as from the exact pages' (a read of anything else, e.g. the sliding layers
    quantized too or the scales not applied, leaves that margin)."""
    rocket = pair[1]
    ids = random_ids(1, 40, seed=3)
    exact = first_step_logits(rocket, ids, cpu_pool(rocket, CFG, 4 << 20, PAGE))
    rounded = first_step_logits(rocket, ids, cpu_pool(rocket, CFG, 4 << 20, PAGE), round_pages=granularity)
    fp8 = first_step_logits(rocket, ids, fp8_pool(rocket, granularity))
    assert relative_error(fp8, rounded) < 0.05
    assert relative_error(fp8, rounded) < relative_error(fp8, exact) / 2, (relative_error(fp8, rounded),
                                                                          relative_error(fp8, exact))


def test_the_batching_engine_gives_each_request_its_tokens_alone(pair):
    arch, rocket, _ = pair
    pool = fp8_pool(rocket, sliding_slots=4)
    prompts = [random_ids(1, n, seed=n)[0].tolist() for n in (37, 21)]
    results = generate_batch(rocket, prompts, config=CFG, pool=pool, sampling=SamplingParams.greedy(8, ignore_eos=True))
    for prompt, result in zip(prompts, results):
        alone_pool = fp8_pool(rocket)
        cache = RocketKVCache(CFG, pool=alone_pool)
        alone = greedy(rocket, torch.tensor([prompt]), max_new_tokens=8, cache=cache)
        assert list(result.token_ids) == alone[0, len(prompt):].tolist(), arch
        cache.close()
    assert all_back(pool)


def test_a_slab_of_another_dtype_than_the_models_keys_is_refused(pair):
    """A pool built from a config naming bfloat16 for a model run in float32: fp8 pages would take the keys, the slab
    (bfloat16) would not hold them as they are: refused at the first decode step, naming both ways out."""
    rocket = pair[1]
    config = copy.deepcopy(rocket.config)
    config.dtype = torch.bfloat16
    pool = fp8_pool(config)
    assert pool.sliding_dtype == torch.bfloat16
    with pytest.raises(ValueError, match=r"slab: torch.bfloat16.*keys are torch.float32.*or from the model"):
        greedy(rocket, random_ids(1, 12), cache=RocketKVCache(CFG, pool=pool), max_new_tokens=3)


def test_a_prefix_hit_on_fp8_pages_replays_the_windows(pair):
    """A prefix hit on an fp8 hybrid pool: the full-attention layers read the hit's pages dequantized, the sliding
    layers' windows are replayed (``replay_tokens``). Oracle: the same prompt cold on a fresh fp8 pool (its prefill
    attends the exact prefix): the hit's first-step logits within fp8 rounding of it (10% relative L2), every page and
    slot back."""
    arch, rocket, _ = pair
    first = random_ids(1, 90, seed=7)
    second = torch.cat([first[:, :80], random_ids(1, 12, seed=8)], dim=1)
    pool = fp8_pool(rocket)
    run(rocket, first, pool, 2)[1].close()
    hot, hot_cache = run(rocket, second, pool, 1)
    cold, cold_cache = run(rocket, second, fp8_pool(rocket), 1)
    assert hot_cache.stats.reused_tokens == 80, arch  # whole pages of the shared 80 tokens
    assert hot_cache.stats.computed_tokens < cold_cache.stats.computed_tokens, arch
    # measured 0.044 (gpt-oss) and 0.014 (Gemma 3); a hit that read wrong pages or windows is off by far more
    assert relative_error(hot.logits[0], cold.logits[0]) < 0.1, arch
    hot_cache.close()
    cold_cache.close()
    assert all_back(pool)
