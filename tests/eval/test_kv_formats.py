"""eval/kv_formats.py: a full cache that holds what bf16 / fp8 pool pages give back, against an oracle that
replays the pool's rule token by token (a page is re-quantized over its valid tokens whenever it grows)."""

from __future__ import annotations

import pytest
import torch

from hf_rocketkv.eval.kv_formats import RoundTripCache
from hf_rocketkv.eval.methods import build_method
from hf_rocketkv.config import RocketKVConfig

E4M3_MAX = 448.0


def _oracle(chunks: list[torch.Tensor], page: int, per_head: bool) -> torch.Tensor:
    """Replays the updates: for every touched page, scale = amax / 448 over its stored tokens (earlier tokens as
    stored, new ones raw), values cast to float8_e4m3fn and back; per KV head when ``per_head``."""
    stored: list[torch.Tensor] = []  # per token [B, H, D], as stored
    for chunk in chunks:
        start = len(stored)
        stored += [chunk[:, :, i] for i in range(chunk.shape[2])]
        for first in range((start // page) * page, len(stored), page):
            tokens = torch.stack(stored[first:first + page], dim=2)  # [B, H, p', D]
            for b in range(tokens.shape[0]):
                heads = [[h] for h in range(tokens.shape[1])] if per_head else [list(range(tokens.shape[1]))]
                for hs in heads:
                    x = tokens[b, hs].double()
                    amax = float(x.abs().max())
                    scale = amax / E4M3_MAX if amax > 0 else 1.0
                    tokens[b, hs] = ((x / scale).clamp(-E4M3_MAX, E4M3_MAX).to(torch.float8_e4m3fn).double()
                                     * scale).to(tokens.dtype)
            for i in range(tokens.shape[2]):
                stored[first + i] = tokens[:, :, i]
    return torch.stack(stored, dim=2).double()


@pytest.mark.parametrize("kv_format,per_head", [("fp8_page", False), ("fp8_head", True)])
@pytest.mark.parametrize("sizes", [[5, 7, 1, 1, 3], [16], [1] * 9, [4, 4, 4]])
def test_fp8_pages_equal_the_replayed_pool_rule(kv_format, per_head, sizes):
    g = torch.Generator().manual_seed(len(sizes) * 10 + sum(sizes))
    chunks = [torch.randn(2, 3, n, 8, generator=g) * torch.exp2(torch.randint(-4, 5, (1, 3, 1, 1), generator=g).float())
              for n in sizes]
    cache = RoundTripCache(kv_format, page_size=4)
    for chunk in chunks:
        keys, values = cache.update(chunk, -chunk, 0)
    want = _oracle(chunks, 4, per_head)
    torch.testing.assert_close(keys.double(), want, rtol=1e-6, atol=1e-7)
    torch.testing.assert_close(values.double(), -want, rtol=1e-6, atol=1e-7)
    raw = torch.cat(chunks, dim=2)
    assert not torch.equal(keys, raw)  # something was rounded
    if all(n % 4 == 0 for n in sizes):  # every page written once: one round trip, the fp8 reference's bound
        # |x - x^| <= |x| 2^-4 + s 2^-10 with s <= amax / 448 (a page growing is rounded again: no such bound)
        assert bool(((keys - raw).abs() <= raw.abs() / 16 + raw.abs().amax() / E4M3_MAX / 1024 + 1e-6).all())


def test_bf16_pages_round_every_value_once():
    g = torch.Generator().manual_seed(0)
    chunks = [torch.randn(1, 2, n, 8, generator=g) for n in (3, 6, 1)]
    cache = RoundTripCache("bf16", page_size=4)
    for chunk in chunks:
        keys, _ = cache.update(chunk, chunk, 1)
    assert torch.equal(keys, torch.cat(chunks, dim=2).to(torch.bfloat16).float())


def test_eval_methods_and_bad_format():
    base = RocketKVConfig()
    method = build_method("full_fp8kv_head", base)
    assert method.kv_format == "fp8_head" and method.attn_implementation == "sdpa"
    assert isinstance(method.new_cache(), RoundTripCache) and method.describe()["kv_format"] == "fp8_head"
    assert build_method("full", base).new_cache().__class__.__name__ == "DynamicCache"
    with pytest.raises(ValueError, match=r"RoundTripCache.kv_format must be one of \['bf16', 'fp8_page', 'fp8_head'\]"):
        RoundTripCache("fp4")


@pytest.mark.parametrize("name, granularity", [("rocketkv_fp8kv", "page"), ("rocketkv_fp8kv_head", "head")])
def test_rocketkv_on_fp8_pool_pages_through_the_eval_path(name, granularity):
    """``rocketkv_fp8kv*``: RocketKVCache on a pool of fp8 pages, run by the eval's shared-prefix prefill and decode
    steps: the prompt's next-token logits equal plain rocketkv's (the prefill reads no fp8 page), the decode steps'
    stay within 5% of them, and the cache needs the model and the tokens to size its pool."""
    from hf_rocketkv.eval.decode import prefill, shared_prefix, step
    from hf_rocketkv.kernels.paged import scale_granularity
    from tests.support.tiny_models import compressing_config, make_models, random_ids

    model, _ = make_models("llama")
    base = compressing_config(kt_cache_dtype="float32")
    method, plain = build_method(name, base), build_method("rocketkv", base)
    assert method.kv_format == f"fp8_{granularity}" and method.attn_implementation == "rocketkv"
    with pytest.raises(ValueError, match="needs the model and the tokens"):
        method.new_cache()
    ids = random_ids(1, 70, seed=9)
    prefix = shared_prefix(model, ids, tail=16)
    runs = [prefill(model, m, prefix, max_new_tokens=4) for m in (plain, method)]
    store = runs[1].cache.layers[0].store
    assert store.fp8 and scale_granularity(store.k_scale) == granularity
    assert torch.equal(runs[1].logits, runs[0].logits)
    token = int(runs[0].logits.argmax())
    decoded = [step(model, run.cache, token, 70) for run in runs]
    assert float((decoded[1] - decoded[0]).norm() / decoded[0].norm()) < 0.05
