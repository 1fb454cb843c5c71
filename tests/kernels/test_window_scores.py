"""window_scores (stage 1): window queries vs all keys, fp32 softmax, summed over window and group; Triton vs reference."""

import pytest
import torch
from kernel_utils import DEVICE, gen, ops, randn

from hf_rocketkv.selection.stage1_snapkv import window_scores

# (dtype, group, head_dim, window)
CASES = [
    (torch.bfloat16, 1, 64, 4),
    (torch.bfloat16, 4, 128, 8),
    (torch.float16, 8, 64, 3),
    (torch.float32, 3, 32, 5),
    (torch.float16, 2, 256, 2),
    (torch.float32, 5, 16, 7),
]


@pytest.mark.parametrize("dtype,group,head_dim,window", CASES)
def test_window_scores_matches_reference(dtype, group, head_dim, window):
    g = gen("window", dtype, group, head_dim, window)
    batch, kv_heads, slots = 4, 2, 150
    # a strided query view, like pending_queries = query_states[:, :, -window:]
    q = randn((batch, kv_heads * group, window + 3, head_dim), dtype, g, scale=2.0)[:, :, 3:]
    keys = randn((batch, kv_heads, slots, head_dim), dtype, g)
    # full row, left padding, only 2 valid tokens (fewer than the window), no valid token at all
    start = torch.tensor([0, 37, slots - 2, slots], device=DEVICE)
    end = torch.tensor([slots, slots, slots, slots], device=DEVICE)
    scaling = head_dim**-0.5
    got = ops().window_scores(q, keys, start, end, scaling)
    want = window_scores(q, keys, start, end, scaling)
    assert got.dtype == torch.float32 and got.shape == want.shape
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-4)
    assert torch.all(got[1, :, :37] == 0) and torch.all(got[3] == 0)
