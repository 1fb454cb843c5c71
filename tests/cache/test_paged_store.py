"""``write_tokens`` of cache/paged_store.py against a slot-by-slot oracle: every written slot lands in its row's page
at its offset, nothing else in the pool changes (shared prefix pages, the rest of partial pages, other rows'
pages)."""

from __future__ import annotations

import random

import pytest
import torch

from hf_rocketkv.cache.paged_store import PagedStore, write_tokens


def oracle_write(k_pages, v_pages, table, keys, values, start, end):
    """Python loops over rows and slots: slot s of row b goes to page table[b, s // P], offset s % P."""
    page = k_pages.shape[2]
    k_out, v_out = k_pages.clone(), v_pages.clone()
    for b, (first, last) in enumerate(zip(start, end)):
        for s in range(first, last):
            p = int(table[b, s // page])
            k_out[p, :, s % page] = keys[b, :, s].to(k_out.dtype)
            v_out[p, :, s % page] = values[b, :, s].to(v_out.dtype)
    return k_out, v_out


@pytest.mark.parametrize("seed", range(12))
def test_write_tokens_matches_slot_by_slot_writes(seed):
    rng = random.Random(seed)
    page = rng.choice([1, 4, 16])
    batch, heads, dim = rng.randint(1, 3), rng.choice([1, 2, 8]), rng.choice([4, 16])
    pages_per_row = rng.randint(1, 6)
    num_pages = batch * pages_per_row + 3
    dtype = rng.choice([torch.float32, torch.bfloat16])
    k_pages = torch.randn(num_pages, heads, page, dim).to(dtype)
    v_pages = torch.randn(num_pages, heads, page, dim).to(dtype)
    order = torch.randperm(num_pages)[: batch * pages_per_row]  # rows own scattered pool pages
    table = order.view(batch, pages_per_row).to(torch.int32)
    width = pages_per_row * page
    keys, values = torch.randn(batch, heads, width, dim), torch.randn(batch, heads, width, dim)
    start, end = [], []
    for _ in range(batch):  # aligned and unaligned ends, empty ranges, shared prefix pages before start
        first = rng.choice([0, page * rng.randint(0, pages_per_row), rng.randint(0, width)])
        last = rng.choice([width, rng.randint(first, width), first])
        start.append(min(first, last))
        end.append(last)
    store = PagedStore(k_pages.clone(), v_pages.clone(), None, table, (pages_per_row,) * batch, False)
    expected_k, expected_v = oracle_write(k_pages, v_pages, table, keys, values, start, end)
    write_tokens(store, keys, values, start, end)
    assert torch.equal(store.k, expected_k)
    assert torch.equal(store.v, expected_v)


def test_write_tokens_refuses_a_slot_without_a_page():
    store = PagedStore(torch.zeros(4, 1, 4, 2), torch.zeros(4, 1, 4, 2), None,
                       torch.tensor([[0, 1, -1]], dtype=torch.int32), (2,), False)
    with pytest.raises(IndexError, match="no page"):
        write_tokens(store, torch.zeros(1, 1, 12, 2), torch.zeros(1, 1, 12, 2), [0], [9])


@pytest.mark.parametrize("batch", [1, 3])
def test_scatter_pages_with_host_counts_matches_page_by_page_writes(batch):
    """``scatter_pages(..., row_pages)`` (the one-row path slices, the others concatenate) against a loop."""
    from hf_rocketkv.kernels.paged import scatter_pages

    g = torch.Generator().manual_seed(batch)
    heads, page, dim, width = 2, 4, 8, 5
    counts = [5, 2, 0][:batch]
    pool = torch.randn(20, heads, page, dim, generator=g)
    order = torch.randperm(20, generator=g).tolist()
    table, used = [], 0
    for n in counts:
        table.append(order[used : used + n] + [-1] * (width - n))
        used += n
    table = torch.tensor(table, dtype=torch.int32)
    rows = torch.randn(batch, heads, width * page, dim, generator=g)
    expected = pool.clone()
    for b, n in enumerate(counts):
        for i in range(n):
            expected[int(table[b, i])] = rows[b, :, i * page : (i + 1) * page]
    scatter_pages(pool, table, rows, tuple(counts))
    assert torch.equal(pool, expected)


@pytest.mark.parametrize("granularity", ["page", "head"])
@pytest.mark.parametrize("seed", range(6))
def test_fp8_write_tokens_follows_the_reference_write_rule(seed, granularity):
    """fp8 pages: ``write_tokens`` equals ``memory/page_io.write_tokens`` (the reference rule) row by row, bit for bit:
    touched pages re-quantized over their tokens with the slots past the write zeroed (stale bytes there, NaN
    patterns included, never reach a scale), pages before ``start`` and other pages untouched."""
    from hf_rocketkv.memory import page_io
    from hf_rocketkv.memory.fp8 import FP8_DTYPE, quantize_pages
    from hf_rocketkv.memory.layout import LayerShape
    from hf_rocketkv.memory.storage import LayerStorage

    rng = random.Random(seed)
    page, heads, dim = rng.choice([4, 8]), rng.choice([1, 2]), rng.choice([4, 8])
    batch, pages_per_row = rng.randint(1, 3), rng.randint(2, 4)
    num_pages = batch * pages_per_row + 2
    shape = LayerShape(heads, dim, page, page, FP8_DTYPE, torch.float32, granularity)
    # earlier tokens: valid fp8 pages with their scales; then stale bytes (0x7f = NaN in e4m3) in some pages
    k, k_scale = quantize_pages(torch.randn(num_pages, heads, page, dim), granularity)
    v, v_scale = quantize_pages(torch.randn(num_pages, heads, page, dim), granularity)
    table = torch.randperm(num_pages)[: batch * pages_per_row].view(batch, pages_per_row).to(torch.int32)
    width = pages_per_row * page
    keys, values = torch.randn(batch, heads, width, dim) * 3, torch.randn(batch, heads, width, dim)
    start, end = [], []
    for b in range(batch):
        first = rng.choice([0, page, rng.randint(0, width - 1)])
        last = rng.randint(first + 1, width)
        start.append(first)
        end.append(last)
        for slot in range(last, ceil_div(last, page) * page):  # stale bytes past the write in its last page
            k.view(torch.uint8)[int(table[b, slot // page]), :, slot % page] = 0x7F
    reference = LayerStorage(shape, k.clone(), v.clone(), torch.zeros(0), k_scale.clone(), v_scale.clone())
    for b in range(batch):
        n = end[b] - start[b]
        page_io.write_tokens(reference, table[b].tolist(), start[b], keys[b, :, start[b] : end[b]],
                             values[b, :, start[b] : end[b]])
        assert n > 0
    store = PagedStore(k.clone(), v.clone(), None, table, (pages_per_row,) * batch, False, k_scale=k_scale.clone(),
                       v_scale=v_scale.clone(), read_dtype=torch.float32)
    write_tokens(store, keys, values, start, end)
    for got, want in ((store.k, reference.k), (store.v, reference.v)):
        assert torch.equal(got.view(torch.uint8), want.view(torch.uint8))
    assert torch.equal(store.k_scale, reference.k_scale) and torch.equal(store.v_scale, reference.v_scale)
    assert not torch.isnan(store.gather()[0]).any()


def ceil_div(a: int, b: int) -> int:
    return -(-a // b)
