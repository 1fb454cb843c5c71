"""featured_attention (prefill / window attention with soft-capping and sinks, in bounded memory) and sink_attention
(sinks through PyTorch's SDPA with an extra channel and key) against a float64 oracle written from the definition:
``l = tanh(q.k * scaling / c) * c`` (no cap: ``q.k * scaling``), masked, ``p_j = exp(l_j) / (sum_i exp(l_i) +
exp(sink_h))``; a query that may see nothing gets zeros."""

from __future__ import annotations

import math

import pytest
import torch

from hf_rocketkv.selection.logit_features import (
    LogitFeatures,
    featured_attention,
    sink_attention,
)


def oracle(query, key, value, allowed, scaling, softcap, sinks):
    batch, heads, n, dim = query.shape
    kv_heads, num_keys = key.shape[1], key.shape[2]
    group = heads // kv_heads
    if allowed is None:
        allowed = torch.tensor([[c <= num_keys - n + j for c in range(num_keys)] for j in range(n)])[None, None]
    allowed = allowed.expand(batch, heads, n, num_keys)
    out = torch.zeros(batch, n, heads, dim, dtype=torch.float64)
    for b in range(batch):
        for h in range(heads):
            k, v = key[b, h // group].double(), value[b, h // group].double()
            for j in range(n):
                cols = allowed[b, h, j].nonzero().flatten()
                if len(cols) == 0:
                    continue
                logits = (k[cols] @ query[b, h, j].double()) * scaling
                if softcap is not None:
                    logits = torch.tanh(logits / softcap) * softcap
                denom = torch.exp(logits).sum() + (math.exp(float(sinks[h])) if sinks is not None else 0.0)
                out[b, j, h] = (torch.exp(logits) / denom) @ v[cols]
    return out


def _inputs(batch, heads, kv_heads, n, num_keys, dim, dtype, seed):
    g = torch.Generator().manual_seed(seed)
    q = (torch.randn(batch, heads, n, dim, generator=g) * 1.5).to(dtype)
    k = torch.randn(batch, kv_heads, num_keys, dim, generator=g).to(dtype)
    v = torch.randn(batch, kv_heads, num_keys, dim, generator=g).to(dtype)
    sinks = torch.randn(heads, generator=g) * 2
    return q, k, v, sinks


def _padding_mask(batch, n, num_keys):
    """Lower-right causal, row 1 left-padded by 3 columns (with n == num_keys its first 3 queries see nothing)."""
    column = torch.arange(num_keys)
    allowed = column[None, :] <= (num_keys - n + torch.arange(n))[:, None]
    allowed = allowed[None, None].repeat(batch, 1, 1, 1)
    allowed[1, :, :, :3] = False
    return allowed


# (heads, kv_heads, n, num_keys, dim, softcap, with_sinks, mask, block_bytes)
CASES = [
    (4, 2, 9, 9, 16, None, True, None, None),  # prefill, causal, sinks through SDPA
    (8, 2, 5, 12, 64, None, True, "padding", None),  # a later chunk, left padding, GQA 4
    (4, 4, 1, 10, 32, None, True, "padding", None),  # one decode query
    (6, 2, 11, 11, 16, 3.0, True, None, 4 * 2 * 6 * 11 * 3),  # cap + sinks, blocks of 3 queries
    (4, 1, 7, 13, 48, 2.0, False, "padding", 4 * 2 * 4 * 13 * 2),  # cap only, blocks of 2, padded
    (4, 2, 10, 10, 24, None, True, "padding", 4 * 2 * 10 * 4),  # sinks in blocks of 4, 3 empty queries
    (2, 2, 6, 6, 8, 1.0, True, "padding", None),  # cap + sinks in one block, 3 empty queries
    (4, 2, 7, 12, 16, None, True, None, 4 * 2 * 12 * 2),  # a later chunk, lower-right causal, sinks in blocks of 2
    (4, 2, 7, 12, 16, 2.0, False, None, 4 * 2 * 4 * 12 * 3),  # the same with a cap only, blocks of 3
]


@pytest.mark.parametrize("heads,kv_heads,n,num_keys,dim,softcap,with_sinks,mask,block_bytes", CASES)
def test_featured_attention_matches_float64_oracle(heads, kv_heads, n, num_keys, dim, softcap, with_sinks, mask,
                                                   block_bytes):
    q, k, v, sinks = _inputs(2, heads, kv_heads, n, num_keys, dim, torch.float32, seed=n * dim)
    allowed = _padding_mask(2, n, num_keys) if mask == "padding" else None
    features = LogitFeatures(softcap=softcap, sinks=sinks if with_sinks else None)
    kwargs = {} if block_bytes is None else {"block_bytes": block_bytes}
    got = featured_attention(q, k, v, allowed, dim**-0.5, features, **kwargs)
    want = oracle(q, k, v, allowed, dim**-0.5, softcap, features.sinks)
    assert got.shape == (2, n, heads, dim) and got.dtype == torch.float32
    torch.testing.assert_close(got.double(), want, atol=2e-5, rtol=0)
    if mask == "padding":
        empty = ~allowed[1, 0].any(-1)  # queries that see nothing: zeros, sink or not
        assert torch.all(got[1, empty] == 0)


def test_sink_attention_in_bf16():
    q, k, v, sinks = _inputs(1, 8, 2, 16, 16, 64, torch.bfloat16, seed=5)
    got = sink_attention(q, k, v, None, 0.125, LogitFeatures(sinks=sinks.to(torch.bfloat16)))
    want = oracle(q, k, v, None, 0.125, None, sinks.to(torch.bfloat16))
    assert got.dtype == torch.bfloat16
    torch.testing.assert_close(got.double(), want, atol=3e-2, rtol=0)
