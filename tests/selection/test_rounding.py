"""selection/rounding.py: ``round_like_cast(x, dtype)`` against the cast it stands for, ``x.to(dtype).float()``
(PyTorch's own conversion is the oracle), on every kind of float32 value, in eager code and under torch.compile
(where inductor drops the cast's rounding: the reason the function exists)."""

from __future__ import annotations

import pytest
import torch

from hf_rocketkv.selection.rounding import round_like_cast

DTYPES = [torch.bfloat16, torch.float16, torch.float8_e5m2]

# values at the edges of each format: signed zeros, smallest subnormals and halfway points between them, the
# smallest normal, the largest finite values and the overflow thresholds (ties to even: up to infinity), infinities
EDGES = [0.0, -0.0, 2.0**-24, 2.0**-25, 3 * 2.0**-25, 2.0**-16, 2.0**-17, 3 * 2.0**-17, 2.0**-14, 2.0**-126,
         2.0**-149, 65504.0, 65519.99, 65520.0, 65536.0, 57344.0, 61439.9, 61440.0, 1.0 + 2.0**-8, 1.0 + 3 * 2.0**-8,
         1.0 + 2.0**-11, 1.0 + 3 * 2.0**-11, 3.3e38, 3.4028235e38, float("inf"), float("-inf")]


def _values(seed: int = 0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    any_bits = torch.randint(-2**31, 2**31 - 1, (200_000,), dtype=torch.int64, generator=g).to(torch.int32)
    any_bits = any_bits.view(torch.float32)
    scaled = torch.randn(200_000, generator=g) * torch.exp2(torch.randint(-30, 20, (200_000,), generator=g).float())
    edges = torch.tensor(EDGES + [-v for v in EDGES], dtype=torch.float32)
    return torch.cat([any_bits[~torch.isnan(any_bits)], scaled, edges])


def _assert_bitwise_equal(got: torch.Tensor, want: torch.Tensor):
    assert torch.equal(got.view(torch.int32), want.view(torch.int32)), (
        f"{(got.view(torch.int32) != want.view(torch.int32)).sum()} values differ")


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_equals_the_cast_bit_for_bit(dtype):
    x = _values()
    _assert_bitwise_equal(round_like_cast(x, dtype), x.to(dtype).float())


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_nan_stays_nan(dtype):
    nans = torch.tensor([0x7FC00000, 0x7F800001, 0x7F800100, -0x00000001], dtype=torch.int32).view(torch.float32)
    assert torch.isnan(round_like_cast(nans, dtype)).all()


def test_float32_is_returned_unchanged_and_other_inputs_are_refused():
    x = _values()[:1000]
    assert round_like_cast(x, torch.float32) is x
    with pytest.raises(ValueError, match="float32"):
        round_like_cast(x.double(), torch.bfloat16)
    with pytest.raises(ValueError, match="dtype must be one of"):
        round_like_cast(x, torch.int8)


@pytest.mark.slow
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_compiled_rounding_equals_the_eager_cast(dtype):
    """Inductor fuses ``x.to(dtype).float()`` away; the integer form survives it."""
    x = _values(seed=1)[:50_000]
    x = x[torch.isfinite(x)]

    def scaled_sum(values):
        return round_like_cast(values, dtype) * 3

    compiled = torch.compile(scaled_sum, fullgraph=True)
    _assert_bitwise_equal(compiled(x), x.to(dtype).float() * 3)
