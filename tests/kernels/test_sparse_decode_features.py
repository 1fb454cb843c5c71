"""sparse_decode_attention with logit soft-capping and per-head sinks: the Triton kernel (interpreted on CPU) and its
torch twin, each against a float64 oracle written from the definition (transformers' eager attention of Gemma 2 and
gpt-oss): ``l = tanh(q.k * scaling / c) * c``; ``p_j = exp(l_j) / (sum_i exp(l_i) + exp(sink_h))``."""

import math

import pytest
import torch

from hf_rocketkv.kernels.sparse_decode_attention import (
    paged_sparse_decode_attention_torch,
    sparse_decode_attention_launch,
    sparse_decode_attention_torch,
)
from tests.kernels.kernel_utils import (
    DEVICE,
    OUT_ATOL,
    gen,
    ops,
    page_table,
    randn,
    selected_slots,
)

pytestmark = pytest.mark.gpu  # compiled for the GPU where one is present (pytest -m gpu); interpreted on CPU


def oracle(q, keys, values, page_idx, page_valid, lengths, page_size, scaling, softcap, sinks):
    """float64, one (row, KV head, query head) at a time: the selected tokens' logits, capped, softmax with the
    sink in the denominator only."""
    batch, kv_heads, group, head_dim = q.shape
    lengths = lengths if lengths.dim() == 2 else lengths[:, None].expand(batch, kv_heads)
    out = torch.zeros(batch, kv_heads, group, head_dim, dtype=torch.float64)
    for b in range(batch):
        for h in range(kv_heads):
            slots = selected_slots(page_idx.cpu(), page_valid.cpu(), lengths.cpu(), b, h, page_size)
            if not slots:
                continue
            k = keys[b, h, slots].double().cpu()
            v = values[b, h, slots].double().cpu()
            for g in range(group):
                logits = (k @ q[b, h, g].double().cpu()) * scaling
                if softcap is not None:
                    logits = torch.tanh(logits / softcap) * softcap
                denom_terms = [math.exp(x) for x in logits.tolist()]
                if sinks is not None:
                    denom_terms.append(math.exp(float(sinks[h * group + g])))
                weights = torch.exp(logits) / sum(denom_terms)
                out[b, h, g] = weights @ v
    return out


# (dtype, group, head_dim, page_size, splits, softcap, with_sinks)
CASES = [
    (torch.float32, 1, 64, 4, 1, 2.0, False),
    (torch.float32, 4, 32, 2, None, None, True),
    (torch.float32, 2, 48, 4, 3, 5.0, True),  # head_dim not a power of two, split + reduce
    (torch.bfloat16, 8, 64, 8, None, 1.5, True),
    (torch.bfloat16, 5, 128, 4, 2, None, True),
    (torch.float16, 3, 64, 1, 1, 30.0, True),
    (torch.float32, 6, 256, 4, 4, 0.5, False),
]


def _inputs(dtype, group, head_dim, page_size, g, per_head=False):
    batch, kv_heads, capacity = 3, 2, 12 * page_size
    num_pages = capacity // page_size
    k = min(8, num_pages)
    q = randn((batch, kv_heads, group, head_dim), dtype, g, scale=2.0)  # large logits: the cap matters
    keys = randn((batch, kv_heads, capacity, head_dim), dtype, g)
    values = randn((batch, kv_heads, capacity, head_dim), dtype, g)
    # rows: a partial last page, no token at all, full
    lengths = torch.tensor([4 * page_size + max(1, page_size // 2), 0, capacity], device=DEVICE)
    if per_head:
        lengths = torch.stack([lengths, (lengths - 1).clamp(min=0)], dim=1)
    page_idx = torch.stack([torch.randperm(num_pages, generator=g)[:k] for _ in range(batch * kv_heads)])
    page_idx = page_idx.view(batch, kv_heads, k).to(DEVICE)
    page_valid = (torch.rand((batch, kv_heads, k), generator=g) > 0.2).to(DEVICE)
    page_valid[2, 1] = False  # a head with no valid page
    return q, keys, values, page_idx, page_valid, lengths


def _sinks(group, kv_heads, g):
    return (torch.randn(kv_heads * group, generator=g) * 2.0).to(DEVICE)


@pytest.mark.parametrize("dtype,group,head_dim,page_size,splits,softcap,with_sinks", CASES)
def test_kernel_and_twin_match_float64_oracle(dtype, group, head_dim, page_size, splits, softcap, with_sinks):
    g = gen("sda-features", dtype, group, head_dim, page_size, splits, softcap, with_sinks)
    args = _inputs(dtype, group, head_dim, page_size, g)
    sinks = _sinks(group, 2, g) if with_sinks else None
    scaling = head_dim**-0.5
    want = oracle(*args, page_size, scaling, softcap, sinks)
    twin = sparse_decode_attention_torch(*args, page_size, scaling, softcap, sinks)
    # 16-token tiles, so that the requested splits happen on these small selections (up to 8 pages x page_size)
    got = sparse_decode_attention_launch(*args, page_size, scaling, num_splits=splits, block_n=16, softcap=softcap,
                                         sinks=sinks)
    atol = OUT_ATOL[dtype]
    for out in (twin, got):
        assert out.dtype == dtype and out.shape == want.shape
        torch.testing.assert_close(out.double().cpu(), want, atol=atol, rtol=0)
    assert torch.all(got[1] == 0) and torch.all(got[2, 1] == 0)  # nothing to attend -> zeros, sink or not


@pytest.mark.parametrize("splits", [1, 3])
def test_sink_only_changes_the_denominator(splits):
    """A very large sink takes almost all the mass (output -> 0), a very small one none (plain attention)."""
    g = gen("sda-sink-limits", splits)
    args = _inputs(torch.float32, 4, 32, 4, g)
    scaling = 32**-0.5
    plain = sparse_decode_attention_launch(*args, 4, scaling, num_splits=splits, block_n=16)
    low = sparse_decode_attention_launch(*args, 4, scaling, num_splits=splits, block_n=16,
                                         sinks=torch.full((8,), -1e4, device=DEVICE))
    high = sparse_decode_attention_launch(*args, 4, scaling, num_splits=splits, block_n=16,
                                          sinks=torch.full((8,), 1e4, device=DEVICE))
    torch.testing.assert_close(low, plain, atol=1e-6, rtol=0)
    assert torch.isfinite(high).all() and high.abs().max() < 1e-6


@pytest.mark.parametrize("softcap,with_sinks,splits", [(3.0, True, 3), (None, True, 2), (0.75, False, 1)])
def test_paged_op_matches_oracle_per_head_lengths(softcap, with_sinks, splits):
    """The registered paged op (pool pages through a block table, lengths per row and KV head) and its twin."""
    g = gen("paged-sda-features", softcap, with_sinks, splits)
    group, head_dim, page_tokens, kt_page = 4, 32, 8, 4
    q, keys, values, page_idx, page_valid, lengths = _inputs(torch.bfloat16, group, head_dim, kt_page, g,
                                                             per_head=True)
    rows, kv_heads, capacity = keys.shape[0], keys.shape[1], keys.shape[2]
    pages_per_row = capacity // page_tokens
    table = page_table([pages_per_row] * rows, rows * pages_per_row + 3, g)
    k_pages = torch.zeros(rows * pages_per_row + 3, kv_heads, page_tokens, head_dim, dtype=keys.dtype, device=DEVICE)
    v_pages = torch.zeros_like(k_pages)
    for b in range(rows):
        for p in range(pages_per_row):
            k_pages[table[b, p]] = keys[b, :, p * page_tokens:(p + 1) * page_tokens]
            v_pages[table[b, p]] = values[b, :, p * page_tokens:(p + 1) * page_tokens]
    sinks = _sinks(group, kv_heads, g).to(torch.bfloat16) if with_sinks else None
    scaling = 0.2
    want = oracle(q, keys, values, page_idx, page_valid, lengths, kt_page, scaling, softcap, sinks)
    twin = paged_sparse_decode_attention_torch(q, k_pages, v_pages, table, page_idx, page_valid, lengths, kt_page,
                                               scaling, softcap=softcap, sinks=sinks)
    op = ops().paged_sparse_decode_attention(q, k_pages, v_pages, table, page_idx, page_valid, lengths, kt_page,
                                             scaling, softcap=softcap, sinks=sinks)
    registered = ops().paged_sparse_decode_attention.op(q, k_pages, v_pages, table, page_idx, page_valid, lengths,
                                                        kt_page, scaling, None, None, softcap, sinks)
    launch = sparse_decode_attention_launch(q, k_pages, v_pages, page_idx, page_valid, lengths, kt_page, scaling,
                                            num_splits=splits, block_n=16, table=table, softcap=softcap, sinks=sinks)
    for out in (twin, op, registered, launch):
        torch.testing.assert_close(out.double().cpu(), want, atol=OUT_ATOL[torch.bfloat16], rtol=0)


@pytest.mark.parametrize("kwargs,match", [
    ({"softcap": 0.0}, "softcap must be a positive number"),
    ({"softcap": -1.0}, "softcap must be a positive number"),
    ({"sinks": torch.zeros(3)}, "sinks must be a 1-D tensor of 8 query heads"),
    ({"sinks": torch.zeros(2, 4)}, "sinks must be a 1-D tensor of 8 query heads"),
])
def test_bad_features_are_refused(kwargs, match):
    g = gen("sda-bad")
    args = _inputs(torch.float32, 4, 32, 4, g)
    kwargs = {k: v.to(DEVICE) if isinstance(v, torch.Tensor) else v for k, v in kwargs.items()}
    with pytest.raises(ValueError, match=match):
        sparse_decode_attention_torch(*args, 4, 0.1, **kwargs)
    with pytest.raises(ValueError, match=match):
        sparse_decode_attention_launch(*args, 4, 0.1, **kwargs)
