"""What integration/causal_prefill.py hands cuDNN, and the graphs it builds ahead of time.

cuDNN builds an execution graph for every new (shape, strides, dtype, flags) it sees, ~70 ms each on an H100, and
keeps them per thread. These tests replace PyTorch's cuDNN attention op with a recording stand-in that computes the
attention (and each row's log-sum-exp) in float64 from the tensors it is given, so on the CPU they check:

* the inputs' signatures (what cuDNN keys its graphs by) depend on the query bucket and the keys before the chunk
  alone, not on the width of the buffer a chunk's keys are views of (the prompt's length), nor on the exact query
  count inside a bucket;
* the answers still equal a float64 oracle of lower-right causal attention;
* ``cudnn_shapes`` lists, for hand-worked chunk sizes and prompt lengths, exactly the shapes chunked prompts meet,
  and ``warm_cudnn_graphs`` then meets every signature a real chunk does.
On a GPU the real op runs the same paths (tests/integration/test_attention.py, ``gpu_steps.sh attention_tests``).
"""

from __future__ import annotations

import pytest
import torch

from hf_rocketkv.integration import causal_prefill
from hf_rocketkv.integration.causal_prefill import (
    CUDNN_QUERY_BUCKET,
    MIN_SPLIT_QUERIES,
    cudnn_shapes,
    cudnn_shapes_of_prompt,
)
from hf_rocketkv.kernels.merge_attention import merge_attention_torch
from tests.support.markers import slow_except

BUCKET = CUDNN_QUERY_BUCKET


class RecordingCudnn:
    """Stands in for ``aten._scaled_dot_product_cudnn_attention``: records each call's graph key and computes
    ``(out [B, Hq, L, D], lse [B, Hq, L, 1])`` in float64 (upper-left causal when asked), grouped-query heads
    read through ``h // (Hq / Hkv)``."""

    def __init__(self):
        self.keys = []

    def __call__(self, query, key, value, bias, log_sumexp, dropout, is_causal, debug_mask, scale):
        self.keys.append(tuple((tuple(t.shape), t.stride(), t.dtype) for t in (query, key, value))
                         + (log_sumexp, is_causal))
        group = query.shape[1] // key.shape[1]
        k = key.double().repeat_interleave(group, dim=1)
        v = value.double().repeat_interleave(group, dim=1)
        scores = (query.double() @ k.transpose(-1, -2)) * scale
        if is_causal:
            rows, cols = scores.shape[-2:]
            scores = scores.masked_fill(torch.ones(rows, cols, dtype=torch.bool).triu(1), float("-inf"))
        lse = torch.logsumexp(scores, dim=-1, keepdim=True)
        out = (scores - lse).exp() @ v
        return out.to(query.dtype), lse.float()


@pytest.fixture
def cudnn(monkeypatch):
    fake = RecordingCudnn()
    monkeypatch.setattr(causal_prefill, "_CUDNN_ATTENTION", fake)
    monkeypatch.setattr(causal_prefill, "merge_attention_triton", merge_attention_torch)  # (the CPU has no Triton)
    return fake


def oracle(query, key, value, scale):
    """Lower-right causal attention in float64, ``[B, Lq, Hq, D]``: query j sees keys ``<= Lk - Lq + j``."""
    group = query.shape[1] // key.shape[1]
    k = key.double().repeat_interleave(group, dim=1)
    v = value.double().repeat_interleave(group, dim=1)
    n, kv_length = query.shape[2], key.shape[2]
    scores = (query.double() @ k.transpose(-1, -2)) * scale
    column, row = torch.arange(kv_length, device=query.device), torch.arange(n, device=query.device)
    allowed = column[None, :] <= (kv_length - n + row)[:, None]
    return (scores.masked_fill(~allowed, float("-inf")).softmax(-1) @ v).transpose(1, 2)


def chunk_inputs(n, prefix, width, heads=4, kv_heads=2, dim=16, seed=0):
    """A chunk of ``n`` queries (the projections' layout) whose keys are the first ``prefix + n`` columns of a
    dense-store buffer ``[1, Hkv, width, D]`` as wide as its prompt."""
    g = torch.Generator().manual_seed(seed)
    query = torch.randn(1, n, heads, dim, generator=g).to(torch.bfloat16).transpose(1, 2)
    keys = torch.randn(1, kv_heads, width, dim, generator=g).to(torch.bfloat16)
    values = torch.randn(1, kv_heads, width, dim, generator=g).to(torch.bfloat16)
    return query, keys[:, :, :prefix + n], values[:, :, :prefix + n]


def signatures(fake, calls):
    start = len(fake.keys)
    for query, key, value, prefix in calls:
        causal_prefill.cudnn_causal_attention(query, key, value, 0.25, prefix)
    return fake.keys[start:]


@pytest.mark.parametrize("prefix", slow_except([0, BUCKET, 2 * BUCKET], keep=[0]))  # the others: 12-14 s each
def test_graph_keys_depend_on_the_bucket_and_the_keys_before_alone(cudnn, prefix):
    """Chunks of 1030 and 1100 queries (one bucket) in buffers of three widths give the same graph keys; a chunk of
    another bucket gives others."""
    n_values, widths = (MIN_SPLIT_QUERIES + 6, MIN_SPLIT_QUERIES + 76), (0, 37, 3 * BUCKET)
    keys = {tuple(signatures(cudnn, [chunk_inputs(n, prefix, prefix + n + extra, seed=n + extra)[:3] + (prefix,)]))
            for n in n_values for extra in widths}
    assert len(keys) == 1
    other = signatures(cudnn, [chunk_inputs(2 * BUCKET + 600, prefix, prefix + 2 * BUCKET + 600)[:3] + (prefix,)])
    assert tuple(other) not in keys
    assert len(other) == (2 if prefix else 1)  # a split: the keys before (no mask) and the chunk's own (causal)


def test_a_whole_prompt_of_a_bucket_s_length_is_not_copied(cudnn):
    """A prompt of exactly a bucket's length in the projections' layout goes to cuDNN as it is."""
    query, key, value = chunk_inputs(2 * BUCKET, 0, 2 * BUCKET)
    key, value = (t.transpose(1, 2).contiguous().transpose(1, 2) for t in (key, value))  # the projections' layout
    seen = []
    fake = causal_prefill._CUDNN_ATTENTION
    causal_prefill._CUDNN_ATTENTION = lambda q, k, v, *a, **kw: seen.append((q, k, v)) or fake(q, k, v, *a, **kw)
    try:
        causal_prefill.cudnn_causal_attention(query, key, value, 0.25, 0)
    finally:
        causal_prefill._CUDNN_ATTENTION = fake
    for given, original in zip(seen[0], (query, key, value)):  # the same memory, read in place
        assert given.data_ptr() == original.data_ptr() and given.stride() == original.stride()


@pytest.mark.parametrize("n,prefix,extra", [(37, 0, 0), (BUCKET, 0, 11), (MIN_SPLIT_QUERIES + 3, BUCKET, 9),
                                            (MIN_SPLIT_QUERIES, 2 * BUCKET, 0), (2 * BUCKET + 1, BUCKET, 300)])
def test_answers_equal_the_oracle_whatever_the_buffer(cudnn, n, prefix, extra):
    query, key, value = chunk_inputs(n, prefix, prefix + n + extra, seed=n + prefix)
    out = causal_prefill.cudnn_causal_attention(query, key, value, 0.25, prefix)
    assert out.shape == (1, n, 4, 16) and out.is_contiguous()
    torch.testing.assert_close(out.double(), oracle(query, key, value, 0.25), atol=2e-2, rtol=2e-2)


@pytest.mark.parametrize("chunk,prompt,expected", [
    (8192, 16384, [(b, 0) for b in range(512, 8193, 512)] + [(b, 8192) for b in range(1024, 8193, 512)]),
    (2048, 4096, [(512, 0), (1024, 0), (1536, 0), (2048, 0), (1024, 2048), (1536, 2048), (2048, 2048)]),
    # the chunk after 4096 keys has at most 904 queries: flash
    (2048, 5000, [(512, 0), (1024, 0), (1536, 0), (2048, 0), (1024, 2048), (1536, 2048), (2048, 2048)]),
    (8192, 1000, [(512, 0), (1024, 0)]),  # prompts of up to 1000 tokens: no later chunk
    (1000, 3000, [(512, 0), (1024, 0)]),  # later chunks start after 1000 and 2000 keys: not whole buckets, flash
    (2048, 2048, [(512, 0), (1024, 0), (1536, 0), (2048, 0)]),
])
def test_cudnn_shapes_hand_worked(chunk, prompt, expected):
    assert cudnn_shapes(chunk, prompt) == expected


def shapes_met(chunk, prompt_len):
    """(bucket, keys before) of each cuDNN call a prompt of ``prompt_len`` meets in chunks of ``chunk`` (the rules of
    the module docstring, written out: a first chunk always; a later one after a multiple of the bucket with at
    least MIN_SPLIT_QUERIES queries)."""
    met = []
    for start in range(0, prompt_len, chunk):
        n = min(chunk, prompt_len - start)
        if start == 0 or (start % BUCKET == 0 and n >= MIN_SPLIT_QUERIES):
            met.append((-(-n // BUCKET) * BUCKET, start))
    return met


@pytest.mark.parametrize("prompt,chunk,expected", [
    (1000, 8192, [(1024, 0)]),
    (8192, 8192, [(8192, 0)]),
    (9000, 8192, [(8192, 0)]),  # 808 queries after 8192 keys: flash
    (9300, 8192, [(8192, 0), (1536, 8192)]),  # 1108 queries: cuDNN, in the 1536 bucket
    (20000, 8192, [(8192, 0), (8192, 8192), (4096, 16384)]),  # 3616 queries after 16384 keys
    (16384, 16384, [(16384, 0)]),
    (3000, 1000, [(1024, 0)]),  # later chunks after 1000 and 2000 keys: not whole buckets, flash
])
def test_cudnn_shapes_of_one_prompt_hand_worked(prompt, chunk, expected):
    assert cudnn_shapes_of_prompt(prompt, chunk) == expected


@pytest.mark.parametrize("chunk,limit", [(8192, 16384), (2048, 9000), (1536, 6000), (3000, 7000)])
def test_the_shapes_of_every_prompt_up_to_a_limit_are_the_planned_ones(chunk, limit):
    met = {shape for length in range(1, limit + 1) for shape in cudnn_shapes_of_prompt(length, chunk)}
    assert met == set(cudnn_shapes(chunk, limit))


@pytest.mark.parametrize("chunk,limit", [(8192, 16384), (2048, 9000), (1536, 6000), (3000, 7000)])
def test_cudnn_shapes_cover_every_prompt_up_to_the_limit_and_nothing_more(chunk, limit):
    met = {shape for length in range(1, limit + 1) for shape in shapes_met(chunk, length)}
    assert set(cudnn_shapes(chunk, limit)) == met


def test_warm_up_meets_every_graph_key_a_real_chunk_meets(cudnn, monkeypatch):
    """After ``warm_cudnn_graphs`` over ``cudnn_shapes(C, N)``, the chunks of prompts up to N (keys in buffers as wide
    as each prompt) add no new graph key."""
    monkeypatch.setattr(causal_prefill, "cudnn_runs", lambda q, k, v, prefix: True)
    chunk, limit = 2 * BUCKET, 5 * BUCKET
    assert causal_prefill.warm_cudnn_graphs(cudnn_shapes(chunk, limit), 4, 2, 16, torch.bfloat16,
                                            torch.device("cpu")) == len(cudnn_shapes(chunk, limit))
    warmed = set(cudnn.keys)
    for length in (BUCKET - 5, 2 * BUCKET, 3 * BUCKET + 7, 4 * BUCKET + 600, 5 * BUCKET):
        for bucket, start in shapes_met(chunk, length):
            n = min(chunk, length - start)
            query, key, value = chunk_inputs(n, start, length, seed=length)
            assert set(signatures(cudnn, [(query, key, value, start)])) <= warmed, (length, start)


def test_warm_up_runs_nothing_where_cudnn_does_not(cudnn):
    """CPU tensors (and float32): cudnn_runs says no, so nothing is built."""
    assert causal_prefill.warm_cudnn_graphs(cudnn_shapes(2048, 4096), 4, 2, 16, torch.bfloat16,
                                            torch.device("cpu")) == 0
    assert not cudnn.keys


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="cuDNN runs on CUDA")
def test_on_a_gpu_the_warm_up_runs_cudnn_on_every_shape_and_chunks_still_equal_the_oracle():
    """The real op: every planned shape runs (head dims of 64 and 128: cuDNN's on an H100), then chunks of prompts
    in buffers as wide as each prompt equal the float64 oracle."""
    chunk, limit = 2 * BUCKET, 5 * BUCKET
    shapes = cudnn_shapes(chunk, limit)
    for dim in (64, 128):
        assert causal_prefill.warm_cudnn_graphs(shapes, 8, 2, dim, torch.bfloat16, torch.device("cuda")) == len(shapes)
        for length in (3 * BUCKET + 7, 4 * BUCKET + 600):
            for _, start in shapes_met(chunk, length):
                n = min(chunk, length - start)
                query, key, value = (t.cuda() for t in chunk_inputs(n, start, length, heads=8, dim=dim, seed=length))
                assert causal_prefill.cudnn_runs(query, key, value, start) == (start == 0 or n >= MIN_SPLIT_QUERIES)
                out = causal_prefill.causal_prefill_attention(query, key, value, dim ** -0.5)
                torch.testing.assert_close(out.double(), oracle(query, key, value, dim ** -0.5),
                                           atol=2e-2, rtol=2e-2)


def sink_oracle(query, key, value, scale, sinks):
    """``oracle`` with one sink logit per query head joining each row's softmax (a key of zero value), float64."""
    group = query.shape[1] // key.shape[1]
    k = key.double().repeat_interleave(group, dim=1)
    v = value.double().repeat_interleave(group, dim=1)
    n, kv_length = query.shape[2], key.shape[2]
    scores = (query.double() @ k.transpose(-1, -2)) * scale
    column, row = torch.arange(kv_length), torch.arange(n)
    scores = scores.masked_fill(~(column[None, :] <= (kv_length - n + row)[:, None]), float("-inf"))
    sink = sinks.double()[None, :, None, None].expand(*scores.shape[:-1], 1)
    probs = torch.cat([scores, sink], dim=-1).softmax(-1)[..., :-1]
    return (probs @ v).transpose(1, 2)


@pytest.mark.parametrize("n,prefix,extra", [(37, 0, 0), (BUCKET, 0, 11), (MIN_SPLIT_QUERIES + 3, BUCKET, 9)])
def test_sinks_through_the_log_sum_exp_equal_the_oracle(cudnn, n, prefix, extra):
    """gpt-oss' sinks on the cuDNN path: a whole prompt and a split chunk, each row scaled by ``sigmoid(lse -
    sink)``, equal attention with the sink in the softmax; sinks large enough to take most of a row's mass, and
    negative ones, so that a wrong scale (or none) fails."""
    query, key, value = chunk_inputs(n, prefix, prefix + n + extra, seed=5 + n)
    sinks = torch.tensor([3.0, -2.0, 9.0, 6.0]).to(torch.bfloat16)
    out = causal_prefill.cudnn_causal_attention(query, key, value, 0.25, prefix, sinks)
    assert out.shape == (1, n, 4, 16) and out.is_contiguous() and out.dtype == torch.bfloat16
    expected = sink_oracle(query, key, value, 0.25, sinks)
    torch.testing.assert_close(out.double(), expected, atol=2e-2, rtol=2e-2)
    plain = causal_prefill.cudnn_causal_attention(query, key, value, 0.25, prefix)
    assert (plain.double() - expected).abs().max() > 0.1  # the sinks change the answer: the check above can fail


def test_a_warm_up_with_sinks_meets_every_graph_key_a_sink_chunk_meets(cudnn, monkeypatch):
    """A model with sinks asks cuDNN for each row's log-sum-exp even on a whole prompt: other graphs than a plain
    model's. ``warm_cudnn_graphs(..., sinks=True)`` builds those, so its chunks add no new graph key; the plain
    warm-up would miss some (so this check can fail)."""
    monkeypatch.setattr(causal_prefill, "cudnn_runs", lambda q, k, v, prefix: True)
    chunk, limit = 2 * BUCKET, 4 * BUCKET
    shapes = cudnn_shapes(chunk, limit)
    causal_prefill.warm_cudnn_graphs(shapes, 4, 2, 16, torch.bfloat16, torch.device("cpu"))
    plain, start = set(cudnn.keys), len(cudnn.keys)
    causal_prefill.warm_cudnn_graphs(shapes, 4, 2, 16, torch.bfloat16, torch.device("cpu"), sinks=True)
    with_sinks = set(cudnn.keys[start:])  # the keys the warm-up with sinks built
    sinks = torch.zeros(4, dtype=torch.bfloat16)
    met = set()
    for length in (BUCKET - 5, 3 * BUCKET + 7, 4 * BUCKET):
        for _, start in shapes_met(chunk, length):
            n = min(chunk, length - start)
            query, key, value = chunk_inputs(n, start, length, seed=length)
            before = len(cudnn.keys)
            causal_prefill.cudnn_causal_attention(query, key, value, 0.25, start, sinks)
            met |= set(cudnn.keys[before:])
    assert met <= with_sinks
    assert not met <= plain  # a whole prompt's graph with the log-sum-exp is not among the plain ones
