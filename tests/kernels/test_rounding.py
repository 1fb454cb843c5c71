"""The kernels' rounding helpers (``_triton_common.cast_to`` and ``quantize_e4m3``) against PyTorch's conversions, bit
for bit: every KT page (bf16 / fp16 / e5m2) and every fp8 pool page a kernel writes goes through them.

The values cover what differs between rounding schemes: signed zeros, tiny negatives that round to -0.0, exact
midpoints between representable values (ties to even), subnormals of each 16- and 8-bit format and the largest
finite values.
The oracle is PyTorch's own ``Tensor.to(dtype)`` (and ``kernels/fp8.quantize_fp8`` for the scaled e4m3 write), never
the helpers under test.
"""

import pytest
import torch

from tests.kernels.kernel_utils import DEVICE, gen

triton = pytest.importorskip("triton")
tl = triton.language

from hf_rocketkv.kernels._triton_common import DT_FP8E4, cast_to, dtype_code, quantize_e4m3  # noqa: E402
from hf_rocketkv.kernels.fp8 import quantize_fp8  # noqa: E402

pytestmark = pytest.mark.gpu  # compiled for the GPU where one is present (pytest -m gpu); interpreted on CPU


@triton.jit
def _cast_kernel(x_ptr, out_ptr, n, DT: tl.constexpr, BLOCK: tl.constexpr):
    i = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    x = tl.load(x_ptr + i, mask=i < n, other=0.0)
    tl.store(out_ptr + i, cast_to(x, DT), mask=i < n)


@triton.jit
def _quantize_kernel(x_ptr, s_ptr, out_ptr, n, BLOCK: tl.constexpr):
    i = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    x = tl.load(x_ptr + i, mask=i < n, other=0.0)
    s = tl.load(s_ptr + i, mask=i < n, other=1.0)
    tl.store(out_ptr + i, quantize_e4m3(x, s), mask=i < n)


def _hard_values(dtype: torch.dtype) -> torch.Tensor:
    """Signed zeros, tiny values on both sides of 0, midpoints and neighbours of midpoints, subnormals, the largest
    finite value of ``dtype``, and random values over its whole exponent range."""
    info = torch.finfo(dtype)
    grid = torch.tensor([0.0, info.smallest_normal, info.tiny * 0.5, 1.0, 1.5, info.max], dtype=torch.float64)
    if dtype != torch.float32:
        steps = torch.arange(1, 40, dtype=torch.float64)
        sub = info.smallest_normal * info.eps  # the subnormal spacing: eps = 2**-mantissa bits
        grid = torch.cat([grid, steps * sub, (steps + 0.5) * sub, 1 + (steps + 0.5) * info.eps])
    tiny = torch.tensor([1e-30, 1e-12, 1e-8, 1e-6, 1e-4], dtype=torch.float64)
    g = gen("rounding", str(dtype))
    log_range = torch.rand(2000, generator=g, dtype=torch.float64) * (2 * torch.log2(torch.tensor(info.max)) + 8)
    spread = 2.0 ** (log_range - torch.log2(torch.tensor(info.max)) - 8)
    values = torch.cat([grid, tiny, spread, grid.nextafter(torch.tensor(float("inf"), dtype=torch.float64))])
    values = values[values.abs() <= info.max]
    # float32 subnormals (below 1.2e-38) are left out: Triton may flush them to zero on load or in arithmetic, and
    # no key, value or scale of a model comes near them
    values = values[(values == 0) | (values.abs() >= torch.finfo(torch.float32).smallest_normal)]
    return torch.cat([values, -values]).to(torch.float32)


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.contiguous().view(torch.uint8 if t.element_size() == 1 else torch.int16)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float8_e5m2, torch.float8_e4m3fn])
def test_cast_to_equals_torch_bit_for_bit(dtype):
    x = _hard_values(dtype).to(DEVICE)
    want = x.to(dtype)
    got = torch.empty_like(want)
    block = 256
    _cast_kernel[(triton.cdiv(x.numel(), block),)](x, got, x.numel(), BLOCK=block,
                                                     DT=DT_FP8E4 if dtype == torch.float8_e4m3fn else dtype_code(dtype))
    differ = (_bits(got) != _bits(want)).nonzero().flatten()
    assert len(differ) == 0, [(float(x[i]), float(got[i].float()), float(want[i].float())) for i in differ[:6]]
    assert bool(torch.signbit(got[x.signbit() & (want.float() == 0)].float()).all()), "-0.0 must stay -0.0"


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_cast_to_overflows_and_infinities_like_torch(dtype):
    """Past the largest finite value: torch rounds to nearest even, so values below max + half a step stay at max
    and the rest become inf (float16: 65504 up to 65519.99, then inf); infinities stay infinite."""
    info = torch.finfo(dtype)
    step = info.max * info.eps / 2  # the spacing just below max (half a step is where rounding goes to inf)
    above = torch.tensor([info.max + step * f for f in (0.25, 0.49, 0.5, 0.51, 1.0, 3.0)] + [1e6, 3e38])
    x = torch.cat([above, -above, torch.tensor([float("inf"), float("-inf")])]).to(torch.float32).to(DEVICE)
    want = x.to(dtype)
    got = torch.empty_like(want)
    _cast_kernel[(1,)](x, got, x.numel(), BLOCK=32, DT=dtype_code(dtype))
    assert torch.equal(_bits(got), _bits(want)), list(zip(x.tolist(), got.float().tolist(), want.float().tolist()))


def test_quantize_e4m3_equals_quantize_fp8_bit_for_bit():
    """The scaled write of an fp8 page: ``x / s`` (IEEE division), clamped to +-448, rounded to e4m3."""
    g = gen("quantize-e4m3")
    x = torch.cat([_hard_values(torch.float8_e4m3fn) * 3.0, torch.randn(2000, generator=g) * 50]).to(DEVICE)
    s = (torch.rand(x.numel(), generator=g) * 2 + 1e-3).to(DEVICE)
    s[:64] = 1.0
    want = quantize_fp8(x[:, None, None, None], s).flatten()
    got = torch.empty(x.numel(), dtype=torch.float8_e4m3fn, device=DEVICE)
    block = 256
    _quantize_kernel[(triton.cdiv(x.numel(), block),)](x, s, got, x.numel(), BLOCK=block)
    differ = (_bits(got) != _bits(want)).nonzero().flatten()
    assert len(differ) == 0, [(float(x[i]), float(s[i]), float(got[i].float()), float(want[i].float()))
                              for i in differ[:6]]
