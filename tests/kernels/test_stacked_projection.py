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


# --------------------------------------------------------------------------------------------------- rotated
def rotary_inputs(batch, tokens, head_dim, dtype, g, shared=False):
    """cos, sin [B or 1, T, D] as LlamaRotaryEmbedding makes them, exact zeros in the first column."""
    inv_freq = 1.0 / (10000 ** (torch.arange(0, head_dim, 2).float() / head_dim))
    positions = torch.randint(0, 40000, (1 if shared else batch, tokens), generator=g).float()
    emb = torch.cat([positions[..., None] * inv_freq] * 2, dim=-1)
    cos, sin = emb.cos(), emb.sin()
    cos[..., 0] = 0.0
    return cos.to(dtype).to(DEVICE), sin.to(dtype).to(DEVICE)


def rotate64(out, cos, sin, batch, tokens, head_dim, sign=-1.0):
    """Float64 rotation of ``out`` [B, T, H * D] (values exact in float64), per transformers' formula; ``sign=1`` on
    absolute values gives each rotated value's ``|p1 c| + |p2 s|``."""
    x = out.double().view(batch, tokens, -1, head_dim)
    c, s = cos.cpu().double()[:, :, None, :], sin.cpu().double()[:, :, None, :]
    half = head_dim // 2
    return (x * c + torch.cat((sign * x[..., half:], x[..., :half]), dim=-1) * s).reshape(batch, tokens, -1)


ROTARY_SHAPES = [  # (batch, tokens, hidden, query heads, KV heads, head_dim)
    (1, 1, 256, 4, 2, 64),     # a decode step of a GQA layer
    (4, 1, 128, 2, 1, 128),    # a batched decode step, the Llama-3 head size
    (2, 3, 200, 3, 3, 48),     # tokens per row, MHA, half a head (24) that no half tile (16) divides
    (3, 5, 96, 5, 1, 40),      # rows across the row block, a half-head of 20
    (2, 32, 64, 2, 1, 16),     # 64 rows, a head smaller than the tile
]


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("shape", ROTARY_SHAPES)
@pytest.mark.parametrize("shared", [False, True], ids=["cos-per-row", "cos-broadcast"])
def test_rotated_outputs_are_transformers_rope_of_the_projection(shape, dtype, shared):
    """With ``rotary``, q and k are transformers' ``apply_rotary_pos_emb`` of the plain projection, bit for bit (the
    same fp32 sums, rounded once, then rotated with eager PyTorch's roundings), v untouched; and every rotated value
    is within a few units in the last place of the float64 rotation of the float64 projection."""
    from transformers.models.llama.modeling_llama import apply_rotary_pos_emb

    batch, tokens, hidden, hq, hkv, head_dim = shape
    g = gen("rotated", shape, dtype, shared)
    x = (torch.randn((batch, tokens, hidden), generator=g) * 2).to(dtype).to(DEVICE)
    weights = tuple((torch.randn((n * head_dim, hidden), generator=g) / hidden ** 0.5).to(dtype).to(DEVICE)
                    for n in (hq, hkv, hkv))
    cos, sin = rotary_inputs(batch, tokens, head_dim, dtype, g, shared)
    assert stacked_projection_supported(x, weights) and sp.rotary_supported(x, weights, cos, sin, head_dim)
    plain = stacked_projection_triton(x, weights)
    got = stacked_projection_triton(x, weights, rotary=(cos, sin, head_dim))
    views = [out.view(batch, tokens, -1, head_dim).transpose(1, 2) for out in plain[:2]]
    want_q, want_k = apply_rotary_pos_emb(*views, cos, sin)
    for out, want in zip(got[:2], (want_q, want_k)):
        assert out.shape == want.transpose(1, 2).reshape(batch, tokens, -1).shape
        flips = int((out.view(batch, tokens, -1, head_dim).transpose(1, 2) != want).sum())
        assert flips <= max(3, 0.01 * out.numel())  # the plain tile's sums; a different order may flip a rare value
    assert torch.equal(got[2], plain[2])
    twin = stacked_projection_reference(x, weights, (cos, sin, head_dim))
    for out, ref, weight in zip(got[:2], twin[:2], weights[:2]):
        exact = rotate64(x.cpu().double() @ weight.cpu().double().T, cos, sin, batch, tokens, head_dim)
        magnitude = rotate64(x.cpu().double().abs() @ weight.cpu().double().abs().T, cos.abs(), sin.abs(), batch,
                             tokens, head_dim, sign=1.0)  # bounds |p1 c| + |p2 s| from above
        bound = 4 * spacing(magnitude, dtype) + hidden * 2.0**-24 * magnitude
        for result in (out, ref):
            error = (result.cpu().double() - exact).abs()
            assert bool((error <= bound).all()), float((error - bound).max())


def test_a_rotated_tile_reads_its_own_head_and_position():
    """Heads whose weights differ by a sign, and rows at distinct positions: a tile that paired columns of two heads,
    or read another row's cos/sin, would break the sign relation or the per-row rotation."""
    head_dim, hidden = 32, 64
    g = gen("own-head")
    w = (torch.randn((head_dim, hidden), generator=g) / 8).to(torch.bfloat16)
    x = torch.randn((3, 1, hidden), generator=g).to(torch.bfloat16).to(DEVICE)
    q_weight = torch.cat([w, -w]).to(DEVICE)
    cos, sin = rotary_inputs(3, 1, head_dim, torch.bfloat16, g)
    q, k = stacked_projection_triton(x, (q_weight, w.to(DEVICE)), rotary=(cos, sin, head_dim))
    assert torch.equal(q[..., head_dim:], -q[..., :head_dim])  # rotation is linear and negation is exact
    assert torch.equal(q[..., :head_dim], k)
    for row in range(3):  # each row alone gives the same values: its own cos/sin were read
        alone = stacked_projection_triton(x[row:row + 1], (q_weight, w.to(DEVICE)),
                                          rotary=(cos[row:row + 1], sin[row:row + 1], head_dim))
        assert torch.equal(alone[0], q[row:row + 1])


def test_what_the_rotated_kernel_does_not_take():
    x, weights = inputs(4, 64, (32, 16, 16), torch.bfloat16, ("rotary-refusals",))
    x = x.view(2, 2, 64)
    cos, sin = rotary_inputs(2, 2, 16, torch.bfloat16, gen("rotary-refusals-cos"))
    assert sp.rotary_supported(x, weights, cos, sin, 16)
    assert not sp.rotary_supported(x.view(4, 64), weights, cos, sin, 16)  # rows without a token axis
    assert not sp.rotary_supported(x, weights[:1], cos, sin, 16)  # no key weight
    assert not sp.rotary_supported(x, weights, cos, sin, 12)  # widths not multiples of the head size
    assert not sp.rotary_supported(x, weights, cos[..., :8], sin[..., :8], 16)  # cos of another head size
    assert not sp.rotary_supported(x, weights, cos.float(), sin.float(), 16)  # another dtype
    assert not sp.rotary_supported(x, weights, cos[:, :1], sin[:, :1], 16)  # other tokens
    assert not sp.rotary_supported(x, weights, torch.cat([cos] * 2), torch.cat([sin] * 2), 16)  # another batch
    with pytest.raises(ValueError, match="BLOCK_C >= 32"):
        stacked_projection_triton(x, weights, tiles=(16, 16, 64, 4, 1), rotary=(cos, sin, 16))
