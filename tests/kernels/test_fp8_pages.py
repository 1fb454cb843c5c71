"""fp8 (e4m3) pool pages in the paged decode ops: reads dequantize and stage 1's compaction quantizes the row's
pages; bad scale arguments are refused; every backend, with ``k_scale`` / ``v_scale`` [N] ("page") or [N, Hkv]
("head"). The decode append's fp8 write rule: tests/kernels/test_fp8_append.py.

Oracles are independent of the ops under test: stored bytes and scales come from ``memory/fp8.py`` and
``memory/page_io.write_tokens`` (the pool's reference writes) over float data, attention from float64 loops over
the dequantized tokens of ``page_io.read_tokens``. Pools start with random (finite) e4m3 bytes and scales in every
page, so a stale byte that entered a scale or a read would show. Triton runs under the interpreter on CPU
(TRITON_INTERPRET=1, tests/conftest.py and this folder's conftest.py).
"""

import pytest
import torch

from hf_rocketkv.kernels.paged import paged_compact_row_torch
from hf_rocketkv.kernels.sparse_decode_attention import (
    paged_sparse_decode_attention_torch,
    sparse_decode_attention_launch,
)
from hf_rocketkv.memory.fp8 import FP8_DTYPE
from hf_rocketkv.memory.page_io import read_tokens, write_tokens
from hf_rocketkv.selection import stage2_pages as ref
from tests.kernels.fp8_pages_support import (
    GRANULARITIES,
    _assert_bytes_equal,
    _bytes,
    _calls,
    _clone,
    _error_case,
    _fill_rows,
    _pool,
    _row_pages,
    _scale_of,
)
from tests.kernels.kernel_utils import DEVICE, OUT_ATOL, gen, ops, page_table, randn, selected_slots

pytestmark = pytest.mark.gpu  # compiled for the GPU where one is present (pytest -m gpu); interpreted on CPU



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
