"""page_scores: signed min/max page scoring + softmax over pages + group mean, Triton vs reference."""

import pytest
import torch

from hf_rocketkv.kernels.page_scores import page_scores_launch
from hf_rocketkv.selection import stage2_pages as ref
from tests.kernels.kernel_utils import DEVICE, gen, ops, query_without_channel_ties, randn

pytestmark = pytest.mark.gpu  # compiled for the GPU where one is present (pytest -m gpu); interpreted on CPU

# (group, head_dim, topr, KT dtype, q dtype, num_splits): None = the launcher's choice, 1 = fused, 3 = split
CASES = [
    (1, 64, 64, torch.float8_e5m2, torch.bfloat16, None),
    (2, 128, 128, torch.bfloat16, torch.bfloat16, 3),
    (4, 64, 24, torch.float16, torch.float16, 1),
    (8, 128, 100, torch.float8_e5m2, torch.bfloat16, 3),
    (3, 32, 7, torch.float32, torch.float32, 1),
    (5, 256, 256, torch.bfloat16, torch.float32, None),
    (6, 128, 40, torch.float32, torch.bfloat16, 3),
    (4, 48, 16, torch.bfloat16, torch.bfloat16, 1),  # head_dim that is not a power of two
]


@pytest.mark.parametrize("per_head_bound", [False, True])
@pytest.mark.parametrize("group,head_dim,topr,kt_dtype,q_dtype,splits", CASES)
def test_page_scores_matches_reference(group, head_dim, topr, kt_dtype, q_dtype, splits, per_head_bound):
    g = gen("page_scores", group, head_dim, topr, kt_dtype, q_dtype, splits)
    batch, kv_heads, num_pages = 3, 2, 150
    q = query_without_channel_ties((batch, kv_heads, group, head_dim), q_dtype, kt_dtype, topr, g)
    kt = randn((batch, kv_heads, num_pages, 2, head_dim), torch.float32, g, scale=2.0).sort(dim=3).values.to(kt_dtype)
    n_pages = torch.tensor([0, 1, 137], device=DEVICE)  # no page, one page, most pages
    got = page_scores_launch(q, kt, n_pages, topr, num_splits=splits, per_head_bound=per_head_bound)
    want = ref.page_scores(q, kt, n_pages, topr, per_head_bound)
    assert got.shape == want.shape and got.dtype == torch.float32
    torch.testing.assert_close(got, want, atol=2e-6, rtol=1e-4)
    assert torch.all(got[0] == 0) and torch.all(got[2, :, 137:] == 0)
    torch.testing.assert_close(got[1:].sum(-1), torch.ones(2, kv_heads, device=DEVICE))


def test_page_scores_op_and_many_pages():
    """The registered op, with more pages than one program block and the split heuristic."""
    g = gen("page_scores_many")
    q = randn((1, 2, 4, 64), torch.bfloat16, g)
    kt = randn((1, 2, 2100, 2, 64), torch.float32, g).sort(dim=3).values.to(torch.float8_e5m2)
    n_pages = torch.tensor([2077], device=DEVICE)
    got = ops().page_scores(q, kt, n_pages, 64)
    torch.testing.assert_close(got, ref.page_scores(q, kt, n_pages, 64), atol=2e-6, rtol=1e-4)


def test_page_scores_per_head_page_counts():
    """n_pages [B, Hkv]: every head softmaxes over its own pages; [B] equals its [B, Hkv] expansion."""
    g = gen("page_scores-per-head")
    q = randn((2, 3, 4, 32), torch.float32, g)
    kt = randn((2, 3, 40, 2, 32), torch.float32, g).sort(dim=3).values.to(torch.bfloat16)
    n_pages = torch.tensor([[0, 40, 7], [1, 23, 39]], device=DEVICE)
    for splits in (1, 3):
        got = page_scores_launch(q, kt, n_pages, 16, num_splits=splits)
        torch.testing.assert_close(got, ref.page_scores(q, kt, n_pages, 16), atol=2e-6, rtol=1e-4)
        assert torch.all(got[0, 0] == 0) and torch.all(got[0, 2, 7:] == 0)
    rows = torch.tensor([12, 40], device=DEVICE)
    assert torch.equal(ops().page_scores(q, kt, rows, 16), ops().page_scores(q, kt, rows[:, None].expand(2, 3), 16))
