"""What the fp8 page tests share (tests/kernels/test_fp8_pages.py: scales, reads and compaction;
tests/kernels/test_fp8_append.py: the decode append): pools of random e4m3 bytes and scales, rows of float tokens
written by the pool's reference ``write_tokens``, byte-exact comparisons, and every entry point of the ops."""

import torch

from hf_rocketkv.kernels.append_token import paged_append_kv_torch, paged_append_token_torch
from hf_rocketkv.kernels.paged import paged_compact_row_torch
from hf_rocketkv.kernels.sparse_decode_attention import paged_sparse_decode_attention_torch
from hf_rocketkv.memory.fp8 import FP8_DTYPE
from hf_rocketkv.memory.layout import LayerShape
from hf_rocketkv.memory.page_io import write_tokens
from hf_rocketkv.memory.storage import LayerStorage
from tests.kernels.kernel_utils import DEVICE, gen, ops, page_table, randn

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


def _scale_of(scale, page, h):
    return scale[page] if scale.dim() == 1 else scale[page, h]
