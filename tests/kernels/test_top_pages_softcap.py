"""top_pages / paged_top_pages with soft-capped page logits (Gemma 2): the fused Triton selection (interpreted on CPU)
and the torch twins against a float64 oracle of the page probabilities written from the definition (per channel the
group-summed query sign picks Kmax or Kmin; each head's logits ``tanh(x * scaling / cap) * cap``, softmax over the
row's pages, mean over the group), through the tie-tolerant selection check of test_select_pages."""

import pytest
import torch

from hf_rocketkv.kernels.paged import paged_top_pages_torch
from hf_rocketkv.kernels.select_pages import top_pages_launch
from hf_rocketkv.selection import stage2_pages as ref
from tests.kernels.kernel_utils import DEVICE, gen, ops, page_table, randn
from tests.kernels.test_select_pages import _kt, assert_valid_selection

pytestmark = pytest.mark.gpu  # compiled for the GPU where one is present (pytest -m gpu); interpreted on CPU


def oracle_probs(q, kt, n_pages, scaling, softcap):
    """float64 ``[B, Hkv, NP]`` (every channel: topr >= head_dim)."""
    q, kt = q.double().cpu(), kt.double().cpu()
    batch, kv_heads, group, _ = q.shape
    n_pages = ref.per_head(n_pages.cpu(), batch, kv_heads)
    out = torch.zeros(batch, kv_heads, kt.shape[2], dtype=torch.float64)
    for b in range(batch):
        for h in range(kv_heads):
            n = int(n_pages[b, h])
            if n == 0:
                continue
            use_max = q[b, h].sum(0) > 0
            picked = torch.where(use_max, kt[b, h, :n, 1], kt[b, h, :n, 0])  # [n, D]
            for g in range(group):
                x = picked @ q[b, h, g] * scaling
                out[b, h, :n] += torch.softmax(torch.tanh(x / softcap) * softcap, 0) / group
    return out


@pytest.mark.parametrize("group,head_dim,page_size,softcap,splits", [
    (4, 32, 4, 2.0, None), (2, 64, 2, 0.5, 3), (1, 16, 8, 5.0, 1), (8, 16, 1, 1.0, 2)])
def test_capped_selection_matches_the_float64_oracle(group, head_dim, page_size, softcap, splits):
    g = gen("top-pages-softcap", group, head_dim, page_size, softcap, splits)
    batch, kv_heads, num_pages, topk, sink, recent = 2, 2, 40, 7, 1, 1
    q = randn((batch, kv_heads, group, head_dim), torch.float32, g, scale=3.0)
    kt = _kt(batch, kv_heads, num_pages, head_dim, torch.float32, g)
    scaling = 0.3
    for lengths in (torch.tensor([0, 37 * page_size - 1], device=DEVICE),
                    torch.tensor([[5, 40 * page_size], [1, 23 * page_size + 1]], device=DEVICE)):
        n_pages = ref.num_pages(lengths, page_size)
        want = oracle_probs(q, kt, n_pages, scaling, softcap)
        for idx, valid in (
            top_pages_launch(q, kt, lengths, page_size, head_dim, topk, sink, recent, score_splits=splits,
                             softcap=softcap, scaling=scaling),
            ref.top_pages(q, kt, lengths, page_size, head_dim, topk, sink, recent, softcap=softcap, scaling=scaling),
        ):
            assert_valid_selection(idx, valid, want.float(), n_pages, topk, sink, recent, atol=1e-5)


def test_paged_op_and_twin_match_the_oracle_and_the_cap_changes_the_selection():
    g = gen("paged-top-pages-softcap")
    batch, kv_heads, group, head_dim, kt_page, per_pool_page = 2, 2, 4, 32, 4, 5
    pages_per_row = 8
    q = randn((batch, kv_heads, group, head_dim), torch.float32, g, scale=3.0)
    kt = _kt(batch, kv_heads, pages_per_row * per_pool_page, head_dim, torch.float32, g)
    table = page_table([pages_per_row] * batch, batch * pages_per_row + 2, g)
    kt_pages = torch.zeros(batch * pages_per_row + 2, kv_heads, per_pool_page, 2, head_dim, device=DEVICE)
    for b in range(batch):
        for p in range(pages_per_row):
            kt_pages[table[b, p]] = kt[b, :, p * per_pool_page:(p + 1) * per_pool_page]
    lengths = torch.tensor([31 * kt_page + 2, 40 * kt_page], device=DEVICE)
    n_pages = ref.num_pages(lengths, kt_page)
    args = (q, kt_pages, table, lengths, kt_page, head_dim, 6)
    want = oracle_probs(q, kt, n_pages, 0.3, 0.4).float()
    for idx, valid in (paged_top_pages_torch(*args, 1, 1, softcap=0.4, scaling=0.3),
                       ops().paged_top_pages(*args, sink_pages=1, recent_pages=1, softcap=0.4, scaling=0.3)):
        assert_valid_selection(idx, valid, want, n_pages, 6, 1, 1, atol=1e-5)
    capped = ops().paged_top_pages(*args, sink_pages=1, recent_pages=1, softcap=0.4, scaling=0.3)
    plain = ops().paged_top_pages(*args, sink_pages=1, recent_pages=1)
    assert not torch.equal(capped[0], plain[0])  # with G = 4 the cap changes which pages win


@pytest.mark.parametrize("kwargs,match", [
    ({"softcap": 0.0, "scaling": 0.1}, "softcap must be a positive number"),
    ({"softcap": 2.0}, "scaling .* must be a positive number with softcap"),
])
def test_bad_softcap_is_refused(kwargs, match):
    g = gen("top-pages-bad")
    q = randn((1, 1, 2, 16), torch.float32, g)
    kt = _kt(1, 1, 4, 16, torch.float32, g)
    lengths = torch.tensor([16], device=DEVICE)
    for run in (top_pages_launch, ref.top_pages):
        with pytest.raises(ValueError, match=match):
            run(q, kt, lengths, 4, 16, 2, 0, 1, **kwargs)
