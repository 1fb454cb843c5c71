"""Page selection under ties on the GPU, at decode shapes (8 KV heads, head_dim 128, topk 64, up to 100,000 pages):
the compiled Triton select_pages / top_pages / paged_top_pages and the PyTorch twins run on CUDA must all choose the
pages the rule names, the lower page id first on a tie.

The twins order ties with ``torch.sort(stable=True)``; on the CPU an unstable sort happens to order these ties the
same way, so only CUDA's sort (bitonic in shared memory for short rows, radix for long ones) can tell a twin that
lost its stable sort. The expected pages come from ``tests/support/page_ties.rule_selection`` (the rule by plain
loops). Scores are tied by construction: set directly, or the same KT summary on every page (the KT of constant
keys). Small interpreted versions: tests/kernels/test_select_pages_ties.py. About 30 s on an H100, most of it the
Triton compilation and the Python oracle on the longest rows.
"""

from __future__ import annotations

import pytest
import torch

from tests.support.page_ties import (
    PATTERNS,
    constant_kt,
    pages_in_use,
    rule_selection,
    tied_probs,
)

HKV, G, D = 8, 4, 128
TOPK, TOPR, KT_PAGE = 64, 32, 4
FORCING = [(0, 1), (4, 16)]  # RocketKV's decode rule; sinks and recent pages as a long-context config sets them


@pytest.fixture(scope="module")
def kernels():
    from hf_rocketkv.kernels.dispatch import TORCH_OPS
    from hf_rocketkv.kernels.triton_ops import TRITON_OPS

    return TRITON_OPS, TORCH_OPS


def assert_rule(got, want, what: str):
    idx, valid = (t.cpu() for t in got)
    want_idx, want_valid = want
    assert torch.equal(valid, want_valid), what
    bad = (idx != want_idx).any(-1).nonzero().tolist()
    assert not bad, f"{what}: (row, KV head) {bad[:4]} chose {idx[tuple(bad[0])].tolist()}, rule {want_idx[tuple(bad[0])].tolist()}"


@pytest.mark.parametrize("num_pages", [64, 575, 2050, 9000])
@pytest.mark.parametrize("pattern", PATTERNS)
def test_select_pages_ties_on_gpu(kernels, pattern, num_pages):
    """Row 0 uses every page, row 1 fewer (a ragged batch); per-row and per-KV-head counts."""
    triton_ops, torch_ops = kernels
    probs = tied_probs(2, HKV, num_pages, pattern)
    per_head = torch.tensor([num_pages - 3 * h for h in range(HKV)])
    for n_pages in (torch.tensor([num_pages, num_pages - 37]), torch.stack([per_head, per_head.flip(0) // 2])):
        for sink, recent in FORCING:
            want = rule_selection(probs, n_pages, TOPK, sink, recent)
            for name, ops in (("triton", triton_ops), ("torch", torch_ops)):
                got = ops.select_pages(probs.cuda(), n_pages.cuda(), TOPK, sink, recent)
                assert_rule(got, want, f"{name} select_pages {pattern} n={n_pages.tolist()} forcing={sink, recent}")


def test_select_pages_ties_on_a_very_long_row(kernels):
    """100,000 pages all tied: the kernels' two merge levels and the twin's radix sort keep the lowest ids."""
    triton_ops, torch_ops = kernels
    probs = tied_probs(1, 1, 100_000, "equal")
    n_pages = torch.tensor([99_990])
    want = rule_selection(probs, n_pages, TOPK, 4, 16)
    for name, ops in (("triton", triton_ops), ("torch", torch_ops)):
        assert_rule(ops.select_pages(probs.cuda(), n_pages.cuda(), TOPK, 4, 16), want, f"{name} select_pages")


@pytest.mark.parametrize("kt_dtype", [torch.bfloat16, torch.float8_e5m2])
@pytest.mark.parametrize("num_pages", [575, 8192])
def test_top_pages_on_constant_keys_on_gpu(kernels, kt_dtype, num_pages):
    """Fused scoring + selection, contiguous and paged KT: every page scores the same, so the forced pages and then
    the lowest page ids are chosen, by the Triton ops and by the twins on CUDA."""
    triton_ops, torch_ops = kernels
    g = torch.Generator().manual_seed(num_pages)
    batch = 2
    q = torch.randn(batch, HKV, G, D, generator=g).to(torch.bfloat16).cuda()
    kt = constant_kt(batch, HKV, num_pages, D, kt_dtype, g, "cuda")
    lengths = torch.tensor([num_pages * KT_PAGE, (num_pages - 41) * KT_PAGE - 3])
    # the paged layout: pool pages of 16 tokens (4 KT pages each), each row's pages scattered through the pool
    per_pool_page = 16 // KT_PAGE
    row_pages = -(-num_pages // per_pool_page)  # a last pool page partly used when num_pages is not a multiple
    table = torch.randperm(batch * row_pages, generator=g).view(batch, row_pages).to(torch.int32).cuda()
    kt_pages = torch.empty(batch * row_pages, HKV, per_pool_page, 2, D, dtype=kt_dtype, device="cuda")
    for b in range(batch):  # row b's constant summary in every pool page it owns
        kt_pages[table[b].long()] = kt[b, :, :per_pool_page][None].expand(row_pages, -1, -1, -1, -1)
    for sink, recent in FORCING:
        want = rule_selection(torch.ones(batch, HKV, num_pages), pages_in_use(lengths, KT_PAGE), TOPK, sink, recent)
        for name, ops in (("triton", triton_ops), ("torch", torch_ops)):
            got = ops.top_pages(q, kt, lengths.cuda(), KT_PAGE, TOPR, TOPK, sink, recent)
            assert_rule(got, want, f"{name} top_pages {kt_dtype} forcing={sink, recent}")
            got = ops.paged_top_pages(q, kt_pages, table, lengths.cuda(), KT_PAGE, TOPR, TOPK, sink, recent)
            assert_rule(got, want, f"{name} paged_top_pages {kt_dtype} forcing={sink, recent}")
