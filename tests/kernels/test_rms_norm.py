"""``kernels/rms_norm.rms_norm_triton`` against a float64 oracle, its torch twin and transformers' LlamaRMSNorm.

The oracle computes the norm in float64 without any rounding; the kernel rounds twice where eager PyTorch does (the
normalized value to the input dtype, then its product with the weight), so each output lies within two unit
roundoffs of the exact value (one per rounding), plus an absolute term where fp16 results are subnormal. Against the
torch twin the kernel differs only where its fp32 sum of squares (reduced in another order) moves a value across a
rounding boundary: rare, and never by more than two ulps. The twin itself equals transformers' module bit for bit.
"""

import pytest
import torch
from transformers.models.llama.modeling_llama import LlamaRMSNorm

from tests.kernels.kernel_utils import DEVICE, gen

pytest.importorskip("triton")

from hf_rocketkv.kernels.rms_norm import (
    MAX_HIDDEN,
    rms_norm_reference,
    rms_norm_supported,
    rms_norm_triton,
)

pytestmark = pytest.mark.gpu  # compiled for the GPU where one is present (pytest -m gpu); interpreted on CPU

UNIT_ROUNDOFF = {torch.bfloat16: 2.0**-8, torch.float16: 2.0**-11}
SMALLEST_SUBNORMAL = {torch.bfloat16: 2.0**-133, torch.float16: 2.0**-24}
EPS = 1e-5


def inputs(rows, hidden, dtype, g, scale=2.0):
    x = (torch.randn((rows, hidden), generator=g) * scale).to(dtype)
    weight = (torch.randn((hidden,), generator=g) * 0.5 + 1.0).to(dtype)
    return x.to(DEVICE), weight.to(DEVICE)


def oracle(x, weight, eps):
    """The norm in float64, no rounding anywhere."""
    h = x.double()
    return weight.double() * (h * torch.rsqrt((h * h).mean(dim=-1, keepdim=True) + eps))


def ulps_apart(a, b):
    """|a - b| in units of the last place of a 16-bit dtype (finite values of the same sign or zero)."""
    ia, ib = (t.view(torch.int16).int() for t in (a, b))
    ia = torch.where(ia < 0, -(ia & 0x7FFF), ia)  # sign-magnitude to a monotonic integer line
    ib = torch.where(ib < 0, -(ib & 0x7FFF), ib)
    return (ia - ib).abs()


def assert_near_oracle(got, x, weight, eps=EPS):
    exact = oracle(x, weight, eps)
    dtype = got.dtype
    bound = 2.0 * UNIT_ROUNDOFF[dtype] * exact.abs() * (1 + UNIT_ROUNDOFF[dtype]) \
        + SMALLEST_SUBNORMAL[dtype] * (1 + weight.double().abs())
    error = (got.double() - exact).abs()
    assert bool((error <= bound).all()), f"max error {float((error - bound).max())} over the bound"


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("hidden", [100, 576, 2880, 4096])
@pytest.mark.parametrize("rows", [1, 3, 70])
def test_rms_norm_matches_the_float64_oracle_and_its_twin(rows, hidden, dtype):
    g = gen("rms_norm", rows, hidden, dtype)
    x, weight = inputs(rows, hidden, dtype, g)
    assert rms_norm_supported(x, weight)
    got = rms_norm_triton(x, weight, EPS)
    assert got.shape == x.shape and got.dtype == dtype and got.is_contiguous()
    assert_near_oracle(got, x, weight)
    twin = rms_norm_reference(x, weight, EPS)
    apart = ulps_apart(got, twin)
    assert int(apart.max()) <= 2
    assert float((apart != 0).float().mean()) < 0.02  # a value near a rounding boundary, not a systematic offset


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("eps, scale", [(0.25, 1.0), (1e-5, 0.01), (1e-3, 0.05)])
def test_the_epsilon_is_the_callers_where_it_matters(dtype, eps, scale):
    """Inputs of ordinary magnitude where ``eps`` moves every output by more than the oracle's bound: N(0, 1) with
    0.25, and embedding-sized activations (0.01, 0.05) with the 1e-5 / 1e-3 of real configs. The kernel is within the
    bound of the float64 oracle at ``eps``; the oracle at another epsilon is not (the bound can see it)."""
    x, weight = inputs(5, 576, dtype, gen("rms_norm-eps", eps, dtype), scale=scale)
    got = rms_norm_triton(x, weight, eps)
    assert_near_oracle(got, x, weight, eps=eps)
    for other in (2 * eps, eps / 2, 0.0):
        with pytest.raises(AssertionError, match="over the bound"):
            assert_near_oracle(got, x, weight, eps=other)


@pytest.mark.parametrize("hidden", [3840, 5120, 16384])
def test_wide_rows_and_leading_dimensions(hidden):
    """[B, 1, H] decode activations, rows over several leading dims, up to a 16k hidden size."""
    g = gen("rms_norm-wide", hidden)
    x, weight = inputs(4, hidden, torch.bfloat16, g)
    x = x.view(2, 2, 1, hidden)
    got = rms_norm_triton(x, weight, 1e-6)
    assert got.shape == x.shape
    assert_near_oracle(got, x, weight, eps=1e-6)


def test_strided_rows_and_hard_values():
    """Rows read through their stride (a slice of a wider tensor); a zero row (the variance is 0: eps alone), tiny
    and large magnitudes (fp16 subnormal and near-overflow outputs)."""
    g = gen("rms_norm-hard")
    wide, weight = inputs(6, 2 * 576, torch.float16, g)
    x, weight = wide[:, :576], weight[:576].clone()
    assert x.stride(0) == 2 * 576 and rms_norm_supported(x, weight)
    x[0] = 0.0
    x[1] = x[1] * 1e-3
    x[2] = torch.where(x[2] > 0, 3.0e4, -3.0e4).to(x.dtype)  # a constant-magnitude row: normalized to +-1
    x[3, ::7] = 6.0e4
    weight[:5] = 2.0**-14  # subnormal products on row 1
    got = rms_norm_triton(x, weight, EPS)
    assert torch.equal(got[0], torch.zeros_like(got[0]))
    assert_near_oracle(got, x, weight)
    assert torch.equal(got[2].abs(), weight.abs())


def test_the_twin_is_transformers_llama_rms_norm_bit_for_bit():
    g = gen("rms_norm-transformers")
    for dtype in (torch.bfloat16, torch.float16):
        for hidden in (100, 576, 4096):
            module = LlamaRMSNorm(hidden, eps=1e-6).to(DEVICE, dtype)
            x, weight = inputs(5, hidden, dtype, g)
            with torch.no_grad():
                module.weight.copy_(weight)
                want = module(x.view(5, 1, hidden))
            twin = rms_norm_reference(x.view(5, 1, hidden), module.weight, module.variance_epsilon)
            assert torch.equal(twin.view(torch.int16), want.view(torch.int16))


@pytest.mark.parametrize("change", ["fp32", "weight_dtype", "weight_2d", "weight_size", "strided_last", "too_wide",
                                    "subclass"])
def test_rms_norm_supported_refuses_what_it_cannot_do(change):
    g = gen("rms_norm-refuse", change)
    hidden = MAX_HIDDEN * 2 if change == "too_wide" else 64
    x, weight = inputs(2, hidden, torch.float32 if change == "fp32" else torch.bfloat16, g)
    if change == "weight_dtype":
        weight = weight.half()
    if change == "weight_2d":
        weight = weight[None]
    if change == "weight_size":
        weight = weight[:-1]
    if change == "strided_last":
        x = torch.cat([x, x], dim=-1)[:, ::2]
    if change == "subclass":  # a tensor subclass (DTensor, a tracing tensor) may not be plain memory
        x = x.as_subclass(Subclass)
    assert not rms_norm_supported(x, weight)


class Subclass(torch.Tensor):
    pass


def test_rms_norm_launches_directly_not_through_wrap_triton(monkeypatch):
    from hf_rocketkv.kernels import launch

    def refuse(kernel):
        raise AssertionError("launched through wrap_triton")

    monkeypatch.setattr(launch, "wrap_triton", refuse)
    x, weight = inputs(2, 64, torch.bfloat16, gen("rms_norm-direct"))
    assert_near_oracle(rms_norm_triton(x, weight, EPS), x, weight)


def fp32_product_oracle(x, weight, eps, formula):
    """gpt-oss' and Gemma's formulas in float64: ``h / rms(h) * weight`` and ``h / rms(h) * (1 + weight)``."""
    h = x.double()
    scale = weight.double() + (1.0 if formula == "gemma" else 0.0)
    return h * torch.rsqrt((h * h).mean(dim=-1, keepdim=True) + eps) * scale


def transformers_norm(formula, hidden):
    from transformers.models.gemma3.modeling_gemma3 import Gemma3RMSNorm
    from transformers.models.gpt_oss.modeling_gpt_oss import GptOssRMSNorm

    return Gemma3RMSNorm(hidden, eps=EPS) if formula == "gemma" else GptOssRMSNorm(hidden, eps=EPS)


@pytest.mark.parametrize("formula", ["gemma", "gpt_oss"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("hidden", [32, 256, 3840])
@pytest.mark.parametrize("rows", [1, 5, 48])
def test_fp32_product_formulas_match_the_float64_oracle_their_twin_and_transformers(rows, hidden, dtype, formula):
    """One rounding (the fp32 product to the input dtype) against the exact value, plus fp32's own error on the way
    (sum of squares, rsqrt, products: a few units of 2**-24); the twin and transformers' module within one ulp."""
    g = gen(f"rms_norm_{formula}", rows, hidden, dtype)
    x, weight = inputs(rows, hidden, dtype, g)
    if formula == "gemma":
        weight = weight - 1.0  # around 0, as trained Gemma norms (1 + weight is the scale)
    assert rms_norm_supported(x, weight)
    got = rms_norm_triton(x, weight, EPS, formula)
    assert got.shape == x.shape and got.dtype == dtype
    exact = fp32_product_oracle(x, weight, EPS, formula)
    bound = (UNIT_ROUNDOFF[dtype] + 2.0**-20) * exact.abs() * (1 + UNIT_ROUNDOFF[dtype]) + SMALLEST_SUBNORMAL[dtype]
    error = (got.double() - exact).abs()
    assert bool((error <= bound).all()), f"max error {float((error - bound).max())} over the bound"
    twin = rms_norm_reference(x, weight, EPS, formula)
    module = transformers_norm(formula, hidden).to(x.device, dtype)
    with torch.no_grad():
        module.weight.copy_(weight)
        eager = module(x)
    assert torch.equal(twin, eager)
    for other in (twin, eager):
        apart = ulps_apart(got, other)
        assert int(apart.max()) <= 1 and float((apart != 0).float().mean()) < 0.02
    # the other formulas on the same inputs are other functions: the name is what selects this one
    for other in ("llama", "gemma", "gpt_oss"):
        if other != formula:
            assert not torch.equal(rms_norm_triton(x, weight, EPS, other), got)
