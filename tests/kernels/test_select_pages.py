"""select_pages and top_pages: top-k pages per KV head with sink / recent pages forced, Triton vs the reference.

The reference defines the tie order (lower page id first) and a canonical output order, so the Triton kernels must
return exactly the reference's tensors; ``assert_same_selection`` compares the chosen SETS (the contract leaves
the order inside K unspecified) and the invalid tail, and the tests also check exact equality where the inputs
are the same probabilities. Interpreted Triton is slow: shapes are small, launch knobs force the multi-stage paths.
"""

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from hf_rocketkv.kernels.select_pages import select_pages_launch, select_plan, top_pages_launch
from hf_rocketkv.kernels.page_scores import page_scores_launch
from hf_rocketkv.selection import stage2_pages as ref
from tests.kernels.kernel_utils import DEVICE, gen, ops, randn

pytestmark = pytest.mark.gpu  # compiled for the GPU where one is present (pytest -m gpu); interpreted on CPU


def assert_same_selection(idx, valid, want_idx, want_valid):
    """Same shapes and dtypes, the same set of valid pages per (row, KV head), the same invalid tail."""
    assert idx.shape == want_idx.shape and idx.dtype == torch.long and valid.dtype == torch.bool
    assert torch.equal(valid.sum(-1), want_valid.sum(-1))
    big = torch.iinfo(torch.long).max
    chosen = torch.where(valid, idx, big).sort(-1).values
    assert torch.equal(chosen, torch.where(want_valid, want_idx, big).sort(-1).values)
    assert torch.equal(torch.where(valid, -1, idx).sort(-1).values, torch.where(want_valid, -1, want_idx).sort(-1).values)


def _probs(batch, kv_heads, num_pages, g):
    """Random probabilities with the hard cases: a row of equal values, many ties, coarse values, zeros, NaN."""
    probs = torch.rand((batch, kv_heads, num_pages), generator=g)
    probs[0, 0] = 0.5  # every page tied
    if batch > 1:
        probs[1, -1, ::3] = 0.25  # many ties
        probs[1, 0] = (probs[1, 0] * 8).round() / 8  # coarse values: ties at the threshold
    if num_pages > 2:
        probs[-1, -1, 1] = float("nan")  # ranks as 0
        probs[-1, -1, 2] = 0.0
    return probs.to(DEVICE)


# (num_pages, topk, sink_pages, recent_pages, chunk, merge_block): one chunk, K > NP, K = NP, several chunks with
# one merge level, several merge levels, forcing variants
CASES = [
    (1, 1, 0, 1, None, None),
    (7, 3, 0, 1, None, None),
    (7, 3, 0, 0, None, None),
    (50, 64, 2, 3, None, None),
    (90, 8, 1, 2, 32, None),  # 3 chunks of 32, one merge
    (150, 4, 0, 1, 16, 16),  # 10 chunks of 16, fan-in 4: merge levels 10 -> 3 -> 1 (the last with fan-in 4)
    (200, 200, 3, 1, None, None),  # K = NP
    (300, 16, 4, 4, 64, 32),  # 5 chunks, fan-in 2: 5 -> 3 -> 2 -> 1
]


@pytest.mark.parametrize("num_pages,topk,sink,recent,chunk,merge_block", CASES)
def test_select_pages_equals_reference(num_pages, topk, sink, recent, chunk, merge_block):
    g = gen("select", num_pages, topk, sink, recent)
    probs = _probs(2, 2, num_pages, g)
    # per row: no page, some pages, all pages
    n_pages = torch.tensor([num_pages, max(num_pages // 2, 1)], device=DEVICE)
    idx, valid = select_pages_launch(probs, n_pages, topk, sink, recent, chunk=chunk, merge_block=merge_block)
    want_idx, want_valid = ref.select_pages(probs, n_pages, topk, sink, recent)
    assert_same_selection(idx, valid, want_idx, want_valid)
    assert torch.equal(idx, want_idx) and torch.equal(valid, want_valid)  # even the canonical order


def test_select_pages_per_head_counts_and_empty_rows():
    """n_pages [B, Hkv]: ragged heads, a head with no page; [B] equals its [B, Hkv] expansion exactly."""
    g = gen("select-per-head")
    probs = _probs(3, 4, 40, g)
    n_pages = torch.tensor([[40, 0, 1, 17], [3, 39, 8, 2], [0, 0, 0, 0]], device=DEVICE)
    idx, valid = select_pages_launch(probs, n_pages, 6, 1, 2, chunk=16, merge_block=16)
    want = ref.select_pages(probs, n_pages, 6, 1, 2)
    assert torch.equal(idx, want[0]) and torch.equal(valid, want[1])
    assert not valid[2].any() and torch.equal(idx[2], torch.arange(6, device=DEVICE).expand(4, 6))
    rows = torch.tensor([40, 0, 13], device=DEVICE)
    by_row = ops().select_pages(probs, rows, 6)
    by_head = ops().select_pages(probs, rows[:, None].expand(3, 4).contiguous(), 6)
    assert torch.equal(by_row[0], by_head[0]) and torch.equal(by_row[1], by_head[1])


def test_select_pages_tl_sort_path_and_strided_probs():
    """tl.sort (the GPU default; very slow when interpreted, so tiny) and a non-contiguous probs view."""
    g = gen("select-tl-sort")
    probs = _probs(2, 2, 24, g).transpose(0, 1).contiguous().transpose(0, 1)  # [B, Hkv, NP] with odd strides
    n_pages = torch.tensor([24, 11], device=DEVICE)
    idx, valid = select_pages_launch(probs, n_pages, 4, 1, 1, chunk=16, merge_block=8, use_tl_sort=True)
    want = ref.select_pages(probs, n_pages, 4, 1, 1)
    assert torch.equal(idx, want[0]) and torch.equal(valid, want[1])


@pytest.mark.parametrize("num_pages,chunk", [(70, None), (575, 256), (575, None)])
def test_select_pages_bitonic_network_path(num_pages, chunk):
    """use_tl_sort=False: the kernel's own bitonic network (the interpreter's default; on the GPU only by request,
    which did not compile on Triton 3.6 until each step became its own function)."""
    g = gen("select-bitonic", num_pages, chunk)
    probs = _probs(2, 2, num_pages, g)
    n_pages = torch.tensor([num_pages, num_pages - 5], device=DEVICE)
    for sink, recent in ((0, 1), (4, 16)):
        idx, valid = select_pages_launch(probs, n_pages, 64, sink, recent, chunk=chunk, use_tl_sort=False)
        want = ref.select_pages(probs, n_pages, 64, sink, recent)
        assert torch.equal(idx, want[0]) and torch.equal(valid, want[1])


def test_select_pages_many_pages_no_torch_fallback():
    """Any page count runs on the kernels (no hand-over to torch.topk above 8,192 pages)."""
    plan = select_plan(100_000, 64, chunk=1024)
    assert plan["num_chunks"] == 98 and plan["levels"] == [13, 2, 1] and plan["fanins"] == [8, 8, 2]
    assert select_plan(2100, 64, chunk=1024)["fanins"] == [4]  # 3 chunk lists: one merge of 4 x 64 keys, not 8 x 64
    g = gen("select-many")
    probs = torch.rand((1, 1, 9000), generator=g).to(DEVICE)
    n_pages = torch.tensor([8999], device=DEVICE)
    idx, valid = select_pages_launch(probs, n_pages, 8, chunk=4096, merge_block=16)
    want = ref.select_pages(probs, n_pages, 8)
    assert torch.equal(idx, want[0]) and torch.equal(valid, want[1])


@pytest.mark.parametrize("kwargs,match", [
    (dict(topk=4, sink_pages=3, recent_pages=2), r"sink_pages \+ recent_pages must be <= topk.*sink_pages=3"),
    (dict(topk=0), r"topk must be >= 1, got 0"),
    (dict(topk=4, sink_pages=-1), r"sink_pages must be >= 0, got -1"),
    (dict(topk=4, recent_pages=-2), r"recent_pages must be >= 0, got -2"),
])
def test_select_pages_rejects_bad_forcing(kwargs, match):
    probs = torch.rand(1, 1, 8, device=DEVICE)
    n_pages = torch.tensor([8], device=DEVICE)
    for fn in (ref.select_pages, ops().select_pages):
        with pytest.raises(ValueError, match=match):
            fn(probs, n_pages, **kwargs)


def test_select_pages_rejects_bad_count_shape():
    probs = torch.rand(2, 3, 8, device=DEVICE)
    for fn in (ref.select_pages, ops().select_pages):
        with pytest.raises(ValueError, match=r"n_pages must have shape \[B\]=\[2\] \(per row\) or \[B, Hkv\]=\[2, 3\]"):
            fn(probs, torch.ones(2, 2, dtype=torch.long, device=DEVICE), 4)


@settings(max_examples=12, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    num_pages=st.integers(1, 40),
    topk=st.integers(1, 12),
    sink=st.integers(0, 3),
    recent=st.integers(0, 3),
    levels=st.integers(0, 4),  # distinct score values: few values -> many ties
    per_head=st.booleans(),
    seed=st.integers(0, 2**16),
)
def test_select_pages_property(num_pages, topk, sink, recent, levels, per_head, seed):
    """Random sizes, forcing, tie-heavy scores, per-row or per-head counts: the kernel returns the reference."""
    sink, recent = min(sink, topk), min(recent, topk - min(sink, topk))
    g = torch.Generator().manual_seed(seed)
    probs = torch.rand((2, 2, num_pages), generator=g)
    if levels:
        probs = (probs * levels).round() / levels
    shape = (2, 2) if per_head else (2,)
    n_pages = torch.randint(0, num_pages + 2, shape, generator=g).to(DEVICE)  # past NP is clamped
    probs = probs.to(DEVICE)
    idx, valid = select_pages_launch(probs, n_pages, topk, sink, recent, chunk=8, merge_block=8)
    want_idx, want_valid = ref.select_pages(probs, n_pages, topk, sink, recent)
    assert torch.equal(idx, want_idx) and torch.equal(valid, want_valid)


# ------------------------------------------------------------------------------------------------ top_pages


def _kt(batch, kv_heads, num_pages, head_dim, kt_dtype, g, scale=2.0):
    return randn((batch, kv_heads, num_pages, 2, head_dim), torch.float32, g, scale).sort(dim=3).values.to(kt_dtype)


def assert_valid_selection(idx, valid, probs, n_pages, topk, sink, recent, atol=1e-6):
    """Tolerance-aware oracle for selections made from (slightly) different probabilities: the forced pages are
    exactly the rule's, and every other chosen page scores at least every unchosen page in use, up to ``atol``."""
    n = ref.per_head(n_pages, *probs.shape[:2]).clamp(0, probs.shape[-1]).cpu()
    probs, idx, valid = probs.cpu(), idx.cpu(), valid.cpu()
    for b in range(probs.shape[0]):
        for h in range(probs.shape[1]):
            nn = int(n[b, h])
            chosen = set(idx[b, h][valid[b, h]].tolist())
            assert len(chosen) == min(topk, probs.shape[-1], nn) == int(valid[b, h].sum())
            forced = {j for j in range(nn) if j < sink or j >= nn - recent}
            assert forced <= chosen and all(0 <= p < nn for p in chosen)
            others = chosen - forced
            rest = set(range(nn)) - chosen
            if others and rest:
                assert min(probs[b, h, p] for p in others) >= max(probs[b, h, p] for p in rest) - atol


# (group, head_dim, topr, KT dtype, q dtype, page_size, score_splits, chunk)
TOP_CASES = [
    (4, 64, 64, torch.float8_e5m2, torch.bfloat16, 4, None, None),
    (1, 32, 12, torch.float32, torch.float32, 1, 2, 32),
    (8, 128, 100, torch.bfloat16, torch.bfloat16, 2, 3, None),
    (3, 16, 16, torch.float16, torch.float16, 16, 1, None),
    (2, 256, 256, torch.float32, torch.bfloat16, 8, None, 16),
]


@pytest.mark.parametrize("per_head_bound", [False, True])
@pytest.mark.parametrize("group,head_dim,topr,kt_dtype,q_dtype,page_size,splits,chunk", TOP_CASES)
def test_top_pages_matches_scores_then_select(group, head_dim, topr, kt_dtype, q_dtype, page_size, splits, chunk,
                                              per_head_bound):
    """Fused scoring + selection == page_scores then select_pages (Triton scores; tie-tolerant against the
    reference scores), with token counts per row and per KV head."""
    g = gen("top_pages", group, head_dim, topr, kt_dtype, page_size)
    batch, kv_heads, num_pages = 2, 2, 70
    q = randn((batch, kv_heads, group, head_dim), q_dtype, g)
    kt = _kt(batch, kv_heads, num_pages, head_dim, kt_dtype, g)
    topk, sink, recent = 8, 1, 2
    for lengths in (torch.tensor([0, 61 * page_size - 1], device=DEVICE),
                    torch.tensor([[5, 70 * page_size], [1, 33 * page_size + 1]], device=DEVICE)):
        idx, valid = top_pages_launch(q, kt, lengths, page_size, topr, topk, sink, recent, score_splits=splits,
                                      chunk=chunk, merge_block=16, per_head_bound=per_head_bound)
        n_pages = ref.num_pages(lengths, page_size)
        probs = page_scores_launch(q, kt, n_pages, topr, per_head_bound=per_head_bound)
        want = ref.select_pages(probs, n_pages, topk, sink, recent)
        assert_same_selection(idx, valid, *want)
        ref_probs = ref.page_scores(q, kt, n_pages, topr, per_head_bound)
        assert_valid_selection(idx, valid, ref_probs, n_pages, topk, sink, recent)


def test_top_pages_op_equals_reference_on_separated_scores():
    """The registered op against the reference top_pages when the page scores are far apart (no near-ties)."""
    g = gen("top_pages-op")
    q = randn((2, 2, 4, 32), torch.float32, g)
    q[..., 0] = 8.0  # channel 0 dominates: page j's score ~ 8 * kmax[j, 0]
    kt = torch.zeros((2, 2, 40, 2, 32))
    kt[..., 1, 0] = torch.randperm(80, generator=g)[:40].float() / 4  # distinct, well separated
    kt = kt.to(torch.bfloat16).to(DEVICE)
    lengths = torch.tensor([157, 40], device=DEVICE)
    idx, valid = ops().top_pages(q, kt, lengths, 4, 32, 6, sink_pages=1, recent_pages=1)
    want_idx, want_valid = ref.top_pages(q, kt, lengths, 4, 32, 6, sink_pages=1, recent_pages=1)
    assert torch.equal(idx, want_idx) and torch.equal(valid, want_valid)
