"""The dense (prefill) attention of the ``rocketkv`` attention function (integration/attention.py ``dense_attention``).

Where flash attention runs and transformers' mask is plain lower-right causal (a whole prompt without a mask, a
prefix hit's new tokens, a later chunk), it runs ``causal_prefill_attention`` (integration/causal_prefill.py: cuDNN in
bucketed shapes, a split merged by log-sum-exp when keys precede the queries; flash attention's lower-right causal
mode with native GQA otherwise) instead of transformers' path (which copies K/V per query head under a mask). Oracle: masked softmax in float64 over keys repeated per query head, from the mask itself.
Every other mask (padding, a custom 4-D mask) and every input flash cannot take (CPU, float32) must take
transformers' path, with the same oracle's answer. On a GPU (``gpu_steps.sh attention_tests``) the flash path runs
too.
"""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from hf_rocketkv.cache.layer import GenerationHints
from hf_rocketkv.integration import attention, causal_prefill
from hf_rocketkv.integration.attention import dense_attention, lower_right_causal
from hf_rocketkv.integration.causal_prefill import CUDNN_QUERY_BUCKET
from hf_rocketkv.integration.causal_prefill import causal_prefill_attention as lower_right_attention


def oracle(query, key, value, allowed, scaling):
    """[B, Lq, Hq, D] from an explicit [B, 1, Lq, Lk] bool mask (True = may attend)."""
    group = query.shape[1] // key.shape[1]
    k = key.double().repeat_interleave(group, dim=1)
    v = value.double().repeat_interleave(group, dim=1)
    scores = (query.double() @ k.transpose(-1, -2)) * scaling
    scores = scores.masked_fill(~allowed, float("-inf"))
    return (scores.softmax(dim=-1) @ v).transpose(1, 2)


def causal_mask(batch, n, kv_length, pad=None):
    column = torch.arange(kv_length)
    allowed = column[None, :] <= (kv_length - n + torch.arange(n))[:, None]
    allowed = allowed[None, None].expand(batch, 1, n, kv_length).clone()
    for b, p in enumerate(pad or []):
        allowed[b, :, :, :p] = False
    return allowed


def inputs(batch, q_heads, kv_heads, n, kv_length, dim, dtype, seed, device="cpu"):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(batch, q_heads, n, dim, generator=g).to(device, dtype)
    k = torch.randn(batch, kv_heads, kv_length, dim, generator=g).to(device, dtype)
    v = torch.randn(batch, kv_heads, kv_length, dim, generator=g).to(device, dtype)
    module = SimpleNamespace(num_key_value_groups=q_heads // kv_heads, is_causal=True, training=False)
    return q, k, v, module


def layer():
    return SimpleNamespace(hints=GenerationHints())


# on a GPU (pytest -m gpu, scripts/gpu_tests.sh) the same oracle checks the flash-attention path, with head dims of
# real models added
DEVICES = ["cpu"] + ([pytest.param("cuda", marks=pytest.mark.gpu)] if torch.cuda.is_available() else [])
SHAPES = [  # batch, Hq, Hkv, Lq, Lk, D
    (1, 8, 2, 5, 40, 16),  # a prefix hit: few new queries after many keys, GQA 4
    (2, 6, 3, 7, 7, 8),  # square: a whole prompt
    (1, 4, 4, 3, 19, 32),  # no GQA
    (3, 12, 1, 9, 33, 16),  # MQA
    (1, 8, 2, 1, 9, 16),  # one query
] + ([(1, 32, 8, 256, 4352, 128), (2, 16, 2, 100, 1000, 64),  # flash, then cuDNN with padded queries
       (1, 8, 2, 1037, 1549, 64), (2, 8, 2, 300, 300, 128), (1, 32, 8, 1024, 2048, 128),  # cuDNN: split, square
       (1, 8, 2, 37, 549, 64)]  # flash: few queries after earlier keys (a prefix hit's new tokens)
      if torch.cuda.is_available() else [])


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_lower_right_attention_equals_the_oracle(shape, dtype, device):
    batch, hq, hkv, n, kv_length, dim = shape
    q, k, v, _ = inputs(batch, hq, hkv, n, kv_length, dim, dtype, seed=sum(shape), device=device)
    mask = causal_mask(batch, n, kv_length).to(device)
    assert lower_right_causal(layer(), mask, [0] * batch, n, kv_length)
    out = lower_right_attention(q, k, v, 0.3)
    assert out.shape == (batch, n, hq, dim) and out.dtype == dtype and out.is_contiguous()
    tolerance = (1e-5 if device == "cpu" else 1e-4) if dtype == torch.float32 else 2e-2
    torch.testing.assert_close(out.double(), oracle(q, k, v, mask, 0.3), atol=tolerance, rtol=tolerance)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("shape", SHAPES)
def test_cudnn_runs_exactly_where_the_keys_before_the_queries_fill_whole_buckets(shape, device, monkeypatch):
    """On CUDA in bf16, cuDNN (queries padded to the bucket, a split merged by log-sum-exp when keys precede them)
    where the keys before the queries are none or a multiple of the bucket before enough queries, and cuDNN takes the
    head dim; flash elsewhere;
    neither on the CPU. The values against the float64 oracle either way."""
    batch, hq, hkv, n, kv_length, dim = shape
    q, k, v, _ = inputs(batch, hq, hkv, n, kv_length, dim, torch.bfloat16, seed=7 + sum(shape), device=device)
    taken = []
    cudnn = causal_prefill.cudnn_causal_attention
    monkeypatch.setattr(causal_prefill, "cudnn_causal_attention", lambda *a: taken.append(1) or cudnn(*a))
    out = lower_right_attention(q, k, v, 0.3)
    prefix = kv_length - n
    assert bool(taken) == causal_prefill.cudnn_runs(q, k, v, prefix)
    if device == "cpu" or prefix % CUDNN_QUERY_BUCKET or (prefix and n < causal_prefill.MIN_SPLIT_QUERIES) \
            or dim > causal_prefill.CUDNN_MAX_HEAD_DIM:
        assert not taken
    elif dim in (64, 128):  # cuDNN's head dims on an H100
        assert taken
    assert out.shape == (batch, n, hq, dim) and out.is_contiguous()
    mask = causal_mask(batch, n, kv_length).to(device)
    torch.testing.assert_close(out.double(), oracle(q, k, v, mask, 0.3), atol=2e-2, rtol=2e-2)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_a_whole_prompt_without_a_mask_takes_the_causal_path_where_flash_runs(dtype, device, monkeypatch):
    """No mask and as many queries as keys (transformers' is_causal case): cuDNN in a bucketed shape on CUDA in bf16,
    transformers' sdpa elsewhere; the oracle's causal answer either way."""
    import hf_rocketkv.integration.attention as attention

    q, k, v, module = inputs(2, 8, 2, 9, 9, 64, dtype, seed=11, device=device)
    taken = []
    monkeypatch.setattr(attention, "cudnn_causal_attention",
                        lambda *a: taken.append(1) or causal_prefill.cudnn_causal_attention(*a))
    out = dense_attention(layer(), module, q, k, v, None, 0.25, None)
    tolerance = (1e-5 if device == "cpu" else 1e-4) if dtype == torch.float32 else 2e-2
    mask = causal_mask(2, 9, 9).to(device)
    torch.testing.assert_close(out.double(), oracle(q, k, v, mask, 0.25), atol=tolerance, rtol=tolerance)
    assert bool(taken) == (device == "cuda" and dtype == torch.bfloat16)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("pad", [[0, 0], [0, 5]])
def test_dense_attention_equals_the_oracle_on_the_path_it_takes(dtype, device, pad, monkeypatch):
    """Flash's lower-right path exactly where flash runs and no row is padded; transformers' path elsewhere."""
    import hf_rocketkv.integration.attention as attention

    q, k, v, module = inputs(2, 8, 2, 6, 20, 64, dtype, seed=3, device=device)
    mask = causal_mask(2, 6, 20, pad).to(device)
    taken = []
    monkeypatch.setattr(attention, "causal_prefill_attention",
                        lambda *a: taken.append(1) or lower_right_attention(*a))
    out = dense_attention(layer(), module, q, k, v, mask, 0.25, pad)
    tolerance = (1e-5 if device == "cpu" else 1e-4) if dtype == torch.float32 else 2e-2
    torch.testing.assert_close(out.double(), oracle(q, k, v, mask, 0.25), atol=tolerance, rtol=tolerance)
    flash = device == "cuda" and dtype == torch.bfloat16
    assert bool(taken) == (flash and not any(pad))


@pytest.mark.parametrize("device", DEVICES)
def test_a_mask_that_is_not_plain_causal_is_recognised_and_honoured(device):
    """One hidden key (a custom 4-D mask, packed sequences): not lower-right causal, and the answer respects it
    (on a GPU in bfloat16, where flash would run)."""
    dtype = torch.bfloat16 if device == "cuda" else torch.float32
    q, k, v, module = inputs(1, 8, 2, 4, 12, 64, dtype, seed=4, device=device)
    mask = causal_mask(1, 4, 12).to(device)
    mask[0, 0, 2, 3] = False
    owner = layer()
    assert not lower_right_causal(owner, mask, [0], 4, 12)
    out = dense_attention(owner, module, q, k, v, mask, 0.25, [0])
    tolerance = 1e-5 if dtype == torch.float32 else 2e-2
    torch.testing.assert_close(out.double(), oracle(q, k, v, mask, 0.25), atol=tolerance, rtol=tolerance)


def test_additive_float_masks_are_read_like_bool_masks():
    allowed = causal_mask(1, 3, 10)
    additive = torch.zeros(allowed.shape).masked_fill(~allowed, torch.finfo(torch.float32).min)
    assert lower_right_causal(layer(), additive, [0], 3, 10)
    additive[0, 0, 0, 0] = torch.finfo(torch.float32).min
    assert not lower_right_causal(layer(), additive, [0], 3, 10)


def test_no_mask_or_unknown_padding_is_never_taken_for_causal():
    mask = causal_mask(1, 3, 10)
    assert not lower_right_causal(layer(), None, [0], 3, 10)
    assert not lower_right_causal(layer(), mask, None, 3, 10)
    assert not lower_right_causal(layer(), mask[:, :, :2], [0], 3, 10)  # a mask of another shape


def test_the_answer_is_compared_once_per_mask_object(monkeypatch):
    """Every layer of a forward gets the same mask: the device comparison (a host sync) runs for the first only."""
    mask = causal_mask(1, 3, 10)
    owner = layer()
    calls = []
    real_check = attention.is_window_band
    monkeypatch.setattr(attention, "is_window_band", lambda *args: calls.append(1) or real_check(*args))
    for _ in range(4):
        assert lower_right_causal(owner, mask, [0], 3, 10)
    assert len(calls) == 1
    other = causal_mask(1, 3, 10)  # the next forward's mask: a new object, compared again
    assert lower_right_causal(owner, other, [0], 3, 10)
    assert len(calls) == 2


def sink_oracle(query, key, value, allowed, scaling, sinks, softcap=None):
    """``oracle`` with an optional soft-cap and one sink logit per query head in each row's softmax (float64)."""
    group = query.shape[1] // key.shape[1]
    k = key.double().repeat_interleave(group, dim=1)
    v = value.double().repeat_interleave(group, dim=1)
    scores = (query.double() @ k.transpose(-1, -2)) * scaling
    if softcap is not None:
        scores = torch.tanh(scores / softcap) * softcap
    scores = scores.masked_fill(~allowed, float("-inf"))
    sink = sinks.double()[None, :, None, None].expand(*scores.shape[:-1], 1)
    return (torch.cat([scores, sink], dim=-1).softmax(-1)[..., :-1] @ v).transpose(1, 2)


@pytest.mark.parametrize("case", ["whole prompt", "chunk", "padded", "soft-capped"])
def test_sinks_take_cudnn_exactly_where_the_mask_is_plain_causal(case, monkeypatch):
    """gpt-oss' sinks without a cap: cuDNN with the sinks applied through the log-sum-exp where it runs (stood in
    for on the CPU by a float64 recording op, ``cudnn_runs`` forced) and the mask is plain causal (none on a whole
    prompt; lower-right on a chunk after a whole bucket of keys); a padded row or soft-capped logits keep the
    reference path. The oracle's answer every time."""
    import hf_rocketkv.integration.attention as attention
    from hf_rocketkv.kernels.merge_attention import merge_attention_torch
    from hf_rocketkv.selection.logit_features import LogitFeatures
    from tests.integration.test_causal_prefill import RecordingCudnn

    fake = RecordingCudnn()
    monkeypatch.setattr(causal_prefill, "_CUDNN_ATTENTION", fake)
    monkeypatch.setattr(causal_prefill, "merge_attention_triton", merge_attention_torch)
    monkeypatch.setattr(attention, "cudnn_runs", lambda *a: True)
    n, kv_length, pad = {"whole prompt": (9, 9, [0, 0]), "chunk": (6, 6 + CUDNN_QUERY_BUCKET, [0, 0]),
                         "padded": (9, 9, [0, 3]), "soft-capped": (9, 9, [0, 0])}[case]
    q, k, v, module = inputs(2, 8, 2, n, kv_length, 16, torch.bfloat16, seed=13, device="cpu")
    sinks = torch.linspace(-2.0, 4.0, 8).to(torch.bfloat16)
    softcap = 5.0 if case == "soft-capped" else None
    allowed = causal_mask(2, n, kv_length, pad)
    mask = None if case in ("whole prompt", "soft-capped") else allowed
    out = dense_attention(layer(), module, q, k, v, mask, 0.25, pad, LogitFeatures(softcap=softcap, sinks=sinks))
    assert bool(fake.keys) == (case in ("whole prompt", "chunk"))
    torch.testing.assert_close(out.double(), sink_oracle(q, k, v, allowed, 0.25, sinks, softcap),
                               atol=2e-2, rtol=2e-2)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="cuDNN runs on CUDA")
@pytest.mark.parametrize("shape", [(1, 64, 8, 1000, 1000, 64), (2, 8, 2, 1037, 1549, 64), (1, 32, 8, 300, 300, 128)])
def test_on_a_gpu_sinks_run_in_cudnn_and_equal_the_oracle(shape):
    """The real op (gpt-oss-20b's heads and head dim among the shapes): a whole prompt and a split chunk."""
    import hf_rocketkv.integration.attention as attention
    from hf_rocketkv.selection.logit_features import LogitFeatures

    batch, hq, hkv, n, kv_length, dim = shape
    q, k, v, module = inputs(batch, hq, hkv, n, kv_length, dim, torch.bfloat16, seed=sum(shape), device="cuda")
    sinks = torch.linspace(-3.0, 9.0, hq, device="cuda").to(torch.bfloat16)
    allowed = causal_mask(batch, n, kv_length).cuda()
    mask = None if n == kv_length else allowed
    assert attention.cudnn_runs(q, k, v, kv_length - n)
    out = dense_attention(layer(), module, q, k, v, mask, dim ** -0.5, [0] * batch, LogitFeatures(sinks=sinks))
    assert out.shape == (batch, n, hq, dim) and out.is_contiguous()
    torch.testing.assert_close(out.double(), sink_oracle(q, k, v, allowed, dim ** -0.5, sinks), atol=2e-2, rtol=2e-2)


@pytest.mark.parametrize("additive", [False, True], ids=["bool", "additive"])
def test_real_queries_are_those_that_see_their_own_column(additive):
    """A replayed forward's real queries (a prefix hit on a sliding model): each real query sees its own input column;
    a padding query (left padding of row 0) does not. Counted from the mask's diagonal, bool or additive."""
    from hf_rocketkv.integration.attention import real_query_count

    batch, n, kv = 2, 6, 10
    first = kv - n  # the queries are the last columns
    allowed = causal_mask(batch, n, kv, pad=[6])  # row 0: input columns 0..5 are padding, its queries at 4 and 5 too
    mask = torch.zeros(allowed.shape).masked_fill(~allowed, torch.finfo(torch.float32).min) if additive else allowed
    expected = sum(bool(allowed[b, 0, j, first + j]) for b in range(batch) for j in range(n))
    assert expected == batch * n - 2
    assert real_query_count(mask, first, batch, n) == expected
    assert real_query_count(None, first, batch, n) == batch * n
