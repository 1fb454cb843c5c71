"""``kernels/expert_linear.expert_linear_triton`` and its torch twin against a float64 oracle.

The oracle multiplies each pair's token by its expert's weights in float64 with no rounding. The kernel sums the
products in fp32 and rounds once to the output dtype, so each output is within one unit roundoff of the dtype of the
exact value plus the fp32 summation's error (``K`` fp32 unit roundoffs of the sum of the products' magnitudes).
Shapes cover both weight layouts (gpt-oss' [E, in, out] and nn.Linear's [E, out, in]), with and without bias, pairs
reading one token row each or ``top_k`` pairs per row, repeated experts, and sizes that are not multiples of the
kernel's blocks.
"""

import pytest
import torch

from tests.kernels.kernel_utils import DEVICE, gen

pytest.importorskip("triton")

from hf_rocketkv.kernels.expert_linear import (  # noqa: E402
    expert_linear_reference,
    expert_linear_supported,
    expert_linear_triton,
)

pytestmark = pytest.mark.gpu  # compiled for the GPU where one is present (pytest -m gpu); interpreted on CPU

UNIT_ROUNDOFF = {torch.bfloat16: 2.0**-8, torch.float16: 2.0**-11, torch.float32: 2.0**-24}


def inputs(tokens, k_in, n_out, experts, pairs_per_token, transposed, bias, dtype, g):
    x = torch.randn((tokens, k_in), generator=g).to(dtype)
    shape = (experts, k_in, n_out) if transposed else (experts, n_out, k_in)
    weight = (torch.randn(shape, generator=g) / k_in**0.5).to(dtype)
    b = torch.randn((experts, n_out), generator=g).to(dtype) if bias else None
    ids = torch.randint(0, experts, (tokens * pairs_per_token,), generator=g)
    ids[0] = ids[-1]  # at least one expert read by two pairs
    return (x.to(DEVICE), weight.to(DEVICE), None if b is None else b.to(DEVICE), ids.to(DEVICE))


def oracle(x, weight, bias, ids, transposed, rows_per_x):
    """``(exact output, sum of |products| per output)`` in float64."""
    rows = x.double().repeat_interleave(rows_per_x, dim=0)
    w = weight.double()[ids]
    if not transposed:
        w = w.transpose(1, 2)
    exact = torch.einsum("sk,skn->sn", rows, w)
    magnitude = torch.einsum("sk,skn->sn", rows.abs(), w.abs())
    if bias is not None:
        exact = exact + bias.double()[ids]
        magnitude = magnitude + bias.double()[ids].abs()
    return exact, magnitude


def assert_near_oracle(got, x, weight, bias, ids, transposed, rows_per_x):
    exact, magnitude = oracle(x, weight, bias, ids, transposed, rows_per_x)
    k_in = x.shape[1]
    bound = UNIT_ROUNDOFF[got.dtype] * exact.abs() * 1.01 + (k_in + 2) * 2.0**-24 * magnitude + 1e-30
    error = (got.double() - exact).abs()
    assert bool((error <= bound).all()), f"max error over the bound by {float((error - bound).max())}"


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
@pytest.mark.parametrize("transposed", [True, False])
@pytest.mark.parametrize("bias", [True, False])
@pytest.mark.parametrize("schedule", ["pairs", "grouped"])
@pytest.mark.parametrize("tokens, pairs_per_token, k_in, n_out, experts", [
    (1, 4, 96, 80, 8),     # one decode token, top-4 (gpt-oss' shape, small)
    (3, 2, 70, 37, 5),     # sizes that are not multiples of any block
    (4, 1, 130, 129, 3),   # one pair per row (the down projection's call)
    (21, 2, 40, 70, 3),    # a batch: about 14 pairs per expert
    (24, 3, 33, 20, 2),    # more pairs per expert than one grouped block of rows (36 each)
])
def test_the_kernel_and_its_twin_are_within_rounding_of_the_oracle(dtype, transposed, bias, schedule, tokens,
                                                                   pairs_per_token, k_in, n_out, experts):
    g = gen("expert_linear", dtype, transposed, bias, tokens, pairs_per_token, k_in, n_out, experts)
    x, weight, b, ids = inputs(tokens, k_in, n_out, experts, pairs_per_token, transposed, bias, dtype, g)
    assert expert_linear_supported(x, weight, b)
    got = expert_linear_triton(x, weight, b, ids, transposed, rows_per_x=pairs_per_token, schedule=schedule)
    assert got.shape == (tokens * pairs_per_token, n_out) and got.dtype == dtype
    assert_near_oracle(got, x, weight, b, ids, transposed, pairs_per_token)
    twin = expert_linear_reference(x, weight, b, ids, transposed, rows_per_x=pairs_per_token)
    assert_near_oracle(twin, x, weight, b, ids, transposed, pairs_per_token)


def test_each_pair_reads_its_own_expert_and_token_row():
    """Exact small integers: pair ``s`` of token ``s // 2`` with expert ``ids[s]`` and that expert's bias, nothing
    of another pair (a stride or an index off by one gives other integers)."""
    experts, k_in, n_out = 3, 5, 4
    weight = torch.arange(experts * k_in * n_out, dtype=torch.float32).reshape(experts, k_in, n_out) % 7 - 3
    bias = torch.arange(experts * n_out, dtype=torch.float32).reshape(experts, n_out) * 10
    x = torch.tensor([[1.0, 0, 0, 0, 2], [0, 1, 0, 3, 0]])
    ids = torch.tensor([2, 0, 1, 2])
    x, weight, bias, ids = x.to(DEVICE), weight.to(DEVICE), bias.to(DEVICE), ids.to(DEVICE)
    want = torch.stack([x[s // 2] @ weight[int(ids[s])] + bias[int(ids[s])] for s in range(4)])
    for schedule in ("pairs", "grouped"):
        got = expert_linear_triton(x, weight, bias, ids, True, rows_per_x=2, schedule=schedule)
        assert torch.equal(got, want), schedule
        flipped = expert_linear_triton(x, weight.transpose(1, 2).contiguous(), bias, ids, False, rows_per_x=2,
                                       schedule=schedule)
        assert torch.equal(flipped, want), schedule


def test_the_grouped_schedule_skips_experts_no_pair_chose_and_keeps_pair_order():
    """Exact integers: 5 experts of which 2 are chosen (17 and 2 pairs, so one expert spans two blocks of rows);
    each output row is its own pair's product, in pair order, whatever the sort did."""
    experts, k_in, n_out = 5, 6, 3
    weight = (torch.arange(experts * k_in * n_out, dtype=torch.float32).reshape(experts, k_in, n_out) % 5 - 2)
    x = (torch.arange(19 * k_in, dtype=torch.float32).reshape(19, k_in) % 3 - 1)
    ids = torch.tensor([3] * 17 + [1, 1])
    ids = ids[torch.randperm(19, generator=torch.Generator().manual_seed(0))]
    x, weight, ids = x.to(DEVICE), weight.to(DEVICE), ids.to(DEVICE)
    got = expert_linear_triton(x, weight, None, ids, True, schedule="grouped")
    want = torch.stack([x[s] @ weight[int(ids[s])] for s in range(19)])
    assert torch.equal(got, want)


def test_auto_groups_exactly_when_the_pairs_outnumber_the_experts(monkeypatch):
    import hf_rocketkv.kernels.expert_linear as module

    grouped = []
    real = module._grouped
    monkeypatch.setattr(module, "_grouped", lambda *a: grouped.append(1) or real(*a))
    x = torch.randn((9, 16)).to(DEVICE)
    weight = torch.randn((8, 16, 16)).to(DEVICE)
    for pairs, expected in ((8, 0), (9, 1)):
        grouped.clear()
        ids = torch.arange(pairs, device=DEVICE) % 8
        expert_linear_triton(x, weight, None, ids, True)
        assert len(grouped) == expected, pairs
    with pytest.raises(ValueError, match="schedule must be one of"):
        expert_linear_triton(x, weight, None, ids, True, schedule="sorted")


def test_no_pairs_give_an_empty_output():
    x = torch.randn((0, 8)).to(DEVICE)
    weight = torch.randn((2, 8, 6)).to(DEVICE)
    assert expert_linear_triton(x, weight, None, torch.zeros(0, dtype=torch.long, device=DEVICE), True).shape == (0, 6)


def test_supported_refuses_what_the_kernel_does_not_read():
    x = torch.randn((2, 8), dtype=torch.bfloat16).to(DEVICE)
    weight = torch.randn((3, 8, 6), dtype=torch.bfloat16).to(DEVICE)
    bias = torch.randn((3, 6), dtype=torch.bfloat16).to(DEVICE)
    assert expert_linear_supported(x, weight, bias)
    assert not expert_linear_supported(x.float(), weight, bias)  # mixed dtypes
    assert not expert_linear_supported(x, weight, bias.float())
    assert not expert_linear_supported(x.t(), weight.transpose(1, 2), bias)  # a strided last dimension
    assert not expert_linear_supported(x[None], weight, bias)  # 3-D hidden states
    assert not expert_linear_supported(x, weight[0], bias)  # one expert, 2-D
    assert not expert_linear_supported(x, weight, bias[:, None])
    assert not expert_linear_supported(x.to(torch.float64), weight.to(torch.float64), None)
