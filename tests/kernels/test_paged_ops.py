"""Paged decode ops (K/V and KT read and written through a block table) against their twins and independent oracles.

Layout (kernels/paged.py): k/v pages [N, Hkv, PP, D], KT pages [N, Hkv, PP // KP, 2, D], table [B, MP] int32 with
-1 for missing pages. Tables here are random permutations of a shared page pool, rows own different page counts,
and the pages no row owns hold large garbage values, so reading a page of another row (or a missing one) shows.
"""

import pytest
import torch

from hf_rocketkv.kernels.append_token import paged_append_kv_torch, paged_append_token_torch
from hf_rocketkv.kernels.dispatch import TORCH_OPS
from hf_rocketkv.kernels.paged import gather_pages, identity_table, scatter_pages
from hf_rocketkv.kernels.sparse_decode_attention import (
    paged_sparse_decode_attention_torch,
    sparse_decode_attention_launch,
)
from hf_rocketkv.selection import stage2_pages as ref
from tests.kernels.kernel_utils import (
    DEVICE,
    OUT_ATOL,
    gen,
    ops,
    page_table,
    query_without_channel_ties,
    randn,
    selected_slots,
)

pytestmark = pytest.mark.gpu  # compiled for the GPU where one is present (pytest -m gpu); interpreted on CPU


def _store(table, num_pages, kv_heads, page_tokens, kt_page, head_dim, dtype, kt_dtype, lengths, g):
    """Pages full of garbage, then each row's first ``lengths`` tokens written with random keys and a KT built over
    them (what compaction leaves), so decode appends continue a consistent state."""
    k_pages = randn((num_pages, kv_heads, page_tokens, head_dim), dtype, g, scale=50.0)
    v_pages = randn((num_pages, kv_heads, page_tokens, head_dim), dtype, g, scale=50.0)
    kt_pages = randn((num_pages, kv_heads, page_tokens // kt_page, 2, head_dim), torch.float32, g, scale=50.0)
    kt_pages = kt_pages.to(kt_dtype)
    batch, width = table.shape
    capacity = width * page_tokens
    keys = randn((batch, kv_heads, capacity, head_dim), dtype, g, scale=3.0)
    values = randn((batch, kv_heads, capacity, head_dim), dtype, g)
    per_head = ref.per_head(lengths, batch, kv_heads)
    filled = (torch.arange(capacity, device=DEVICE) < per_head[..., None])[..., None]
    keys = torch.where(filled, keys.float(), 0.0).to(dtype)
    scatter_pages(k_pages, table, keys)
    scatter_pages(v_pages, table, values)
    scatter_pages(kt_pages, table, ref.build_kt(keys, lengths, kt_page, kt_dtype))
    positions = torch.randint(0, 100, (batch, kv_heads, capacity), generator=g, dtype=torch.int32).to(DEVICE)
    return [k_pages, v_pages, kt_pages, table, positions, lengths.clone(), torch.tensor(40, device=DEVICE)]


def _append_steps(fn, state, steps, dtype, g, kt_page, with_kt=True):
    batch, kv_heads = state[4].shape[:2]
    head_dim = state[0].shape[3]
    for _ in range(steps):
        state[6] += 1
        k = randn((batch, kv_heads, 2, head_dim), dtype, g, scale=3.0)[:, :, 1]  # strided like key_states[:, :, 0]
        v = randn((batch, kv_heads, head_dim), dtype, g)
        if with_kt:
            assert fn(*state, k, v, kt_page) is None
        else:
            assert fn(state[0], state[1], *state[3:], k, v) is None
    return state


# (kv_heads, page_tokens PP, KT page KP, head_dim, dtype, KT dtype, per-head lengths)
APPEND_CASES = [
    (2, 8, 4, 16, torch.float32, torch.float32, False),
    (1, 4, 4, 32, torch.bfloat16, torch.float8_e5m2, False),
    (3, 16, 2, 48, torch.float16, torch.bfloat16, True),
    (8, 8, 8, 64, torch.bfloat16, torch.float8_e5m2, True),
]


@pytest.mark.parametrize("kv_heads,page_tokens,kt_page,head_dim,dtype,kt_dtype,per_head", APPEND_CASES)
def test_paged_append_token_kernel_equals_twin_and_contiguous_reference(
    kv_heads, page_tokens, kt_page, head_dim, dtype, kt_dtype, per_head
):
    g = gen("paged-append", kv_heads, page_tokens, kt_page, head_dim, dtype, per_head)
    table = page_table([3, 1, 4], 12, g)
    capacity_per_row = torch.tensor([3, 1, 4], device=DEVICE) * page_tokens
    steps = 3
    if per_head:
        lengths = torch.stack([torch.randint(0, int(c) - steps + 1, (kv_heads,), generator=g).to(DEVICE)
                               for c in capacity_per_row])
    else:  # an empty row, a row at a page boundary, a row mid page
        lengths = torch.tensor([0, page_tokens - steps, page_tokens + kt_page // 2 + 1], device=DEVICE)
    base = _store(table, 12, kv_heads, page_tokens, kt_page, head_dim, dtype, kt_dtype, lengths, g)
    want = _append_steps(paged_append_token_torch, [t.clone() for t in base], steps, dtype, gen("new"), kt_page)
    got = _append_steps(ops().paged_append_token, [t.clone() for t in base], steps, dtype, gen("new"), kt_page)
    for a, b in zip(got, want):
        assert a.dtype == b.dtype and torch.equal(a.float(), b.float())
    # pages no row owns are untouched
    owned = table[table >= 0].long()
    free = torch.ones(12, dtype=torch.bool, device=DEVICE)
    free[owned] = False
    for t, before in zip(got[:3], base[:3]):
        assert torch.equal(t[free].float(), before[free].float())
    # the contiguous reference over the gathered rows gives the same rows
    keys, values = gather_pages(base[0], table), gather_pages(base[1], table)
    kt = gather_pages(base[2], table)
    contiguous = [keys, values, base[4].clone(), kt, lengths.clone(), base[6].clone()]
    g_new = gen("new")
    for _ in range(steps):
        contiguous[5] += 1
        k = randn((3, kv_heads, 2, head_dim), dtype, g_new, scale=3.0)[:, :, 1]
        v = randn((3, kv_heads, head_dim), dtype, g_new)
        TORCH_OPS.append_token(*contiguous, k, v, kt_page)
    assert torch.equal(gather_pages(got[0], table).float(), contiguous[0].float())
    assert torch.equal(gather_pages(got[1], table).float(), contiguous[1].float())
    assert torch.equal(gather_pages(got[2], table).float(), contiguous[3].float())
    assert torch.equal(got[4], contiguous[2]) and torch.equal(got[5], contiguous[4])


def test_paged_append_kv_writes_no_kt():
    g = gen("paged-append-kv")
    table = page_table([2, 2], 6, g)
    lengths = torch.tensor([3, 8], device=DEVICE)
    base = _store(table, 6, 2, 8, 4, 16, torch.float32, torch.float32, lengths, g)
    want = _append_steps(paged_append_kv_torch, [t.clone() for t in base], 2, torch.float32, gen("kv"), 4, False)
    got = _append_steps(ops().paged_append_kv, [t.clone() for t in base], 2, torch.float32, gen("kv"), 4, False)
    for a, b in zip(got, want):
        assert torch.equal(a.float(), b.float())
    assert torch.equal(got[2], base[2])  # the KT pages are not touched
    assert got[5].tolist() == [5, 10]


def test_paged_append_drops_writes_without_a_page():
    """A row whose next slot has no page (-1) or lies past the table: the kernel writes nothing anywhere and still
    counts the token; the reference refuses."""
    g = gen("paged-append-full")
    table = page_table([2, 1], 4, g)  # row 1: one page, then -1
    lengths = torch.tensor([16, 8], device=DEVICE)  # row 0: past the table; row 1: its next slot has no page
    state = _store(table, 4, 2, 8, 4, 16, torch.float32, torch.float32, torch.tensor([16, 8], device=DEVICE), g)
    before = [t.clone() for t in state]
    _append_steps(ops().paged_append_token, state, 1, torch.float32, gen("full"), 4)
    for t, b in zip(state[:3], before[:3]):
        assert torch.equal(t, b)
    assert state[5].tolist() == [17, 9]
    with pytest.raises(IndexError):
        _append_steps(paged_append_token_torch, [t.clone() for t in before], 1, torch.float32, gen("full"), 4)
    assert lengths.tolist() == [16, 8]


def test_paged_append_token_with_one_logical_length_per_row():
    """Rows of several requests decode together (serving/batching/engine.py): ``seen`` [B] records each row's token at
    its own input column; the Triton kernel equals the reference, and each row equals a one-row append with its own 0-d
    count."""
    g = gen("paged-append-seen-rows")
    table = page_table([2, 1, 3], 8, g)
    lengths = torch.tensor([5, 2, 17], device=DEVICE)
    base = _store(table, 8, 2, 8, 4, 16, torch.float32, torch.float32, lengths, g)
    base[6] = torch.tensor([40, 7, 300], device=DEVICE)  # per-row logical lengths
    want = _append_steps(paged_append_token_torch, [t.clone() for t in base], 2, torch.float32, gen("rows"), 4)
    got = _append_steps(ops().paged_append_token, [t.clone() for t in base], 2, torch.float32, gen("rows"), 4)
    for a, b in zip(got, want):
        assert torch.equal(a.float(), b.float())
    rows = torch.arange(3, device=DEVICE)
    assert got[4][rows, :, lengths + 1].tolist() == [[41, 41], [8, 8], [301, 301]]
    assert got[6].tolist() == [42, 9, 302]
    with pytest.raises(ValueError, match=r"seen must be 0-d or \[batch=3\]"):
        bad = [t.clone() for t in base]
        bad[6] = torch.tensor([1, 2], device=DEVICE)
        _append_steps(ops().paged_append_token, bad, 1, torch.float32, gen("rows"), 4)


@pytest.mark.parametrize("counts,per_head", [
    ([40, 7, 300], False),  # one count per row: each program advances its own
    ([12], True),  # one row owning a 0-d count (generate() at batch 1), per-head lengths
    ([12], False),
    (None, False),  # one 0-d count shared by three rows: advanced before their programs read it
])
def test_paged_append_token_advances_the_count_in_its_launch(counts, per_head):
    """``advance_seen=True``: ``seen`` is the count before the token and moves past it with the append (each token's
    input column is the count before it), equal to advancing it first and appending without the flag."""
    g = gen("paged-append-advance", counts, per_head)
    batch = len(counts) if counts else 3
    table = page_table([2, 1, 3][:batch], 8, g)
    lengths = torch.tensor([5, 2, 17][:batch], device=DEVICE)
    if per_head:
        lengths = torch.tensor([[3, 9]], device=DEVICE)
    base = _store(table, 8, 2, 8, 4, 16, torch.bfloat16, torch.float32, lengths, g)
    if counts is not None:
        base[6] = torch.tensor(counts if len(counts) > 1 else counts[0], device=DEVICE)
    start = base[6].clone()
    steps = 3
    for fn in (paged_append_token_torch, ops().paged_append_token):
        want = _append_steps(fn, [t.clone() for t in base], steps, torch.bfloat16, gen("adv"), 4)
        got = [t.clone() for t in base]
        new = gen("adv")
        for _ in range(steps):  # _append_steps' draws, without its own count advance
            k = randn((batch, 2, 2, 16), torch.bfloat16, new, scale=3.0)[:, :, 1]
            v = randn((batch, 2, 16), torch.bfloat16, new)
            fn(*got, k, v, 4, advance_seen=True)
        for a, b in zip(got, want):
            assert torch.equal(a.float(), b.float())
        assert torch.equal(got[6], start + steps)
        rows = torch.arange(batch, device=DEVICE)[:, None]
        slot = ref.per_head(lengths, batch, 2)  # the first token's slot per row and KV head
        first_column = start.reshape(-1, 1).expand(batch, 2)
        assert torch.equal(got[4][rows, torch.arange(2, device=DEVICE)[None, :], slot].long(), first_column)


def test_advancing_a_count_broadcast_over_rows_is_refused_before_any_write():
    """A ``[B]`` count that is one value expanded over the rows (stride 0) cannot advance in place: ``advance_seen``
    on it is refused naming ``seen``, and nothing is written (the pages, KT, positions, lengths and count as given)."""
    g = gen("paged-append-expanded")
    table = page_table([2, 1, 3], 8, g)
    lengths = torch.tensor([5, 2, 17], device=DEVICE)
    base = _store(table, 8, 2, 8, 4, 16, torch.bfloat16, torch.float32, lengths, g)
    shared = torch.tensor(40, device=DEVICE)
    k = randn((3, 2, 16), torch.bfloat16, g, scale=3.0)
    v = randn((3, 2, 16), torch.bfloat16, g)
    for fn in (paged_append_token_torch, ops().paged_append_token):
        got = [t.clone() for t in base]
        got[6] = shared.expand(3)
        with pytest.raises(ValueError, match="seen is one count broadcast over 3 rows"):
            fn(*got, k, v, 4, advance_seen=True)
        for a, b in zip(got[:6], base[:6]):
            assert torch.equal(a.float(), b.float())
        assert int(shared) == 40


def _selection_inputs(g, group, head_dim, kv_heads, page_tokens, kt_page, kt_dtype, q_dtype, topr):
    table = page_table([5, 2, 4], 14, g)
    lengths = torch.tensor([5 * page_tokens, 2 * page_tokens - 3, 4 * page_tokens // 3], device=DEVICE)
    state = _store(table, 14, kv_heads, page_tokens, kt_page, head_dim, q_dtype, kt_dtype, lengths, g)
    q = query_without_channel_ties((3, kv_heads, group, head_dim), q_dtype, kt_dtype, topr, g)
    return q, state


# (group, head_dim, kv_heads, PP, KP, topr, topk, KT dtype, q dtype)
SELECT_CASES = [
    (1, 16, 1, 8, 4, 16, 3, torch.float32, torch.float32),
    (4, 32, 2, 16, 4, 8, 5, torch.float8_e5m2, torch.bfloat16),
    (3, 64, 3, 8, 2, 64, 100, torch.bfloat16, torch.bfloat16),
    (8, 16, 1, 4, 4, 5, 2, torch.float16, torch.float16),
]


@pytest.mark.parametrize("group,head_dim,kv_heads,page_tokens,kt_page,topr,topk,kt_dtype,q_dtype", SELECT_CASES)
def test_paged_page_scores_and_top_pages(group, head_dim, kv_heads, page_tokens, kt_page, topr, topk, kt_dtype,
                                         q_dtype):
    g = gen("paged-select", group, head_dim, kv_heads, page_tokens, kt_page, topr, topk)
    q, state = _selection_inputs(g, group, head_dim, kv_heads, page_tokens, kt_page, kt_dtype, q_dtype, topr)
    kt_pages, table, lengths = state[2], state[3], state[5]
    contiguous_kt = gather_pages(kt_pages, table)
    n_pages = ref.num_pages(lengths, kt_page)
    want = ref.page_scores(q, contiguous_kt, n_pages, topr)
    torch.testing.assert_close(TORCH_OPS.paged_page_scores(q, kt_pages, table, n_pages, topr), want, atol=0, rtol=0)
    torch.testing.assert_close(ops().paged_page_scores(q, kt_pages, table, n_pages, topr), want, atol=2e-6, rtol=1e-4)
    want_idx, want_valid = ref.top_pages(q, contiguous_kt, lengths, kt_page, topr, topk)
    for fn in (TORCH_OPS.paged_top_pages, ops().paged_top_pages):
        idx, valid = fn(q, kt_pages, table, lengths, kt_page, topr, topk)
        assert torch.equal(idx, want_idx) and torch.equal(valid, want_valid)
    # per-head lengths
    per_head = torch.stack([lengths, (lengths - 1).clamp(min=0)], dim=1)[:, :1].expand(3, kv_heads).contiguous()
    per_head[:, -1] = (per_head[:, -1] // 2)
    want_idx, want_valid = ref.top_pages(q, contiguous_kt, per_head, kt_page, topr, topk)
    idx, valid = ops().paged_top_pages(q, kt_pages, table, per_head, kt_page, topr, topk)
    assert torch.equal(idx, want_idx) and torch.equal(valid, want_valid)


def _oracle_paged_attention(q, k_pages, v_pages, table, page_idx, page_valid, lengths, kt_page, scaling):
    """Float64 loops over exactly the selected tokens, addressed through the table."""
    batch, kv_heads, group, head_dim = q.shape
    page_tokens = k_pages.shape[2]
    lengths = ref.per_head(lengths, batch, kv_heads)
    out = torch.zeros(batch, kv_heads, group, head_dim, dtype=torch.float64)
    for b in range(batch):
        for h in range(kv_heads):
            slots = selected_slots(page_idx, page_valid, lengths, b, h, kt_page)
            if not slots:
                continue
            pages = [int(table[b, s // page_tokens]) for s in slots]
            k = torch.stack([k_pages[p, h, s % page_tokens].double().cpu() for p, s in zip(pages, slots)])
            v = torch.stack([v_pages[p, h, s % page_tokens].double().cpu() for p, s in zip(pages, slots)])
            probs = torch.softmax(q[b, h].double().cpu() @ k.T * scaling, dim=-1)
            out[b, h] = probs @ v
    return out


@pytest.mark.parametrize("group,head_dim,kv_heads,page_tokens,kt_page,dtype,splits", [
    (1, 16, 2, 8, 4, torch.float32, 1),
    (4, 32, 2, 16, 4, torch.bfloat16, 3),
    (8, 64, 1, 4, 2, torch.float16, None),
    (2, 48, 3, 8, 8, torch.float32, 2),
])
def test_paged_sparse_decode_attention(group, head_dim, kv_heads, page_tokens, kt_page, dtype, splits):
    g = gen("paged-sda", group, head_dim, kv_heads, page_tokens, kt_page, dtype)
    q, state = _selection_inputs(g, group, head_dim, kv_heads, page_tokens, kt_page, torch.float32, dtype, head_dim)
    k_pages, v_pages, table, lengths = state[0], state[1], state[3], state[5]
    num_kt_pages = table.shape[1] * page_tokens // kt_page
    k = min(4, num_kt_pages)
    page_idx = torch.stack([torch.randperm(num_kt_pages, generator=g)[:k] for _ in range(3 * kv_heads)])
    page_idx = page_idx.view(3, kv_heads, k).to(DEVICE)
    page_valid = (torch.rand((3, kv_heads, k), generator=g) > 0.2).to(DEVICE)
    scaling = head_dim**-0.5
    oracle = _oracle_paged_attention(q, k_pages, v_pages, table, page_idx, page_valid, lengths, kt_page, scaling)
    twin = paged_sparse_decode_attention_torch(q, k_pages, v_pages, table, page_idx, page_valid, lengths, kt_page,
                                               scaling)
    got = sparse_decode_attention_launch(q, k_pages, v_pages, page_idx, page_valid, lengths, kt_page, scaling,
                                         num_splits=splits, table=table)
    op = ops().paged_sparse_decode_attention(q, k_pages, v_pages, table, page_idx, page_valid, lengths, kt_page,
                                             scaling)
    tol = OUT_ATOL[dtype]
    torch.testing.assert_close(twin.double().cpu(), oracle, atol=tol, rtol=0)
    torch.testing.assert_close(got.double().cpu(), oracle, atol=tol, rtol=0)
    torch.testing.assert_close(op.double().cpu(), oracle, atol=tol, rtol=0)


def test_identity_table_round_trip():
    g = gen("identity")
    pages = randn((6, 2, 4, 8), torch.float32, g)
    table = identity_table(3, 2, DEVICE)
    rows = gather_pages(pages, table)
    assert rows.shape == (3, 2, 8, 8)
    assert torch.equal(rows[1, :, 4:], pages[3])
    copy = torch.zeros_like(pages)
    scatter_pages(copy, table, rows)
    assert torch.equal(copy, pages)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float8_e5m2])
def test_scatter_pages_with_host_page_counts_equals_the_masked_write(dtype):
    """``scatter_pages(..., row_pages)`` (no device mask: host page counts) writes exactly what the masked write
    does, on shuffled pool pages with rows of different page counts (-1 after each row's pages)."""
    g = gen("scatter-counts")
    counts = (3, 1, 4)
    order = torch.randperm(12, generator=g).tolist()
    table = torch.full((3, 4), -1, dtype=torch.int32)
    start = 0
    for b, n in enumerate(counts):
        table[b, :n] = torch.tensor(order[start : start + n], dtype=torch.int32)
        start += n
    table = table.to(DEVICE)
    rows = randn((3, 2, 4 * 5, 8), torch.float32, g).to(dtype)
    base = randn((12, 2, 5, 8), torch.float32, g).to(dtype)
    want, got = base.clone(), base.clone()
    scatter_pages(want, table, rows)
    scatter_pages(got, table, rows, counts)
    assert torch.equal(got.float(), want.float())
    assert not torch.equal(got.float(), base.float())  # something was written


def test_registered_paged_ops_run_through_the_dispatcher():
    """The triton_op registrations (what torch.compile traces) give the launchers' results."""
    g = gen("paged-registered")
    table = page_table([2, 3], 7, g)
    lengths = torch.tensor([9, 17], device=DEVICE)
    base = _store(table, 7, 2, 8, 4, 16, torch.float32, torch.float32, lengths, g)
    direct = _append_steps(ops().paged_append_token, [t.clone() for t in base], 2, torch.float32, gen("r"), 4)
    # the appends' registered schemas take the scales without a default: None for float pages
    op = ops().paged_append_token.op
    registered = _append_steps(lambda *a: op(*a, None, None), [t.clone() for t in base], 2, torch.float32, gen("r"), 4)
    for a, b in zip(direct, registered):
        assert torch.equal(a, b)
    q = randn((2, 2, 2, 16), torch.float32, g)
    k_pages, v_pages, kt_pages, table, lengths = direct[0], direct[1], direct[2], direct[3], direct[5]
    idx, valid = ops().paged_top_pages.op(q, kt_pages, table, lengths, 4, 16, 3)
    want_idx, want_valid = ops().paged_top_pages(q, kt_pages, table, lengths, 4, 16, 3)
    assert torch.equal(idx, want_idx) and torch.equal(valid, want_valid)
    for per_head_bound in (False, True):  # the flag reaches the registered op and the paged twin
        bound_idx, bound_valid = ops().paged_top_pages.op(q, kt_pages, table, lengths, 4, 16, 3, 0, 1, per_head_bound)
        twin_idx, twin_valid = TORCH_OPS.paged_top_pages(q, kt_pages, table, lengths, 4, 16, 3, 0, 1, per_head_bound)
        assert torch.equal(bound_valid, twin_valid)
        assert torch.equal(bound_idx.sort(-1).values, twin_idx.sort(-1).values)
        scores = ops().paged_page_scores.op(q, kt_pages, table, ref.num_pages(lengths, 4), 16, per_head_bound)
        torch.testing.assert_close(scores, TORCH_OPS.paged_page_scores(q, kt_pages, table, ref.num_pages(lengths, 4),
                                                                       16, per_head_bound), atol=2e-6, rtol=1e-4)
    out = ops().paged_sparse_decode_attention.op(q, k_pages, v_pages, table, idx, valid, lengths, 4, 0.25)
    torch.testing.assert_close(out, paged_sparse_decode_attention_torch(q, k_pages, v_pages, table, idx, valid,
                                                                        lengths, 4, 0.25), atol=2e-5, rtol=0)


def test_registered_appends_take_the_scales_without_defaults():
    """The appends mutate k_scale / v_scale, so their schemas declare them without a default: torch 2.11's
    ADInplaceOrView kernel indexes mutated arguments in the dispatcher's tuple, which drops trailing defaulted ones
    (an IndexError for every eager call on float pages there). The RocketOps entries still default them to None,
    under torch.compile too (the wrapper passes them explicitly)."""
    import inspect

    from torch._library.custom_ops import CustomOpDef

    for name in ("paged_append_token", "paged_append_kv"):
        entry = getattr(ops(), name)
        assert isinstance(entry.op, CustomOpDef), name
        schema = entry.op._opoverload._schema
        scales = {a.name: a for a in schema.arguments if a.name in ("k_scale", "v_scale")}
        assert set(scales) == {"k_scale", "v_scale"}, name
        for arg in scales.values():
            assert not arg.has_default_value(), (name, arg.name)
            assert arg.alias_info is not None and arg.alias_info.is_write, (name, arg.name)  # mutated
        params = inspect.signature(entry).parameters
        assert params["k_scale"].default is None and params["v_scale"].default is None, name


@pytest.mark.skipif(not torch.cuda.is_available(),
                    reason="the interpreter cannot run a triton_op on the fake tensors torch.compile traces with")
def test_append_entry_without_scales_compiles_fullgraph():
    """``ops().paged_append_token(...)`` with the scales left out (float pages), traced by torch.compile: the entry
    hands the op explicit Nones, no graph break, the eager entry's writes."""
    g = gen("paged-append-compile")
    table = page_table([2, 3], 7, g)
    lengths = torch.tensor([9, 17], device=DEVICE)
    base = _store(table, 7, 2, 8, 4, 16, torch.float32, torch.float32, lengths, g)
    eager = _append_steps(ops().paged_append_token, [t.clone() for t in base], 1, torch.float32, gen("c"), 4)
    torch._dynamo.reset()
    compiled = torch.compile(ops().paged_append_token, fullgraph=True, backend="aot_eager")
    traced = _append_steps(compiled, [t.clone() for t in base], 1, torch.float32, gen("c"), 4)
    for a, b in zip(eager, traced):
        assert torch.equal(a, b)
