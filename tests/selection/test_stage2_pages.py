"""Stage 2 (selection/stage2_pages.py: KT page summaries, page scoring, top-k pages; and the PyTorch sparse attention)
against brute-force references (spec §3).

The references (tests/support/stage2_oracle.py) loop over batch rows, KV heads, pages, channels and query heads in
float64. Scoring follows the TensorRT-LLM variant the package implements: temperature 1/sqrt(D), top-r channels by
|q| summed over the GQA group, max/min picked per channel by the sign of the group-summed q, softmax over the row's
valid pages, mean over the group, and q rounded to the KT dtype before scoring. Fixed cases, then random shapes
(hypothesis).
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from hf_rocketkv.kernels.sparse_decode_attention import sparse_decode_attention_torch
from hf_rocketkv.selection.stage2_pages import (
    build_kt,
    num_pages,
    page_scores,
    per_head,
    select_pages,
    top_pages,
    update_kt,
)
from tests.support.stage2_oracle import brute_force_pages, ref_build_kt, ref_page_scores, ref_sparse_attention

KT_DTYPES = [torch.float32, torch.bfloat16, torch.float16, torch.float8_e5m2]


def gen(seed):
    return torch.Generator().manual_seed(seed)


# ------------------------------------------------------------------------------------------------ ties


def has_channel_gap(q, topr):
    """True when the top-``topr`` channel set by group-summed |q| is unique (no tie at the boundary)."""
    dim = q.shape[-1]
    if topr >= dim:
        return True
    magnitude = q.double().abs().sum(dim=2).sort(dim=-1, descending=True).values
    return bool(torch.all(magnitude[..., topr - 1] - magnitude[..., topr] > 1e-4))


# ------------------------------------------------------------------------------------------------ KT


@pytest.mark.parametrize("kt_dtype", KT_DTYPES)
@pytest.mark.parametrize("page_size", [1, 2, 4, 8])
def test_build_kt_matches_loops(kt_dtype, page_size):
    capacity = 6 * page_size
    keys = torch.randn(3, 2, capacity, 8, generator=gen(page_size)) * 3
    lengths = torch.tensor([capacity, capacity - page_size // 2 - 1, 1 if page_size > 1 else 3])
    got = build_kt(keys, lengths, page_size, kt_dtype)
    assert got.dtype == kt_dtype and got.shape == (3, 2, 6, 2, 8)
    ref = ref_build_kt(keys, lengths, page_size, kt_dtype)
    assert torch.equal(got.float(), ref.float())


def test_build_kt_ignores_garbage_after_length():
    keys = torch.randn(1, 1, 8, 4, generator=gen(3))
    keys[0, 0, 5:] = 1e4  # not stored tokens: must not leak into the partial page
    kt = build_kt(keys, torch.tensor([5]), 4, torch.float32)
    assert torch.equal(kt[0, 0, 1, 0], keys[0, 0, 4])
    assert torch.equal(kt[0, 0, 1, 1], keys[0, 0, 4])


@pytest.mark.parametrize("kt_dtype", KT_DTYPES)
@pytest.mark.parametrize("page_size", [1, 2, 4])
def test_update_kt_incremental_equals_rebuild(kt_dtype, page_size):
    capacity, dim = 40, 16
    keys = torch.randn(3, 2, capacity, dim, generator=gen(7 + page_size)) * 4
    lengths = torch.tensor([0, 5, 2 * page_size])
    stored = torch.zeros_like(keys)
    for b, n in enumerate(lengths.tolist()):
        stored[b, :, :n] = keys[b, :, :n]
    kt = build_kt(stored, lengths, page_size, kt_dtype)
    for _ in range(capacity - int(lengths.max())):
        slot = lengths.clone()
        rows = torch.arange(3)
        key_new = keys[rows, :, slot]  # [B, Hkv, D]
        stored[rows, :, slot] = key_new
        update_kt(kt, key_new, slot, page_size)
        lengths = lengths + 1
        assert torch.equal(kt.float(), build_kt(stored, lengths, page_size, kt_dtype).float()), lengths.tolist()


def test_update_kt_fresh_page_overwrites_stale_summary():
    """A page that starts fresh must not keep min/max of whatever the buffer held before (e.g. zeros)."""
    kt = torch.zeros(1, 1, 2, 2, 4)
    kt[0, 0, 1] = -100.0
    key_new = torch.full((1, 1, 4), 5.0)
    update_kt(kt, key_new, torch.tensor([4]), 4)
    assert torch.equal(kt[0, 0, 1, 0], key_new[0, 0]) and torch.equal(kt[0, 0, 1, 1], key_new[0, 0])


# ------------------------------------------------------------------------------------------------ page scores

SCORE_CASES = [
    # batch, kv heads, group, head_dim, pages, lengths, topr, kt dtype
    (1, 1, 1, 16, 5, [17], 16, torch.float32),
    (2, 2, 4, 16, 6, [24, 9], 8, torch.float32),
    (2, 3, 2, 32, 8, [29, 32], 5, torch.float32),
    (3, 2, 8, 16, 7, [28, 1, 13], 3, torch.float32),
    (2, 2, 4, 64, 5, [20, 11], 64, torch.bfloat16),
    (2, 2, 2, 32, 6, [21, 24], 12, torch.bfloat16),
    (2, 1, 3, 16, 9, [36, 7], 100, torch.float8_e5m2),
    (2, 2, 4, 32, 6, [24, 18], 32, torch.float8_e5m2),
    (1, 2, 1, 16, 4, [16], 1, torch.float32),
    (2, 2, 2, 16, 5, [19, 4], 16, torch.float16),
]


@pytest.mark.parametrize("per_head_bound", [False, True])
@pytest.mark.parametrize("index", range(len(SCORE_CASES)))
def test_page_scores_match_reference(index, per_head_bound):
    batch, heads, group, dim, pages, lengths, topr, kt_dtype = SCORE_CASES[index]
    page_size = 4
    lengths = torch.tensor(lengths)
    seed = index
    while True:  # resample until the top-r channel set is unique (ties are an implementation choice)
        q = torch.randn(batch, heads, group, dim, generator=gen(seed))
        if has_channel_gap(q.to(kt_dtype).float(), topr):
            break
        seed += 1000
    keys = torch.randn(batch, heads, pages * page_size, dim, generator=gen(seed + 1)) * 2
    kt = build_kt(keys, lengths, page_size, kt_dtype)
    n_pages = num_pages(lengths, page_size)
    got = page_scores(q, kt, n_pages, topr, per_head_bound)
    assert got.dtype == torch.float32 and got.shape == (batch, heads, pages)
    ref = ref_page_scores(q, kt, n_pages, topr, per_head_bound)
    torch.testing.assert_close(got.double(), ref, rtol=1e-4, atol=1e-6)
    for b in range(batch):
        assert torch.all(got[b, :, int(n_pages[b]) :] == 0), "pages past the row's length must score 0"
        torch.testing.assert_close(got[b, :, : int(n_pages[b])].sum(-1), torch.ones(heads), rtol=1e-5, atol=1e-5)


def test_num_pages():
    assert num_pages(torch.tensor([0, 1, 4, 5, 8]), 4).tolist() == [0, 1, 1, 2, 2]


def test_page_scores_sign_tie_picks_min():
    """Group-summed q == 0 in a channel -> Kmin (the sign rule is 'max if sum > 0 else min')."""
    q = torch.tensor([[[[1.0, 1.0], [-1.0, 1.0]]]])  # G=2; channel 0 sums to 0 (-> min), channel 1 to 2 (-> max)
    kt = torch.zeros(1, 1, 2, 2, 2)
    kt[0, 0, 0, 0, 0], kt[0, 0, 0, 1, 0] = -3.0, 3.0  # page 0: channel 0 in [-3, 3], channel 1 = 0
    kt[0, 0, 1, :, :] = 1.0  # page 1: every key is (1, 1)
    probs = page_scores(q, kt, torch.tensor([2]), topr=2)[0, 0]
    scale = 2**-0.5
    head0 = torch.softmax(torch.tensor([-3.0, 2.0]) * scale, 0)  # Kmin on channel 0: 1*-3, page 1: 1 + 1
    head1 = torch.softmax(torch.tensor([3.0, 0.0]) * scale, 0)  # -1*-3, page 1: -1 + 1
    torch.testing.assert_close(probs, (head0 + head1) / 2)
    torch.testing.assert_close(probs.double()[None, None], ref_page_scores(q, kt, torch.tensor([2]), topr=2))


def test_page_scores_use_group_sign_not_per_head_bound():
    """For GQA the picked bound is shared by the group (group-summed sign), unlike a per-head max(q*Kmax, q*Kmin)."""
    q = torch.tensor([[[[2.0], [-1.0]]]])  # sum 1 > 0 -> Kmax for both heads
    kt = torch.zeros(1, 1, 2, 2, 1)
    kt[0, 0, 0, 0, 0], kt[0, 0, 0, 1, 0] = -4.0, 1.0
    kt[0, 0, 1, 0, 0], kt[0, 0, 1, 1, 0] = 0.0, 0.0
    probs = page_scores(q, kt, torch.tensor([2]), topr=1)[0, 0]
    # Kmax = 1: head 0 logit 2 vs 0, head 1 logit -1 vs 0 (scaled by 1/sqrt(1))
    p0 = torch.softmax(torch.tensor([2.0, 0.0]), 0)
    p1 = torch.softmax(torch.tensor([-1.0, 0.0]), 0)
    torch.testing.assert_close(probs, (p0 + p1) / 2)


def test_head_bound_scores_each_head_by_its_own_sign():
    """stage2_score="head_bound": each head takes max(q*Kmax, q*Kmin) per channel (Quest's bound)."""
    q = torch.tensor([[[[2.0], [-1.0]]]])  # the same case as above
    kt = torch.zeros(1, 1, 2, 2, 1)
    kt[0, 0, 0, 0, 0], kt[0, 0, 0, 1, 0] = -4.0, 1.0
    probs = page_scores(q, kt, torch.tensor([2]), topr=1, per_head_bound=True)[0, 0]
    p0 = torch.softmax(torch.tensor([2.0, 0.0]), 0)  # head 0 (q > 0): Kmax = 1
    p1 = torch.softmax(torch.tensor([4.0, 0.0]), 0)  # head 1 (q < 0): Kmin = -4 -> logit 4
    torch.testing.assert_close(probs, (p0 + p1) / 2)


@pytest.mark.parametrize("seed", range(6))
def test_head_bound_is_an_upper_bound_of_every_key_logit(seed):
    """With every channel and fp32 KT, a head's page logit under "head_bound" is >= q.k of every key of the page
    (what makes it Quest's bound); with one query head per KV head it equals the group-sign rule."""
    g = gen(seed)
    batch, heads, group, dim, page_size, pages = 2, 2, 4, 16, 4, 6
    q = torch.randn(batch, heads, group, dim, generator=g)
    keys = torch.randn(batch, heads, pages * page_size, dim, generator=g)
    lengths = torch.tensor([pages * page_size, pages * page_size - 3])
    kt = build_kt(keys, lengths, page_size, torch.float32)
    lo, hi = kt[:, :, :, 0], kt[:, :, :, 1]  # [B, H, NP, D]
    bound = (q.clamp(min=0)[:, :, :, None] * hi[:, :, None] + q.clamp(max=0)[:, :, :, None] * lo[:, :, None]).sum(-1)
    for b in range(batch):
        for j in range(int(lengths[b])):
            logit = torch.einsum("hgd,hd->hg", q[b], keys[b, :, j])
            assert bool((bound[b, :, :, j // page_size] >= logit - 1e-5).all())
    n_pages = num_pages(lengths, page_size)
    torch.testing.assert_close(page_scores(q[:, :, :1], kt, n_pages, dim, True), page_scores(q[:, :, :1], kt, n_pages, dim))


def test_page_scores_temperature_is_inverse_sqrt_head_dim():
    dim = 16
    q = torch.zeros(1, 1, 1, dim)
    q[..., 0] = 4.0
    kt = torch.zeros(1, 1, 2, 2, dim)
    kt[0, 0, 0, :, 0] = 2.0  # page 0 logit 8 / sqrt(16) = 2, page 1 logit 0
    probs = page_scores(q, kt, torch.tensor([2]), topr=1)[0, 0]
    torch.testing.assert_close(probs, torch.softmax(torch.tensor([2.0, 0.0]), 0))


def test_topr_channels_by_group_summed_magnitude():
    """Only the top-r channels of sum_g |q| count: a huge key in an unselected channel changes nothing."""
    q = torch.tensor([[[[3.0, 0.1, -2.0, 0.2], [-3.0, 0.1, -2.0, 0.2]]]])  # |q| sums: 6, .2, 4, .4
    kt = torch.zeros(1, 1, 3, 2, 4)
    kt[0, 0, :, :, 0] = torch.tensor([1.0, -1.0, 0.5])[:, None]
    kt[0, 0, :, :, 2] = torch.tensor([-1.0, 0.0, 2.0])[:, None]
    base = page_scores(q, kt, torch.tensor([3]), topr=2)
    kt2 = kt.clone()
    kt2[0, 0, 1, :, 3] = 50.0  # channel 3 is not among the top 2
    torch.testing.assert_close(page_scores(q, kt2, torch.tensor([3]), topr=2), base)
    assert not torch.allclose(page_scores(q, kt2, torch.tensor([3]), topr=4), base)


# ------------------------------------------------------------------------------------------------ select pages


def assert_selection(page_idx, page_valid, probs, n_pages, topk):
    batch, heads, total = probs.shape
    assert page_idx.dtype == torch.long and page_valid.dtype == torch.bool
    assert page_idx.shape == page_valid.shape == (batch, heads, min(topk, total))
    for b in range(batch):
        n = int(n_pages[b])
        k = min(topk, n)
        for h in range(heads):
            idx = page_idx[b, h].tolist()
            valid = page_valid[b, h].tolist()
            chosen = [p for p, ok in zip(idx, valid) if ok]
            assert len(chosen) == k, f"row {b} head {h}: {len(chosen)} valid pages, expected min(topk, pages)={k}"
            assert len(set(chosen)) == k
            assert all(0 <= p < n for p in chosen), "a page past the row's length was selected"
            assert len(set(idx)) == len(idx), "a page was returned twice"
            if n == 0:
                continue
            assert n - 1 in chosen, "the page holding the newest token must be selected"
            others = [p for p in chosen if p != n - 1]
            scores = probs[b, h, : n - 1].double().tolist()
            ranked = sorted(scores, reverse=True)
            if others:
                kth = ranked[len(others) - 1]
                for p in range(n - 1):
                    if p in others:
                        assert scores[p] >= kth - 1e-12
                    else:
                        assert scores[p] <= kth + 1e-12


@pytest.mark.parametrize("topk", [1, 2, 3, 5, 8, 64])
def test_select_pages(topk):
    total = 8
    n_pages = torch.tensor([8, 5, 1, 3, 0])
    probs = torch.rand(5, 3, total, generator=gen(topk))
    probs = probs * (torch.arange(total)[None, None, :] < n_pages[:, None, None])
    page_idx, page_valid = select_pages(probs, n_pages, topk)
    assert_selection(page_idx, page_valid, probs, n_pages, topk)
    assert torch.equal(page_valid, page_idx < n_pages[:, None, None])


def test_select_pages_newest_forced_even_when_lowest():
    probs = torch.tensor([[[0.5, 0.3, 0.2, 0.0]]])  # newest page (2) scores low, page 3 unused
    page_idx, page_valid = select_pages(probs, torch.tensor([3]), topk=2)
    assert sorted(page_idx[0, 0][page_valid[0, 0]].tolist()) == [0, 2]


def ref_select(probs, n_pages, topk, sink, recent):
    """Loops: forced pages (first ``sink``, last ``recent`` in use), then the best others; ties -> lower page."""
    batch, heads, total = probs.shape
    k = min(topk, total)
    idx = torch.zeros(batch, heads, k, dtype=torch.long)
    for b in range(batch):
        for h in range(heads):
            n = int(n_pages[b, h] if n_pages.dim() == 2 else n_pages[b])
            n = max(0, min(n, total))
            forced = [j for j in range(n) if j < sink or j >= n - recent]
            score = [float(probs[b, h, j]) for j in range(n)]
            score = [x if x > 0 else 0.0 for x in score]  # NaN and negatives rank as 0
            others = sorted((j for j in range(n) if j not in forced), key=lambda j: (-score[j], j))
            chosen = (forced + others)[: min(k, n)]
            idx[b, h] = torch.tensor(chosen + list(range(n, n + k - len(chosen))), dtype=torch.long)
    return idx, idx < torch.as_tensor(n_pages).reshape(batch, -1).clamp(0, total)[..., None]


@pytest.mark.parametrize("topk,sink,recent", [(1, 0, 1), (3, 0, 1), (4, 2, 2), (5, 1, 3), (8, 0, 0), (64, 3, 1)])
def test_select_pages_forcing_and_ties_match_loops(topk, sink, recent):
    g = gen(topk * 10 + sink)
    probs = (torch.rand(4, 3, 12, generator=g) * 4).round() / 4  # coarse: many ties
    probs[0, 1, 3] = float("nan")
    n_pages = torch.tensor([12, 5, 1, 0])
    idx, valid = select_pages(probs, n_pages, topk, sink_pages=sink, recent_pages=recent)
    want_idx, want_valid = ref_select(probs, n_pages, topk, sink, recent)
    assert torch.equal(idx, want_idx) and torch.equal(valid, want_valid)  # the canonical order too


def test_select_pages_per_head_counts():
    g = gen(77)
    probs = torch.rand(2, 3, 10, generator=g)
    n_pages = torch.tensor([[10, 0, 3], [7, 12, 1]])  # 12 > NP: clamped
    idx, valid = select_pages(probs, n_pages, 4, sink_pages=1, recent_pages=1)
    want_idx, want_valid = ref_select(probs, n_pages, 4, 1, 1)
    assert torch.equal(idx, want_idx) and torch.equal(valid, want_valid)
    rows = torch.tensor([6, 9])
    by_row, by_head = select_pages(probs, rows, 4), select_pages(probs, rows[:, None].expand(2, 3), 4)
    assert torch.equal(by_row[0], by_head[0]) and torch.equal(by_row[1], by_head[1])


def test_select_pages_lower_page_wins_ties():
    probs = torch.tensor([[[0.2, 0.5, 0.5, 0.1, 0.5, 0.0]]])
    idx, valid = select_pages(probs, torch.tensor([6]), topk=3)  # page 5 forced, then two of the three 0.5s
    assert idx[0, 0].tolist() == [5, 1, 2] and valid.all()


@pytest.mark.parametrize("kwargs, name", [
    ({"topk": 2, "sink_pages": 2, "recent_pages": 1}, "sink_pages \\+ recent_pages"), ({"topk": 0}, "topk"),
    ({"topk": 3, "sink_pages": -1}, "sink_pages"), ({"topk": 3, "recent_pages": -1}, "recent_pages"),
])
def test_select_pages_rejects_bad_forcing(kwargs, name):
    with pytest.raises(ValueError, match=f"select_pages: {name} must be"):
        select_pages(torch.rand(1, 1, 4), torch.tensor([4]), **kwargs)


def test_top_pages_is_scores_then_select():
    g = gen(91)
    q = torch.randn(2, 2, 3, 16, generator=g)
    keys = torch.randn(2, 2, 40, 16, generator=g)
    for lengths in (torch.tensor([37, 6]), torch.tensor([[40, 0], [9, 21]])):
        kt = build_kt(keys, lengths, 4, torch.bfloat16)
        got = top_pages(q, kt, lengths, 4, 8, 3, sink_pages=1, recent_pages=1)
        n_pages = num_pages(lengths, 4)
        want = select_pages(page_scores(q, kt, n_pages, 8), n_pages, 3, sink_pages=1, recent_pages=1)
        assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])


def _chosen_sets(page_idx, valid):
    return [[{int(p) for p, ok in zip(page_idx[b, h], valid[b, h]) if ok} for h in range(page_idx.shape[1])]
            for b in range(page_idx.shape[0])]


def _newest_plus_best(probs, n_pages, topk):
    """The decode rule by loops over float64 scores: the newest page, then the best others (lower id on ties)."""
    chosen = []
    for b in range(probs.shape[0]):
        n = int(n_pages[b])
        row = []
        for h in range(probs.shape[1]):
            others = sorted(range(n - 1), key=lambda j: (-float(probs[b, h, j]), j))
            row.append(set(([n - 1] + others)[: min(topk, n)]))
        chosen.append(row)
    return chosen


@pytest.mark.parametrize("seed", range(4))
def test_top_pages_defaults_are_the_decode_rule(seed):
    """Called with its defaults (no sink page, the newest page forced), top_pages picks what the brute-force oracle
    of RocketKV's decode rule picks; with ``per_head_bound`` it ranks by the oracle's head-bound scores."""
    g = gen(300 + seed)
    q = torch.randn(2, 2, 4, 16, generator=g)
    keys = torch.randn(2, 2, 48, 16, generator=g)
    lengths = torch.tensor([45, 23])
    kt = ref_build_kt(keys, lengths, 4, torch.float32)
    if not has_channel_gap(q, 8):
        pytest.skip("a tie at the top-r channel boundary")
    assert _chosen_sets(*top_pages(q, kt, lengths, 4, 8, 5)) == _chosen_sets(*brute_force_pages(q, kt, lengths, 4,
                                                                                              8, 5))
    n_pages = num_pages(lengths, 4)
    head_bound = ref_page_scores(q, kt, n_pages, 8, per_head_bound=True)
    assert _chosen_sets(*top_pages(q, kt, lengths, 4, 8, 5, per_head_bound=True)) == _newest_plus_best(
        head_bound, n_pages, 5)
    group_sign = ref_page_scores(q, kt, n_pages, 8)
    assert _newest_plus_best(head_bound, n_pages, 5) != _newest_plus_best(group_sign, n_pages, 5), (
        "the case must tell the two scoring rules apart")


def test_page_scores_of_a_head_without_pages_are_zero():
    """Pages past a head's count get probability 0, also when the head has no page at all (a softmax over nothing,
    NaN before it is zeroed); the other head's row is a distribution over its pages in use."""
    g = gen(17)
    q = torch.randn(1, 2, 2, 8, generator=g)
    kt = build_kt(torch.randn(1, 2, 16, 8, generator=g), torch.tensor([[13, 0]]), 4, torch.float32)
    probs = page_scores(q, kt, torch.tensor([[4, 0]]), 8)
    assert torch.equal(probs[0, 1], torch.zeros(4))
    assert float(probs[0, 0].sum()) == pytest.approx(1.0) and bool((probs[0, 0] > 0).all())
    with pytest.raises(ValueError, match=r"^n_pages must have shape"):
        page_scores(q, kt, torch.tensor([4, 4, 4]), 8)


def test_select_pages_names_misshaped_page_counts():
    with pytest.raises(ValueError, match=r"^n_pages must have shape"):
        select_pages(torch.rand(1, 2, 4), torch.tensor([4, 4, 4]), 2)


def test_per_head_refuses_counts_of_another_shape():
    """[B] or [B, Hkv] only: a 2-D count tensor of another shape, or a 1-D one of another length, is refused."""
    assert per_head(torch.tensor([3, 5]), 2, 3).tolist() == [[3, 3, 3], [5, 5, 5]]
    for counts in (torch.zeros(2, 4), torch.zeros(3, 3), torch.zeros(3), torch.zeros(2, 3, 1)):
        with pytest.raises(ValueError, match=r"^lengths must have shape"):
            per_head(counts, 2, 3)


def test_update_kt_names_a_misshaped_slot():
    kt = torch.zeros(2, 3, 4, 2, 8)
    with pytest.raises(ValueError, match=r"^slot must have shape"):
        update_kt(kt, torch.zeros(2, 3, 8), torch.zeros(5, dtype=torch.long), 4)


def test_per_head_counts_in_kt_and_scores_equal_single_heads():
    """build_kt / page_scores with [B, Hkv] counts == the same op run on each (row, head) alone."""
    g = gen(93)
    keys = torch.randn(2, 3, 16, 8, generator=g)
    q = torch.randn(2, 3, 2, 8, generator=g)
    lengths = torch.tensor([[16, 0, 5], [9, 13, 1]])
    kt = build_kt(keys, lengths, 4, torch.float32)
    probs = page_scores(q, kt, num_pages(lengths, 4), 8)
    for b in range(2):
        for h in range(3):
            one_kt = build_kt(keys[b:b + 1, h:h + 1], lengths[b, h:h + 1], 4, torch.float32)
            assert torch.equal(kt[b, h], one_kt[0, 0])
            one = page_scores(q[b:b + 1, h:h + 1], one_kt, num_pages(lengths[b, h:h + 1], 4), 8)
            torch.testing.assert_close(probs[b, h], one[0, 0])


# ------------------------------------------------------------------------------------------------ sparse attention


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("group,dim,page_size,topk", [(1, 16, 4, 2), (4, 32, 2, 5), (8, 64, 8, 1), (3, 16, 1, 7)])
def test_sparse_decode_attention_equals_dense_on_selected_tokens(dtype, group, dim, page_size, topk):
    batch, heads, total_pages = 3, 2, 6
    capacity = total_pages * page_size
    g = gen(group * dim + page_size)
    q = torch.randn(batch, heads, group, dim, generator=g).to(dtype)
    keys = torch.randn(batch, heads, capacity, dim, generator=g).to(dtype)
    values = torch.randn(batch, heads, capacity, dim, generator=g).to(dtype)
    lengths = torch.tensor([capacity, capacity - page_size // 2 - 1 if page_size > 1 else capacity - 3, 1])
    keys[2, :, 1:] = 1e4  # slots past the row's length hold stale data that must not be attended
    values[2, :, 1:] = 1e4
    n_pages = num_pages(lengths, page_size)
    probs = torch.rand(batch, heads, total_pages, generator=g)
    page_idx, page_valid = select_pages(probs, n_pages, topk)
    scaling = dim**-0.5
    got = sparse_decode_attention_torch(q, keys, values, page_idx, page_valid, lengths, page_size, scaling)
    assert got.dtype == dtype and got.shape == (batch, heads, group, dim)
    ref = ref_sparse_attention(q, keys, values, page_idx, page_valid, lengths, page_size, scaling)
    tol = dict(rtol=1e-5, atol=1e-5) if dtype == torch.float32 else dict(rtol=2e-2, atol=2e-2)
    torch.testing.assert_close(got.double(), ref, **tol)


@pytest.mark.parametrize("group,dim,page_size", [(1, 16, 4), (4, 32, 2), (2, 64, 8)])
def test_sparse_decode_attention_all_pages_equals_full_attention(group, dim, page_size):
    batch, heads, total_pages = 3, 2, 5
    capacity = total_pages * page_size
    g = gen(dim + page_size)
    q = torch.randn(batch, heads, group, dim, generator=g)
    keys = torch.randn(batch, heads, capacity, dim, generator=g)
    values = torch.randn(batch, heads, capacity, dim, generator=g)
    lengths = torch.tensor([capacity, capacity - 1, page_size + 1])
    n_pages = num_pages(lengths, page_size)
    probs = torch.rand(batch, heads, total_pages, generator=g)
    page_idx, page_valid = select_pages(probs, n_pages, topk=total_pages)
    scaling = dim**-0.5
    got = sparse_decode_attention_torch(q, keys, values, page_idx, page_valid, lengths, page_size, scaling)
    for b in range(batch):
        n = int(lengths[b])
        dense = F.scaled_dot_product_attention(q[b], keys[b, :, :n], values[b, :, :n], scale=scaling)
        torch.testing.assert_close(got[b], dense, rtol=1e-5, atol=1e-5)


# ------------------------------------------------------------------------------------------------ random shapes
# random batch, KV heads, GQA ratio 1-8, head dim, page size, ragged row lengths (partial last pages): page scores
# equal the float64 oracle, and the selected pages are the newest page plus the best others (hypothesis)
SETTINGS = settings(
    max_examples=25, deadline=None, derandomize=True, suppress_health_check=[HealthCheck.too_slow]
)


@st.composite
def selection_case(draw):
    batch = draw(st.integers(1, 3))
    heads = draw(st.integers(1, 3))
    group = draw(st.sampled_from([1, 2, 3, 4, 8]))
    dim = draw(st.sampled_from([4, 8, 16]))
    page = draw(st.sampled_from([1, 2, 4, 8]))
    pages = draw(st.integers(1, 6))
    lengths = draw(st.lists(st.integers(1, pages * page), min_size=batch, max_size=batch))  # ragged, partial pages
    topr = draw(st.integers(1, dim + 2))
    topk = draw(st.integers(1, pages + 1))
    seed = draw(st.integers(0, 2**16))
    return batch, heads, group, dim, page, pages, lengths, topr, topk, seed


@SETTINGS
@given(selection_case())
def test_page_scores_and_selection_match_brute_force(case):
    batch, heads, group, dim, page, pages, lengths, topr, topk, seed = case
    g = torch.Generator().manual_seed(seed)
    keys = torch.randn(batch, heads, pages * page, dim, generator=g)
    lengths_t = torch.tensor(lengths)
    kt = ref_build_kt(keys, lengths_t, page, torch.float32)
    q = torch.randn(batch, heads, group, dim, generator=g)
    n_pages = num_pages(lengths_t, page)

    probs = page_scores(q, kt, n_pages, topr)
    expected = ref_page_scores(q, kt, n_pages, topr)
    channel_margin = q.double().abs().sum(2).sort(-1, descending=True).values
    if topr < dim and bool((channel_margin[..., topr - 1] - channel_margin[..., topr]).abs().min() < 1e-6):
        return  # a tie at the top-r channel boundary: either channel set is right
    torch.testing.assert_close(probs.double(), expected, rtol=1e-5, atol=1e-6)

    page_idx, valid = select_pages(probs, n_pages, topk)
    k = min(topk, pages)
    assert page_idx.shape == (batch, heads, k)
    for b in range(batch):
        n = int(n_pages[b])
        for h in range(heads):
            chosen = {int(p) for p, ok in zip(page_idx[b, h], valid[b, h]) if ok}
            assert len(chosen) == min(k, n) and all(0 <= p < n for p in chosen)
            assert n - 1 in chosen  # the newest page is always attended
            others = sorted(range(n - 1), key=lambda j: (-float(expected[b, h, j]), j))
            best = set(others[: min(k, n) - 1])
            worst_taken = min((float(expected[b, h, j]) for j in chosen - {n - 1}), default=None)
            best_left = max((float(expected[b, h, j]) for j in set(others) - chosen), default=None)
            if worst_taken is not None and best_left is not None:
                assert worst_taken >= best_left - 1e-6, (chosen, best)  # no better page left out (up to ties)
