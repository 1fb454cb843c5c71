"""sparse_decode_attention: exact attention over the selected pages, Triton (flash-decoding) vs reference."""

import pytest
import torch

from hf_rocketkv.kernels.sparse_decode_attention import sparse_decode_attention_launch, sparse_decode_attention_torch
from tests.kernels.kernel_utils import DEVICE, OUT_ATOL, gen, ops, randn

pytestmark = pytest.mark.gpu  # compiled for the GPU where one is present (pytest -m gpu); interpreted on CPU

# (dtype, group, head_dim, page_size, num_splits): None = the launcher's choice, 1 = no reduce kernel
CASES = [
    (torch.bfloat16, 1, 64, 1, None),
    (torch.bfloat16, 4, 128, 4, 3),
    (torch.float16, 8, 128, 16, None),
    (torch.float16, 2, 64, 2, 1),
    (torch.float32, 3, 32, 8, 2),
    (torch.float32, 5, 256, 4, 1),
    (torch.bfloat16, 6, 64, 8, 4),
    (torch.float16, 4, 48, 4, 2),  # head_dim that is not a power of two
]


def _inputs(dtype, group, head_dim, page_size, g):
    batch, kv_heads, capacity = 4, 2, 12 * page_size
    num_pages = capacity // page_size
    k = min(6, num_pages)
    q = randn((batch, kv_heads, group, head_dim), dtype, g)
    keys = randn((batch, kv_heads, capacity, head_dim), dtype, g)
    values = randn((batch, kv_heads, capacity, head_dim), dtype, g)
    # rows: no token, a partial last page, full, a few tokens
    lengths = torch.tensor([0, 5 * page_size + page_size // 2 + 1, capacity, 2], device=DEVICE).clamp(max=capacity)
    page_idx = torch.stack([torch.randperm(num_pages, generator=g)[:k] for _ in range(batch * kv_heads)])
    page_idx = page_idx.view(batch, kv_heads, k).to(DEVICE)
    page_valid = (torch.rand((batch, kv_heads, k), generator=g) > 0.25).to(DEVICE)
    page_valid[1, 1] = False  # a head with no valid page at all
    return q, keys, values, page_idx, page_valid, lengths


@pytest.mark.parametrize("dtype,group,head_dim,page_size,splits", CASES)
def test_sparse_decode_attention_matches_reference(dtype, group, head_dim, page_size, splits):
    g = gen("sda", dtype, group, head_dim, page_size, splits)
    args = _inputs(dtype, group, head_dim, page_size, g)
    scaling = head_dim**-0.5
    got = sparse_decode_attention_launch(*args, page_size, scaling, num_splits=splits)
    want = sparse_decode_attention_torch(*args, page_size, scaling)
    assert got.dtype == dtype and got.shape == want.shape
    assert torch.isfinite(got).all()
    torch.testing.assert_close(got.float(), want.float(), atol=OUT_ATOL[dtype], rtol=0)
    assert torch.all(got[0] == 0) and torch.all(got[1, 1] == 0)  # nothing to attend -> zeros, like the reference


def test_sparse_decode_attention_op_strided_query():
    """The registered op with a query view laid out like decode_attention's reshape of [B, Hq, 1, D]."""
    g = gen("sda-op")
    q, keys, values, page_idx, page_valid, lengths = _inputs(torch.bfloat16, 4, 64, 4, g)
    q = q.reshape(4, 8, 1, 64).transpose(1, 2).contiguous().transpose(1, 2).reshape(4, 2, 4, 64)
    got = ops().sparse_decode_attention(q, keys, values, page_idx, page_valid, lengths, 4, 0.125)
    want = sparse_decode_attention_torch(q, keys, values, page_idx, page_valid, lengths, 4, 0.125)
    torch.testing.assert_close(got.float(), want.float(), atol=OUT_ATOL[torch.bfloat16], rtol=0)


def test_sparse_decode_attention_per_head_lengths():
    """lengths [B, Hkv]: each head attends only its own stored tokens; [B] equals its [B, Hkv] expansion."""
    g = gen("sda-per-head")
    q, keys, values, page_idx, page_valid, _ = _inputs(torch.float32, 2, 32, 4, g)
    lengths = torch.tensor([[0, 48], [13, 2], [48, 21], [5, 0]], device=DEVICE)
    for splits in (1, 2):
        got = sparse_decode_attention_launch(q, keys, values, page_idx, page_valid, lengths, 4, 0.2, num_splits=splits)
        want = sparse_decode_attention_torch(q, keys, values, page_idx, page_valid, lengths, 4, 0.2)
        torch.testing.assert_close(got, want, atol=OUT_ATOL[torch.float32], rtol=0)
        assert torch.all(got[0, 0] == 0) and torch.all(got[3, 1] == 0)
    rows = torch.tensor([0, 30, 48, 7], device=DEVICE)
    by_row = ops().sparse_decode_attention(q, keys, values, page_idx, page_valid, rows, 4, 0.2)
    by_head = ops().sparse_decode_attention(q, keys, values, page_idx, page_valid, rows[:, None].expand(4, 2), 4, 0.2)
    assert torch.equal(by_row, by_head)
