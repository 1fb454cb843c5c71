"""RocketKVCache on a KVBlockPool of fp8 (e4m3) pages (cache/pool_pages.py over memory/fp8.py): half the bytes per
page, read back in the model's dtype.

Oracles, none of them the code under test:
- the same request on a float32 pool (the exact pages), whose compacted pages, quantized page by page with
  ``memory/fp8.py``'s reference (``quantize_pages``), must be exactly the fp8 run's pages read back;
- ``memory/fp8.py``'s error bound of one round trip (``|x| * 2**-4 + s * 2**-10``), for tokens the decode appends
  (re-quantizing a page when a larger token arrives can round a stored token a second time: twice the bound);
- the float32 pool's logits: the prefill's (no fp8 read yet) equal exactly, the first decode step's (attention over
  fp8 pages) within a tolerance that a read without the scales exceeds by orders of magnitude.

A tiny random Llama in float32 on CPU, ``backend="torch"``; the Triton kernels' fp8 reads and writes are checked
against their PyTorch twins in tests/kernels/test_fp8_pages.py and tests/kernels/test_fp8_append.py.
"""

from __future__ import annotations

import pytest
import torch

from hf_rocketkv import KVBlockPool, RocketKVCache
from hf_rocketkv.memory.fp8 import FP8_DTYPE
from tests.support.fp8_pages import relative_error, round_trip
from tests.support.tiny_models import (
    compressing_config,
    cpu_pool,
    greedy,
    left_pad,
    make_models,
    random_ids,
)

PAGE = 8  # pool page size (tokens); the KT page is the config's 4
CFG = compressing_config(kt_cache_dtype="float32")  # budget 24, window 8, KT page 4, topk 3


def make_pool(model, cfg, dtype, granularity="page", max_bytes=4 << 20, **kwargs) -> KVBlockPool:
    """A pool of ``dtype`` pages (fp8: one scale per ``granularity``), keyed by the model's config."""
    return cpu_pool(model.config, cfg, max_bytes, PAGE, dtype, scale_granularity=granularity, **kwargs)


def run(model, ids, cfg, pool, new=4, mask=None, **cache_kwargs):
    cache = RocketKVCache(cfg, pool=pool, **cache_kwargs)
    out = greedy(model, ids, attention_mask=mask, max_new_tokens=new, cache=cache,
                 output_logits=True, return_dict_in_generate=True)
    return out, cache



@pytest.mark.parametrize("granularity", ["page", "head"])
@pytest.mark.parametrize("prompt_lens", [[60], [60, 37]])
def test_compacted_fp8_pages_are_the_exact_pages_quantized(model, granularity, prompt_lens):
    """After stage 1 (prefill only): the same kept tokens as on a float32 pool, and every page of the view is the
    float32 pool's page quantized by the reference, bit for bit once read back; half the page bytes."""
    ids, mask = left_pad([random_ids(1, n, seed=n)[0] for n in prompt_lens])
    exact_pool, fp8_pool = make_pool(model, CFG, torch.float32), make_pool(model, CFG, FP8_DTYPE, granularity)
    _, exact = run(model, ids, CFG, exact_pool, new=1, mask=mask)
    _, fp8 = run(model, ids, CFG, fp8_pool, new=1, mask=mask)
    for ref, layer in zip(exact.layers, fp8.layers):
        assert layer.compressed and layer.store.fp8 and layer.store.k.dtype == FP8_DTYPE
        assert torch.equal(layer.positions, ref.positions) and torch.equal(layer.lengths, ref.lengths)
        ref_keys, ref_values = ref.store.gather()
        keys, values = layer.store.gather()
        assert keys.dtype == torch.float32  # read back in the model's dtype
        torch.testing.assert_close(keys, round_trip(ref_keys, granularity, PAGE), rtol=0, atol=0)
        torch.testing.assert_close(values, round_trip(ref_values, granularity, PAGE), rtol=0, atol=0)
        torch.testing.assert_close(layer.store.gather_kt(), ref.store.gather_kt(), rtol=0, atol=0)  # KT: exact keys
    per_page = lambda pool: pool.layer(0).k[0].numel() * pool.layer(0).k.element_size()  # noqa: E731
    assert per_page(fp8_pool) * 4 == per_page(exact_pool)  # e4m3 against float32


@pytest.mark.parametrize("granularity", ["page", "head"])
def test_decode_reads_fp8_pages_within_the_rounding_of_their_scales(model, granularity):
    """Prefill logits equal the float32 pool's exactly (nothing read from fp8 yet); the decode steps' logits stay
    within 5% (relative L2) of them, while reading the pages without their scales (bytes taken as values) is off by
    far more; the appended tokens of layer 0 (whose keys do not depend on the cache) are within twice the round trip
    bound of the exact ones; every page goes back to the pool."""
    ids = random_ids(1, 61, seed=5)
    exact_pool, fp8_pool = make_pool(model, CFG, torch.float32), make_pool(model, CFG, FP8_DTYPE, granularity)
    ref_out, ref = run(model, ids, CFG, exact_pool, new=6)
    out, fp8 = run(model, ids, CFG, fp8_pool, new=6)
    torch.testing.assert_close(out.logits[0], ref_out.logits[0], rtol=0, atol=0)
    agree = 0
    for step, (a, b) in enumerate(zip(out.logits[1:], ref_out.logits[1:]), start=1):
        if not torch.equal(out.sequences[0, : 61 + step], ref_out.sequences[0, : 61 + step]):
            break  # the runs chose different tokens: later logits answer different inputs
        assert relative_error(a, b) < 0.05, (step, relative_error(a, b))
        agree += 1
    assert agree >= 1
    # layer 0: the same inputs in both runs until the tokens differ, so its stored decode tokens are comparable
    layer, exact_layer = fp8.layers[0], ref.layers[0]
    first = int(exact_layer.lengths) - 5  # the generated slots follow the kept prompt tokens
    keys, _ = layer.store.gather()
    exact_keys, _ = exact_layer.store.gather()
    generated = slice(first, first + agree)
    scale = layer.store.k_scale
    bound = exact_keys[:, :, generated].abs() * 2**-4 + float(scale.max()) * 2**-10
    assert ((keys[:, :, generated] - exact_keys[:, :, generated]).abs() <= 2 * bound).all()
    # the scales are needed: the raw e4m3 values read as if unscaled are nowhere near
    unscaled = layer.store.k[layer.store.table[0, :1].long()].float()
    assert relative_error(unscaled[0].transpose(0, 1).reshape(-1), keys[0, :, :PAGE].transpose(0, 1).reshape(-1)) > 0.5
    fp8.close()  # (the generate outputs hold their caches)
    assert fp8_pool.free_pages() == fp8_pool.total_pages()


def test_fp8_pool_serves_padded_batches_beams_and_decode_compression(model):
    """The write paths besides stage 1 and the append (beam reorder, decode-time compression, growth past the
    admitted size) run on fp8 pages: the prefill logits equal the float32 pool's, the first decode step's are close,
    and no page leaks."""
    ids, mask = left_pad([random_ids(1, n, seed=n)[0] for n in (50, 33)])
    cfgs = {
        "beams": (CFG, dict(num_beams=2, num_return_sequences=1)),
        "compression": (CFG.replace(decode_budget=8, decode_interval=4, decode_window=2, decode_kernel_size=1), {}),
    }
    for name, (cfg, extra) in cfgs.items():
        pools = [make_pool(model, cfg, torch.float32), make_pool(model, cfg, FP8_DTYPE)]
        outs = []
        for pool in pools:
            cache = RocketKVCache(cfg, pool=pool)
            outs.append(greedy(model, ids, attention_mask=mask, max_new_tokens=10, cache=cache,
                               output_logits=True, return_dict_in_generate=True, **extra))
            cache.close()
        torch.testing.assert_close(outs[1].logits[0], outs[0].logits[0], rtol=0, atol=0, msg=name)
        if torch.equal(outs[1].sequences[:, : ids.shape[1] + 1], outs[0].sequences[:, : ids.shape[1] + 1]):
            assert relative_error(outs[1].logits[1], outs[0].logits[1]) < 0.05, name
        for pool in pools:
            assert pool.free_pages() == pool.total_pages(), name


def test_prefix_hit_on_fp8_pages(model):
    """A second request sharing a 48-token prefix reads it from fp8 prompt pages (dequantized into its dense store):
    it reuses them, its prefill logits are those of a cold run on float32 pages up to the prefix's rounding, and every
    page comes back."""
    prefix = random_ids(1, 48, seed=11)
    second = torch.cat([prefix, random_ids(1, 13, seed=12)], dim=1)
    pool, exact_pool = make_pool(model, CFG, FP8_DTYPE), make_pool(model, CFG, torch.float32)
    run(model, torch.cat([prefix, random_ids(1, 9, seed=13)], dim=1), CFG, pool)[1].close()
    out, cache = run(model, second, CFG, pool)
    assert cache.stats.reused_tokens >= 40
    cold, _ = run(model, second, CFG, exact_pool)
    assert relative_error(out.logits[0], cold.logits[0]) < 0.05
    cache.close()
    assert pool.free_pages() == pool.total_pages()


def test_keep_all_history_on_fp8_pages(model):
    """multi_turn="keep_all": the conversation's history lives in fp8 pages (written by the write rule, appended by
    decode); the second turn re-runs stage 1 over it, dequantized, close to the float32 pool's turn."""
    cfg = CFG.replace(multi_turn="keep_all")
    turn1 = random_ids(1, 40, seed=21)
    logits = []
    for dtype in (torch.float32, FP8_DTYPE):
        pool = make_pool(model, cfg, dtype)
        cache = RocketKVCache(cfg, pool=pool)
        first = greedy(model, turn1, max_new_tokens=4, cache=cache)
        ids = torch.cat([first, random_ids(1, 12, seed=22)], dim=1)
        out = greedy(model, ids, max_new_tokens=3, cache=cache, output_logits=True,
                     return_dict_in_generate=True)
        if dtype == FP8_DTYPE:
            assert cache.layers[0].history.store.fp8
        logits.append(out.logits[0])
        cache.close()
        assert pool.free_pages() == pool.total_pages()
    assert relative_error(logits[1], logits[0]) < 0.05


def test_fp8_pool_with_a_bfloat16_model():
    """A bf16 model on an fp8 pool: pages read back in bfloat16, logits close to a bf16 pool's."""
    model, _ = make_models("llama")
    model = model.to(torch.bfloat16)
    ids = random_ids(1, 45, seed=31)
    outs = []
    for dtype in (torch.bfloat16, FP8_DTYPE):
        out, cache = run(model, ids, CFG, make_pool(model, CFG, dtype), new=3)
        outs.append(out)
        assert cache.layers[0].store.gather()[0].dtype == torch.bfloat16
    assert torch.equal(outs[1].logits[0], outs[0].logits[0])
    assert relative_error(outs[1].logits[1].float(), outs[0].logits[1].float()) < 0.05


@pytest.mark.parametrize("granularity", ["page", "head"])
def test_compiled_decode_on_fp8_pages_equals_eager(granularity):
    """generate()'s compiled decode step (dynamo, fullgraph: a host sync or a data-dependent branch in the fp8 append
    would break the graph) gives the eager fp8 run's tokens, and a second request replays the same graph."""
    from torch._dynamo import utils as dynamo_utils

    from tests.support.decode_runners import eager_compile_config

    torch._dynamo.reset()
    model, _ = make_models("llama", num_hidden_layers=1)
    ids, mask = left_pad([random_ids(1, 40, seed=3)[0], random_ids(1, 33, seed=4)[0]])
    # the second request hits the first one's prompt pages: its stage 1 reads the prefix from fp8 pages, so its
    # oracle is the eager run's second request on a pool of its own, not a cold run
    eager_pool = make_pool(model, CFG, FP8_DTYPE, granularity)
    eager = []
    for _ in range(2):
        cache = RocketKVCache(CFG, pool=eager_pool)
        eager.append(greedy(model, ids, attention_mask=mask, max_new_tokens=6, cache=cache,
                            disable_compile=True))
        cache.close()
    pool = make_pool(model, CFG, FP8_DTYPE, granularity)
    dynamo_utils.counters.clear()
    for expected in eager:
        cache = RocketKVCache(CFG.replace(decode_runner="torch_compile"), pool=pool)
        compiled = greedy(model, ids, attention_mask=mask, max_new_tokens=6, cache=cache,
                          compile_config=eager_compile_config())
        assert torch.equal(compiled, expected)
        cache.close()
    assert cache.stats.reused_tokens > 0
    assert dynamo_utils.counters["stats"]["unique_graphs"] == 1, dict(dynamo_utils.counters["stats"])
    assert pool.free_pages() == pool.total_pages()


def test_fp8_pages_with_triton_kernels_need_compute_capability_8_9():
    """e4m3 conversions in the Triton kernels need sm_89+: an older GPU is refused with the ways out; the torch
    backend and the CPU are not concerned."""
    from hf_rocketkv.cache.pool_pages import check_fp8_kernels

    cuda = torch.device("cuda", 0)
    with pytest.raises(ValueError, match=r"compute capability 8.9 or newer .* has 8.0.*backend='torch'"):
        check_fp8_kernels("triton", cuda, capability=(8, 0))
    for backend, device, capability in (("triton", cuda, (9, 0)), ("triton", cuda, (8, 9)), ("torch", cuda, (8, 0)),
                                        ("triton", torch.device("cpu"), None)):
        check_fp8_kernels(backend, device, capability)
