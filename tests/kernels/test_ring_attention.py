"""ring_decode_attention: a sliding-window layer's decode attention over its ring, read in place.

The oracle is independent of the ring's slot arithmetic: each row is a sequence of tokens by position (some of them
padding), the ring is filled by writing position p into slot p % W one token at a time, and the oracle attends, in
float64, to the last W positions *in position order* that the mask allows (the mask given by position, turned into
the column order transformers uses only to call the op). Twin and Triton kernel are both checked against it.
"""

import math

import pytest
import torch

from hf_rocketkv.kernels.ring_attention import ring_decode_attention_launch, ring_decode_attention_torch
from tests.kernels.kernel_utils import DEVICE, OUT_ATOL, gen, ops

pytestmark = pytest.mark.gpu  # compiled for the GPU where one is present (pytest -m gpu); interpreted on CPU


def make_case(dtype, batch, kv_heads, group, head_dim, window, seen, padding, g, spare_rows=0):
    """Rings of ``batch`` rows that saw ``seen[b]`` tokens (this step's included), the first ``padding[b]`` of them
    padding; stored in a store of ``batch + spare_rows`` rows at shuffled rows. Returns the op's arguments and the
    per-row token sequences for the oracle."""
    n_store = batch + spare_rows
    tokens_k = [torch.randn(kv_heads, n, head_dim, generator=g) for n in seen]
    tokens_v = [torch.randn(kv_heads, n, head_dim, generator=g) for n in seen]
    store_k = torch.randn(n_store, kv_heads, window, head_dim, generator=g)  # stale bytes: must never be read
    store_v = torch.randn(n_store, kv_heads, window, head_dim, generator=g)
    rows = torch.randperm(n_store, generator=g)[:batch]
    for b, n in enumerate(seen):
        for p in range(n):  # written one token at a time, as decode does
            store_k[rows[b], :, p % window] = tokens_k[b][:, p]
            store_v[rows[b], :, p % window] = tokens_v[b][:, p]
    allowed_by_position = [[p >= padding[b] for p in range(n)] for b, n in enumerate(seen)]
    mask = torch.zeros(batch, window, dtype=torch.bool)
    for b, n in enumerate(seen):
        first = max(0, n - window)
        for c in range(window):
            p = first + c
            mask[b, c] = p < n and allowed_by_position[b][p]
    q = torch.randn(batch, kv_heads, group, head_dim, generator=g)
    args = dict(q=q.to(dtype).to(DEVICE), keys=store_k.to(dtype).to(DEVICE), values=store_v.to(dtype).to(DEVICE),
                seen=torch.tensor(seen, dtype=torch.long, device=DEVICE), rows=rows.to(DEVICE), mask=mask.to(DEVICE))
    return args, tokens_k, tokens_v, allowed_by_position


def oracle(args, tokens_k, tokens_v, allowed, scaling, softcap=None, sinks=None):
    q = args["q"].double().cpu()
    batch, kv_heads, group, head_dim = q.shape
    window = args["keys"].shape[2]
    out = torch.zeros(batch, kv_heads, group, head_dim, dtype=torch.float64)
    for b in range(batch):
        n = int(args["seen"][b])
        visible = [p for p in range(max(0, n - window), n) if allowed[b][p]]
        k = tokens_k[b].to(args["keys"].dtype).double()[:, visible]  # [Hkv, V, D]
        v = tokens_v[b].to(args["values"].dtype).double()[:, visible]
        logits = torch.einsum("hgd,hnd->hgn", q[b], k) * scaling
        if softcap is not None:
            logits = torch.tanh(logits / softcap) * softcap
        if sinks is not None:
            sink = sinks.double().cpu().reshape(kv_heads, group, 1)
            full = torch.cat([logits, sink], dim=-1)
            probs = torch.softmax(full, dim=-1)[..., :-1]
        elif visible:
            probs = torch.softmax(logits, dim=-1)
        else:
            continue
        out[b] = torch.einsum("hgn,hnd->hgd", probs, v)
    return out


# (dtype, group, head_dim, window, seen per row, padding per row, num_splits)
CASES = [
    (torch.float32, 1, 16, 8, [1, 5, 8, 9], [0, 0, 0, 0], None),
    (torch.float32, 3, 32, 16, [40, 16, 3, 17], [2, 5, 0, 1], 2),  # padding still inside the window (rows 1, 2)
    (torch.bfloat16, 4, 64, 32, [100, 31, 33, 2], [0, 30, 10, 1], None),
    (torch.float16, 2, 48, 24, [24, 25, 70, 7], [20, 0, 50, 3], 3),  # head_dim not a power of two
    (torch.bfloat16, 8, 128, 64, [64, 300, 1, 65], [63, 0, 0, 64], 1),
    (torch.float32, 2, 256, 40, [41, 80, 12, 39], [0, 41, 11, 0], None),  # row 1: padding just left the window
]


@pytest.mark.parametrize("dtype,group,head_dim,window,seen,padding,splits", CASES)
def test_ring_decode_attention_matches_the_position_order_oracle(dtype, group, head_dim, window, seen, padding,
                                                                 splits):
    g = gen("ring", dtype, group, head_dim, window, seen, splits)
    args, tk, tv, allowed = make_case(dtype, 4, 2, group, head_dim, window, seen, padding, g, spare_rows=3)
    scaling = head_dim ** -0.5
    want = oracle(args, tk, tv, allowed, scaling)
    twin = ring_decode_attention_torch(**args, scaling=scaling)
    got = ring_decode_attention_launch(**args, scaling=scaling, num_splits=splits)
    assert got.dtype == dtype and got.shape == want.shape == twin.shape
    torch.testing.assert_close(twin.double().cpu(), want, atol=OUT_ATOL[dtype], rtol=0)
    torch.testing.assert_close(got.double().cpu(), want, atol=OUT_ATOL[dtype], rtol=0)


@pytest.mark.parametrize("splits", [1, None])
def test_softcap_and_sinks_inside_the_kernel(splits):
    g = gen("ring-features", splits)
    args, tk, tv, allowed = make_case(torch.bfloat16, 3, 2, 4, 64, 16, [30, 9, 16], [0, 3, 0], g)
    sinks = torch.randn(8, generator=g).to(DEVICE)
    for softcap, sink in ((20.0, None), (None, sinks), (5.0, sinks)):
        want = oracle(args, tk, tv, allowed, 0.3, softcap, sink)
        for got in (ring_decode_attention_torch(**args, scaling=0.3, softcap=softcap, sinks=sink),
                    ring_decode_attention_launch(**args, scaling=0.3, softcap=softcap, sinks=sink, num_splits=splits)):
            torch.testing.assert_close(got.double().cpu(), want, atol=OUT_ATOL[torch.bfloat16], rtol=0)


@pytest.mark.parametrize("n", [21, 5, 16])
def test_one_count_for_all_rows_without_store_rows_or_mask(n):
    """generate()'s layout: the batch's own rings (no rows), one 0-d count for every row, no mask (the causal
    window alone: a ring not yet full leaves its unfilled slots, which hold stale bytes, unread); and a mask given as
    one row for the whole batch."""
    g = gen("ring-scalar", n)
    window = 16
    args, tk, tv, allowed = make_case(torch.float32, 2, 2, 2, 32, window, [n, n], [0, 0], g)
    keys, values = args["keys"][args["rows"]], args["values"][args["rows"]]
    want = oracle(args, tk, tv, allowed, 0.2)
    seen = torch.tensor(n, device=DEVICE)
    for mask in (None, args["mask"][:1]):
        for got in (ring_decode_attention_torch(args["q"], keys, values, seen, 0.2, mask=mask),
                    ops().ring_decode_attention(args["q"], keys, values, seen, 0.2, None, mask)):
            torch.testing.assert_close(got.double().cpu(), want, atol=OUT_ATOL[torch.float32], rtol=0)


def test_strided_query_view_as_the_attention_passes_it():
    """The query [B, Hq, 1, D] transformers hands over (a transposed view) reshaped to [B, Hkv, G, D]."""
    g = gen("ring-strided")
    args, tk, tv, allowed = make_case(torch.bfloat16, 2, 2, 4, 64, 16, [20, 5], [0, 2], g)
    q = args["q"].reshape(2, 8, 1, 64).transpose(1, 2).contiguous().transpose(1, 2).reshape(2, 2, 4, 64)
    args["q"] = q
    want = oracle(args, tk, tv, allowed, 0.125)
    got = ops().ring_decode_attention(q, args["keys"], args["values"], args["seen"], 0.125, args["rows"],
                                      args["mask"])
    torch.testing.assert_close(got.double().cpu(), want, atol=OUT_ATOL[torch.bfloat16], rtol=0)


@pytest.mark.parametrize("change,field", [
    (dict(seen=torch.zeros(3, dtype=torch.long)), "seen"),
    (dict(seen=torch.zeros(2, dtype=torch.int32)), "seen"),
    (dict(rows=torch.zeros(2, dtype=torch.int32)), "rows"),
    (dict(mask=torch.ones(2, 15, dtype=torch.bool)), "mask"),
    (dict(mask=torch.zeros(2, 16)), "mask"),
    (dict(rows=None), "rows"),
])
def test_bad_arguments_are_refused_naming_them(change, field):
    g = gen("ring-bad")
    args, *_ = make_case(torch.float32, 2, 2, 2, 16, 16, [3, 4], [0, 0], g, spare_rows=1)
    args.update({k: (v.to(DEVICE) if isinstance(v, torch.Tensor) else v) for k, v in change.items()})
    for op in (ring_decode_attention_torch, ring_decode_attention_launch):
        with pytest.raises(ValueError, match=field):
            op(**args, scaling=0.25)


def test_nothing_visible_gives_zeros():
    g = gen("ring-empty")
    args, *_ = make_case(torch.float32, 2, 2, 2, 16, 8, [3, 10], [0, 0], g)
    args["mask"] = torch.zeros_like(args["mask"])
    for op in (ring_decode_attention_torch, ring_decode_attention_launch):
        got = op(**args, scaling=0.25)
        assert torch.equal(got, torch.zeros_like(got)) and not math.isnan(float(got.sum()))
