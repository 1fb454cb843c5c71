"""window_scores (stage 1): window queries vs all keys, fp32 softmax, summed over window and group; Triton vs reference."""

import pytest
import torch

from hf_rocketkv.selection.stage1_snapkv import window_scores
from tests.kernels.kernel_utils import DEVICE, gen, ops, randn

pytestmark = pytest.mark.gpu  # compiled for the GPU where one is present (pytest -m gpu); interpreted on CPU

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


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_window_scores_over_several_key_chunks(dtype):
    """Pass 1 splits the keys into chunks when there are few (row, KV head) pairs to spread over the GPU; pass 2
    combines the chunks' statistics per row. With 2 x 1 pairs and 1,300 slots, the interpreter's 4 stand-in SMs give
    min(ceil(1300 / 512), ceil(8 / 2)) = 3 chunks; row 1 starts at slot 700, so its first chunk sees no key at all
    (a -inf partial maximum that must drop out of the combination)."""
    g = gen("window-chunks", dtype)
    batch, kv_heads, group, window, head_dim, slots = 2, 1, 4, 8, 64, 1300
    q = randn((batch, kv_heads * group, window, head_dim), dtype, g, scale=2.0)
    keys = randn((batch, kv_heads, slots, head_dim), dtype, g)
    start = torch.tensor([0, 700], device=DEVICE)
    end = torch.tensor([slots, slots - 5], device=DEVICE)
    got = ops().window_scores(q, keys, start, end, head_dim**-0.5)
    want = window_scores(q, keys, start, end, head_dim**-0.5)
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-4)
    assert torch.all(got[1, :, :700] == 0) and torch.all(got[1, :, slots - 5:] == 0)
    # every window query's probabilities sum to 1: the scores of a row sum to group * window
    torch.testing.assert_close(got.sum(dim=-1), torch.full((batch, kv_heads), float(group * window), device=DEVICE),
                               atol=1e-3, rtol=1e-4)
