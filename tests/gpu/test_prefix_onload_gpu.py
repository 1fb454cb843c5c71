"""A prefix hit onloaded from host memory computes exactly what the same hit on the device computes, on a GPU.

A cold request fills a KVBlockPool that has host memory; the same 4,096-token prefix with another 128-token tail
then runs once as a device hit, and once more (in a fresh pool) after ``pool.evict()`` moved the prefix pages to the
host (an onload hit). The oracle is the device hit: the onloaded pages are the same bytes, so the greedy tokens and
every step's logits must be bit-identical. Llama-3.1-8B layer shapes (4 layers), random weights, float32 and
bfloat16, Triton backend.
"""

from __future__ import annotations

import pytest
import torch

from hf_rocketkv import KVBlockPool, RocketKVCache, RocketKVConfig

from .gpu_models import CUDA, llama_8b_layers

LAYERS, PREFIX, TAIL, NEW_TOKENS = 4, 4096, 128, 16
GIB = 2**30


def _generate(model, pool, config, ids, new_tokens):
    """Greedy tokens, the stacked per-step logits and the cache's counters of one request served from ``pool``."""
    cache = RocketKVCache(config, pool=pool)
    with torch.no_grad():
        out = model.generate(ids, attention_mask=torch.ones_like(ids), cache=cache,
                             max_new_tokens=new_tokens, do_sample=False, eos_token_id=None, pad_token_id=0,
                             disable_compile=True, output_scores=True, return_dict_in_generate=True)
    stats = cache.stats.as_dict()
    cache.close()
    return out.sequences[0, ids.shape[1]:].tolist(), torch.stack(out.scores).float().cpu(), stats


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["float32", "bfloat16"])
def test_onloaded_prefix_hit_is_bit_identical_to_the_device_hit(dtype):
    model = llama_8b_layers(LAYERS, dtype)
    config = RocketKVConfig(backend="triton")
    g = torch.Generator().manual_seed(0)
    vocab = model.config.vocab_size
    prefix = torch.randint(3, vocab, (1, PREFIX), generator=g)
    tails = [torch.randint(3, vocab, (1, TAIL), generator=g) for _ in range(2)]
    cold = torch.cat([prefix, tails[0]], 1).to(CUDA)
    ids = torch.cat([prefix, tails[1]], 1).to(CUDA)

    def hit(to_host: bool):
        """A fresh pool: the cold request stores the prefix, then ``ids`` hits it (after an evict to host)."""
        pool = KVBlockPool(model.config, max_gpu_bytes=4 * GIB, host_bytes=4 * GIB, page_size=16, dtype=dtype,
                           kt_page_size=config.page_size, kt_dtype=config.kt_cache_dtype, device=CUDA)
        _generate(model, pool, config, cold, 2)
        evicted = 0
        if to_host:
            evicted = pool.evict()
            pool.synchronize()
        return (*_generate(model, pool, config, ids, NEW_TOKENS), evicted)

    device_tokens, device_logits, device_stats, _ = hit(to_host=False)
    host_tokens, host_logits, host_stats, evicted = hit(to_host=True)
    assert evicted > 0 and host_stats["onloaded_bytes"] > 0, "nothing went through host memory"
    assert host_stats["reused_tokens"] == device_stats["reused_tokens"] >= PREFIX - 16
    assert host_tokens == device_tokens
    max_diff = float((device_logits - host_logits).abs().max())
    assert torch.equal(device_logits, host_logits), f"logits differ by up to {max_diff}"
