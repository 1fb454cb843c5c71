"""Hybrid models (gpt-oss, Gemma 3: sliding-window + full-attention layers) on a KVBlockPool on a GPU, Triton backend:
the paths tests/integration/test_hybrid_fp8_pool.py and test_hybrid_offload_and_files.py check on the CPU.

- fp8 (e4m3) pages: each full-attention page is the float32 pool's page quantized by the reference
  (``memory/fp8.py``), bit for bit; the sliding slab holds transformers' own cache's K/V unquantized; the first decode
  step is within 5% of a float32 run whose pages the reference rounded; a prefix hit on fp8 pages is within 10% of a
  cold run, and bit-identical to it after a round trip through host memory (the same hit from the device pages);
- host offload: a prefix evicted to pinned host memory comes back byte for byte (the free device pages scrambled
  meanwhile) and its hit equals a cold run on a fresh pool (greedy tokens equal, fp32 logits close);
- prefix files (saved from the device or from the host): loaded into a fresh pool, the pages byte for byte, the hit
  equals a cold run.

The CPU tests' tiny random configs (tests/support/hybrid_models.py: 4 layers, window 8), sizes and helpers, on CUDA.
"""

from __future__ import annotations

import pytest
import torch

from hf_rocketkv import RocketKVCache, SlidingWindowLayer
from hf_rocketkv.memory.fp8 import FP8_DTYPE
from tests.integration.test_hybrid_fp8_pool import first_step_logits
from tests.integration.test_hybrid_offload_and_files import (
    HIT,
    HOST,
    assert_pages_hold,
    cold_run,
    global_layers,
    oracle_page_bytes,
    snapshot,
)
from tests.integration.test_hybrid_prefix_reuse import (
    PAGE,
    all_back,
    assert_same,
    run,
    shared,
)
from tests.support.fp8_pages import relative_error, round_trip
from tests.support.hybrid_models import WINDOW
from tests.support.tiny_models import compressing_config, cpu_pool, random_ids

from .gpu_models import CUDA, greedy, hybrid_models_on_cuda
from .test_hybrid_pool_gpu import ARCHS
from hf_rocketkv.integration.compat import output_cache

CONFIG = compressing_config(backend="triton")  # the CPU offload / file tests' config
FP8_CONFIG = compressing_config(kt_cache_dtype="float32", backend="triton")  # the CPU fp8 tests' config


@pytest.fixture(scope="module", params=ARCHS)
def pair(request):
    return (request.param, *hybrid_models_on_cuda(request.param))


def cuda_pool(model, config=CONFIG, dtype=torch.float32, **kwargs):
    """A pool on the GPU of 4 MiB of ``dtype`` pages of PAGE tokens (the CPU tests' pool)."""
    return cpu_pool(model, config, page_size=PAGE, dtype=dtype, device=CUDA, **kwargs)


def cuda_ids(length: int, seed: int) -> torch.Tensor:
    return random_ids(1, length, seed=seed).to(CUDA)


def cuda_shared(first_len: int, shared_len: int, second_len: int):
    """Two prompts on the GPU whose first ``shared_len`` tokens are equal."""
    return tuple(ids.to(CUDA) for ids in shared(first_len, shared_len, second_len))


# ------------------------------------------------------------------------------------------------ fp8 pages
@pytest.mark.parametrize("granularity", ["page", "head"])
def test_fp8_full_attention_pages_are_the_float32_pages_quantized_by_the_reference(pair, granularity):
    arch, rocket, _ = pair
    ids = cuda_ids(60, seed=5)
    exact_pool = cuda_pool(rocket, FP8_CONFIG)
    pool = cuda_pool(rocket, FP8_CONFIG, FP8_DTYPE, scale_granularity=granularity)
    assert pool.dtype == FP8_DTYPE and pool.sliding_dtype == torch.float32
    exact, fp8 = RocketKVCache(FP8_CONFIG, pool=exact_pool), RocketKVCache(FP8_CONFIG, pool=pool)
    greedy(rocket, ids, exact, 1, compiled=False)  # the prefill (stage 1 compacts the pages) and no decode step
    greedy(rocket, ids, fp8, 1, compiled=False)
    for i, (ref, layer) in enumerate(zip(exact.layers, fp8.layers)):
        if isinstance(layer, SlidingWindowLayer):
            assert layer._keys.dtype == torch.float32 and torch.equal(layer._keys, ref._keys), f"{arch} layer {i}"
            continue
        assert layer.compressed and layer.store.fp8 and layer.store.k.dtype == FP8_DTYPE
        assert layer.store.k.is_cuda
        assert torch.equal(layer.positions, ref.positions) and torch.equal(layer.lengths, ref.lengths)
        for got, want in zip(layer.store.gather(), ref.store.gather()):  # K, V read back in float32
            assert got.dtype == torch.float32
            assert torch.equal(got, round_trip(want, granularity, PAGE)), f"{arch} layer {i}"
    fp8.close()
    exact.close()
    assert all_back(pool) and all_back(exact_pool)


def test_fp8_pool_sliding_slab_holds_transformers_kv_unquantized(pair):
    """The sliding layers before the first full-attention one (their input reads no fp8 page) hold in the slab, in
    float32, their last window of transformers' own cache over the same tokens."""
    arch, rocket, oracle = pair
    pool = cuda_pool(rocket, FP8_CONFIG, FP8_DTYPE)
    ids = cuda_ids(40, seed=3)
    cache = RocketKVCache(FP8_CONFIG, pool=pool)
    tokens = greedy(rocket, ids, cache, 12, compiled=False)
    with torch.no_grad():  # the last token is in no cache yet
        reference = output_cache(oracle(torch.cat([ids, tokens[:, :-1]], dim=1), use_cache=True))
    first_global = rocket.config.layer_types.index("full_attention")
    assert first_global > 0
    for i in range(first_global):
        layer = cache.layers[i]
        assert isinstance(layer, SlidingWindowLayer) and layer.stored == WINDOW - 1
        slab_k, _ = pool.sliding_slab(i, layer.keys)
        assert slab_k.dtype == torch.float32 and slab_k.is_cuda
        assert layer.keys.untyped_storage().data_ptr() == slab_k.untyped_storage().data_ptr()  # a row of the slab
        order = torch.remainder(torch.arange(layer.stored, device=CUDA) + layer.seen_tokens - layer.stored, WINDOW)
        ref = reference.layers[i]
        # one forward over the whole sequence against prefill + decode steps: other GEMM shapes, fp32 rounding
        torch.testing.assert_close(layer.keys[:, :, order], ref.keys[:, :, -layer.stored:], rtol=1e-4, atol=1e-4)
        torch.testing.assert_close(layer.values[:, :, order], ref.values[:, :, -layer.stored:], rtol=1e-4, atol=1e-4)
    cache.close()
    assert all_back(pool), arch


@pytest.mark.parametrize("granularity", ["page", "head"])
def test_fp8_first_decode_step_reads_the_pages_rounded_by_the_reference(pair, granularity):
    """The Triton decode on fp8 pages against float32 pages that the reference quantize / dequantize rounded after
    the prefill: within 5%, and less than half as far as from the exact float32 pages (a read that skips the scales,
    or quantizes the sliding layers too, leaves that margin)."""
    arch, rocket, _ = pair
    ids = cuda_ids(40, seed=3)
    # every kept page attended: stage 2's choice among near-tied pages of a random model could otherwise differ
    # between the runs (GPU rounding) and move the logits far more than fp8 does; stage 1 still evicts
    config = FP8_CONFIG.replace(topk=4096)
    exact = first_step_logits(rocket, ids, cuda_pool(rocket, config), config=config)
    rounded = first_step_logits(rocket, ids, cuda_pool(rocket, config), granularity, config)
    fp8_pool = cuda_pool(rocket, config, FP8_DTYPE, scale_granularity=granularity)
    fp8 = first_step_logits(rocket, ids, fp8_pool, config=config)
    near, far = relative_error(fp8, rounded), relative_error(fp8, exact)
    assert near < 0.05 and near < far / 2, (arch, near, far)


def test_an_fp8_prefix_hit_through_host_memory_is_the_device_hit(pair):
    """The same hit on fp8 pages from the device and after ``evict()`` moved them (with their scales) to pinned host
    memory: tokens and logits bit-identical; both within fp8 rounding (10%) of the prompt run cold."""
    arch, rocket, _ = pair
    first = cuda_ids(90, seed=7)  # the CPU test's prompts: 80 shared tokens, 10 pages
    second = torch.cat([first[:, :80], cuda_ids(12, seed=8)], dim=1)

    def hit(host: bool):
        pool = cuda_pool(rocket, FP8_CONFIG, FP8_DTYPE, host_bytes=HOST if host else 0)
        run(rocket, FP8_CONFIG, pool, first)
        if host:
            assert pool.evict() > 0 and pool.cached_pages() == 0
            pool.synchronize()
            assert all(info.tier == "host" for info in pool.resident_prefix(second[0]))
        out = run(rocket, FP8_CONFIG, pool, second)
        assert all_back(pool)
        return out

    device, onloaded = hit(host=False), hit(host=True)
    cold = run(rocket, FP8_CONFIG, cuda_pool(rocket, FP8_CONFIG, FP8_DTYPE), second)
    assert device[2].reused_tokens == onloaded[2].reused_tokens == 80 and cold[2].reused_tokens == 0, arch
    assert device[2].onloaded_bytes == 0 < onloaded[2].onloaded_bytes, arch
    assert torch.equal(onloaded[0], device[0]) and torch.equal(onloaded[1], device[1]), arch
    assert relative_error(device[1][0], cold[1][0]) < 0.1, arch  # the CPU test measured 0.044 and 0.014


# ------------------------------------------------------------------------------------------------ host offload
def test_a_prefix_onloaded_from_pinned_host_memory_equals_a_cold_run(pair):
    """The first request's pages go to the host; every free device page (K, V and KT) is then scrambled, so an onload
    that copies nothing fails; the hit onloads the prefix: its pages hold what they held, byte for byte, and it
    generates the tokens and logits of the prompt run cold on a fresh pool."""
    arch, rocket, _ = pair
    first, second = cuda_shared(70, 59, 72)
    pool = cuda_pool(rocket, host_bytes=HOST)
    page = oracle_page_bytes(len(global_layers(pool)), CONFIG)
    run(rocket, CONFIG, pool, first)
    before = snapshot(pool, second[0])
    assert len(before) == HIT // PAGE
    cached = pool.cached_pages()
    assert pool.evict() == cached > 0 and pool.stats().offloaded_bytes == cached * page
    pool.synchronize()
    assert all(info.tier == "host" for info in pool.resident_prefix(second[0]))
    generator = torch.Generator(CUDA).manual_seed(0)
    for i in global_layers(pool):
        for tensor in pool.layer(i).tensors().values():
            tensor.normal_(generator=generator)

    hot = run(rocket, CONFIG, pool, second)
    assert hot[2].reused_tokens == HIT and hot[2].onloaded_bytes == HIT // PAGE * page, arch
    hit_pages = pool.resident_prefix(second[0])[: HIT // PAGE]
    assert all(info.tier == "device" for info in hit_pages)
    assert_pages_hold(pool, [info.index for info in hit_pages], before)
    assert_same(hot, cold_run(rocket, CONFIG, second, device=CUDA))
    assert all_back(pool)
    pool.close()


# ------------------------------------------------------------------------------------------------ prefix files
@pytest.mark.parametrize("from_host", [False, True], ids=["device", "host"])
def test_a_prefix_file_loaded_on_the_gpu_serves_a_hit_equal_to_a_cold_run(pair, tmp_path, from_host):
    arch, rocket, _ = pair
    first, second = cuda_shared(70, 59, 72)
    pool = cuda_pool(rocket, host_bytes=HOST if from_host else 0)
    run(rocket, CONFIG, pool, first)
    before = snapshot(pool, second[0])
    if from_host:  # saved from the pinned host slots
        assert pool.evict() > 0 and pool.cached_pages() == 0
    path = tmp_path / f"{arch}.safetensors"
    assert pool.save_prefix(path, second[0]) == HIT

    fresh = cuda_pool(rocket)  # nothing stored yet: load_prefix allocates its pages on the pool's device
    loaded = fresh.load_prefix(path)
    assert (loaded.num_tokens, loaded.pages_loaded, loaded.pages_already_resident) == (HIT, HIT // PAGE, 0)
    assert all(fresh.layer(i).k.is_cuda for i in global_layers(fresh))
    assert_pages_hold(fresh, [info.index for info in fresh.resident_prefix(second[0])], before)
    hot = run(rocket, CONFIG, fresh, second)
    assert hot[2].reused_tokens == HIT and hot[2].onloaded_bytes == 0, arch
    assert_same(hot, cold_run(rocket, CONFIG, second, device=CUDA))
    assert all_back(fresh) and all_back(pool)
    pool.close()
