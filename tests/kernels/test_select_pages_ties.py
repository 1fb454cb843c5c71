"""Page selection under ties: when many pages score the same, the Triton kernels (select_pages, top_pages,
paged_top_pages) and their PyTorch twins must choose the pages the rule names, the lower page id first on a tie.

The expected selection comes from ``tests/support/page_ties.rule_selection`` (the rule by plain loops), not from
the code under test. Page scores are tied by construction: set directly (``tied_probs``), or the same KT summary on
every page (``constant_kt``, the KT of constant keys), so every page's logit and probability is the same float.
Small shapes for Triton's interpreter, with launch knobs that force the chunked sort and its merge levels (tied runs
cross the chunk boundaries); tests/gpu/test_select_pages_ties_gpu.py runs long rows on the GPU, where the twins'
torch.sort runs CUDA's algorithms.
"""

import pytest
import torch

from hf_rocketkv.kernels.dispatch import TORCH_OPS
from hf_rocketkv.kernels.select_pages import select_pages_launch, top_pages_launch
from hf_rocketkv.selection import stage2_pages as ref
from tests.kernels.kernel_utils import DEVICE, gen, ops, page_table
from tests.support.page_ties import (
    PATTERNS,
    constant_kt,
    pages_in_use,
    rule_selection,
    tied_probs,
)

pytestmark = pytest.mark.gpu  # compiled for the GPU where one is present (pytest -m gpu); interpreted on CPU


def assert_rule(got, want):
    """Exactly the rule's pages in its canonical order (forced ascending, then by score with the lower id first,
    then the unused ids), which the reference and the kernels both document."""
    idx, valid = (t.cpu() for t in got)
    want_idx, want_valid = want
    assert torch.equal(valid, want_valid)
    assert torch.equal(idx, want_idx), (idx, want_idx)


# (num_pages, topk, sink_pages, recent_pages, chunk, merge_block): one chunk; 10 chunks of 16 with merge levels
# 10 -> 3 -> 1; K = NP; 3 chunks of 32 with one merge
SELECT_CASES = [
    (40, 8, 0, 1, None, None),
    (150, 16, 2, 3, 16, 16),
    (90, 90, 1, 1, 32, None),
    (100, 12, 4, 4, 32, None),
]


@pytest.mark.parametrize("pattern", PATTERNS)
@pytest.mark.parametrize("num_pages,topk,sink,recent,chunk,merge_block", SELECT_CASES)
def test_select_pages_ties_follow_the_rule(pattern, num_pages, topk, sink, recent, chunk, merge_block):
    """Triton's select_pages (with launch knobs and with its defaults) and the PyTorch reference, per-row and
    per-head counts, against the rule."""
    probs = tied_probs(2, 2, num_pages, pattern)
    for n_pages in (torch.tensor([num_pages, num_pages // 2 + 1]),
                    torch.tensor([[num_pages - 3, 5], [1, num_pages]])):
        want = rule_selection(probs, n_pages, topk, sink, recent)
        p, n = probs.to(DEVICE), n_pages.to(DEVICE)
        assert_rule(select_pages_launch(p, n, topk, sink, recent, chunk=chunk, merge_block=merge_block), want)
        assert_rule(ops().select_pages(p, n, topk, sink, recent), want)
        assert_rule(ref.select_pages(p, n, topk, sink, recent), want)


def test_rule_oracle_by_hand():
    """The oracle itself on a case worked by hand: 6 pages, scores [.5, .25, .5, .5, NaN, .5], 5 in use, topk 3,
    one sink and one recent page: forced {0, 4}; the others 1 (.25), 2 (.5), 3 (.5) -> 2 wins the tie with 3."""
    probs = torch.tensor([[[0.5, 0.25, 0.5, 0.5, float("nan"), 0.5]]])
    idx, valid = rule_selection(probs, torch.tensor([5]), 3, 1, 1)
    assert idx.tolist() == [[[0, 4, 2]]] and valid.all()
    idx, valid = rule_selection(probs, torch.tensor([2]), 4, 0, 1)  # 2 in use: page 1 forced, then 0; 2, 3 unused
    assert idx.tolist() == [[[1, 0, 2, 3]]] and valid.tolist() == [[[True, True, False, False]]]


@pytest.mark.parametrize("kt_dtype", [torch.bfloat16, torch.float8_e5m2])
@pytest.mark.parametrize("sink,recent", [(0, 1), (2, 3)])
def test_top_pages_on_constant_keys_follow_the_rule(kt_dtype, sink, recent):
    """Fused scoring + selection with every page's KT the same: the Triton kernel (chunked, two score splits) and
    the reference top_pages both take the forced pages, then the lowest page ids."""
    g = gen("ties-top-pages", kt_dtype, sink, recent)
    batch, heads, group, dim, num_pages, page, topk, topr = 2, 2, 2, 16, 70, 4, 8, 8
    q = (torch.randn(batch, heads, group, dim, generator=g)).to(torch.bfloat16).to(DEVICE)
    kt = constant_kt(batch, heads, num_pages, dim, kt_dtype, g, DEVICE)
    lengths = torch.tensor([num_pages * page, 37 * page - 3])
    want = rule_selection(torch.ones(batch, heads, num_pages), pages_in_use(lengths, page), topk, sink, recent)
    lengths = lengths.to(DEVICE)
    got = top_pages_launch(q, kt, lengths, page, topr, topk, sink, recent, score_splits=2, chunk=16, merge_block=16)
    assert_rule(got, want)
    assert_rule(ref.top_pages(q, kt, lengths, page, topr, topk, sink, recent), want)


def test_paged_top_pages_on_constant_keys_follow_the_rule():
    """The decode step's selection over a paged KT (pages scattered through a pool by the table): row page ids,
    the lowest first, for the Triton op and the PyTorch twin."""
    g = gen("ties-paged-top-pages")
    heads, group, dim, pool_tokens, kt_page, topk, topr = 2, 2, 16, 16, 4, 6, 8
    per_pool_page = pool_tokens // kt_page
    table = page_table([9, 4], 16, g)
    kt_row = constant_kt(1, heads, 1, dim, torch.bfloat16, g, "cpu")[0, :, 0]  # [Hkv, 2, D]: one summary per head
    kt_pages = kt_row[None, :, None].expand(16, heads, per_pool_page, 2, dim).contiguous().to(DEVICE)
    q = torch.randn(2, heads, group, dim, generator=g).to(DEVICE)
    lengths = torch.tensor([9 * pool_tokens - 1, 4 * pool_tokens // 2 + 1])
    want = rule_selection(torch.ones(2, heads, table.shape[1] * per_pool_page), pages_in_use(lengths, kt_page),
                          topk, 1, 1)
    lengths = lengths.to(DEVICE)
    for fn in (ops().paged_top_pages, TORCH_OPS.paged_top_pages):
        assert_rule(fn(q, kt_pages, table, lengths, kt_page, topr, topk, 1, 1), want)
