"""Soft-capping and sinks (selection/logit_features.py and the scorers that use them) against a float64 oracle written
from transformers' eager formulas: Gemma 2 (``matmul * scaling``, ``tanh(x / cap) * cap``, additive mask, softmax) and
gpt-oss (mask, the sink concatenated as a last column, softmax, the sink column dropped)."""

from __future__ import annotations

import math

import pytest
import torch

from hf_rocketkv.selection.logit_features import (
    LogitFeatures,
    attention_reference,
    masked_attention,
    soft_cap,
    sparse_attention_reference,
)
from hf_rocketkv.selection.stage1_snapkv import featured_window_scores, scores_with, window_scores
from hf_rocketkv.selection.stage2_pages import build_kt, capped_page_scores, num_pages, page_scores

B, HQ, HKV, D = 2, 4, 2, 8


def tensors(n: int, keys: int, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(B, HQ, n, D, generator=g) * 2
    k = torch.randn(B, HKV, keys, D, generator=g) * 2
    v = torch.randn(B, HKV, keys, D, generator=g)
    return q, k, v


def eager_oracle(q, k, v, allowed, scaling, softcap=None, sinks=None):
    """transformers' eager attention in float64: repeat_kv, logits, cap, additive mask, softmax with the sink
    column, sink dropped -> [B, n, Hq, D]."""
    group = q.shape[1] // k.shape[1]
    k64 = k.double().repeat_interleave(group, dim=1)
    v64 = v.double().repeat_interleave(group, dim=1)
    logits = q.double() @ k64.transpose(2, 3) * scaling
    if softcap is not None:
        logits = torch.tanh(logits / softcap) * softcap
    logits = logits + torch.zeros(allowed.shape, dtype=torch.float64).masked_fill(~allowed, torch.finfo(torch.float64).min)
    if sinks is not None:
        sink = sinks.double().reshape(1, -1, 1, 1).expand(q.shape[0], -1, q.shape[2], 1)
        combined = torch.cat([logits, sink], dim=-1)
        probs = torch.softmax(combined - combined.amax(dim=-1, keepdim=True), dim=-1)[..., :-1]
    else:
        probs = torch.softmax(logits, dim=-1)
    return (probs @ v64).transpose(1, 2)


def causal(n: int, keys: int, window: int | None = None, pad: tuple[int, ...] = (0, 0)) -> torch.Tensor:
    """bool [B, 1, n, keys]: lower-right causal, optional sliding window, left padding per row."""
    column = torch.arange(keys)
    position = keys - n + torch.arange(n)
    allowed = column[None, :] <= position[:, None]
    if window is not None:
        allowed &= column[None, :] > position[:, None] - window
    rows = [allowed & (column[None, :] >= p) for p in pad]
    return torch.stack(rows)[:, None]


SINKS = torch.tensor([0.5, -1.0, 2.0, 0.0])


@pytest.mark.parametrize("softcap,sinks", [(None, None), (3.0, None), (None, SINKS), (2.0, SINKS)],
                         ids=["plain", "softcap", "sinks", "both"])
@pytest.mark.parametrize("n,keys,window,pad", [(12, 12, None, (0, 3)), (5, 17, None, (2, 0)), (1, 9, None, (0, 4)),
                                               (12, 12, 4, (0, 3)), (1, 20, 6, (0, 0))],
                         ids=["prefill", "chunk", "decode", "sliding-prefill", "sliding-decode"])
def test_attention_reference_matches_the_eager_oracle(softcap, sinks, n, keys, window, pad):
    q, k, v = tensors(n, keys)
    allowed = causal(n, keys, window, pad)
    scaling = 0.3
    out = attention_reference(q, k, v, allowed, scaling, LogitFeatures(softcap, sinks))
    expected = eager_oracle(q, k, v, allowed, scaling, softcap, sinks)
    rows_with_keys = allowed.any(dim=-1)[:, 0]  # [B, n]: fully masked query rows are padding, never used
    torch.testing.assert_close(out.double()[rows_with_keys], expected[rows_with_keys], rtol=1e-5, atol=1e-5)
    # masked_attention agrees (its plain path is PyTorch's SDPA)
    torch.testing.assert_close(masked_attention(q, k, v, allowed, scaling, LogitFeatures(softcap, sinks))[
        rows_with_keys], out[rows_with_keys], rtol=1e-5, atol=1e-5)


def test_mask_none_is_lower_right_causal():
    q, k, v = tensors(5, 11)
    features = LogitFeatures(2.5, SINKS)
    torch.testing.assert_close(attention_reference(q, k, v, None, 0.4, features),
                               attention_reference(q, k, v, causal(5, 11), 0.4, features))


def test_soft_cap_is_applied_before_the_mask():
    assert soft_cap(torch.tensor([-math.inf]), 3.0).item() == -3.0  # why masking must come after
    assert soft_cap(torch.tensor([100.0]), 3.0).item() == pytest.approx(3.0)
    assert soft_cap(torch.tensor([0.01]), 3.0).item() == pytest.approx(0.01, rel=1e-4)


def test_sparse_attention_over_every_slot_equals_dense_decode():
    q, k, v = tensors(1, 10)
    features = LogitFeatures(2.0, SINKS)
    slots = torch.arange(10).expand(B, HKV, 10)
    valid = torch.ones(B, HKV, 10, dtype=torch.bool)
    valid[1, :, :3] = False  # row 1: the first three slots hold no token
    grouped = q.reshape(B, HKV, HQ // HKV, D)
    out = sparse_attention_reference(grouped, k, v, slots, valid, 0.3, features)
    allowed = valid[:, :1, None, :].expand(B, 1, 1, 10)
    expected = eager_oracle(q, k, v, allowed, 0.3, 2.0, SINKS)  # [B, 1, Hq, D]
    torch.testing.assert_close(out.reshape(B, HQ, D).double(), expected[:, 0], rtol=1e-5, atol=1e-5)


def window_oracle(q_window, keys, start, end, scaling, softcap, sinks):
    """Stage 1's window scores from the eager probabilities in float64: the window queries' attention (cap, causal
    inside the window, padding hidden, sink in the denominator), summed over the window and the GQA group."""
    w, n = q_window.shape[2], keys.shape[2]
    allowed = torch.zeros(B, 1, w, n, dtype=torch.bool)
    for b in range(B):
        for i in range(w):
            allowed[b, 0, i, int(start[b]): int(end[b]) - w + i + 1] = True
    group = HQ // HKV
    logits = q_window.double() @ keys.double().repeat_interleave(group, 1).transpose(2, 3) * scaling
    if softcap is not None:
        logits = torch.tanh(logits / softcap) * softcap
    logits = logits.masked_fill(~allowed, -math.inf)
    if sinks is not None:
        sink = sinks.double().reshape(1, -1, 1, 1).expand(B, -1, w, 1)
        probs = torch.softmax(torch.cat([logits, sink], -1), -1)[..., :-1]
    else:
        probs = torch.softmax(logits, -1)
    return probs.sum(dim=2).reshape(B, HKV, group, n).sum(dim=2)


@pytest.mark.parametrize("softcap,sinks", [(3.0, None), (None, SINKS), (2.0, SINKS)], ids=["softcap", "sinks", "both"])
def test_window_scores_use_the_models_logits(softcap, sinks):
    q, k, _ = tensors(4, 15, seed=2)
    start, end = torch.tensor([0, 5]), torch.tensor([15, 15])
    features = LogitFeatures(softcap, sinks)
    scores = featured_window_scores(q, k, start, end, 0.35, features)
    torch.testing.assert_close(scores.double(), window_oracle(q, k, start, end, 0.35, softcap, sinks),
                               rtol=1e-5, atol=1e-5)
    assert scores_with(features).func is featured_window_scores
    assert scores_with(LogitFeatures()) is window_scores
    plain = featured_window_scores(q, k, start, end, 0.35, LogitFeatures())
    torch.testing.assert_close(plain, window_scores(q, k, start, end, 0.35), rtol=0, atol=0)


def test_capped_page_scores_against_an_oracle():
    """Page logits at the model's scale, capped, softmax over the pages in use, mean over the group."""
    g = torch.Generator().manual_seed(4)
    q = torch.randn(B, HKV, HQ // HKV, D, generator=g) * 3
    keys = torch.randn(B, HKV, 16, D, generator=g) * 3
    lengths = torch.tensor([16, 9])
    kt = build_kt(keys, lengths, 4, torch.float32)
    n_pages = num_pages(lengths, 4)
    probs = capped_page_scores(q, kt, n_pages, D, False, 0.5, 1.5)
    expected = torch.zeros(B, HKV, 4, dtype=torch.float64)
    for b in range(B):
        for h in range(HKV):
            sign = q[b, h].double().sum(0) > 0  # the group-summed sign picks max or min per channel
            picked = torch.where(sign, kt[b, h, :, 1].double(), kt[b, h, :, 0].double())  # [NP, D]
            logits = torch.tanh(q[b, h].double() @ picked.T * 0.5 / 1.5) * 1.5  # [G, NP]
            logits[:, int(n_pages[b]):] = -math.inf
            expected[b, h] = torch.softmax(logits, -1).mean(0)
    torch.testing.assert_close(probs.double(), expected, rtol=1e-5, atol=1e-6)
    # a cap far above the logits is no cap: page_scores at the same scale
    torch.testing.assert_close(capped_page_scores(q, kt, n_pages, D, False, D ** -0.5, 1e6),
                               page_scores(q, kt, n_pages, D), rtol=1e-4, atol=1e-6)


@pytest.mark.parametrize("kwargs,field", [(dict(softcap=0.0), "softcap"), (dict(softcap="50"), "softcap"),
                                          (dict(sinks=torch.zeros(2, 2)), "sinks"), (dict(sinks=[1.0]), "sinks")])
def test_bad_features_name_the_field(kwargs, field):
    with pytest.raises(ValueError, match=f"LogitFeatures.{field}"):
        LogitFeatures(**kwargs)


def test_same_as_takes_a_fresh_view_of_the_same_sinks():
    """A tensor-parallel plan that shards the sinks hands the attention a fresh local view of its shard at every
    forward: the same features as at prefill. Other memory, or another slice of it, is not."""
    sinks = torch.randn(4)
    prefill = LogitFeatures(sinks=sinks[:2])
    assert prefill.same_as(LogitFeatures(sinks=sinks[:2]))
    assert not prefill.same_as(LogitFeatures(sinks=sinks[:2].clone()))
    assert not prefill.same_as(LogitFeatures(sinks=sinks[2:]))
    assert not prefill.same_as(LogitFeatures(sinks=sinks[:2], softcap=5.0))
    assert not prefill.same_as(LogitFeatures())
