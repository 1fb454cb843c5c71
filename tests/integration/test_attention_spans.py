"""A long first forward's attention in query spans (integration/attention.py ``attend_in_spans``).

A sliding layer's first forward of ``n`` tokens attends each block of queries only over the keys its window can
reach, and a causal layer with soft-capping or sinks only over the keys up to the block's end. Oracle: float64
masked softmax over keys repeated per query head, from transformers-style full masks (causal, sliding window, left
padding), with the cap and the sinks written out here (``tanh`` cap, one extra denominator logit per query head).
Compared on the real queries (a padding query attends nothing).
"""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from hf_rocketkv.cache.layer import GenerationHints
from hf_rocketkv.integration import attention
from hf_rocketkv.integration.attention import attend_in_spans, dense_attention, spans_pay_off, window_attention
from hf_rocketkv.selection.logit_features import PLAIN, LogitFeatures
from tests.integration.test_attention import inputs as attention_inputs

BLOCK = 8
# on a GPU (pytest -m gpu) the same oracle checks the spans in bfloat16, through the fused SDPA kernels
DEVICES = [("cpu", torch.float32)] + (
    [pytest.param(("cuda", torch.bfloat16), marks=pytest.mark.gpu)] if torch.cuda.is_available() else [])
TOLERANCE = {torch.float32: 1e-5, torch.bfloat16: 3e-2}


def oracle(query, key, value, allowed, scaling, softcap=None, sinks=None):
    """[B, Lq, Hq, D] in float64 from a bool mask [B, 1, Lq, Lk]."""
    group = query.shape[1] // key.shape[1]
    k = key.double().repeat_interleave(group, dim=1)
    v = value.double().repeat_interleave(group, dim=1)
    logits = (query.double() @ k.transpose(-1, -2)) * scaling
    if softcap is not None:
        logits = softcap * torch.tanh(logits / softcap)
    logits = logits.masked_fill(~allowed, float("-inf"))
    if sinks is not None:
        sink = sinks.double()[None, :, None, None].expand(*logits.shape[:-1], 1)
        logits = torch.cat([logits, sink], dim=-1)
    probs = torch.softmax(logits, dim=-1).nan_to_num(0.0)
    if sinks is not None:
        probs = probs[..., :-1]
    return (probs @ v).transpose(1, 2)


def full_mask(batch, n, window=None, pad=()):
    """transformers' mask of a first forward: causal, within ``window`` (key > query - window), no padding key."""
    q = torch.arange(n)[:, None]
    k = torch.arange(n)[None, :]
    allowed = k <= q
    if window is not None:
        allowed &= k > q - window
    allowed = allowed[None, None].expand(batch, 1, n, n).clone()
    for row, p in enumerate(pad):
        allowed[row, :, :, :p] = False
    return allowed


def inputs(batch, q_heads, kv_heads, n, dim, seed, device="cpu", dtype=torch.float32):
    """A first forward's query, keys and values (``n`` of each) and a module as transformers' sdpa reads it."""
    return attention_inputs(batch, q_heads, kv_heads, n, n, dim, dtype, seed, device)


def features_of(kind, q_heads, seed):
    sinks = torch.randn(q_heads, generator=torch.Generator().manual_seed(seed)) * 2
    return {"plain": PLAIN, "softcap": LogitFeatures(softcap=3.0, sinks=None),
            "sinks": LogitFeatures(softcap=None, sinks=sinks),
            "both": LogitFeatures(softcap=3.0, sinks=sinks)}[kind]


def real_rows(out, n, pad):
    """Real queries only: [B, Lq, Hq, D] with padding queries zeroed."""
    out = out.cpu()
    keep = torch.ones(out.shape[0], n, dtype=torch.bool)
    for row, p in enumerate(pad):
        keep[row, :p] = False
    return out.double() * keep[:, :, None, None]


@pytest.fixture
def small_spans(monkeypatch):
    monkeypatch.setattr(attention, "FIRST_FORWARD_QUERY_BLOCK", BLOCK)


@pytest.mark.parametrize("device_dtype", DEVICES)
@pytest.mark.parametrize("kind", ["plain", "softcap", "sinks", "both"])
@pytest.mark.parametrize("window", [3, 8, 13])
@pytest.mark.parametrize("pad", [(), (0, 5), (19, 0)])
def test_a_sliding_first_forward_in_spans_equals_the_oracle(kind, window, pad, device_dtype, small_spans):
    device, dtype = device_dtype
    batch = max(1, len(pad))
    n, q_heads, kv_heads, dim = 45, 8, 2, 16
    q, k, v, module = inputs(batch, q_heads, kv_heads, n, dim, window + len(pad), device, dtype)
    features = features_of(kind, q_heads, seed=window)
    if features.sinks is not None:
        features = LogitFeatures(softcap=features.softcap, sinks=features.sinks.to(device, dtype))
    mask = full_mask(batch, n, window, pad).to(device)
    assert spans_pay_off(q, k, mask, window, needs_mask=features.plain)
    out = window_attention(module, q, k, v, mask, 0.25, features, sliding_window=window)
    expected = oracle(q, k, v, mask, 0.25, features.softcap, features.sinks)
    tol = TOLERANCE[dtype]
    torch.testing.assert_close(real_rows(out, n, pad), real_rows(expected, n, pad), rtol=tol, atol=tol)


@pytest.mark.parametrize("kind", ["softcap", "sinks", "both"])
@pytest.mark.parametrize("pad", [(), (0, 7)])
@pytest.mark.parametrize("masked", [True, False])
def test_a_causal_first_forward_with_features_in_spans_equals_the_oracle(kind, pad, masked, small_spans):
    """Global layers of gpt-oss (sinks) and Gemma 2 (soft-capping): spans of the causal keys, with transformers'
    mask or none (lower-right causal)."""
    if pad and not masked:
        pytest.skip("padding comes with a mask")
    batch = max(1, len(pad))
    n, q_heads, kv_heads, dim = 37, 6, 3, 8
    q, k, v, module = inputs(batch, q_heads, kv_heads, n, dim, seed=len(pad))
    features = features_of(kind, q_heads, seed=2)
    mask = full_mask(batch, n, None, pad)
    layer = SimpleNamespace(hints=GenerationHints())
    out = dense_attention(layer, module, q, k, v, mask if masked else None, 0.3, None, features)
    expected = oracle(q, k, v, mask, 0.3, features.softcap, features.sinks)
    torch.testing.assert_close(real_rows(out, n, pad), real_rows(expected, n, pad), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("window", [None, 4, 8, 11])
def test_each_span_reads_only_the_keys_its_queries_can_see(window):
    """The spans cover every query once, in order, and each reads keys [start - window, end): what the mask lets
    its queries see, and no more than the block plus the window."""
    n = 40
    q, k, v, _ = inputs(1, 2, 1, n, 4, seed=1)
    mask = full_mask(1, n, window)
    seen = []

    def attend(q_part, k_part, v_part, rows):
        start = sum(queries for queries, _ in seen)
        seen.append((q_part.shape[2], k_part.shape[2]))
        # every column the span's queries may attend is inside its keys: the rows keep all of the mask's True
        assert int(rows.sum()) == int(mask[:, :, start:start + q_part.shape[2]].sum())
        return torch.zeros(1, q_part.shape[2], 2, 4)

    out = attend_in_spans(attend, q, k, v, mask, window, block=BLOCK)
    block = max(BLOCK, window or 0)
    assert out.shape == (1, n, 2, 4)
    assert [s for s, _ in seen] == [min(block, n - start) for start in range(0, n, block)]
    for i, (_, keys) in enumerate(seen):
        start, end = i * block, min(n, (i + 1) * block)
        assert keys == end - (0 if window is None else max(0, start - window))


def test_short_forwards_later_chunks_and_unusable_masks_run_whole(small_spans):
    q, k, v, _ = inputs(1, 2, 1, 40, 4, seed=0)
    mask = full_mask(1, 40, 4)
    assert spans_pay_off(q, k, mask, 4, needs_mask=True)
    assert not spans_pay_off(q[:, :, :15], k[:, :, :15], mask[..., :15, :15], 4, needs_mask=True)  # one span
    assert not spans_pay_off(q[:, :, 20:], k, mask[..., 20:, :], 4, needs_mask=True)  # keys before the queries
    assert not spans_pay_off(q, k, None, 4, needs_mask=True)  # sdpa would read None as upper-left causal
    assert spans_pay_off(q, k, None, None, needs_mask=False)
    assert not spans_pay_off(q, k, mask[:, :, -1:], 4, needs_mask=True)  # a broadcast row
    assert not spans_pay_off(q, k, mask, 21, needs_mask=True)  # the window spans more than half the forward


@pytest.mark.parametrize("kind", ["plain", "sinks", "softcap"])
def test_a_sliding_layer_attends_in_spans_of_at_most_the_window_block(kind, monkeypatch):
    """A sliding layer, plain or with soft-capping or sinks: spans of ``WINDOW_SPAN_BLOCK`` queries (or the window,
    if larger), fewer than ``FIRST_FORWARD_QUERY_BLOCK``, so a prompt of two window blocks runs in spans. The answer is
    the oracle's."""
    monkeypatch.setattr(attention, "FIRST_FORWARD_QUERY_BLOCK", 64)
    monkeypatch.setattr(attention, "WINDOW_SPAN_BLOCK", 16)
    blocks = []
    real = attention.attend_in_spans
    monkeypatch.setattr(attention, "attend_in_spans", lambda *a: blocks.append(a[6]) or real(*a))
    n, window, q_heads = 40, 5, 4
    q, k, v, module = inputs(1, q_heads, 2, n, 8, seed=9)
    features = features_of(kind, q_heads, seed=4)
    mask = full_mask(1, n, window)
    out = window_attention(module, q, k, v, mask, 0.25, features, sliding_window=window)
    assert blocks == [16]
    expected = oracle(q, k, v, mask, 0.25, features.softcap, features.sinks)
    torch.testing.assert_close(out.double(), expected, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("kind", ["plain", "sinks"])
def test_a_causal_layer_keeps_the_long_block_unless_it_has_features(kind, monkeypatch):
    """Without a window (a dense layer): a plain layer's spans are ``FIRST_FORWARD_QUERY_BLOCK`` queries (it needs
    none below two of them), a layer with sinks ``WINDOW_SPAN_BLOCK``."""
    monkeypatch.setattr(attention, "FIRST_FORWARD_QUERY_BLOCK", 20)
    monkeypatch.setattr(attention, "WINDOW_SPAN_BLOCK", 8)
    blocks = []
    real = attention.attend_in_spans
    monkeypatch.setattr(attention, "attend_in_spans", lambda *a: blocks.append(a[6]) or real(*a))
    n, q_heads = 32, 4
    q, k, v, module = inputs(1, q_heads, 2, n, 8, seed=3)
    features = features_of(kind, q_heads, seed=5)
    mask = full_mask(1, n, None)
    out = window_attention(module, q, k, v, mask, 0.25, features)
    assert blocks == ([] if kind == "plain" else [8])
    expected = oracle(q, k, v, mask, 0.25, features.softcap, features.sinks)
    torch.testing.assert_close(out.double(), expected, rtol=1e-5, atol=1e-5)
