"""``kernels/residual_norm.residual_norm_triton`` against eager PyTorch's add, float64 oracles and its torch twin.

Without ``pre`` the sum is eager PyTorch's bf16/fp16 add (fp32 operands, one rounding), so ``summed`` must equal
torch's ``residual + x`` bit for bit, signed zeros, exact cancellations and absorbed operands included. The norm of
the sum is checked against the float64 oracles of ``test_rms_norm.py`` evaluated on the kernel's own ``summed`` (so
the expected value does not come from the kernel's norm): within two unit roundoffs for the llama formula (two
roundings), one (plus fp32's few units of 2**-24) for gemma (``h * rsqrt(mean h^2 + eps) * (1 + w)``) and gpt_oss
(``w * h * rsqrt(...)``), plus an absolute term for subnormal results.

With ``pre`` (Gemma 2/3: norm the sublayer output, add the residual, norm the sum) the exact sum ``residual +
norm(x)`` is computed in float64; the kernel's ``summed`` carries the norm's error bound plus one rounding of the
add. Against the torch twin outputs differ only where the norm's fp32 sum of squares (reduced in another order) moves
a value across a rounding boundary: rarely, and by at most two ulps (of the operand, where the add cancels).
"""

import pytest
import torch

from tests.kernels.kernel_utils import DEVICE, gen, spacing
from tests.kernels.test_rms_norm import (
    SMALLEST_SUBNORMAL,
    UNIT_ROUNDOFF,
    fp32_product_oracle,
    oracle,
    ulps_apart,
)

pytest.importorskip("triton")

from hf_rocketkv.kernels.residual_norm import (
    residual_norm_reference,
    residual_norm_supported,
    residual_norm_triton,
)
from hf_rocketkv.kernels.rms_norm import rms_norm_reference, rms_norm_triton

pytestmark = pytest.mark.gpu  # compiled for the GPU where one is present (pytest -m gpu); interpreted on CPU

FORMULAS = ["llama", "gpt_oss", "gemma"]
DTYPES = [torch.bfloat16, torch.float16]


def bits(t):
    return t.view(torch.int16)  # torch.equal on these tells -0.0 from +0.0


def norm(hidden, dtype, g, formula, eps=1e-6):
    weight = torch.randn((hidden,), generator=g) * 0.5 + (0.0 if formula == "gemma" else 1.0)  # Gemma: 1 + w
    return weight.to(dtype).to(DEVICE), eps


def hard_operands(shape, dtype, g):
    """Spread magnitudes, and by column: exact cancellation, -0 + -0, +0 + -0, a large residual with a small x and
    the reverse, and ties (x half an ulp of the residual: round to even decides)."""
    x = (torch.randn(shape, generator=g) * torch.exp2(torch.randint(-8, 9, shape, generator=g).float())).to(dtype)
    r = (torch.randn(shape, generator=g) * 4).to(dtype)
    col = torch.arange(shape[-1]) % 8
    r = torch.where(col == 0, -x, r)
    x = torch.where((col == 1) | (col == 2), torch.tensor(-0.0, dtype=dtype), x)
    r = torch.where(col == 1, torch.tensor(-0.0, dtype=dtype), torch.where(col == 2, torch.zeros_like(r), r))
    r = torch.where(col == 3, (r.float() * 2**10).to(dtype), r)
    x = torch.where(col == 3, (x.float().clamp(-4, 4) * 2**-8).to(dtype), x)
    x = torch.where(col == 4, (x.float().clamp(-4, 4) * 2**10).to(dtype), x)
    half_ulp = spacing(r.double(), dtype) / 2 * torch.where(torch.rand(shape, generator=g) < 0.5, -1.0, 1.0)
    x = torch.where(col == 5, half_ulp.to(dtype), x)
    return x.to(DEVICE), r.to(DEVICE)


def run(x, residual, formula, pre=None, post=None):
    """The kernel, with the contract every call must keep: outputs contiguous of x's shape and dtype, ``normed`` None
    exactly without ``post``, inputs untouched."""
    assert residual_norm_supported(x, residual, pre, post)
    before = [t.clone() for t in (x, residual)]
    summed, normed = residual_norm_triton(x, residual, formula, pre=pre, post=post)
    assert (normed is None) == (post is None)
    for out in (summed, normed) if post is not None else (summed,):
        assert out.shape == x.shape and out.dtype == x.dtype and out.is_contiguous()
    assert all(torch.equal(bits(t), bits(b)) for t, b in zip((x, residual), before))
    return summed, normed


def exact_norm(x, weight, eps, formula):
    """(float64 norm of x, the bound on a kernel output's distance from it) for ``formula``."""
    dtype, u = x.dtype, UNIT_ROUNDOFF[x.dtype]
    if formula == "llama":
        exact = oracle(x, weight, eps)
        return exact, 2.0 * u * exact.abs() * (1 + u) + SMALLEST_SUBNORMAL[dtype] * (1 + weight.double().abs())
    exact = fp32_product_oracle(x, weight, eps, formula)
    return exact, (u + 2.0**-20) * exact.abs() * (1 + u) + SMALLEST_SUBNORMAL[dtype]


def assert_within(got, exact, bound):
    error = (got.double() - exact).abs()
    assert bool((error <= bound).all()), f"max error {float((error - bound).max())} over the bound"


SHAPES = [(1, 1, 4096), (3, 1, 3840), (2, 35, 576), (70, 100)]  # [B, 1, H] decode, [B, T, H] prefill, 2-D rows


@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("formula", FORMULAS)
def test_the_sum_is_torchs_add_bit_for_bit_and_its_norm_near_the_oracle(formula, dtype, shape):
    g = gen("residual_norm", formula, dtype, shape)
    x, residual = hard_operands(shape, dtype, g)
    summed, normed = run(x, residual, formula)
    assert normed is None
    assert torch.equal(bits(summed), bits(residual + x))
    post = norm(shape[-1], dtype, g, formula, eps=1e-5)
    summed2, normed = run(x, residual, formula, post=post)
    assert torch.equal(bits(summed2), bits(summed))
    assert_within(normed, *exact_norm(summed, *post, formula))


@pytest.mark.parametrize("with_post", [False, True])
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("formula", FORMULAS)
def test_with_pre_the_sum_is_near_the_float64_oracle_and_the_twin(formula, dtype, with_post):
    """Gemma 2/3's pattern. The epsilons differ (0.25 before the add, 1e-6 after): on a row of variance 9, 0.25
    scales the normed operand by ~1.4%, beyond the bounds, so each norm must use its own."""
    hidden = 3840  # Gemma-3-12B
    g = gen("residual_norm-pre", formula, dtype, with_post)
    x = (torch.randn((4, 1, hidden), generator=g) * 3).to(dtype).to(DEVICE)
    residual = (torch.randn((4, 1, hidden), generator=g) * 2).to(dtype).to(DEVICE)
    pre, post = norm(hidden, dtype, g, formula, eps=0.25), norm(hidden, dtype, g, formula)
    summed, normed = run(x, residual, formula, pre, post if with_post else None)
    exact_a, bound_a = exact_norm(x, *pre, formula)
    exact = residual.double() + exact_a
    assert_within(summed, exact, bound_a + UNIT_ROUNDOFF[dtype] * (exact.abs() + bound_a))
    twin_sum, _ = residual_norm_reference(x, residual, formula, pre, post if with_post else None)
    # where the add cancels, one ulp of the normed operand is many of the sum: count in the larger one's ulps
    unit = torch.maximum(spacing(summed.double(), dtype), spacing(exact_a, dtype))
    apart = (summed.double() - twin_sum.double()).abs() / unit
    assert float(apart.max()) <= 2 and float((apart != 0).float().mean()) < 0.02
    if with_post:
        assert_within(normed, *exact_norm(summed, *post, formula))
        # the twin's norm of the kernel's own sum: the twin's sum may sit an ulp away, and the norm of a sum an ulp
        # away is more than two ulps away where the add cancelled (seen on an H100 in fp16)
        apart = ulps_apart(normed, rms_norm_reference(summed, *post, formula))
        assert int(apart.max()) <= 2 and float((apart != 0).float().mean()) < 0.02


def test_strided_inputs_match_their_contiguous_copies():
    """x a slice of a wider tensor (row stride 2H, read in place), the residual a transpose of [T, B, H] (copied by
    the wrapper): both keep the last dimension contiguous, and the result is that of contiguous copies."""
    g = gen("residual_norm-strided")
    hidden, dtype = 576, torch.bfloat16
    x = (torch.randn((2, 3, 2 * hidden), generator=g)).to(dtype).to(DEVICE)[..., :hidden]
    residual = (torch.randn((3, 2, hidden), generator=g) * 4).to(dtype).to(DEVICE).transpose(0, 1)
    assert not x.is_contiguous() and not residual.is_contiguous() and x.shape == residual.shape
    pre, post = norm(hidden, dtype, g, "gemma", eps=0.25), norm(hidden, dtype, g, "gemma")
    got = run(x, residual, "gemma", pre, post)
    want = run(x.contiguous(), residual.contiguous(), "gemma", pre, post)
    assert all(torch.equal(bits(a), bits(b)) for a, b in zip(got, want))


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("formula", FORMULAS)
@pytest.mark.parametrize("hidden", [4096, 3840, 576])
def test_the_post_norm_is_the_rms_norm_kernels_norm_of_the_sum_bit_for_bit(formula, dtype, hidden):
    """What a decoder layer hands to the next one (``integration/layer_chain.py``): the normed sum must be exactly what
    the next layer's fused ``input_layernorm`` would compute from the returned sum, so the hand-over changes no
    token. Both kernels run the same formula code over the same block of the row."""
    g = gen("residual_norm-handover", formula, dtype, hidden)
    x, residual = hard_operands((3, 1, hidden), dtype, g)
    post = norm(hidden, dtype, g, formula, eps=1e-6)
    pre = norm(hidden, dtype, g, formula, eps=0.25) if formula == "gemma" else None
    summed, normed = run(x, residual, formula, pre, post)
    assert torch.equal(bits(normed), bits(rms_norm_triton(summed, post[0], post[1], formula)))


@pytest.mark.parametrize("shape", [(0, 1, 64), (2, 0, 64)])
def test_zero_rows_give_empty_outputs(shape):
    x = torch.empty(shape, dtype=torch.float16, device=DEVICE)
    post = norm(64, torch.float16, gen("residual_norm-empty"), "llama")
    summed, normed = run(x, x.clone(), "llama", post=post)
    assert summed.shape == normed.shape == shape
    assert run(x, x.clone(), "llama")[1] is None


@pytest.mark.parametrize("change", ["none", "none_pre_post", "fp32", "residual_shape", "residual_dtype",
                                    "pre_weight_size", "post_weight_dtype", "x_strided_last", "residual_strided_last"])
def test_residual_norm_supported(change):
    g = gen("residual_norm-supported", change)
    dtype = torch.float32 if change == "fp32" else torch.bfloat16
    x, residual = ((torch.randn((2, 1, 64), generator=g)).to(dtype).to(DEVICE) for _ in range(2))
    pre = post = None
    if change == "none_pre_post":
        pre, post = norm(64, dtype, g, "gemma"), norm(64, dtype, g, "gemma")
    if change == "residual_shape":
        residual = residual.expand(2, 2, 64)
    if change == "residual_dtype":
        residual = residual.half()
    if change == "pre_weight_size":
        pre, post = norm(63, dtype, g, "gemma"), norm(64, dtype, g, "gemma")
    if change == "post_weight_dtype":
        post = (norm(64, dtype, g, "llama")[0].half(), 1e-6)
    if change == "x_strided_last":
        x = torch.cat([x, x], dim=-1)[..., ::2]
    if change == "residual_strided_last":
        residual = torch.cat([residual, residual], dim=-1)[..., ::2]
    assert residual_norm_supported(x, residual, pre, post) == change.startswith("none")
