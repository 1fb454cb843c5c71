"""build_kt and update_kt (KT page min/max summaries): Triton == reference, bit for bit, for every KT dtype."""

import pytest
import torch

from hf_rocketkv.selection import stage2_pages as ref
from tests.kernels.kernel_utils import DEVICE, gen, ops, randn

pytestmark = pytest.mark.gpu  # compiled for the GPU where one is present (pytest -m gpu); interpreted on CPU

# (key dtype, KT dtype, page_size, head_dim): every value of each axis appears at least once
CASES = [
    (torch.bfloat16, torch.float8_e5m2, 1, 64),
    (torch.bfloat16, torch.bfloat16, 2, 128),
    (torch.float16, torch.float16, 4, 64),
    (torch.float32, torch.float32, 8, 32),
    (torch.float32, torch.float8_e5m2, 16, 128),
    (torch.float16, torch.bfloat16, 4, 256),
    (torch.bfloat16, torch.float32, 4, 48),  # head_dim that is not a power of two
]


def _lengths(capacity: int, page_size: int) -> torch.Tensor:
    # a row with no token, a partial last page, a full row
    return torch.tensor([0, max(1, capacity // 2 - page_size // 2 - 1), capacity], device=DEVICE)


@pytest.mark.parametrize("key_dtype,kt_dtype,page_size,head_dim", CASES)
def test_build_kt_matches_reference(key_dtype, kt_dtype, page_size, head_dim):
    g = gen("build", key_dtype, kt_dtype, page_size, head_dim)
    capacity = 6 * page_size
    keys = randn((3, 2, capacity, head_dim), key_dtype, g, scale=3.0)
    lengths = _lengths(capacity, page_size)
    got = ops().build_kt(keys, lengths, page_size, kt_dtype)
    want = ref.build_kt(keys, lengths, page_size, kt_dtype)
    assert got.dtype == want.dtype and got.shape == want.shape
    assert torch.equal(got.float(), want.float())


def test_build_kt_non_contiguous_keys():
    g = gen("build-strided")
    keys = randn((2, 8, 3, 64), torch.bfloat16, g).transpose(1, 2)  # [B, Hkv, C, D] view with odd strides
    lengths = torch.tensor([8, 5], device=DEVICE)
    got = ops().build_kt(keys, lengths, 2, torch.float8_e5m2)
    assert torch.equal(got.float(), ref.build_kt(keys, lengths, 2, torch.float8_e5m2).float())


@pytest.mark.parametrize("key_dtype,kt_dtype,page_size,head_dim", CASES[:5])
def test_update_kt_matches_reference_and_rebuild(key_dtype, kt_dtype, page_size, head_dim):
    g = gen("update", key_dtype, kt_dtype, page_size, head_dim)
    capacity = 4 * page_size
    keys = randn((3, 2, capacity, head_dim), key_dtype, g, scale=3.0)
    lengths = torch.tensor([0, page_size + 1, capacity - 3], device=DEVICE)  # fresh page, mid page, near the end
    lengths = lengths.clamp(max=capacity - 3)
    kt_ref = ref.build_kt(keys, lengths, page_size, kt_dtype)
    kt_tri = kt_ref.clone()
    for _ in range(3):
        new = randn((3, 2, 1, head_dim), key_dtype, g, scale=3.0)[:, :, 0]  # a strided view, like key_states[:, :, 0]
        rows = torch.arange(3, device=DEVICE)
        keys[rows, :, lengths] = new
        ref.update_kt(kt_ref, new, lengths, page_size)
        out = ops().update_kt(kt_tri, new, lengths, page_size)
        assert out is None
        lengths = lengths + 1
        assert torch.equal(kt_tri.float(), kt_ref.float())
    assert torch.equal(kt_tri.float(), ref.build_kt(keys, lengths, page_size, kt_dtype).float())


def test_kt_ops_take_per_head_counts():
    """build_kt lengths and update_kt slots per (row, KV head); [B] equals its [B, Hkv] expansion exactly."""
    g = gen("kt-per-head")
    page_size, capacity = 4, 24
    keys = randn((2, 3, capacity, 32), torch.bfloat16, g, scale=3.0)
    lengths = torch.tensor([[0, 5, 24], [8, 1, 13]], device=DEVICE)
    got = ops().build_kt(keys, lengths, page_size, torch.float8_e5m2)
    want = ref.build_kt(keys, lengths, page_size, torch.float8_e5m2)
    assert torch.equal(got.float(), want.float())
    for b in range(2):  # the reference per head == the per-row reference on that head alone
        for h in range(3):
            one = ref.build_kt(keys[b:b + 1, h:h + 1], lengths[b, h:h + 1], page_size, torch.float8_e5m2)
            assert torch.equal(want[b, h].float(), one[0, 0].float())
    slot = lengths.clamp(max=capacity - 1)
    new = randn((2, 3, 32), torch.bfloat16, g, scale=3.0)
    kt_ref = want.clone()
    ref.update_kt(kt_ref, new, slot, page_size)
    ops().update_kt(got, new, slot, page_size)
    assert torch.equal(got.float(), kt_ref.float())
    rows = torch.tensor([7, 12], device=DEVICE)
    a, b = want.clone(), want.clone()
    ops().update_kt(a, new, rows, page_size)
    ops().update_kt(b, new, rows[:, None].expand(2, 3), page_size)
    assert torch.equal(a.float(), b.float())
    assert torch.equal(ops().build_kt(keys, rows, page_size, torch.bfloat16),
                       ops().build_kt(keys, rows[:, None].expand(2, 3), page_size, torch.bfloat16))
