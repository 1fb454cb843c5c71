"""``kernels/gated_projection.gated_projection_triton`` and ``projection_triton`` against a float64 oracle and their
torch twins.

The oracle computes ``act(x @ gate.T) * (x @ up.T)`` in float64 from the same 16-bit inputs and rounds where eager
PyTorch rounds (each projection's output, the activation, the product: the kernel's contract). The kernel reduces
in fp32 in another order than float64 and takes ``exp`` / ``tanh`` from the backend, so a projection or the
activation may land on the other side of a rounding boundary; each such flip moves the output by a bounded amount
(``flip_bound``), and flips are rare. So: every output within that bound of the oracle, and at most a few percent
of outputs differ from it at all. The twin (transformers' own ops) is held to the same bound, which keeps the bound
honest: the test is not looser for the kernel than the eager module already is. A plain projection rounds once:
within one unit in the last place of the oracle.
"""

import math

import pytest
import torch

from tests.kernels.kernel_utils import DEVICE, gen, spacing

pytest.importorskip("triton")

from hf_rocketkv.kernels import gated_projection as gp  # noqa: E402
from hf_rocketkv.kernels.gated_projection import (  # noqa: E402
    MAX_ROWS,
    gated_projection_reference,
    gated_projection_supported,
    gated_projection_triton,
    projection_reference,
    projection_supported,
    projection_triton,
)

pytestmark = pytest.mark.gpu  # compiled for the GPU where one is present (pytest -m gpu); interpreted on CPU

ACT_SLOPE = 1.2  # |silu'| <= 1.1 and |gelu_tanh'| <= 1.13 everywhere


def activation(g: torch.Tensor, act: str) -> torch.Tensor:
    if act == "silu":
        return g / (1 + torch.exp(-g))
    return 0.5 * g * (1 + torch.tanh(math.sqrt(2 / math.pi) * (g + 0.044715 * g ** 3)))


def oracle(x, gate, up, act):
    """(output, g, a, u) in float64, rounded to the dtype at the contract's four places."""
    dtype = x.dtype
    g = (x.double() @ gate.double().T).to(dtype).double()
    u = (x.double() @ up.double().T).to(dtype).double()
    a = activation(g, act).to(dtype).double()
    return (a * u).to(dtype).double(), g, a, u


def flip_bound(out, g, a, u, dtype):
    """What one rounding flip of g, of a and of u, then of the output, can move an output by."""
    return (u.abs() * (ACT_SLOPE * spacing(g, dtype) + spacing(a, dtype)) + a.abs() * spacing(u, dtype)
            + spacing(out, dtype))


def inputs(rows, hidden, inter, dtype, key):
    g = gen("gated_projection", *key)
    x = (torch.randn((rows, hidden), generator=g) * 2).to(dtype)
    gate = (torch.randn((inter, hidden), generator=g) / hidden ** 0.5).to(dtype)
    up = (torch.randn((inter, hidden), generator=g) / hidden ** 0.5).to(dtype)
    return x.to(DEVICE), gate.to(DEVICE), up.to(DEVICE)


def assert_near_oracle(got, x, gate, up, act):
    exact, g, a, u = oracle(x.cpu(), gate.cpu(), up.cpu(), act)
    got = got.cpu().double()
    bound = flip_bound(exact, g, a, u, x.dtype)
    error = (got - exact).abs()
    assert bool((error <= bound).all()), f"max error over the bound: {float((error - bound).max())}"
    flips = int((got != exact).sum())
    assert flips <= max(3, 0.05 * got.numel()), flips  # flips are rare, not a systematic offset


@pytest.mark.parametrize("act", ["silu", "gelu_tanh"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("rows, hidden, inter", [(1, 256, 96), (3, 200, 70), (16, 128, 48), (17, 64, 33),
                                                 (40, 136, 64), (64, 256, 40)])
def test_the_kernel_matches_the_float64_oracle_and_its_twin(rows, hidden, inter, dtype, act):
    x, gate, up = inputs(rows, hidden, inter, dtype, (rows, hidden, inter, dtype, act))
    assert gated_projection_supported(x, gate, up)
    got = gated_projection_triton(x, gate, up, act)
    assert got.shape == (rows, inter) and got.dtype == dtype and got.is_contiguous()
    assert_near_oracle(got, x, gate, up, act)
    assert_near_oracle(gated_projection_reference(x, gate, up, act), x, gate, up, act)


def test_leading_dimensions_are_rows_and_a_strided_batch_is_read_in_place():
    """[B, T, hidden] like a decode step's hidden states; a row stride wider than hidden (a slice of a wider
    buffer) is read through the stride."""
    x, gate, up = inputs(6, 64, 40, torch.bfloat16, ("3d",))
    wide = torch.zeros((6, 96), dtype=x.dtype, device=x.device)
    wide[:, :64] = x
    strided = wide[:, :64].reshape(2, 3, 64)
    got = gated_projection_triton(strided, gate, up, "silu")
    assert got.shape == (2, 3, 40)
    assert torch.equal(got.reshape(6, 40), gated_projection_triton(x, gate, up, "silu"))


def test_the_twin_is_transformers_own_mlp_half():
    """The twin is the module's first half op for op (``act_fn(gate_proj(x)) * up_proj(x)``), bit for bit."""
    from transformers import LlamaConfig
    from transformers.models.llama.modeling_llama import LlamaMLP

    config = LlamaConfig(hidden_size=64, intermediate_size=96, hidden_act="silu")
    mlp = LlamaMLP(config).to(torch.bfloat16)
    x = torch.randn((2, 3, 64), generator=gen("twin")).to(torch.bfloat16)
    with torch.no_grad():
        expected = mlp.act_fn(mlp.gate_proj(x)) * mlp.up_proj(x)
        assert torch.equal(gated_projection_reference(x, mlp.gate_proj.weight, mlp.up_proj.weight, "silu"),
                           expected)


def test_what_the_kernel_does_not_take(monkeypatch):
    x, gate, up = inputs(4, 64, 32, torch.bfloat16, ("refusals",))
    assert gated_projection_supported(x, gate, up)
    assert not gated_projection_supported(x.float(), gate.float(), up.float())  # fp32: cuBLAS's
    assert not gated_projection_supported(x, gate.half(), up)  # mixed dtypes
    assert not gated_projection_supported(x.new_zeros((MAX_ROWS + 1, 64)), gate, up)  # a prefill chunk
    assert not gated_projection_supported(x.new_zeros((64, 4)).t(), gate, up)  # hidden not contiguous
    assert not gated_projection_supported(x, gate, up[:16])  # projections of other shapes
    assert not gated_projection_supported(x[:, :32], gate, up)  # hidden of another size
    assert not gated_projection_supported(x, gate.t().contiguous().t(), up)  # weight rows not contiguous
    if DEVICE.type == "cpu":
        monkeypatch.setattr(gp, "interpreting", lambda: False)
        assert not gated_projection_supported(x, gate, up)  # a CPU tensor needs the interpreter


def test_no_rows_gives_an_empty_output():
    x, gate, up = inputs(1, 64, 32, torch.bfloat16, ("empty",))
    out = gated_projection_triton(x[:0], gate, up, "gelu_tanh")
    assert out.shape == (0, 32)


# --------------------------------------------------------------------------------------------- the plain projection
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("rows, hidden, out", [(1, 384, 96), (3, 200, 70), (16, 100, 300), (33, 64, 33),
                                               (64, 256, 40)])
def test_the_plain_projection_is_within_one_rounding_of_the_float64_oracle(rows, hidden, out, dtype):
    """``x @ weight.T`` rounded once: the fp32 sums (error at most ``hidden * 2^-24 * |x| |W|``, which matters for
    outputs near zero) may put an output on the other side of a rounding boundary, one unit in the last place, and
    rarely; the twin (``F.linear``) is held to the same."""
    x, weight, _ = inputs(rows, hidden, out, dtype, ("plain", rows, hidden, out, dtype))
    assert projection_supported(x, weight)
    got = projection_triton(x, weight)
    assert got.shape == (rows, out) and got.dtype == dtype and got.is_contiguous()
    x64, w64 = x.cpu().double(), weight.cpu().double()
    exact = (x64 @ w64.T).to(dtype).double()
    bound = spacing(exact, dtype) + hidden * 2.0**-24 * (x64.abs() @ w64.abs().T)
    for result in (got, projection_reference(x, weight)):
        error = (result.cpu().double() - exact).abs()
        assert bool((error <= bound).all()), float((error - bound).max())
        assert int((result.cpu().double() != exact).sum()) <= max(3, 0.05 * exact.numel())


def test_the_plain_projection_reads_strided_rows_and_takes_leading_dimensions():
    x, weight, _ = inputs(6, 64, 40, torch.bfloat16, ("plain-3d",))
    wide = torch.zeros((6, 96), dtype=x.dtype, device=x.device)
    wide[:, :64] = x
    got = projection_triton(wide[:, :64].reshape(2, 3, 64), weight)
    assert got.shape == (2, 3, 40)
    assert torch.equal(got.reshape(6, 40), projection_triton(x, weight))
    assert projection_triton(x[:0], weight).shape == (0, 40)


def test_what_the_plain_projection_does_not_take():
    x, weight, _ = inputs(4, 64, 32, torch.bfloat16, ("plain-refusals",))
    assert projection_supported(x, weight)
    assert not projection_supported(x.float(), weight.float())  # fp32: cuBLAS's
    assert not projection_supported(x, weight.half())  # mixed dtypes
    assert not projection_supported(x.new_zeros((MAX_ROWS + 1, 64)), weight)  # a prefill chunk
    assert not projection_supported(x[:, :32], weight)  # in-features of another size
    assert not projection_supported(x, weight.t().contiguous().t())  # weight rows not contiguous
    assert not projection_supported(x, weight[None])  # not a matrix
