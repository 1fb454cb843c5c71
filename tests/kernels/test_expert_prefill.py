"""``kernels/expert_prefill.py``: gpt-oss' gate and the combine, each kernel and its torch twin against a float64
oracle, and the grouped GEMM (torch's where it runs, the reference loop elsewhere).

The oracles are written here from the formulas (gpt-oss' ``_apply_gate`` with the bias added first; the weighted sum
of each token's pairs back in token order), not from the twins. The kernels compute in fp32 and round once, so each
output is within one unit roundoff of its dtype of the exact value, plus fp32 error on the intermediate terms.
"""

import pytest
import torch

from tests.kernels.kernel_utils import DEVICE, gen

pytest.importorskip("triton")

from hf_rocketkv.kernels.expert_linear import sort_by_expert  # noqa: E402
from hf_rocketkv.kernels.expert_prefill import (  # noqa: E402
    clamped_glu_reference,
    clamped_glu_triton,
    combine_reference,
    combine_triton,
    grouped_matmul,
    grouped_matmul_reference,
    grouped_matmul_runs,
)

pytestmark = pytest.mark.gpu  # compiled for the GPU where one is present (pytest -m gpu); interpreted on CPU

UNIT_ROUNDOFF = {torch.bfloat16: 2.0**-8, torch.float16: 2.0**-11, torch.float32: 2.0**-24}
DTYPES = [torch.bfloat16, torch.float16, torch.float32]


def assert_rounded(got, exact, slack):
    """``got`` within one unit roundoff of its dtype of ``exact`` plus ``slack`` (fp32 error of the terms)."""
    bound = UNIT_ROUNDOFF[got.dtype] * exact.abs() * 1.01 + slack + 1e-30
    error = (got.double() - exact).abs()
    assert bool((error <= bound).all()), f"max error over the bound by {float((error - bound).max())}"


def glu_oracle(up, bias, ids, alpha, limit):
    x = up.double() + (bias.double()[ids] if bias is not None else 0.0)
    gate, lin = x[:, 0::2].clamp(max=limit), x[:, 1::2].clamp(min=-limit, max=limit)
    return (lin + 1.0) * gate / (1.0 + torch.exp(-alpha * gate))


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("bias", [True, False])
@pytest.mark.parametrize("rows, width, experts", [(7, 40, 3), (1, 1030, 2), (33, 5, 5)])
def test_clamped_glu_and_its_twin_are_within_rounding_of_the_oracle(dtype, bias, rows, width, experts):
    g = gen("clamped_glu", dtype, bias, rows, width, experts)
    up = (torch.randn((rows, 2 * width), generator=g) * 6).to(dtype).to(DEVICE)  # past the limit both ways
    b = (torch.randn((experts, 2 * width), generator=g) * 2).to(dtype).to(DEVICE) if bias else None
    ids = torch.randint(0, experts, (rows,), generator=g).to(DEVICE)
    exact = glu_oracle(up, b, ids, 1.702, 7.0)
    assert bool((up.double() > 7.0).any()) and bool((up.double() < -7.0).any())  # both clamps are exercised
    slack = 1e-5 * (exact.abs() + 1)
    for got in (clamped_glu_triton(up, b, ids, 1.702, 7.0), clamped_glu_reference(up, b, ids, 1.702, 7.0)):
        assert got.shape == (rows, width) and got.dtype == dtype
        assert_rounded(got, exact, slack)


def test_clamped_glu_reads_gate_and_up_interleaved_and_each_rows_own_bias():
    """Exact values: gate at even columns, up at odd ones, the bias of the row's own expert; a swapped pair, a
    shifted column or another row's expert gives other numbers."""
    up = torch.tensor([[1.0, 2.0, -3.0, 9.0], [20.0, -20.0, 0.0, 0.5]]).to(DEVICE)
    bias = torch.tensor([[0.0, 0.0, 0.0, 0.0], [1.0, 1.0, -1.0, 0.5]]).to(DEVICE)
    ids = torch.tensor([1, 0]).to(DEVICE)
    got = clamped_glu_triton(up, bias, ids, 1.0, 7.0)
    x = up + bias[ids]
    gate, lin = x[:, 0::2].clamp(max=7.0), x[:, 1::2].clamp(-7.0, 7.0)
    want = (lin + 1) * gate * torch.sigmoid(gate)
    torch.testing.assert_close(got, want, rtol=1e-6, atol=1e-6)


def combine_oracle(down, position, bias, ids, weights):
    tokens, top_k = ids.shape
    rows = down.double()[position.long()]
    if bias is not None:
        rows = rows + bias.double()[ids.reshape(-1)]
    products = rows * weights.double().reshape(-1, 1)
    return products.view(tokens, top_k, -1).sum(dim=1), products.abs().view(tokens, top_k, -1).sum(dim=1)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("bias", [True, False])
@pytest.mark.parametrize("tokens, top_k, hidden, experts", [(5, 4, 40, 6), (1, 2, 1100, 3), (9, 1, 17, 2)])
def test_combine_and_its_twin_are_within_rounding_of_the_oracle(dtype, bias, tokens, top_k, hidden, experts):
    g = gen("combine", dtype, bias, tokens, top_k, hidden, experts)
    ids = torch.randint(0, experts, (tokens, top_k), generator=g)
    order, _, _ = sort_by_expert(ids.reshape(-1), experts)
    position = torch.empty(tokens * top_k, dtype=torch.long)
    position[order.long()] = torch.arange(tokens * top_k)
    down = torch.randn((tokens * top_k, hidden), generator=g).to(dtype)
    b = torch.randn((experts, hidden), generator=g).to(dtype) if bias else None
    weights = torch.softmax(torch.randn((tokens, top_k), generator=g), dim=-1)
    args = [t.to(DEVICE) if t is not None else None for t in (down, position, b, ids, weights)]
    exact, magnitude = combine_oracle(*args)
    for got in (combine_triton(*args), combine_reference(*args)):
        assert got.shape == (tokens, hidden) and got.dtype == dtype
        assert_rounded(got, exact, (top_k + 2) * 2.0**-23 * magnitude)


def test_combine_puts_each_pair_back_on_its_own_token():
    """Exact integers: token t's output is the sum over its pairs of (its sorted row + its expert's bias) times its
    weight; a position or weight read for another pair gives other integers."""
    ids = torch.tensor([[2, 0], [1, 2], [0, 1]])
    order, _, _ = sort_by_expert(ids.reshape(-1), 3)
    position = torch.empty(6, dtype=torch.long)
    position[order.long()] = torch.arange(6)
    pair_values = torch.arange(6, dtype=torch.float32)[:, None] * 10 + torch.arange(3, dtype=torch.float32)
    down = pair_values[order.long()]  # sorted rows: pair s's values at its sorted place
    bias = torch.tensor([[100.0, 0, 0], [200.0, 0, 0], [300.0, 0, 0]])
    weights = torch.tensor([[1.0, 2.0], [3.0, 1.0], [2.0, 2.0]])
    got = combine_triton(*(t.to(DEVICE) for t in (down, position, bias, ids, weights)))
    want = torch.stack([sum((pair_values[2 * t + j] + bias[ids[t, j]]) * weights[t, j] for j in range(2))
                        for t in range(3)])
    assert torch.equal(got.cpu(), want)


@pytest.mark.parametrize("transposed", [True, False])
def test_grouped_matmul_multiplies_each_experts_rows_by_its_weights(transposed):
    """Rows sorted by expert, one expert with no rows: each block of rows times its own expert's weights (the
    reference on the CPU; torch's grouped GEMM on a GPU in bf16 at aligned sizes)."""
    g = gen("grouped_matmul", transposed)
    experts, k_in, n_out = 4, 32, 48
    ids = torch.tensor([0, 0, 2, 2, 2, 3, 0, 3, 2])
    order, counts, starts = sort_by_expert(ids, experts)
    x = torch.randn((ids.numel(), k_in), generator=g)[order.long()]
    weight = torch.randn((experts, k_in, n_out) if transposed else (experts, n_out, k_in), generator=g)
    dtype = torch.bfloat16 if DEVICE.type == "cuda" else torch.float32
    x, weight, ends = x.to(DEVICE, dtype), weight.to(DEVICE, dtype), (starts + counts).to(DEVICE)
    got = grouped_matmul(x, weight, ends, transposed)
    w = weight.double() if transposed else weight.double().transpose(1, 2)
    exact = torch.cat([x[i:i + 1].double() @ w[int(e)] for i, e in enumerate(ids[order.long()])])
    magnitude = torch.cat([x[i:i + 1].double().abs() @ w[int(e)].abs() for i, e in enumerate(ids[order.long()])])
    assert grouped_matmul_runs(x, w.to(dtype)) == (DEVICE.type == "cuda")
    assert_rounded(got, exact, (k_in + 2) * 2.0**-23 * magnitude)
    twin = grouped_matmul_reference(x, w.to(dtype), ends)
    assert_rounded(twin, exact, (k_in + 2) * 2.0**-23 * magnitude)
