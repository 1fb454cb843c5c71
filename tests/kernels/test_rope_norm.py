"""``kernels/rope.rope_triton`` with per-head norms (Gemma 3's ``q_norm`` / ``k_norm`` before RoPE, one launch)
against a float64 oracle, its torch twin and transformers' own modules.

The oracle normalizes each head in float64 without rounding (``exact_norm``: the bound of one fused-norm output
around it, per formula), then rotates the exact normalized values by the 16-bit cos/sin in float64. A kernel output
is the sum of two rounded products of rounded normalized values, rounded once more: it lies within the propagated
norm bound plus three unit roundoffs of the terms' magnitudes (and a subnormal term). The q and k norms carry
different weights and epsilons (1e-6 and 0.25: at a head variance of ~9, 0.25 moves the norm by ~1.4%, far outside
the bound), so a swapped weight, epsilon or half fails. Against the twin (``rope_torch`` with the norms: eager
PyTorch, bit for bit transformers' ``Gemma3RMSNorm`` and ``apply_rotary_pos_emb``) the kernel differs only where its
sum of squares, reduced in another order, moves a normalized value across a rounding boundary: rare.
"""

import pytest
import torch

from tests.kernels.kernel_utils import gen
from tests.kernels.test_residual_norm import exact_norm, norm
from tests.kernels.test_rope import bits, projected, rotary
from tests.kernels.test_rms_norm import SMALLEST_SUBNORMAL, UNIT_ROUNDOFF

pytest.importorskip("triton")

from hf_rocketkv.kernels.rope import rope_supported, rope_torch, rope_triton  # noqa: E402

pytestmark = pytest.mark.gpu  # compiled for the GPU where one is present (pytest -m gpu); interpreted on CPU

SHAPES = [  # (batch, query heads, KV heads, head_dim, tokens)
    (1, 16, 8, 256, 1),  # Gemma-3-12B's decode step
    (3, 4, 2, 64, 1),
    (2, 9, 3, 48, 1),  # heads not a multiple of the program's 8, half-dim not a power of two
    (2, 4, 2, 32, 5),  # a prefill chunk
]
FORMULAS = ["gemma", "llama", "gpt_oss"]


def oracle(x, cos, sin, weight, eps, formula):
    """(float64 rotated norm of x [B, H, T, D], the bound on a kernel output's distance from it)."""
    dtype, u = x.dtype, UNIT_ROUNDOFF[x.dtype]
    n, b = exact_norm(x, weight, eps, formula)
    half = x.shape[-1] // 2
    c, s = cos.double().unsqueeze(1), sin.double().unsqueeze(1)
    n1, n2, b1, b2 = n[..., :half], n[..., half:], b[..., :half], b[..., half:]
    c1, c2, s1, s2 = c[..., :half], c[..., half:], s[..., :half], s[..., half:]
    exact = torch.cat([n1 * c1 - n2 * s1, n2 * c2 + n1 * s2], dim=-1)
    propagated = torch.cat([c1.abs() * b1 + s1.abs() * b2, c2.abs() * b2 + s2.abs() * b1], dim=-1)
    magnitude = torch.cat([(n1 * c1).abs() + (n2 * s1).abs(), (n2 * c2).abs() + (n1 * s2).abs()], dim=-1)
    bound = propagated + 3 * u * (magnitude + propagated) * (1 + u) + 3 * SMALLEST_SUBNORMAL[dtype]
    return exact, bound


def assert_within(got, exact, bound):
    error = (got.double() - exact).abs()
    assert bool((error <= bound).all()), f"max error {float((error - bound).max())} over the bound"


def inputs(shape, dtype, formula, key):
    batch, hq, hkv, head_dim, tokens = shape
    g = gen("rope-norm", key, shape, dtype, formula)
    q, k = projected(batch, hq, head_dim, dtype, g, tokens), projected(batch, hkv, head_dim, dtype, g, tokens)
    q[0, 0, 0] = 0  # a head of zeros: its variance is 0, its norm rsqrt(eps) * 0
    cos, sin = rotary(batch, head_dim, dtype, g, tokens=tokens)
    q_norm, k_norm = norm(head_dim, dtype, g, formula, eps=1e-6), norm(head_dim, dtype, g, formula, eps=0.25)
    return q, k, cos, sin, q_norm, k_norm


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("formula", FORMULAS)
def test_normed_rope_is_near_the_float64_oracle_and_the_twin(formula, shape, dtype):
    q, k, cos, sin, q_norm, k_norm = inputs(shape, dtype, formula, "oracle")
    assert rope_supported(q, k, cos, sin, q_norm, k_norm)
    before = [t.clone() for t in (q, k)]
    got_q, got_k = rope_triton(q, k, cos, sin, q_norm, k_norm, formula)
    assert all(torch.equal(bits(t), bits(b)) for t, b in zip((q, k), before))
    assert got_q.shape == q.shape and got_k.shape == k.shape and got_q.transpose(1, 2).is_contiguous()
    assert_within(got_q, *oracle(q, cos, sin, *q_norm, formula))
    assert_within(got_k, *oracle(k, cos, sin, *k_norm, formula))
    twin_q, twin_k = rope_torch(q, k, cos, sin, q_norm, k_norm, formula)
    for got, twin in ((got_q, twin_q), (got_k, twin_k)):
        assert float((bits(got) != bits(twin)).float().mean()) < 0.03


def test_the_twin_is_transformers_gemma3_norms_and_rope_bit_for_bit():
    """The oracle the integration tests compare with: ``rope_torch`` with the norms equals ``Gemma3RMSNorm`` on q and
    k, then Gemma 3's ``apply_rotary_pos_emb``."""
    from transformers.models.gemma3.modeling_gemma3 import Gemma3RMSNorm, apply_rotary_pos_emb

    q, k, cos, sin, q_norm, k_norm = inputs(SHAPES[1], torch.bfloat16, "gemma", "twin")
    modules = []
    for weight, eps in (q_norm, k_norm):
        module = Gemma3RMSNorm(weight.shape[0], eps=eps).to(weight.device, weight.dtype)
        module.weight.data.copy_(weight)
        modules.append(module)
    want_q, want_k = apply_rotary_pos_emb(modules[0](q), modules[1](k), cos, sin)
    twin_q, twin_k = rope_torch(q, k, cos, sin, q_norm, k_norm, "gemma")
    assert torch.equal(bits(twin_q), bits(want_q)) and torch.equal(bits(twin_k), bits(want_k))


def test_without_norms_the_kernel_is_unchanged_bit_for_bit():
    """The norms are optional: without them (and whatever ``formula`` says) the plain RoPE, transformers' values."""
    q, k, cos, sin, _, _ = inputs(SHAPES[2], torch.float16, "gemma", "plain")
    plain_q, plain_k = rope_torch(q, k, cos, sin)
    for formula in FORMULAS:
        got_q, got_k = rope_triton(q, k, cos, sin, formula=formula)
        assert torch.equal(bits(got_q), bits(plain_q)) and torch.equal(bits(got_k), bits(plain_k))


@pytest.mark.parametrize("change", ["one_norm", "weight_size", "weight_dtype", "weight_strided", "weight_2d",
                                    "eps_tensor"])
def test_rope_supported_refuses_norms_it_cannot_read(change):
    q, k, cos, sin, q_norm, k_norm = inputs(SHAPES[1], torch.bfloat16, "gemma", "refuse")
    weight, eps = k_norm
    if change == "one_norm":
        assert not rope_supported(q, k, cos, sin, q_norm, None)
        assert not rope_supported(q, k, cos, sin, None, k_norm)
        return
    changed = {
        "weight_size": lambda: (weight[:-2], eps),
        "weight_dtype": lambda: (weight.float(), eps),
        "weight_strided": lambda: (torch.stack([weight, weight], dim=1)[:, 0], eps),
        "weight_2d": lambda: (weight[None], eps),
        "eps_tensor": lambda: (weight, torch.tensor(eps)),
    }[change]()
    assert rope_supported(q, k, cos, sin, q_norm, k_norm)
    assert not rope_supported(q, k, cos, sin, q_norm, changed)
