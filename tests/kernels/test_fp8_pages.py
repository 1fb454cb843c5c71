"""fp8 (e4m3) pool pages in the paged decode ops: reads dequantize, the decode append follows the fp8 write rule,
stage 1's compaction quantizes the row's pages; every backend, with ``k_scale`` / ``v_scale`` [N] ("page") or
[N, Hkv] ("head").

Oracles are independent of the ops under test: stored bytes and scales come from ``memory/fp8.py`` and
``memory/page_io.write_tokens`` (the pool's reference writes) over float data, attention from float64 loops over
the dequantized tokens of ``page_io.read_tokens``. Pools start with random (finite) e4m3 bytes and scales in every
page, so a stale byte that entered a scale or a read would show. Triton runs under the interpreter on CPU
(TRITON_INTERPRET=1, tests/conftest.py and this folder's conftest.py).
"""

import collections

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from hf_rocketkv.kernels.append_token import fp8_append_torch, paged_append_kv_torch, paged_append_token_torch
from hf_rocketkv.kernels.paged import paged_compact_row_torch
from hf_rocketkv.kernels.sparse_decode_attention import (
    paged_sparse_decode_attention_torch,
    sparse_decode_attention_launch,
)
from hf_rocketkv.memory.fp8 import FP8_DTYPE, FP8_MAX, dequantize_fp8, fp8_scales, quantize_fp8
from hf_rocketkv.memory.layout import LayerShape
from hf_rocketkv.memory.page_io import read_tokens, write_tokens
from hf_rocketkv.memory.storage import LayerStorage
from hf_rocketkv.selection import stage2_pages as ref
from tests.kernels.kernel_utils import DEVICE, OUT_ATOL, gen, ops, page_table, randn, selected_slots

pytestmark = pytest.mark.gpu  # compiled for the GPU where one is present (pytest -m gpu); interpreted on CPU

GRANULARITIES = ("page", "head")


# ------------------------------------------------------------------------------------------------------- fixtures
def _garbage_fp8(shape, g) -> torch.Tensor:
    """Random e4m3 bytes, NaN codes (0x7f, 0xff) replaced by zero: a previous owner's finite leftovers."""
    raw = torch.randint(0, 256, shape, generator=g, dtype=torch.uint8)
    raw[(raw & 0x7F) == 0x7F] = 0
    return raw.view(FP8_DTYPE).to(DEVICE)


def _pool(num_pages, heads, page_tokens, kt_page, head_dim, granularity, g):
    """An fp8 layer of garbage: pages, scales in [0.1, 10), KT; wrapped in a LayerStorage for page_io."""
    scale_shape = (num_pages,) if granularity == "page" else (num_pages, heads)
    shape = LayerShape(num_kv_heads=heads, head_dim=head_dim, page_size=page_tokens, kt_page_size=kt_page,
                       kv_dtype=FP8_DTYPE, kt_dtype=torch.float32, scale_granularity=granularity)
    return LayerStorage(
        shape=shape,
        k=_garbage_fp8((num_pages, heads, page_tokens, head_dim), g),
        v=_garbage_fp8((num_pages, heads, page_tokens, head_dim), g),
        kt=randn((num_pages, heads, page_tokens // kt_page, 2, head_dim), torch.float32, g, scale=50.0),
        k_scale=(torch.rand(scale_shape, generator=g) * 9.9 + 0.1).to(DEVICE),
        v_scale=(torch.rand(scale_shape, generator=g) * 9.9 + 0.1).to(DEVICE),
    )


def _clone(layer: LayerStorage) -> LayerStorage:
    return LayerStorage(shape=layer.shape, k=layer.k.clone(), v=layer.v.clone(), kt=layer.kt.clone(),
                        k_scale=layer.k_scale.clone(), v_scale=layer.v_scale.clone())


def _head_view(layer: LayerStorage, h: int) -> LayerStorage:
    """KV head h of a "head"-granularity layer as a one-head layer (views: page_io writes land in ``layer``)."""
    shape = LayerShape(num_kv_heads=1, head_dim=layer.shape.head_dim, page_size=layer.shape.page_size,
                       kt_page_size=layer.shape.kt_page_size, kv_dtype=FP8_DTYPE, kt_dtype=layer.kt.dtype,
                       scale_granularity="head")
    return LayerStorage(shape=shape, k=layer.k[:, h : h + 1], v=layer.v[:, h : h + 1], kt=layer.kt[:, h : h + 1],
                        k_scale=layer.k_scale[:, h : h + 1], v_scale=layer.v_scale[:, h : h + 1])


def _row_pages(table, b):
    return [p for p in table[b].tolist() if p >= 0]


def _fill_rows(layer, table, lengths, g, key_scale=None):
    """Rows' first ``lengths[b]`` tokens written by ``page_io.write_tokens`` (the pool's prefill writes).
    ``key_scale`` [Hkv]: per-head key magnitudes (so page and head scales differ). Returns the float tokens."""
    heads, dim = layer.shape.num_kv_heads, layer.shape.head_dim
    tokens = []
    for b, n in enumerate(lengths.tolist()):
        keys = torch.randn((heads, n, dim), generator=g) * 3.0
        if key_scale is not None:
            keys = keys * key_scale[:, None, None]
        values = torch.randn((heads, n, dim), generator=g)
        write_tokens(layer, _row_pages(table, b), 0, keys.to(DEVICE), values.to(DEVICE))
        tokens.append((keys, values))
    return tokens


def _bytes(t: torch.Tensor) -> torch.Tensor:
    return t.view(torch.uint8) if t.dtype == FP8_DTYPE else t


def _assert_bytes_equal(a: torch.Tensor, b: torch.Tensor, what: str):
    assert a.dtype == b.dtype and a.shape == b.shape, what
    differ = (_bytes(a) != _bytes(b)).nonzero()
    if len(differ):  # where, and the values on both sides: enough to tell a rounding from a wrong slot
        where = [tuple(i.tolist()) for i in differ[:6]]
        values = [(float(a[i].float()), float(b[i].float())) for i in where]
        raise AssertionError(f"{what}: {len(differ)} of {a.numel()} differ, first at {where}: {values}")


def _fp8_step(x: torch.Tensor, s: torch.Tensor) -> torch.Tensor:
    """One e4m3 step at value x stored with scale s: 2**(e - 3) * s for |x / s| in [2**e, 2**(e + 1)), e >= -6;
    2**-9 * s below the normal range."""
    scaled = (x / s).abs().clamp(min=2.0**-6)
    return torch.exp2(torch.floor(torch.log2(scaled)) - 3) * s


# ---------------------------------------------------------------------------------------------------- the errors
def _error_case(granularity="page"):
    g = gen("fp8-errors", granularity)
    layer = _pool(6, 2, 8, 4, 16, granularity, g)
    table = page_table([2, 1], 6, g)
    lengths = torch.tensor([3, 5], device=DEVICE)
    return layer, table, lengths


def _calls(layer, table, lengths, float_pages=False):
    """Every entry point, each as fn(k_pages, v_pages, k_scale, v_scale)."""
    batch, heads, dim = table.shape[0], layer.k.shape[1], layer.k.shape[3]
    positions = torch.zeros((batch, heads, table.shape[1] * 8), dtype=torch.int32, device=DEVICE)
    seen = torch.tensor(9, device=DEVICE)
    key = torch.randn(batch, heads, dim).to(DEVICE)
    q = torch.randn(batch, heads, 2, dim).to(DEVICE)
    idx = torch.zeros((batch, heads, 1), dtype=torch.long, device=DEVICE)
    valid = torch.ones((batch, heads, 1), dtype=torch.bool, device=DEVICE)
    kt = layer.kt.clone()
    dense = torch.randn(heads, 12, dim).to(DEVICE)
    slots = torch.arange(4, device=DEVICE).expand(heads, 4)
    row_positions = torch.zeros((heads, table.shape[1] * 8), dtype=torch.int32, device=DEVICE)
    calls = {}
    for backend, o in (("torch", None), ("triton", ops())):
        append = paged_append_token_torch if o is None else o.paged_append_token
        append_kv = paged_append_kv_torch if o is None else o.paged_append_kv
        attend = paged_sparse_decode_attention_torch if o is None else o.paged_sparse_decode_attention
        compact = paged_compact_row_torch if o is None else o.paged_compact_row
        calls[f"{backend}-append_token"] = lambda k, v, ks, vs, f=append: f(
            k, v, kt.clone(), table, positions.clone(), lengths.clone(), seen, key, key, 4, k_scale=ks, v_scale=vs)
        calls[f"{backend}-append_kv"] = lambda k, v, ks, vs, f=append_kv: f(
            k, v, table, positions.clone(), lengths.clone(), seen, key, key, k_scale=ks, v_scale=vs)
        calls[f"{backend}-attention"] = lambda k, v, ks, vs, f=attend: f(
            q, k, v, table, idx, valid, lengths, 4, 0.25, k_scale=ks, v_scale=vs)
        calls[f"{backend}-compact"] = lambda k, v, ks, vs, f=compact: f(
            dense, dense, slots, None, k, v, kt.clone(), table[0], 1, row_positions.clone(), 4, k_scale=ks,
            v_scale=vs)
    # the registered ops take the scales positionally: torch 2.11's ADInplaceOrView kernel of a mutating custom op
    # indexes its mutated arguments in the positional tuple (IndexError for keyword ones; 2.13 fills them in)
    calls["registered-append_token"] = lambda k, v, ks, vs: ops().paged_append_token.op(
        k, v, kt.clone(), table, positions.clone(), lengths.clone(), seen, key, key, 4, ks, vs)
    calls["registered-attention"] = lambda k, v, ks, vs: ops().paged_sparse_decode_attention.op(
        q, k, v, table, idx, valid, lengths, 4, 0.25, ks, vs)
    return calls


@pytest.mark.parametrize("entry", [f"{b}-{op}" for b in ("torch", "triton")
                                   for op in ("append_token", "append_kv", "attention", "compact")]
                         + ["registered-append_token", "registered-attention"])
def test_bad_scale_arguments_raise_value_errors(entry):
    layer, table, lengths = _error_case()
    call = _calls(layer, table, lengths)[entry]
    k, v, ks, vs = layer.k, layer.v, layer.k_scale, layer.v_scale
    float_k, float_v = k.float(), v.float()
    n = k.shape[0]
    bad = [
        ((float_k, float_v, ks, vs), r"k_scale / v_scale are given, so k_pages must be torch.float8_e4m3fn"),
        ((k, float_v, ks, vs), r"so v_pages must be torch.float8_e4m3fn"),
        ((k, v, None, None), r"k_pages are torch.float8_e4m3fn, so k_scale and v_scale .* are required"),
        ((float_k, v, None, None), r"v_pages are torch.float8_e4m3fn, so k_scale and v_scale"),
        ((k, v, ks, None), r"k_scale and v_scale go together .* v_scale is None"),
        ((k, v, None, vs), r"k_scale is None"),
        ((k, v, torch.ones(n + 1, device=DEVICE), vs), r"k_scale must be float32 \[N=6\] .* got shape \[7\]"),
        ((k, v, ks, torch.ones(n, 3, device=DEVICE)), r"v_scale must be .*\[N=6, Hkv=2\].* got shape \[6, 3\]"),
        ((k, v, ks, torch.ones(n, 2, 1, device=DEVICE)), r"v_scale must be .* got shape \[6, 2, 1\]"),
        ((k, v, ks.half(), vs), r"k_scale must be float32 .* got dtype torch.float16"),
        ((k, v, ks, vs.double()), r"v_scale must be float32 .* got dtype torch.float64"),
    ]
    for args, message in bad:
        before = [t.clone() for t in (k, v, ks, vs)]
        with pytest.raises(ValueError, match=message):
            call(*args)
        for t, b in zip((k, v, ks, vs), before):  # nothing was written before the refusal
            assert torch.equal(_bytes(t), _bytes(b))
    call(k, v, ks, vs)  # the well-formed call runs
    call(float_k, float_v, None, None)  # float pages without scales: as before


@pytest.mark.parametrize("backend", ["torch", "triton"])
def test_append_refuses_page_scales_with_per_head_lengths(backend):
    layer, table, _ = _error_case("page")
    per_head = torch.tensor([[3, 4], [5, 5]], device=DEVICE)
    for name in ("append_token", "append_kv"):
        call = _calls(layer, table, per_head)[f"{backend}-{name}"]
        with pytest.raises(ValueError, match=r"per-KV-head lengths \[2, 2\] need per-head scales; k_scale is one"):
            call(layer.k, layer.v, layer.k_scale, layer.v_scale)


# ------------------------------------------------------------------------------------------------------ the reads
def _oracle_attention(q, layer, table, page_idx, page_valid, lengths, kt_page, scaling):
    """Float64 attention over exactly the selected tokens, dequantized by ``page_io.read_tokens``."""
    batch, kv_heads, group, head_dim = q.shape
    lengths = ref.per_head(lengths, batch, kv_heads)
    out = torch.zeros(batch, kv_heads, group, head_dim, dtype=torch.float64)
    for b in range(batch):
        row_len = int(lengths[b].max())
        keys, values = read_tokens(layer, _row_pages(table, b), row_len)  # [Hkv, T, D] float32, dequantized
        for h in range(kv_heads):
            slots = selected_slots(page_idx, page_valid, lengths, b, h, kt_page)
            if not slots:
                continue
            k, v = keys[h, slots].double().cpu(), values[h, slots].double().cpu()
            probs = torch.softmax(q[b, h].double().cpu() @ k.T * scaling, dim=-1)
            out[b, h] = probs @ v
    return out


# (granularity, group G, head_dim, kv_heads, page tokens PP, KT page KP, q dtype, splits)
ATTENTION_CASES = [
    ("page", 1, 64, 2, 8, 4, torch.float32, 1),
    ("head", 2, 128, 2, 16, 4, torch.float32, 3),
    ("head", 4, 64, 3, 8, 2, torch.bfloat16, None),
    ("page", 4, 128, 1, 8, 8, torch.float32, 2),
    ("page", 2, 64, 2, 16, 8, torch.float16, None),
    ("head", 1, 64, 2, 8, 4, torch.float32, None),
]


@pytest.mark.parametrize("granularity,group,head_dim,kv_heads,page_tokens,kt_page,q_dtype,splits", ATTENTION_CASES)
def test_sparse_decode_attention_reads_dequantized_pages(granularity, group, head_dim, kv_heads, page_tokens,
                                                         kt_page, q_dtype, splits):
    g = gen("fp8-sda", granularity, group, head_dim, kv_heads, page_tokens, kt_page, q_dtype)
    num_pages = 14
    layer = _pool(num_pages, kv_heads, page_tokens, kt_page, head_dim, granularity, g)
    table = page_table([5, 2, 4], num_pages, g)
    # full rows, a partial last page, a row a third full; KV heads of different magnitudes
    lengths = torch.tensor([5 * page_tokens, 2 * page_tokens - 3, 4 * page_tokens // 3], device=DEVICE)
    _fill_rows(layer, table, lengths, g, key_scale=torch.logspace(0, -2, kv_heads))
    q = randn((3, kv_heads, group, head_dim), q_dtype, g)
    num_kt_pages = table.shape[1] * page_tokens // kt_page
    k = min(5, num_kt_pages)
    page_idx = torch.stack([torch.randperm(num_kt_pages, generator=g)[:k] for _ in range(3 * kv_heads)])
    page_idx = page_idx.view(3, kv_heads, k).to(DEVICE)
    page_valid = (torch.rand((3, kv_heads, k), generator=g) > 0.2).to(DEVICE)
    scaling = head_dim**-0.5
    args = (q, layer.k, layer.v, table, page_idx, page_valid, lengths, kt_page, scaling)
    scales = dict(k_scale=layer.k_scale, v_scale=layer.v_scale)
    oracle = _oracle_attention(q, layer, table, page_idx, page_valid, lengths, kt_page, scaling)
    twin = paged_sparse_decode_attention_torch(*args, **scales)
    launched = sparse_decode_attention_launch(q, layer.k, layer.v, page_idx, page_valid, lengths, kt_page, scaling,
                                              num_splits=splits, table=table, **scales)
    op = ops().paged_sparse_decode_attention(*args, **scales)
    registered = ops().paged_sparse_decode_attention.op(*args, layer.k_scale, layer.v_scale)
    tol = OUT_ATOL[q_dtype]
    for name, got in (("twin", twin), ("kernel", launched), ("op", op), ("registered", registered)):
        assert got.dtype == q_dtype and got.shape == q.shape, name
        torch.testing.assert_close(got.double().cpu(), oracle, atol=tol, rtol=0, msg=name)
    torch.testing.assert_close(launched.float(), twin.float(), atol=tol if q_dtype != torch.float32 else 1e-5, rtol=0)
    # per-KV-head lengths read through the same scales
    per_head = torch.stack([lengths - h for h in range(kv_heads)], dim=1).clamp(min=0)
    oracle = _oracle_attention(q, layer, table, page_idx, page_valid, per_head, kt_page, scaling)
    got = ops().paged_sparse_decode_attention(q, layer.k, layer.v, table, page_idx, page_valid, per_head, kt_page,
                                              scaling, **scales)
    torch.testing.assert_close(got.double().cpu(), oracle, atol=tol, rtol=0)


def test_attention_scale_is_applied_per_page_and_head():
    """One token per KV head whose bytes are equal in every page but whose scales differ: the output is exactly
    the dequantized value (a single selected token gets probability 1)."""
    g = gen("fp8-sda-single")
    for granularity in GRANULARITIES:
        layer = _pool(4, 2, 4, 4, 64, granularity, g)
        table = torch.tensor([[2], [0]], dtype=torch.int32, device=DEVICE)
        layer.v[:, :, 0] = torch.full((64,), 2.0).to(FP8_DTYPE).to(DEVICE)
        lengths = torch.tensor([1, 1], device=DEVICE)
        q = randn((2, 2, 2, 64), torch.float32, g)
        idx = torch.zeros((2, 2, 1), dtype=torch.long, device=DEVICE)
        valid = torch.ones((2, 2, 1), dtype=torch.bool, device=DEVICE)
        want = torch.empty(2, 2, 2, 64)
        for b, page in enumerate((2, 0)):
            for h in range(2):
                want[b, h] = 2.0 * float(_scale_of(layer.v_scale, page, h))
        for fn in (paged_sparse_decode_attention_torch, ops().paged_sparse_decode_attention):
            got = fn(q, layer.k, layer.v, table, idx, valid, lengths, 4, 0.125, k_scale=layer.k_scale,
                     v_scale=layer.v_scale)
            torch.testing.assert_close(got.cpu(), want, atol=1e-6, rtol=1e-6)


# ----------------------------------------------------------------------------------------------------- the append
def _append(backend, layer, table, positions, lengths, seen, key, value, kt_page, with_kt=True):
    if backend == "torch":
        fn = paged_append_token_torch if with_kt else paged_append_kv_torch
    elif backend == "triton":
        fn = ops().paged_append_token if with_kt else ops().paged_append_kv
    else:
        fn = ops().paged_append_token.op if with_kt else ops().paged_append_kv.op
    scales = (layer.k_scale, layer.v_scale)  # positional: see _calls on torch 2.11's registered ops
    if with_kt:
        fn(layer.k, layer.v, layer.kt, table, positions, lengths, seen, key, value, kt_page, *scales)
    else:
        fn(layer.k, layer.v, table, positions, lengths, seen, key, value, *scales)


def _scale_of(scale, page, h):
    return scale[page] if scale.dim() == 1 else scale[page, h]


@pytest.mark.parametrize("granularity", GRANULARITIES)
@pytest.mark.parametrize("backend", ["torch", "triton", "registered"])
def test_append_rule_fresh_grow_and_keep(granularity, backend):
    """Three rows: row 0's next slot opens a page of garbage (the scale resets, the other slots are zeroed); row 1's
    token is 3x the page's largest value (head 1: 3x too with "page" scales, 0.25x with "head" scales); row 2's is a
    quarter of it (no re-quantization: the stored bytes stay bit for bit)."""
    heads, page_tokens, kt_page, dim = 2, 8, 4, 16
    g = gen("fp8-rule", granularity)
    layer = _pool(8, heads, page_tokens, kt_page, dim, granularity, g)
    table = page_table([2, 1, 1], 8, g)
    lengths = torch.tensor([page_tokens, 3, 5], device=DEVICE)
    _fill_rows(layer, table, lengths, g, key_scale=torch.tensor([1.0, 0.5]))
    before = _clone(layer)
    # the tokens: scaled relative to each row page's largest stored magnitude, per KV head
    key = torch.randn((3, heads, dim), generator=g).to(DEVICE)
    value = torch.randn((3, heads, dim), generator=g).to(DEVICE)
    pages = [int(table[0, 1]), int(table[1, 0]), int(table[2, 0])]
    factors = {1: [3.0, 3.0 if granularity == "page" else 0.25], 2: [0.25, 0.25]}
    for row, per_head_factor in factors.items():
        for h, f in enumerate(per_head_factor):
            for new, store, scale in ((key, layer.k, layer.k_scale), (value, layer.v, layer.v_scale)):
                stored = dequantize_fp8(store[pages[row] : pages[row] + 1],
                                        scale[pages[row] : pages[row] + 1])[0]  # [Hkv, PP, D]
                peak = stored.abs().amax() if granularity == "page" else stored[h].abs().amax()
                new[row, h] = new[row, h] / new[row, h].abs().amax() * peak * f
    positions = torch.zeros((3, heads, 2 * page_tokens), dtype=torch.int32, device=DEVICE)
    seen = torch.tensor(50, device=DEVICE)
    got = _clone(layer)
    got_lengths = lengths.clone()
    _append(backend, got, table, positions, got_lengths, seen, key, value, kt_page)
    assert got_lengths.tolist() == [page_tokens + 1, 4, 6]

    for which, new in (("k", key), ("v", value)):
        old_pages, old_scale = getattr(before, which), getattr(before, f"{which}_scale")
        new_pages, new_scale = getattr(got, which), getattr(got, f"{which}_scale")
        # row 0, fresh page: the token alone sets the scale, every other slot is zero (write_tokens' result)
        page = pages[0]
        want_scale = fp8_scales(new[0][None, :, None], granularity)[0]  # [] or [Hkv]
        torch.testing.assert_close(new_scale[page], want_scale, atol=0, rtol=0)
        want_token = quantize_fp8(new[0][None, :, None], want_scale[None])[0, :, 0]
        _assert_bytes_equal(new_pages[page, :, 0], want_token, f"{which} fresh token")
        assert not _bytes(new_pages[page, :, 1:]).any(), f"{which}: a fresh page's later slots are zeroed"
        # rows 1 and 2: per KV head, grow (re-quantize the slots below the offset) or keep (bytes unchanged)
        for row, offset in ((1, 3), (2, 5)):
            page = pages[row]
            for h in range(heads):
                s_old = _scale_of(old_scale, page, h)
                s_new = _scale_of(new_scale, page, h)
                amax = new[row].abs().amax() if granularity == "page" else new[row, h].abs().amax()
                grows = factors[row][h] > 1
                if grows:
                    # float64 then float32: the correctly rounded float32 quotient
                    torch.testing.assert_close(s_new, (amax.double() / FP8_MAX).float(), atol=0, rtol=0)
                    kept = dequantize_fp8(old_pages[page : page + 1, h : h + 1, :offset], s_old.reshape(1))
                    want_kept = quantize_fp8(kept, s_new.reshape(1))[0, 0]
                else:
                    assert s_new == s_old, f"{which} row {row} head {h}: the scale must not change"
                    want_kept = old_pages[page, h, :offset]
                _assert_bytes_equal(new_pages[page, h, :offset], want_kept, f"{which} row {row} head {h} kept")
                want_token = quantize_fp8(new[row, h][None, None, None].float(), s_new.reshape(1))[0, 0, 0]
                _assert_bytes_equal(new_pages[page, h, offset], want_token, f"{which} row {row} head {h} token")
                _assert_bytes_equal(new_pages[page, h, offset + 1 :], old_pages[page, h, offset + 1 :],
                                    f"{which} row {row} head {h} after")
        # pages no append touched: unchanged
        others = [p for p in range(8) if p not in pages]
        _assert_bytes_equal(new_pages[others], old_pages[others], f"{which} other pages")
        _assert_bytes_equal(new_scale[others], old_scale[others], f"{which} other scales")

    # the grow and fresh rows equal page_io.write_tokens' write of the token, bit for bit (same scales, same
    # arithmetic); the keep row's token slot too (its scale is recomputed by write_tokens, an ulp away at most)
    oracle = _clone(before)
    for row, start in ((0, page_tokens), (1, 3), (2, 5)):
        write_tokens(oracle, _row_pages(table, row), start, key[row][:, None], value[row][:, None])
    for which in ("k", "v"):
        for row in (0, 1):
            page = pages[row]
            heads_grown = range(heads) if row == 0 or granularity == "page" else [0]
            for h in heads_grown:
                _assert_bytes_equal(getattr(got, which)[page, h], getattr(oracle, which)[page, h], f"{which} {row}")
    # KT, positions and lengths as for float pages (the KT from the unquantized key)
    float_layer = (before.k.float(), before.v.float(), before.kt.clone())
    float_positions, float_lengths = torch.zeros_like(positions), lengths.clone()
    paged_append_token_torch(*float_layer, table, float_positions, float_lengths, seen, key, value, kt_page)
    assert torch.equal(got.kt, float_layer[2])
    assert torch.equal(positions, float_positions) and torch.equal(got_lengths, float_lengths)


def _sequence(backend, layer, table, lengths, steps, kt_page, g, with_kt=True, events=None):
    """``steps`` appends of tokens whose magnitudes jump around (some grow the page scale, most do not); returns
    the float tokens per step. ``events`` (a Counter): what each row's K append did to its page scale (fresh page,
    grown, kept)."""
    batch, heads, dim = table.shape[0], layer.k.shape[1], layer.k.shape[3]
    positions = torch.zeros((batch, heads, table.shape[1] * layer.k.shape[2]), dtype=torch.int32, device=DEVICE)
    seen = torch.tensor(100, device=DEVICE)
    tokens = []
    for _ in range(steps):
        seen += 1
        magnitude = torch.exp(torch.randn((batch, heads, 1), generator=g) * 1.5)
        key = (torch.randn((batch, heads, dim), generator=g) * magnitude).to(DEVICE)
        value = (torch.randn((batch, heads, dim), generator=g) * magnitude.flip(1)).to(DEVICE)
        slots = lengths.tolist()
        before = layer.k_scale.clone()
        _append(backend, layer, table, positions, lengths, seen, key, value, kt_page, with_kt)
        tokens.append((key, value))
        if events is not None:
            page_tokens = layer.k.shape[2]
            for b, slot in enumerate(slots):
                slot = slot if isinstance(slot, int) else slot[0]
                page = int(table[b, slot // page_tokens])
                grown = bool((layer.k_scale[page] != before[page]).any())
                events["fresh" if slot % page_tokens == 0 else ("grown" if grown else "kept")] += 1
    return tokens, positions


def _assert_within_one_step(got: LayerStorage, oracle: LayerStorage, table, count, h=None):
    """Dequantized rows within one e4m3 step (at the oracle's scale) of the oracle's, scales within 1e-5."""
    for b in range(table.shape[0]):
        n = int(count[b]) if h is None else int(count[b, h])
        row = _row_pages(table, b)
        for (a, want), scale in zip(zip(read_tokens(got, row, n), read_tokens(oracle, row, n)),
                                    (oracle.k_scale, oracle.v_scale)):
            per_token = scale[torch.tensor(row, device=DEVICE).repeat_interleave(got.k.shape[2])[:n]]
            s = per_token[None, :, None] if per_token.dim() == 1 else per_token.T[:, :, None]
            assert torch.all((a - want).abs() <= _fp8_step(want, s) * 1.0001), (b, (a - want).abs().max())
        torch.testing.assert_close(got.k_scale[row], oracle.k_scale[row], atol=0, rtol=1e-5)
        torch.testing.assert_close(got.v_scale[row], oracle.v_scale[row], atol=0, rtol=1e-5)


# (granularity, kv_heads, head_dim, page tokens PP, KT page KP)
SEQUENCE_CASES = [
    ("page", 2, 64, 8, 4),
    ("head", 2, 128, 8, 4),
    ("page", 1, 128, 4, 2),
    ("head", 3, 64, 8, 8),
]


@pytest.mark.parametrize("granularity,kv_heads,head_dim,page_tokens,kt_page", SEQUENCE_CASES)
def test_append_sequence_equals_write_tokens_token_by_token(granularity, kv_heads, head_dim, page_tokens, kt_page):
    """Appends through the rule against ``page_io.write_tokens`` of each token at its slot, over rows of different
    lengths (an empty row, one mid page, one at a page boundary) and across page boundaries.

    Tolerance: one e4m3 step of each value at its page's scale (and 1e-5 relative on the scales). Where the scale
    grows, or a page opens, both re-quantize with the same scale and agree bit for bit; where it does not, the rule
    keeps the stored bytes and quantizes the token with the page's scale, while write_tokens re-quantizes the whole
    page with a scale recomputed from the dequantized page (amax = 448 * s in float32, so s again up to an ulp): a
    value at an e4m3 rounding midpoint can then land one step away, and the ulps can add up over the steps.
    The Triton op equals the twin bit for bit; KT, positions and lengths equal the float-page append's.
    """
    g = gen("fp8-sequence", granularity, kv_heads, head_dim, page_tokens, kt_page)
    num_pages = 12
    layer = _pool(num_pages, kv_heads, page_tokens, kt_page, head_dim, granularity, g)
    table = page_table([3, 3, 4], num_pages, g)
    lengths = torch.tensor([0, page_tokens + page_tokens // 2, 2 * page_tokens], device=DEVICE)
    _fill_rows(layer, table, lengths, g)
    steps = page_tokens + 1
    results, events = {}, collections.Counter()
    for backend in ("torch", "triton"):  # (the registered op: test_append_rule_fresh_grow_and_keep)
        state, state_lengths = _clone(layer), lengths.clone()
        tokens, positions = _sequence(backend, state, table, state_lengths, steps, kt_page, gen("tokens", head_dim),
                                      events=events if backend == "torch" else None)
        results[backend] = (state, state_lengths, positions)
    assert events["fresh"] >= 3 and events["grown"] >= 2 and events["kept"] >= 2, events  # every branch ran
    twin, twin_lengths, twin_positions = results["torch"]
    for backend in ("triton",):
        state, state_lengths, positions = results[backend]
        for name in ("k", "v", "kt", "k_scale", "v_scale"):
            _assert_bytes_equal(getattr(state, name), getattr(twin, name), f"{backend} {name}")
        assert torch.equal(state_lengths, twin_lengths) and torch.equal(positions, twin_positions)
    assert twin_lengths.tolist() == (lengths + steps).tolist()
    # the oracle: write_tokens of each token at its slot
    oracle = _clone(layer)
    for step, (key, value) in enumerate(tokens):
        for b in range(3):
            write_tokens(oracle, _row_pages(table, b), int(lengths[b]) + step, key[b][:, None], value[b][:, None])
    _assert_within_one_step(twin, oracle, table, twin_lengths)
    # KT / positions / lengths: as the float-page append of the same tokens
    float_state = [layer.k.float(), layer.v.float(), layer.kt.clone()]
    float_lengths = lengths.clone()
    float_positions = torch.zeros_like(twin_positions)
    seen = torch.tensor(100, device=DEVICE)
    for key, value in tokens:
        seen += 1
        paged_append_token_torch(*float_state, table, float_positions, float_lengths, seen, key, value, kt_page)
    assert torch.equal(twin.kt, float_state[2]) and torch.equal(twin_positions, float_positions)
    assert torch.equal(twin_lengths, float_lengths)


@pytest.mark.parametrize("backend", ["torch", "triton"])
def test_append_kv_and_per_head_lengths_with_head_scales(backend):
    """paged_append_kv (no KT) with per-KV-head lengths ([B, Hkv], heads at different fill levels) and "head" scales:
    each KV head equals write_tokens on that head alone (a one-head view of the pool), within one e4m3 step."""
    heads, page_tokens, dim = 3, 8, 64
    g = gen("fp8-per-head", backend)
    layer = _pool(10, heads, page_tokens, 4, dim, "head", g)
    table = page_table([3, 2], 10, g)
    lengths = torch.tensor([[0, 5, 8], [7, 9, 12]], device=DEVICE)
    for h in range(heads):
        _fill_rows(_head_view(layer, h), table, lengths[:, h], g)
    kt_before = layer.kt.clone()
    state, state_lengths = _clone(layer), lengths.clone()
    steps = 4
    tokens, _ = _sequence(backend, state, table, state_lengths, steps, 4, gen("per-head-tokens"), with_kt=False)
    assert torch.equal(state_lengths, lengths + steps) and torch.equal(state.kt, kt_before)
    oracle = _clone(layer)
    for h in range(heads):
        view = _head_view(oracle, h)
        for step, (key, value) in enumerate(tokens):
            for b in range(2):
                write_tokens(view, _row_pages(table, b), int(lengths[b, h]) + step, key[b, h : h + 1, None],
                             value[b, h : h + 1, None])
    for h in range(heads):
        _assert_within_one_step(_head_view(state, h), _head_view(oracle, h), table, state_lengths[:, h])


@pytest.mark.parametrize("granularity", GRANULARITIES)
def test_triton_append_drops_fp8_writes_without_a_page(granularity):
    """As for float pages: a row whose next slot has no page (-1) or lies past the table gets no write anywhere
    (pages and scales untouched) and its token is still counted; the twin refuses."""
    g = gen("fp8-drop", granularity)
    layer = _pool(4, 2, 8, 4, 16, granularity, g)
    table = page_table([2, 1], 4, g)  # row 0: past its table at 16; row 1: its next slot's page is -1
    lengths = torch.tensor([16, 8], device=DEVICE)
    _fill_rows(layer, table, lengths, g)
    state = _clone(layer)
    _sequence("triton", state, table, lengths, 1, 4, gen("drop-tokens"))
    for name in ("k", "v", "kt", "k_scale", "v_scale"):
        _assert_bytes_equal(getattr(state, name), getattr(layer, name), name)
    assert lengths.tolist() == [17, 9]
    with pytest.raises(IndexError):
        _sequence("torch", _clone(layer), table, torch.tensor([16, 8], device=DEVICE), 1, 4, gen("drop-tokens"))


class _HostReads(TorchDispatchMode):
    """Counts the ops that make the host wait for a tensor's value (as tests/cache/test_host_syncs.py)."""

    READS = {torch.ops.aten._local_scalar_dense.default, torch.ops.aten.nonzero.default,
             torch.ops.aten.equal.default}

    def __init__(self):
        super().__init__()
        self.counts = collections.Counter()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func in self.READS:
            self.counts[str(func)] += 1
        return func(*args, **(kwargs or {}))


@pytest.mark.parametrize("granularity", GRANULARITIES)
def test_append_rule_reads_nothing_back_and_compiles_fullgraph(granularity):
    """The rule never reads a device value on the host (no ``.item()``, no data-dependent branch) and traces into
    one graph (torch.compile(fullgraph=True)) that writes what eager writes."""
    g = gen("fp8-compile", granularity)
    layer = _pool(6, 2, 8, 4, 16, granularity, g)
    table = page_table([2, 2], 6, g)
    lengths = torch.tensor([8, 5], device=DEVICE)
    _fill_rows(layer, table, lengths, g)
    key = torch.randn((2, 2, 16), generator=g).to(DEVICE) * 5
    value = torch.randn((2, 2, 16), generator=g).to(DEVICE) * 0.1
    page = torch.stack([table[0, 1], table[1, 0]]).long()[:, None].expand(2, 2)
    offset = torch.tensor([[0, 0], [5, 5]], device=DEVICE)
    eager = _clone(layer)
    with _HostReads() as reads:
        fp8_append_torch(eager.k, eager.k_scale, page, offset, key)
        fp8_append_torch(eager.v, eager.v_scale, page, offset, value)
    assert reads.counts == {}
    torch._dynamo.reset()
    compiled_state = _clone(layer)
    compiled = torch.compile(paged_append_token_torch, fullgraph=True, backend="aot_eager")
    positions = torch.zeros((2, 2, 16), dtype=torch.int32, device=DEVICE)
    compiled_lengths = lengths.clone()
    compiled(compiled_state.k, compiled_state.v, compiled_state.kt, table, positions, compiled_lengths,
             torch.tensor(9, device=DEVICE), key, value, 4, k_scale=compiled_state.k_scale,
             v_scale=compiled_state.v_scale)
    for name in ("k", "v", "k_scale", "v_scale"):
        _assert_bytes_equal(getattr(compiled_state, name), getattr(eager, name), name)
    assert compiled_lengths.tolist() == [9, 6]


@pytest.mark.skipif(not torch.cuda.is_available(),
                    reason="the interpreter cannot run a triton_op on the fake tensors torch.compile traces with")
def test_registered_append_compiles_fullgraph():
    """The registered op (what RocketKVLayer's compiled decode step traces) with fp8 pages, under
    torch.compile(fullgraph=True): no graph break, the twin's writes."""
    g = gen("fp8-compile-op")
    layer = _pool(6, 2, 8, 4, 16, "head", g)
    table = page_table([2, 2], 6, g)
    lengths = torch.tensor([7, 8], device=DEVICE)
    _fill_rows(layer, table, lengths, g)
    key = torch.randn((2, 2, 16), generator=g).to(DEVICE)
    value = torch.randn((2, 2, 16), generator=g).to(DEVICE)
    want, got = _clone(layer), _clone(layer)
    want_lengths, got_lengths = lengths.clone(), lengths.clone()
    positions = torch.zeros((2, 2, 16), dtype=torch.int32, device=DEVICE)
    seen = torch.tensor(9, device=DEVICE)
    paged_append_token_torch(want.k, want.v, want.kt, table, positions.clone(), want_lengths, seen, key, value, 4,
                             k_scale=want.k_scale, v_scale=want.v_scale)
    torch._dynamo.reset()
    op = ops().paged_append_token

    def step(k, v, kt, ks, vs, lengths):
        op(k, v, kt, table, positions, lengths, seen, key, value, 4, ks, vs)

    torch.compile(step, fullgraph=True, backend="aot_eager")(got.k, got.v, got.kt, got.k_scale, got.v_scale,
                                                              got_lengths)
    for name in ("k", "v", "kt", "k_scale", "v_scale"):
        _assert_bytes_equal(getattr(got, name), getattr(want, name), name)
    assert torch.equal(got_lengths, want_lengths)


# ------------------------------------------------------------------------------------------------ the compaction
@pytest.mark.parametrize("granularity", GRANULARITIES)
@pytest.mark.parametrize("head_dim,page_tokens,kt_page", [(64, 8, 4), (128, 16, 8)])
def test_compact_row_quantizes_the_row_pages_like_write_tokens(granularity, head_dim, page_tokens, kt_page):
    """The kept slots of each KV head, quantized over the row's pages: bit for bit what write_tokens stores for the
    same tokens (partial last page, pages past the kept tokens all zero with scale 1), KT and positions as the
    float-page compaction, other pages untouched."""
    g = gen("fp8-compact", granularity, head_dim, page_tokens, kt_page)
    heads, dense, max_pages, num_pages = 2, 70, 5, 9
    keys = randn((heads, dense, head_dim), torch.float32, g, scale=3.0)
    keys = keys * torch.tensor([1.0, 0.01], device=DEVICE)[:, None, None]  # KV heads of different magnitudes
    values = randn((heads, dense, head_dim), torch.float32, g)
    for n, row_pages in ((2 * page_tokens + 3, 4), (page_tokens, 1), (0, 2)):
        slots = torch.stack([torch.randperm(dense, generator=g)[:n].sort().values for _ in range(heads)]).to(DEVICE)
        layer = _pool(num_pages, heads, page_tokens, kt_page, head_dim, granularity, g)
        order = torch.randperm(num_pages, generator=g)[:max_pages].to(torch.int32)
        table = torch.where(torch.arange(max_pages) < row_pages, order, -1).to(DEVICE)
        owned = table[:row_pages].tolist()
        # the oracle: write_tokens of the kept tokens, the pages past them all zero (scale 1)
        oracle = _clone(layer)
        kept_k = torch.stack([keys[h, slots[h]] for h in range(heads)])
        kept_v = torch.stack([values[h, slots[h]] for h in range(heads)])
        write_tokens(oracle, owned, 0, kept_k, kept_v)
        for p in owned[-(-n // page_tokens) if n else 0 :]:
            for name in ("k", "v"):
                getattr(oracle, name)[p] = torch.zeros((heads, page_tokens, head_dim)).to(FP8_DTYPE)
                getattr(oracle, f"{name}_scale")[p] = 1.0
        # KT and positions: the float-page compaction
        float_k, float_v, float_kt = layer.k.float(), layer.v.float(), layer.kt.clone()
        float_positions = torch.zeros((heads, max_pages * page_tokens), dtype=torch.int32, device=DEVICE)
        paged_compact_row_torch(keys, values, slots, None, float_k, float_v, float_kt, table, row_pages,
                                float_positions, kt_page)
        for fn in (paged_compact_row_torch, ops().paged_compact_row):
            got = _clone(layer)
            positions = torch.full_like(float_positions, 7)
            fn(keys, values, slots, None, got.k, got.v, got.kt, table, row_pages, positions, kt_page,
               k_scale=got.k_scale, v_scale=got.v_scale)
            for name in ("k", "v", "k_scale", "v_scale"):
                _assert_bytes_equal(getattr(got, name), getattr(oracle, name), f"{fn.__name__} {name} n={n}")
            assert torch.equal(got.kt, float_kt) and torch.equal(positions, float_positions)
            read_k, _ = read_tokens(got, owned, n)
            # what the pages hold dequantizes back to the kept keys within the fp8 bound of memory/fp8.py
            per_token = got.k_scale[torch.tensor(owned, device=DEVICE).repeat_interleave(page_tokens)[:n]]
            s = per_token[None, :, None] if granularity == "page" else per_token.T[:, :, None]
            assert torch.all((read_k - kept_k).abs() <= kept_k.abs() * 2.0**-4 + s * 2.0**-10 + 1e-7)
