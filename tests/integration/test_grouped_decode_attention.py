"""A sliding layer's decode step over its ring (``attention.grouped_decode_attention``): the query heads of each KV head
as query rows of one SDPA head, against attention written out in float64 (every query head over its KV head's keys,
the mask applied, softmax), for GQA ratios 1 to 8, head dims to 256, masks with padding and the ring's wrap; and the
path taken by generate() on a tiny Gemma 3 with the tokens of transformers' own cache."""

from __future__ import annotations

import pytest
import torch

from hf_rocketkv import RocketKVCache
from hf_rocketkv.integration import attention
from tests.support.hybrid_models import make_hybrid_models
from tests.support.tiny_models import greedy, keep_all_config, left_pad, random_ids


def oracle(query, key, value, mask, scaling):
    """``[B, 1, Hq, D]`` in float64: query head h reads KV head h // G."""
    batch, heads, _, dim = query.shape
    group = heads // key.shape[1]
    k = key.double().repeat_interleave(group, dim=1)
    v = value.double().repeat_interleave(group, dim=1)
    logits = (query.double() @ k.transpose(-1, -2)) * scaling  # [B, Hq, 1, W]
    logits = logits.masked_fill(~mask.expand(batch, heads, 1, -1), float("-inf"))
    return (logits.softmax(-1) @ v).transpose(1, 2)


@pytest.mark.parametrize("kv_heads, group", [(1, 1), (2, 1), (2, 4), (1, 8), (8, 2)])
@pytest.mark.parametrize("dim", [16, 64, 256])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_grouped_decode_attention_equals_attention_written_out(kv_heads, group, dim, dtype):
    generator = torch.Generator().manual_seed(kv_heads * 100 + group * 10 + dim)
    batch, window = 3, 12
    query = torch.randn(batch, kv_heads * group, 1, dim, generator=generator).to(dtype)
    key = torch.randn(batch, kv_heads, window, dim, generator=generator).to(dtype)
    value = torch.randn(batch, kv_heads, window, dim, generator=generator).to(dtype)
    mask = torch.rand(batch, 1, 1, window, generator=generator) < 0.7  # padding and slots not yet written
    mask[:, :, :, 5] = True  # the newest token's slot: every row sees it
    scaling = dim ** -0.5
    got = attention.grouped_decode_attention(query, key, value, mask, scaling)
    assert got.shape == (batch, 1, kv_heads * group, dim) and got.dtype == dtype
    tolerance = dict(rtol=1e-5, atol=1e-5) if dtype == torch.float32 else dict(rtol=2e-2, atol=2e-2)
    torch.testing.assert_close(got.double(), oracle(query, key, value, mask, scaling), **tolerance)
    # a mask broadcast over the batch (no padding) as ring_mask returns without an attention mask
    shared = mask[:1]
    torch.testing.assert_close(attention.grouped_decode_attention(query, key, value, shared, scaling).double(),
                               oracle(query, key, value, shared, scaling), **tolerance)


def test_generate_on_gemma3_takes_it_for_every_sliding_decode_step(monkeypatch):
    rocket, oracle_model = make_hybrid_models("gemma3")
    calls = []
    real = attention.grouped_decode_attention
    monkeypatch.setattr(attention, "grouped_decode_attention",
                        lambda *args: calls.append(args[1].shape) or real(*args))
    ids, mask = left_pad([random_ids(1, 30, seed=3)[0], random_ids(1, 5, seed=4)[0]])  # padding inside the window
    new_tokens = 12  # past the window of 8: the ring wraps
    got = greedy(rocket, ids, attention_mask=mask, max_new_tokens=new_tokens,
                 cache=RocketKVCache(keep_all_config(kt_cache_dtype="float32")))  # nothing evicted
    want = greedy(oracle_model, ids, attention_mask=mask, max_new_tokens=new_tokens)
    assert torch.equal(got, want)
    sliding = sum(kind == "sliding_attention" for kind in rocket.config.layer_types)
    assert len(calls) == sliding * (new_tokens - 1)
    assert set(calls) == {(2, rocket.config.num_key_value_heads, rocket.config.sliding_window,
                           rocket.config.head_dim)}
