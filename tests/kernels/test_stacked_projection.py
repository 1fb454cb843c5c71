"""``kernels/stacked_projection.stacked_projection_triton`` against a float64 oracle and its torch twin.

Each output is ``x @ w.T`` rounded once to the dtype. The kernel sums in fp32 in another order than float64, so an
output near a rounding boundary may land one unit in the last place away, or, near zero, by the fp32 sums' error
(at most ``hidden * 2^-24 * |x| |W|``); such flips are rare. The twin (``F.linear`` per weight, as transformers'
modules run them) is held to the same bound, so the bound is not looser for the kernel than cuBLAS already is.
"""

import pytest
import torch

from tests.kernels.kernel_utils import DEVICE, gen, spacing

pytest.importorskip("triton")

from hf_rocketkv.kernels import stacked_projection as sp  # noqa: E402
from hf_rocketkv.kernels.stacked_projection import (  # noqa: E402
    MAX_ROWS,
    stacked_projection_reference,
    stacked_projection_supported,
    stacked_projection_triton,
)

pytestmark = pytest.mark.gpu  # compiled for the GPU where one is present (pytest -m gpu); interpreted on CPU


def inputs(rows, hidden, outs, dtype, key):
    g = gen("stacked_projection", *key)
    x = (torch.randn((rows, hidden), generator=g) * 2).to(dtype)
    weights = tuple((torch.randn((n, hidden), generator=g) / hidden ** 0.5).to(dtype) for n in outs)
    return x.to(DEVICE), tuple(w.to(DEVICE) for w in weights)


def assert_within_one_rounding(result, x, weight):
    dtype, hidden = x.dtype, x.shape[-1]
    x64, w64 = x.cpu().double().reshape(-1, hidden), weight.cpu().double()
    exact = (x64 @ w64.T).to(dtype).double()
    bound = spacing(exact, dtype) + hidden * 2.0**-24 * (x64.abs() @ w64.abs().T)
    got = result.cpu().double().reshape(exact.shape)
    error = (got - exact).abs()
    assert bool((error <= bound).all()), float((error - bound).max())
    assert int((got != exact).sum()) <= max(3, 0.05 * exact.numel())  # flips are rare, not an offset


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("rows, hidden, outs", [
    (1, 256, (128, 32, 32)),   # q / k / v of a GQA layer (4 query heads per KV head)
    (3, 200, (70, 70, 70)),    # MHA, a hidden size no tile divides, output widths no tile divides
    (16, 128, (64, 16)),       # two weights
    (17, 96, (40,)),           # one weight
    (33, 64, (96, 8, 8)),      # 8 of 32 columns in a tile
    (64, 136, (48, 24, 24)),   # the most rows the kernel takes
])
def test_each_output_is_within_one_rounding_of_the_float64_oracle(rows, hidden, outs, dtype):
    x, weights = inputs(rows, hidden, outs, dtype, (rows, hidden, outs, dtype))
    assert stacked_projection_supported(x, weights)
    got = stacked_projection_triton(x, weights)
    twin = stacked_projection_reference(x, weights)
    assert len(got) == len(weights)
    for out, ref, weight in zip(got, twin, weights):
        assert out.shape == (rows, weight.shape[0]) and out.dtype == dtype and out.is_contiguous()
        assert_within_one_rounding(out, x, weight)
        assert_within_one_rounding(ref, x, weight)


def test_each_weight_lands_in_its_own_output():
    """Weights that differ only by a sign and a scale: a program writing another weight's columns, or reading
    another weight's rows, shows at once (the outputs are exact multiples of each other)."""
    x, (w,) = inputs(5, 64, (32,), torch.float16, ("own",))
    got = stacked_projection_triton(x, (w, -w, (2 * w)[:16]))
    assert torch.equal(got[1], -got[0])
    assert torch.equal(got[2], 2 * got[0][:, :16])


def test_leading_dimensions_are_rows_and_strided_rows_are_read_in_place():
    x, weights = inputs(6, 64, (48, 16, 16), torch.bfloat16, ("3d",))
    wide = torch.zeros((6, 96), dtype=x.dtype, device=x.device)
    wide[:, :64] = x
    got = stacked_projection_triton(wide[:, :64].reshape(2, 3, 64), weights)
    flat = stacked_projection_triton(x, weights)
    for out, ref in zip(got, flat):
        assert out.shape == (2, 3, ref.shape[1])
        assert torch.equal(out.reshape(ref.shape), ref)


def test_the_twin_is_transformers_own_projections():
    """The twin is ``q_proj(x), k_proj(x), v_proj(x)`` of transformers' Llama attention, bit for bit."""
    from transformers import LlamaConfig
    from transformers.models.llama.modeling_llama import LlamaAttention

    config = LlamaConfig(hidden_size=64, num_attention_heads=4, num_key_value_heads=2, head_dim=16)
    attention = LlamaAttention(config, layer_idx=0).to(torch.bfloat16)
    x = torch.randn((2, 3, 64), generator=gen("twin")).to(torch.bfloat16)
    with torch.no_grad():
        expected = (attention.q_proj(x), attention.k_proj(x), attention.v_proj(x))
        got = stacked_projection_reference(x, (attention.q_proj.weight, attention.k_proj.weight,
                                                attention.v_proj.weight))
    assert all(torch.equal(a, b) for a, b in zip(got, expected))


def test_what_the_kernel_does_not_take(monkeypatch):
    x, weights = inputs(4, 64, (32, 16, 16), torch.bfloat16, ("refusals",))
    assert stacked_projection_supported(x, weights)
    assert not stacked_projection_supported(x.float(), tuple(w.float() for w in weights))  # fp32: cuBLAS's
    assert not stacked_projection_supported(x, (weights[0].half(), *weights[1:]))  # mixed dtypes
    assert not stacked_projection_supported(x.new_zeros((MAX_ROWS + 1, 64)), weights)  # a prefill chunk
    assert not stacked_projection_supported(x[:0], weights)  # no rows
    assert not stacked_projection_supported(x[:, :32], weights)  # in-features of another size
    assert not stacked_projection_supported(x, (weights[0].t().contiguous().t(),))  # weight rows not contiguous
    assert not stacked_projection_supported(x, (weights[0][None],))  # not a matrix
    assert not stacked_projection_supported(x, ())  # no weight
    assert not stacked_projection_supported(x, weights + weights[:1])  # more than three
    if DEVICE.type == "cpu":
        monkeypatch.setattr(sp, "interpreting", lambda: False)
        assert not stacked_projection_supported(x, weights)  # a CPU tensor needs the interpreter
