"""fp8 e4m3 page quantization: round-trip error bounds, scale shapes, edge values."""

import pytest
import torch

from hf_rocketkv.memory import dequantize_fp8, fp8_scales, quantize_fp8, quantize_pages

SHAPES = [(1, 1, 1, 1), (3, 2, 8, 16), (2, 4, 16, 64), (5, 1, 4, 128)]


def _bound(x: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """|x| * 2**-4 (half an e4m3 step in the normal range) + s * 2**-10 (half the subnormal step), plus fp32 slack."""
    s = scale.reshape(*scale.shape, *([1] * (x.dim() - scale.dim())))
    return x.abs() * 2.0**-4 + s * 2.0**-10 + x.abs() * 1e-6


@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("granularity", ["page", "head"])
@pytest.mark.parametrize("source_dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_round_trip_within_bound(shape, granularity, source_dtype):
    generator = torch.Generator().manual_seed(sum(shape) * 7 + len(granularity))
    # magnitudes spread over many binades per page, so normal and subnormal ranges are both exercised
    x = (torch.randn(shape, generator=generator) * torch.exp2(torch.randint(-12, 6, shape, generator=generator).float()))
    x = x.to(source_dtype)
    q, scale = quantize_pages(x, granularity)
    assert q.dtype == torch.float8_e4m3fn and q.shape == x.shape
    assert scale.dtype == torch.float32
    assert scale.shape == ((shape[0],) if granularity == "page" else shape[:2])
    back = dequantize_fp8(q, scale)
    x32 = x.float()
    assert torch.all((back - x32).abs() <= _bound(x32, scale))


def test_scales_from_amax_and_largest_value_exact():
    x = torch.zeros(2, 2, 4, 4)
    x[0, 0, 1, 2] = -3.5
    x[0, 1, 0, 0] = 7.0
    x[1, 1, 3, 3] = 0.25
    page = fp8_scales(x, "page")
    head = fp8_scales(x, "head")
    assert torch.equal(page, torch.tensor([7.0 / 448, 0.25 / 448]))
    assert torch.equal(head, torch.tensor([[3.5 / 448, 7.0 / 448], [1.0, 0.25 / 448]]))  # empty head: scale 1
    back = dequantize_fp8(quantize_fp8(x, page), page)
    assert back[0, 1, 0, 0] == 7.0 and back[1, 1, 3, 3] == 0.25  # the amax maps to 448 exactly


def test_zero_page_stays_zero_and_saturates():
    x = torch.zeros(1, 2, 4, 8)
    q, scale = quantize_pages(x, "page")
    assert torch.equal(scale, torch.ones(1)) and torch.equal(dequantize_fp8(q, scale), x)
    big = quantize_fp8(torch.full((1, 1, 1, 2), 1e6), torch.ones(1))
    assert torch.equal(big.float(), torch.full((1, 1, 1, 2), 448.0))  # clamped, never NaN


def test_head_granularity_is_tighter_for_uneven_heads():
    x = torch.randn(1, 2, 16, 32, generator=torch.Generator().manual_seed(0))
    x[:, 1] *= 1e-5  # head 1 is tiny: under a shared page scale it falls into e4m3's subnormal range
    errors = {}
    for granularity in ("page", "head"):
        q, scale = quantize_pages(x, granularity)
        errors[granularity] = (dequantize_fp8(q, scale)[:, 1] - x[:, 1]).abs().max()
    assert errors["head"] < errors["page"]


def test_bad_inputs():
    with pytest.raises(ValueError, match="scale_granularity"):
        fp8_scales(torch.zeros(1, 1, 1, 1), "token")
    with pytest.raises(ValueError, match=r"\[n, H, p, D\]"):
        fp8_scales(torch.zeros(2, 3), "page")
    with pytest.raises(ValueError, match="float8_e4m3fn"):
        dequantize_fp8(torch.zeros(1, 1, 1, 1), torch.ones(1))
