"""paged_compact_row (stage 1's compaction of one row into its pages): the Triton kernel and the PyTorch twin
against a slot-by-slot oracle, bit for bit, and pages the row does not own are never touched."""

import pytest
import torch

from hf_rocketkv.kernels.paged import paged_compact_row_torch
from tests.kernels.kernel_utils import DEVICE, gen, ops, randn

pytestmark = pytest.mark.gpu  # compiled for the GPU where one is present (pytest -m gpu); interpreted on CPU


def oracle(keys, values, slots, columns, k_pages, v_pages, kt_pages, table, row_pages, positions, kp, counts=None):
    """Slot by slot, in Python: what the compaction must leave in the pages (written in place, like the op).
    ``counts`` [Hkv]: head h keeps only its first counts[h] slots (per-head budgets)."""
    heads, n = slots.shape
    page = k_pages.shape[2]
    per_page = page // kp
    positions.fill_(-1)
    for h in range(heads):
        n_h = n if counts is None else int(counts[h])
        kept = []  # the kept keys of the current KT page, fp32
        for s in range(row_pages * page):
            target, offset = int(table[s // page]), s % page
            if s < n_h:
                source = int(slots[h, s])
                k_pages[target, h, offset] = keys[h, source].to(k_pages.dtype)
                v_pages[target, h, offset] = values[h, source].to(v_pages.dtype)
                positions[h, s] = int(columns[h, source]) if columns is not None else source
                kept.append(keys[h, source].float())
            else:
                k_pages[target, h, offset] = 0
                v_pages[target, h, offset] = 0
            if kt_pages is not None and s % kp == kp - 1:
                j = s // kp
                kt_target = kt_pages[int(table[j // per_page]), h, j % per_page]
                if kept:
                    stacked = torch.stack(kept)
                    kt_target[0] = stacked.amin(dim=0).to(kt_pages.dtype)
                    kt_target[1] = stacked.amax(dim=0).to(kt_pages.dtype)
                else:
                    kt_target.zero_()
                kept = []


# (kv dtype, kt dtype, page tokens PP, kt page size KP, head_dim)
CASES = [
    (torch.bfloat16, torch.bfloat16, 16, 4, 64),
    (torch.float16, torch.float8_e5m2, 8, 2, 32),
    (torch.float32, torch.float32, 4, 4, 48),  # a private store's layout (one KT page per page); odd head_dim
    (torch.bfloat16, torch.float32, 16, 1, 128),
    (torch.float32, torch.float16, 8, 8, 16),
]


def _case(kv_dtype, kt_dtype, page, kp, head_dim, n, row_pages, max_pages, with_columns, tag):
    g = gen("compact", kv_dtype, kt_dtype, page, kp, head_dim, n, row_pages, max_pages, with_columns, tag)
    heads, dense, num_pages = 2, 3 * max_pages * page + 5, max_pages + 6
    # the row's dense store is a slice of a batch (strided), its slots ascending
    keys = randn((2, heads, dense, head_dim), kv_dtype, g, scale=3.0)[1]
    values = randn((2, heads, dense, head_dim), kv_dtype, g)[1]
    slots = torch.stack([torch.randperm(dense, generator=g)[:n].sort().values for _ in range(heads)]).to(DEVICE)
    columns = (torch.randint(0, 10**6, (heads, dense), generator=g, dtype=torch.int32).to(DEVICE)
               if with_columns else None)
    # pool pages in no particular order; every page starts with garbage (a previous owner's bytes)
    order = torch.randperm(num_pages, generator=g)[:max_pages].to(torch.int32)
    table = torch.where(torch.arange(max_pages) < row_pages, order, -1).to(DEVICE)
    k_pages = randn((num_pages, heads, page, head_dim), kv_dtype, g)
    v_pages = randn((num_pages, heads, page, head_dim), kv_dtype, g)
    kt_pages = randn((num_pages, heads, page // kp, 2, head_dim), torch.float32, g).to(kt_dtype)
    positions = torch.full((heads, max_pages * page), 7, dtype=torch.int32, device=DEVICE)
    return keys, values, slots, columns, k_pages, v_pages, kt_pages, table, row_pages, positions, kp


def _run(fn, case):
    keys, values, slots, columns, k_pages, v_pages, kt_pages, table, row_pages, positions, kp = case
    outputs = [t.clone() for t in (k_pages, v_pages, kt_pages, positions)]
    fn(keys, values, slots, columns, outputs[0], outputs[1], outputs[2], table, row_pages, outputs[3], kp)
    return outputs


def _assert_same(got, want):
    for name, a, b in zip(("k_pages", "v_pages", "kt_pages", "positions"), got, want):
        assert a.dtype == b.dtype and a.shape == b.shape, name
        assert torch.equal(a.float(), b.float()), f"{name} differs"


@pytest.mark.parametrize("kv_dtype,kt_dtype,page,kp,head_dim", CASES)
@pytest.mark.parametrize("with_columns", [False, True])
def test_compact_row_matches_the_slot_by_slot_oracle(kv_dtype, kt_dtype, page, kp, head_dim, with_columns):
    max_pages = 5
    # kept counts: a partial KT page, exactly the row's pages, a single slot, nothing kept
    for n, row_pages in ((2 * page + kp // 2 + 1, 3), (3 * page, 3), (1, 1), (0, 2), (page - 1, 4)):
        case = _case(kv_dtype, kt_dtype, page, kp, head_dim, n, row_pages, max_pages, with_columns, "oracle")
        want = _run(oracle, case)
        _assert_same(_run(paged_compact_row_torch, case), want)
        _assert_same(_run(ops().paged_compact_row, case), want)


def test_compact_row_leaves_other_pages_untouched_and_fills_every_position():
    case = _case(torch.bfloat16, torch.bfloat16, 16, 4, 64, 20, 2, 4, True, "untouched")
    k_pages, table = case[4], case[7]
    got = _run(ops().paged_compact_row, case)
    owned = set(table[:2].tolist())
    for p in range(k_pages.shape[0]):
        if p not in owned:
            assert torch.equal(got[0][p], k_pages[p]) and torch.equal(got[2][p].float(), case[6][p].float())
    positions = got[3]
    assert positions.shape == (2, 64) and bool((positions[:, 20:] == -1).all()) and bool((positions[:, :20] >= 0).all())


def test_compact_row_takes_an_expanded_slot_view():
    """A row under the budget keeps every slot: ``whole_row`` hands an ``arange(...).expand(Hkv, n)`` view."""
    case = list(_case(torch.float16, torch.float16, 8, 4, 32, 12, 2, 3, False, "expand"))
    case[2] = torch.arange(3, 15, device=DEVICE).expand(2, 12)
    want = _run(oracle, case)
    _assert_same(_run(ops().paged_compact_row, case), want)


@pytest.mark.parametrize("kv_dtype,kt_dtype,page,kp,head_dim", CASES[:3])
@pytest.mark.parametrize("with_columns", [False, True])
def test_compact_row_with_per_head_counts_matches_the_oracle(kv_dtype, kt_dtype, page, kp, head_dim, with_columns):
    """AdaKV's per-head budgets: head h keeps slots[h, :counts[h]], the rest of its row is empty (zeros, position -1,
    KT over its own kept keys only); the -1 padding AdaKV puts after a head's slots is never read."""
    max_pages = 5
    for n, row_pages, counts in ((2 * page + kp // 2 + 1, 3, (2 * page + kp // 2 + 1, 3)), (3 * page, 3, (0, 3 * page)),
                                 (page + 1, 2, (1, page))):
        case = list(_case(kv_dtype, kt_dtype, page, kp, head_dim, n, row_pages, max_pages, with_columns, "counts"))
        counts_t = torch.tensor(counts, device=DEVICE)
        slots = case[2].clone()
        for h, c in enumerate(counts):
            slots[h, c:] = -1  # AdaKV's padding
        case[2] = slots
        want = _run(lambda *a: oracle(*a, counts=counts_t), case)
        assert bool((want[3][0, counts[0]:] == -1).all()) and bool((want[3][1, counts[1]:] == -1).all())
        for fn in (paged_compact_row_torch, ops().paged_compact_row):
            _assert_same(_run(lambda *a, f=fn: f(*a, counts=counts_t), case), want)
        # counts equal to n for every head: the same as no counts
        full = _run(lambda *a: paged_compact_row_torch(*a, counts=torch.full((2,), n, device=DEVICE)),
                    _case(kv_dtype, kt_dtype, page, kp, head_dim, n, row_pages, max_pages, with_columns, "full"))
        _assert_same(full, _run(oracle, _case(kv_dtype, kt_dtype, page, kp, head_dim, n, row_pages, max_pages,
                                              with_columns, "full")))


@pytest.mark.parametrize("granularity", ["page", "head"])
def test_compact_row_per_head_counts_on_fp8_pages_equals_the_twin(granularity):
    """fp8 pages with per-head counts: the backend's op writes the twin's bytes (pages, scales, KT, positions)."""
    g = gen("compact-fp8-counts", granularity)
    heads, dense, page, kp, dim, num_pages, max_pages, row_pages = 2, 40, 8, 4, 32, 7, 4, 3
    keys = randn((heads, dense, dim), torch.float32, g, scale=3.0)
    values = randn((heads, dense, dim), torch.float32, g)
    n, counts = 19, torch.tensor([19, 5], device=DEVICE)
    slots = torch.stack([torch.randperm(dense, generator=g)[:n].sort().values for _ in range(heads)]).to(DEVICE)
    slots[1, 5:] = -1
    table = torch.randperm(num_pages, generator=g)[:max_pages].to(torch.int32).to(DEVICE)
    scale_shape = (num_pages,) if granularity == "page" else (num_pages, heads)
    outputs = []
    for fn in (paged_compact_row_torch, ops().paged_compact_row):
        k_pages = torch.zeros((num_pages, heads, page, dim), device=DEVICE).to(torch.float8_e4m3fn)
        v_pages = torch.zeros_like(k_pages)
        kt_pages = torch.zeros((num_pages, heads, page // kp, 2, dim), device=DEVICE)
        k_scale = torch.ones(scale_shape, device=DEVICE)
        v_scale = torch.ones(scale_shape, device=DEVICE)
        positions = torch.full((heads, max_pages * page), 7, dtype=torch.int32, device=DEVICE)
        fn(keys, values, slots, None, k_pages, v_pages, kt_pages, table, row_pages, positions, kp,
           k_scale=k_scale, v_scale=v_scale, counts=counts)
        outputs.append((k_pages.view(torch.uint8), v_pages.view(torch.uint8), kt_pages, k_scale, v_scale, positions))
    for a, b in zip(*outputs):
        assert torch.equal(a, b)
    positions = outputs[0][5]
    assert bool((positions[1, 5:] == -1).all()) and bool((positions[1, :5] >= 0).all())


def test_compact_row_refuses_bad_counts():
    case = list(_case(torch.float32, torch.float32, 4, 4, 16, 6, 2, 3, False, "bad-counts"))
    for bad in (torch.tensor([1.0, 2.0], device=DEVICE), torch.tensor([1, 2, 3], device=DEVICE), [1, 2]):
        with pytest.raises(ValueError, match=r"counts must be None or an integer tensor \[Hkv\]"):
            _run(lambda *a, c=bad: ops().paged_compact_row(*a, counts=c), case)


def test_compact_row_refuses_more_slots_than_pages():
    case = list(_case(torch.float32, torch.float32, 4, 4, 16, 9, 2, 3, False, "refuse"))
    with pytest.raises(ValueError, match="do not fit"):
        _run(ops().paged_compact_row, case)
