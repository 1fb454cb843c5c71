"""A sliding layer's prefill attention as one flash call with a window (integration/window_prefill.py).

- The op's CPU twin (``flash_twin``), written from its spec (PyTorch's flash_attn ``mha_fwd`` and ``mask.h``: query
  row ``i`` of ``n`` sees key columns ``i + kv - n - window_size_left <= c <= i + kv - n + window_size_right``;
  ``is_causal`` sets ``window_size_right = 0``; a left window of at least ``kv`` means none), stands in for
  ``torch.ops.aten._flash_attention_forward`` on the CPU, with the device check forced: ``window_attention`` given
  the layer then equals the float64 oracle of tests/integration/test_attention_spans.py over grouped-query ratios,
  head dims, whole prompts and chunks after keys, windows shorter and longer than the keys, with and without sinks.
- ``is_window_band`` against masks of transformers' own mask functions (the sliding causal one, with padding) and
  the ``None`` masks transformers hands over when it skips the mask; ``window_band`` compares once per mask object.
- Tiny random Gemma 3, gpt-oss, Mistral (window), Cohere 2 and Gemma 2 through ``generate()`` (a whole prompt, a
  chunked prefill, a padded batch) and gpt-oss through ``generate_batch`` on a ``KVBlockPool`` in 16-token prefill
  chunks: the same tokens and logits with the band route on (the twin) as off (``_TAKES_WINDOW`` False), the route
  taken (Gemma 2's soft-capping never takes it).
- On a GPU (``-m gpu``): the real op against the float64 oracle in bfloat16, with and without sinks.
"""

from __future__ import annotations

import copy
from types import SimpleNamespace

import pytest
import torch
from transformers import masking_utils

from hf_rocketkv import RocketKVCache
from hf_rocketkv.cache.layer import GenerationHints
from hf_rocketkv.integration import window_prefill
from hf_rocketkv.integration.attention import window_attention
from hf_rocketkv.integration.call_state import CallState, call_state
from hf_rocketkv.integration.compat import cache_kwargs
from hf_rocketkv.selection.logit_features import PLAIN, LogitFeatures
from tests.integration.test_attention import inputs
from tests.integration.test_attention_spans import oracle
from tests.support.hybrid_models import HYBRID_ARCHS, WINDOW, make_hybrid_models
from tests.support.tiny_models import cpu_pool, greedy, greedy_with_logits, keep_all_config, left_pad, random_ids

SCALING = 0.125
FLASH_SHAPES = [  # (batch, Hq, Hkv, n, kv, D): grouped-query ratios 1, 2, 4; head dims 64, 128, 256
    (2, 2, 2, 24, 24, 64),  # a whole prompt
    (2, 4, 2, 24, 24, 128),
    (2, 8, 2, 24, 24, 256),
    (2, 2, 2, 9, 40, 128),  # a chunk after earlier keys
    (2, 4, 2, 9, 40, 256),
    (2, 8, 2, 9, 40, 64),
]
WINDOWS = [5, 16, 64]  # shorter than the keys, then longer than them


# ------------------------------------------------------------------------------------------ the op's twin
def flash_twin(query, key, value, cum_seq_q, cum_seq_k, max_q, max_k, dropout_p, is_causal, return_debug_mask, *,
               scale=None, window_size_left=None, window_size_right=None, seqused_k=None, alibi_slopes=None):
    """``torch.ops.aten._flash_attention_forward`` on the CPU, from its spec: inputs ``[B, L, H, D]`` (sequence before
    heads), a batch of equal lengths (no cumulative lengths); float64 masked softmax; returns ``(out [B, Lq, Hq, D]``
    in the query's dtype and layout, ``logsumexp [B, Hq, Lq]`` fp32, and three unused tensors)."""
    assert cum_seq_q is None and cum_seq_k is None and seqused_k is None and alibi_slopes is None
    assert dropout_p == 0.0 and return_debug_mask is False
    batch, n, q_heads, dim = query.shape
    kv, kv_heads = key.shape[1], key.shape[2]
    assert (max_q, max_k) == (n, kv) and value.shape == key.shape and key.shape[0] == batch
    assert q_heads % kv_heads == 0 and dim <= 256 and dim % 8 == 0
    assert all(t.stride(-1) == 1 for t in (query, key, value))
    left = -1 if window_size_left is None else int(window_size_left)  # attention.cu: None is -1, "no limit" ...
    right = (0 if is_causal else -1) if window_size_right is None else int(window_size_right)
    left, right = (-1 if left >= kv else left), (-1 if right >= kv else right)  # mha_fwd: past the keys = none
    if is_causal and n > 1:  # (one query: mha_fwd drops the causal flag, the given right window stays)
        right = 0
    group = q_heads // kv_heads
    q = query.double().transpose(1, 2)
    k = key.double().transpose(1, 2).repeat_interleave(group, dim=1)
    v = value.double().transpose(1, 2).repeat_interleave(group, dim=1)
    logits = (q @ k.transpose(-1, -2)) * (dim ** -0.5 if scale is None else scale)
    diagonal = kv - n + torch.arange(n)[:, None]  # mask.h: bottom-right aligned
    column = torch.arange(kv)[None, :]
    allowed = torch.ones(n, kv, dtype=torch.bool)
    if right >= 0:
        allowed &= column <= diagonal + right
    if left >= 0:
        allowed &= column >= diagonal - left
    logits = logits.masked_fill(~allowed, float("-inf"))
    lse = torch.logsumexp(logits, dim=-1)
    result = torch.softmax(logits, dim=-1).nan_to_num(0.0) @ v
    out = torch.empty_like(query)  # the op's output: empty_like(query), so the query's layout
    out.copy_(result.transpose(1, 2))
    unused = torch.empty(0)
    return out, lse.float(), unused, unused, unused


class Twin:
    """``flash_twin`` counting its calls (the band route taken)."""

    def __init__(self):
        self.calls = 0

    def __call__(self, *args, **kwargs):
        self.calls += 1
        return flash_twin(*args, **kwargs)


@pytest.fixture
def twin(monkeypatch):
    """The twin in place of the op, and the device check passed on the CPU (float32)."""
    counting = Twin()
    monkeypatch.setattr(window_prefill, "_FLASH_FORWARD", counting)
    monkeypatch.setattr(window_prefill, "_TAKES_WINDOW", True)
    monkeypatch.setattr(window_prefill, "flash_device_runs", lambda query, key, value: True)
    return counting


def band_mask(batch, n, kv, window):
    """The band as a bool ``[B, 1, n, kv]`` mask: query j sees columns ``kv - n + j - (window - 1) .. kv - n + j``."""
    own = kv - n + torch.arange(n)[:, None]
    column = torch.arange(kv)[None, :]
    return ((column <= own) & (column > own - window))[None, None].expand(batch, 1, n, kv)


def transformers_mask(batch, n, kv, window, padding=None, kv_offset=0):
    """transformers' sliding causal mask of a forward of ``n`` queries over ``kv`` keys whose first key is position
    ``kv_offset`` (the queries are the last keys), from its own mask functions evaluated on the index grid; with
    ``padding`` (bool ``[B, kv_offset + kv]``, True = real token) its padding mask too."""
    mask_function = masking_utils.sliding_window_causal_mask_function(window)
    if padding is not None:
        mask_function = masking_utils.and_masks(mask_function, masking_utils.padding_mask_function(padding))
    rows = torch.arange(batch)[:, None, None, None]
    heads = torch.zeros(1, 1, 1, 1, dtype=torch.long)
    queries = (kv_offset + kv - n + torch.arange(n))[None, None, :, None]
    keys = (kv_offset + torch.arange(kv))[None, None, None, :]
    return mask_function(rows, heads, queries, keys).expand(batch, 1, n, kv)


def layer_stub(flash_window: bool = True):
    return SimpleNamespace(hints=GenerationHints(), flash_window=flash_window)


# ------------------------------------------------------------------------------------------ one call, the twin
@pytest.mark.parametrize("sinks", [False, True])
@pytest.mark.parametrize("window", WINDOWS)
@pytest.mark.parametrize("shape", FLASH_SHAPES)
def test_window_attention_through_the_twin_equals_the_oracle(twin, shape, window, sinks):
    batch, q_heads, kv_heads, n, kv, dim = shape
    q, k, v, module = inputs(batch, q_heads, kv_heads, n, kv, dim, torch.float32, seed=dim + window)
    sink_logits = torch.randn(q_heads, generator=torch.Generator().manual_seed(window)) * 2 if sinks else None
    features = LogitFeatures(sinks=sink_logits) if sinks else PLAIN
    mask = band_mask(batch, n, kv, window)
    out = window_attention(module, q, k, v, mask, SCALING, features, layer=layer_stub(), sliding_window=window)
    assert twin.calls == 1
    assert out.shape == (batch, n, q_heads, dim) and out.is_contiguous()
    expected = oracle(q, k, v, mask, SCALING, None, sink_logits)
    torch.testing.assert_close(out.double(), expected, rtol=1e-5, atol=1e-5)


def test_the_twin_reads_the_window_bottom_right_aligned():
    """The twin's own mask, written out: 3 queries after 5 keys, a left window of 2, causal: query j's own column is
    5 + j, and it sees that column and the two before it."""
    q, k, v, _ = inputs(1, 2, 1, 3, 8, 8, torch.float32, seed=0)
    v = torch.eye(8)[None, None, :, :].expand(1, 1, 8, 8).contiguous()  # value of key c: one-hot c
    out = flash_twin(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), None, None, 3, 8, 0.0, True, False,
                     scale=0.0, window_size_left=2, window_size_right=0)[0]
    seen = out[0, :, 0] > 0  # uniform logits (scale 0): each query's weights are 1/3 on its columns
    assert seen.tolist() == [[c in (3, 4, 5) for c in range(8)], [c in (4, 5, 6) for c in range(8)],
                             [c in (5, 6, 7) for c in range(8)]]


def test_a_mask_that_is_not_the_band_stays_on_the_old_path(twin):
    """Padding, soft-capping, no window, no layer, a single query: the twin is never called, the answer the
    oracle's."""
    batch, q_heads, kv_heads, n, kv, dim, window = 2, 4, 2, 12, 12, 64, 5
    q, k, v, module = inputs(batch, q_heads, kv_heads, n, kv, dim, torch.float32, seed=3)
    padding = torch.ones(batch, kv, dtype=torch.bool)
    padding[1, :3] = False
    padded = transformers_mask(batch, n, kv, window, padding)
    band = band_mask(batch, n, kv, window)
    cases = [
        (padded, PLAIN, layer_stub(), window),
        (band, LogitFeatures(softcap=3.0), layer_stub(), window),
        (band, PLAIN, layer_stub(flash_window=False), window),  # flash_window_prefill off
        (band, PLAIN, None, window),
    ]
    for mask, features, layer, sliding in cases:
        out = window_attention(module, q, k, v, mask, SCALING, features, layer=layer, sliding_window=sliding)
        expected = oracle(q, k, v, mask, SCALING, features.softcap, features.sinks)
        keep = padding[:, -n:, None, None]  # padding queries attend nothing real
        torch.testing.assert_close(out.double() * keep, expected * keep, rtol=1e-5, atol=1e-5)
    assert not window_prefill.flash_window_runs(q[:, :, -1:], k, v, window, PLAIN)  # one query: a decode step
    assert not window_prefill.flash_window_runs(q, k, v, None, PLAIN)
    assert twin.calls == 0


def test_graphs_and_compilation_keep_the_old_path(twin):
    q, k, v, module = inputs(1, 4, 2, 16, 16, 64, torch.float32, seed=4)
    layer = layer_stub()
    layer.hints.in_graph = True
    window_attention(module, q, k, v, band_mask(1, 16, 16, 6), SCALING, PLAIN, layer=layer, sliding_window=6)
    assert twin.calls == 0


def test_flash_window_runs_checks_the_op_dims_and_device(monkeypatch):
    q, k, v, _ = inputs(1, 4, 2, 8, 8, 64, torch.float32, seed=5)
    assert not window_prefill.flash_window_runs(q, k, v, 4, PLAIN)  # the CPU: no flash kernel
    monkeypatch.setattr(window_prefill, "flash_device_runs", lambda query, key, value: True)
    assert window_prefill.flash_window_runs(q, k, v, 4, PLAIN)
    assert window_prefill.flash_window_runs(q, k, v, 4, LogitFeatures(sinks=torch.zeros(4)))
    assert not window_prefill.flash_window_runs(q, k, v, 4, LogitFeatures(softcap=2.0))
    for dim in (12, 264):  # not a multiple of 8; over 256
        qd, kd, vd, _ = inputs(1, 4, 2, 8, 8, dim, torch.float32, seed=5)
        assert not window_prefill.flash_window_runs(qd, kd, vd, 4, PLAIN)
    assert not window_prefill.flash_window_runs(q, k[:, :, :4], v[:, :, :4], 4, PLAIN)  # more queries than keys
    monkeypatch.setattr(window_prefill, "_TAKES_WINDOW", False)
    assert not window_prefill.flash_window_runs(q, k, v, 4, PLAIN)


# ------------------------------------------------------------------------------------------ the band check
@pytest.mark.parametrize("window", [1, 4, 8, 30])
@pytest.mark.parametrize("n, kv, offset", [(20, 20, 0), (6, 13, 9), (1, 8, 20)])
def test_transformers_sliding_masks_are_the_band(window, n, kv, offset):
    """A forward without padding: transformers' sliding causal mask (its mask functions; ``kv_offset`` the
    position of the first stored key) is the band, as bool and as an additive float mask."""
    mask = transformers_mask(2, n, kv, window, kv_offset=offset)
    assert window_prefill.is_window_band(mask, n, kv, window)
    additive = torch.zeros(mask.shape).masked_fill(~mask, torch.finfo(torch.float32).min)
    assert window_prefill.is_window_band(additive, n, kv, window)
    assert not window_prefill.is_window_band(mask, n, kv, window + 1) or kv <= window  # another window
    assert not window_prefill.is_window_band(mask[:, :, 1:], n, kv, window)  # other shapes
    assert not window_prefill.is_window_band(mask.expand(2, 3, n, kv), n, kv, window)  # a mask per head


def test_padding_and_an_extra_masked_element_are_not_the_band():
    n, window = 16, 5
    padding = torch.ones(2, n, dtype=torch.bool)
    padding[0, :4] = False  # row 0 left-padded by 4
    assert not window_prefill.is_window_band(transformers_mask(2, n, n, window, padding), n, n, window)
    one_off = transformers_mask(2, n, n, window).clone()
    one_off[1, 0, 9, 8] = False  # one element the band allows, masked
    assert not window_prefill.is_window_band(one_off, n, n, window)
    one_more = transformers_mask(2, n, n, window).clone()
    one_more[1, 0, 9, 2] = True  # one element outside the band, allowed
    assert not window_prefill.is_window_band(one_more, n, n, window)
    causal = transformers_mask(2, n, n, n)  # plain causal: the band of a window as long as the forward, only
    assert not window_prefill.is_window_band(causal, n, n, window)
    assert window_prefill.is_window_band(causal, n, n, n)


@pytest.mark.parametrize("rows_per_block", [1, 3, 7])
def test_the_band_is_compared_a_block_of_rows_at_a_time(monkeypatch, rows_per_block):
    """``BAND_BLOCK_ELEMENTS`` bounds the comparison's temporaries (a 128k prompt's mask is 15 GiB): in blocks of 1,
    3 or 7 query rows (the last one partial), the band is still found, as bool and as an additive mask, and one wrong
    element in the first, a middle or the last row is still seen."""
    batch, n, kv, window = 2, 16, 20, 5
    monkeypatch.setattr(window_prefill, "BAND_BLOCK_ELEMENTS", rows_per_block * kv * batch)
    mask = transformers_mask(batch, n, kv, window, kv_offset=3).clone()
    assert window_prefill.is_window_band(mask, n, kv, window)
    assert window_prefill.is_window_band(torch.zeros(mask.shape).masked_fill(~mask, -1e9), n, kv, window)
    for row in (0, 8, n - 1):
        own = kv - n + row
        for column, value in ((own, False), (own - window, True)):  # the query's own key masked; one past the window
            wrong = mask.clone()
            wrong[1, 0, row, column] = value
            assert not window_prefill.is_window_band(wrong, n, kv, window)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_the_band_check_of_a_long_mask_allocates_a_block_not_the_mask():
    """A 32k-token forward's mask (1 GiB of bool) is compared with a few blocks' worth of temporaries (the band,
    its two halves, the comparison: 4 blocks and the aranges), not with a band of the mask's size."""
    n = window = 32768
    mask = torch.ones(n, n, dtype=torch.bool, device="cuda").tril_()[None, None]
    torch.cuda.synchronize()
    before = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    assert window_prefill.is_window_band(mask, n, n, window)
    assert torch.cuda.max_memory_allocated() - before <= 6 * window_prefill.BAND_BLOCK_ELEMENTS


def test_a_skipped_mask_is_the_band_only_where_causal_is():
    """transformers hands no mask where sdpa's own causal flag does the masking (a square forward shorter than the
    window, no padding): that is the band when the forward is no longer than the window; a longer square forward
    read as causal sees keys outside the window; a chunk after keys read so (upper-left causal) is not the band."""
    assert window_prefill.is_window_band(None, 6, 6, 8)
    assert window_prefill.is_window_band(None, 8, 8, 8)
    assert not window_prefill.is_window_band(None, 9, 9, 8)
    assert not window_prefill.is_window_band(None, 4, 10, 8)


def test_window_band_compares_once_per_mask_object(monkeypatch):
    compares = []
    real = window_prefill.is_window_band
    monkeypatch.setattr(window_prefill, "is_window_band", lambda *a: compares.append(a[1:]) or real(*a))
    layer = layer_stub()
    mask = transformers_mask(1, 12, 12, 4)
    assert window_prefill.window_band(layer, mask, 12, 12, 4) and len(compares) == 1
    assert window_prefill.window_band(layer, mask, 12, 12, 4) and len(compares) == 1  # same mask: remembered
    memo = call_state(layer).mask_memos["band"]
    assert memo[0]() is mask and memo[1:] == ((12, 12, 4), True)
    fresh = mask.clone()  # a new forward's mask: a new object, compared again
    assert window_prefill.window_band(layer, fresh, 12, 12, 4) and len(compares) == 2
    assert not window_prefill.window_band(layer, fresh, 12, 12, 5) and len(compares) == 3  # asked for another window
    assert window_prefill.window_band(layer, None, 3, 3, 4) and len(compares) == 4  # no mask: nothing remembered
    assert call_state(layer).mask_memos["band"][0]() is fresh
    assert copy.deepcopy(call_state(layer)).mask_memos == {}  # a copied cache forgets the latest forward's memos
    assert CallState().mask_memos == {}


# ------------------------------------------------------------------------------------------ models, end to end
ARCHS = list(HYBRID_ARCHS)


@pytest.fixture(scope="module", params=ARCHS)
def hybrid(request):
    return request.param, make_hybrid_models(request.param)[0]


def run_both(monkeypatch, twin, run):
    """``run()`` with the band route off (``_TAKES_WINDOW`` False), then on (the twin): both results and the twin's
    calls."""
    monkeypatch.setattr(window_prefill, "_TAKES_WINDOW", False)
    off = run()
    assert twin.calls == 0
    monkeypatch.setattr(window_prefill, "_TAKES_WINDOW", True)
    return off, run(), twin.calls


def check_route(arch, calls):
    if arch == "gemma2":  # soft-capped logits: the op takes no cap
        assert calls == 0
    else:
        assert calls > 0, f"{arch}: the band route was never taken"


@pytest.mark.parametrize("chunk", [None, 6])
def test_generate_takes_the_band_and_gives_the_same_tokens_and_logits(hybrid, twin, monkeypatch, chunk):
    """Two rows of 40 tokens (batch 2, no padding) as one prompt or in chunks of 6 (the first chunk shorter than
    the window: transformers skips its mask)."""
    arch, rocket = hybrid
    ids = torch.cat([random_ids(1, 40, seed=21), random_ids(1, 40, seed=22)])
    mask = torch.ones_like(ids)
    extra = {} if chunk is None else {"prefill_chunk_size": chunk}

    def run():
        out = greedy(rocket, ids, max_new_tokens=8, attention_mask=mask, output_logits=True,
                     return_dict_in_generate=True,
                     **cache_kwargs(RocketKVCache(keep_all_config(flash_window_prefill=True))), **extra)
        return out.sequences, torch.stack(out.logits).float()

    (tokens_off, logits_off), (tokens_on, logits_on), calls = run_both(monkeypatch, twin, run)
    check_route(arch, calls)
    assert torch.equal(tokens_on, tokens_off), arch
    torch.testing.assert_close(logits_on, logits_off, rtol=1e-4, atol=1e-4)


def test_flash_window_prefill_false_keeps_the_previous_path(twin):
    """flash_window_prefill=False: the twin is never called, on any layer; the default takes the route."""
    rocket = make_hybrid_models("gemma3")[0]
    ids = random_ids(1, 30, seed=8)
    off = RocketKVCache(keep_all_config(flash_window_prefill=False))
    greedy_with_logits(rocket, ids, torch.ones_like(ids), off, 4)
    assert twin.calls == 0
    greedy_with_logits(rocket, ids, torch.ones_like(ids), RocketKVCache(keep_all_config()), 4)
    assert twin.calls == 3


def test_a_padded_batch_keeps_its_prefill_on_the_old_path(twin, monkeypatch):
    """Gemma 3, rows of 37 and 21 tokens left-padded: the prefill's mask is not the band (the twin is not called
    for it), the tokens are those of the band route off."""
    rocket = make_hybrid_models("gemma3")[0]
    ids, mask = left_pad([random_ids(1, n, seed=n)[0] for n in (37, 21)])
    answers = []
    real = window_prefill.is_window_band
    monkeypatch.setattr(window_prefill, "is_window_band", lambda *a: answers.append(real(*a)) or answers[-1])

    def run():
        return greedy_with_logits(rocket, ids, mask, RocketKVCache(keep_all_config(flash_window_prefill=True)), 6)

    (tokens_off, logits_off), (tokens_on, logits_on), calls = run_both(monkeypatch, twin, run)
    assert calls == 0 and answers == [False]  # one prefill forward, compared once, not the band
    assert torch.equal(tokens_on, tokens_off)
    torch.testing.assert_close(logits_on, logits_off, rtol=0, atol=0)


def test_one_prefill_forward_compares_its_mask_once(twin, monkeypatch):
    """Gemma 3's three sliding layers share the forward's mask: one device comparison for the prefill, none for the
    decode steps (one query each)."""
    rocket = make_hybrid_models("gemma3")[0]
    compares = []
    real = window_prefill.is_window_band
    monkeypatch.setattr(window_prefill, "is_window_band", lambda *a: compares.append(a[1:]) or real(*a))
    ids = random_ids(1, 30, seed=8)
    greedy_with_logits(rocket, ids, torch.ones_like(ids), RocketKVCache(keep_all_config(flash_window_prefill=True)), 4)
    assert compares == [(30, 30, WINDOW)]
    assert twin.calls == 3  # each sliding layer of the prefill: one call


def test_generate_batch_on_a_pool_in_16_token_chunks_gives_the_same_tokens(twin, monkeypatch):
    """gpt-oss (sinks) through the batching engine on a KVBlockPool, prompts prefilled in chunks of 16 tokens."""
    from hf_rocketkv.serving import SamplingParams, generate_batch
    from hf_rocketkv.serving.batching.scheduler import BatchingConfig

    served = make_hybrid_models("gpt_oss")[0]
    config = keep_all_config(kt_cache_dtype="float32", flash_window_prefill=True)
    prompts = [random_ids(1, n, seed=900 + n)[0].tolist() for n in (45, 12, 29)]
    batching = BatchingConfig(max_running=4, buckets=(1, 2, 4), prefill_chunk_tokens=16, prefill_token_budget=16)

    def run():
        pool = cpu_pool(served, config, 2 << 20, 8)
        results = generate_batch(served, prompts, config=config, pool=pool, sampling=SamplingParams.greedy(6),
                                 batching=batching)
        return [list(r.token_ids) for r in results]

    off, on, calls = run_both(monkeypatch, twin, run)
    assert calls > 0
    assert on == off


# ------------------------------------------------------------------------------------------ the real op (GPU)
@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("sinks", [False, True])
@pytest.mark.parametrize("window", WINDOWS + [1024])
@pytest.mark.parametrize("shape", FLASH_SHAPES + [(1, 16, 8, 1000, 1000, 256), (2, 8, 2, 300, 1323, 64)])
def test_the_flash_op_with_a_window_equals_the_oracle_on_a_gpu(shape, window, sinks):
    """bfloat16 against the float64 oracle under the band; the routed call (the layer given, the mask compared)
    gives the very same output."""
    batch, q_heads, kv_heads, n, kv, dim = shape
    q, k, v, module = inputs(batch, q_heads, kv_heads, n, kv, dim, torch.bfloat16, seed=dim + window, device="cuda")
    sink_logits = torch.randn(q_heads, generator=torch.Generator().manual_seed(window)) * 2
    features = LogitFeatures(sinks=sink_logits.to("cuda", torch.bfloat16)) if sinks else PLAIN
    assert window_prefill.flash_window_runs(q, k, v, window, features)
    mask = band_mask(batch, n, kv, window).to("cuda")
    out = window_prefill.flash_window_attention(q, k, v, SCALING, window, features.sinks)
    assert out.shape == (batch, n, q_heads, dim) and out.is_contiguous()
    expected = oracle(q, k, v, mask, SCALING, None, features.sinks)
    torch.testing.assert_close(out.double(), expected, rtol=3e-2, atol=3e-2)
    layer = layer_stub()
    routed = window_attention(module, q, k, v, mask, SCALING, features, layer=layer, sliding_window=window)
    assert call_state(layer).mask_memos["band"][2] is True  # the route compared the mask and took the band
    torch.testing.assert_close(routed, out, rtol=0, atol=0)
