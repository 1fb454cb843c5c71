"""select_pages: top-k pages per KV head with the newest page forced, Triton vs reference (tie-tolerant)."""

import pytest
import torch
from kernel_utils import DEVICE, gen, ops

from hf_rocketkv.selection import stage2_pages as ref


def _check(probs: torch.Tensor, n_pages: torch.Tensor, topk: int) -> None:
    idx, valid = ops().select_pages(probs, n_pages, topk)
    ref_idx, ref_valid = ref.select_pages(probs, n_pages, topk)
    assert idx.shape == ref_idx.shape and idx.dtype == torch.long and valid.dtype == torch.bool
    probs, idx, valid, ref_idx, ref_valid = (t.cpu() for t in (probs, idx, valid, ref_idx, ref_valid))
    batch, kv_heads, num_pages = probs.shape
    for b in range(batch):
        n = int(n_pages[b])
        taken = min(topk, num_pages, n)
        for h in range(kv_heads):
            chosen = idx[b, h][valid[b, h]].tolist()
            assert valid[b, h].sum() == ref_valid[b, h].sum() == taken
            assert len(set(chosen)) == taken and all(0 <= p < n for p in chosen)
            assert chosen == sorted(chosen)  # ascending page order
            if taken:
                assert n - 1 in chosen  # the newest page is forced
            if taken > 1:  # tolerance-aware set check: every other chosen page is at least the (taken-1)-th best
                kth = probs[b, h, : n - 1].topk(taken - 1).values[-1]
                assert all(probs[b, h, p] >= kth for p in chosen if p != n - 1)
                scores = probs[b, h, [p for p in chosen if p != n - 1]].sort().values
                ref_pages = [p for p in ref_idx[b, h][ref_valid[b, h]].tolist() if p != n - 1]
                torch.testing.assert_close(scores, probs[b, h, ref_pages].sort().values, atol=0, rtol=0)
            assert idx[b, h][~valid[b, h]].tolist() == list(range(n, n + topk_count(valid[b, h])))


def topk_count(valid_row: torch.Tensor) -> int:
    return int((~valid_row).sum())


# (num_pages, topk): K < NP, K > NP (K = NP), K = NP, one page, more pages than one program block (512)
CASES = [(1, 1), (7, 3), (50, 64), (300, 16), (300, 300), (1200, 100)]


@pytest.mark.parametrize("num_pages,topk", CASES)
def test_select_pages_matches_reference(num_pages, topk):
    g = gen("select", num_pages, topk)
    probs = torch.rand((4, 2, num_pages), generator=g)
    probs[1, 0] = 0.5  # every page tied
    probs[2, 1, ::3] = 0.25  # many ties
    probs[3] = (probs[3] * 8).round() / 8  # coarse values: ties at the threshold
    probs = probs.to(DEVICE)
    n_pages = torch.tensor([0, max(num_pages // 2, 1), num_pages, max(num_pages - 1, 1)], device=DEVICE)
    _check(probs, n_pages, topk)


def test_select_pages_real_probabilities():
    """On page_scores output (softmax values, one row summing to 1): same chosen set as the reference."""
    g = gen("select-real")
    logits = torch.randn((2, 4, 600), generator=g) * 4
    n_pages = torch.tensor([577, 300])
    mask = torch.arange(600)[None, :] < n_pages[:, None]
    probs = torch.softmax(logits.masked_fill(~mask[:, None], float("-inf")), dim=-1).to(DEVICE)
    n_pages = n_pages.to(DEVICE)
    idx, valid = ops().select_pages(probs, n_pages, 64)
    ref_idx, _ = ref.select_pages(probs, n_pages, 64)
    assert valid.all()
    assert torch.equal(idx.sort(dim=-1).values, ref_idx.sort(dim=-1).values)


@pytest.mark.parametrize("digit_bits,use_histogram", [(4, False), (4, True), (8, False)])
def test_select_pages_radix_variants(digit_bits, use_histogram):
    """The other radix widths / histogram paths of the kernel select the same pages."""
    from hf_rocketkv.kernels.select_pages import HAS_MASKED_HISTOGRAM, select_pages_launch

    if use_histogram and not HAS_MASKED_HISTOGRAM:
        pytest.skip("this Triton has no masked tl.histogram")
    g = gen("select-variants", digit_bits, use_histogram)
    probs = torch.rand((2, 2, 90), generator=g)
    probs[1] = (probs[1] * 4).round() / 4
    probs = probs.to(DEVICE)
    n_pages = torch.tensor([90, 61], device=DEVICE)
    want_idx, want_valid = select_pages_launch(probs, n_pages, 20)
    idx, valid = select_pages_launch(probs, n_pages, 20, digit_bits=digit_bits, use_histogram=use_histogram)
    assert torch.equal(idx, want_idx) and torch.equal(valid, want_valid)
