"""``kernels/rope.rope_triton`` against transformers' own ``apply_rotary_pos_emb``, bit for bit, in decode steps (one
token) and prefills (many tokens, cos/sin per token, broadcast over the batch or per row).

The oracle is the modeling code's function (``transformers.models.llama.modeling_llama``), called exactly as
LlamaAttention calls it, on the projection's transposed views; the values include signed zeros, ties of the 16-bit
rounding, fp16 subnormals and large magnitudes, where any difference in where a product or sum is rounded shows.
"""

import pytest
import torch
from transformers.models.llama.modeling_llama import apply_rotary_pos_emb

from tests.kernels.kernel_utils import DEVICE, gen
from tests.support.markers import slow_except

pytest.importorskip("triton")

from hf_rocketkv.kernels.rope import rope_supported, rope_torch, rope_triton  # noqa: E402

pytestmark = pytest.mark.gpu  # compiled for the GPU where one is present (pytest -m gpu); interpreted on CPU

SHAPES = [  # (batch, query heads, KV heads, head_dim)
    (1, 32, 8, 128),
    (3, 4, 2, 64),
    (2, 9, 3, 48),  # heads not a multiple of the program's 8, half-dim not a power of two
    (5, 2, 1, 8),
]
PREFILL_SHAPES = [  # (batch, query heads, KV heads, head_dim, tokens)
    (1, 32, 8, 128, 37),
    (2, 4, 2, 64, 5),
    (3, 9, 3, 48, 11),
]


def projected(batch, heads, head_dim, dtype, g, tokens=1):
    """A [B, H, T, D] view like ``q_proj(x).view(B, T, H, D).transpose(1, 2)``, with hard values mixed in."""
    x = torch.randn((batch, tokens, heads * head_dim), generator=g) * 4
    flat = x.view(-1)
    hard = torch.tensor([0.0, -0.0, 1e-30, -1e-30, 3.0e-6, -6.0e-8, 3.0e4, -3.0e4, 1.00390625, -1.01171875])
    flat[torch.randint(0, flat.numel(), (len(hard) * 3,), generator=g)] = hard.repeat(3)
    return x.to(dtype).to(DEVICE).view(batch, tokens, heads, head_dim).transpose(1, 2)


def rotary(batch, head_dim, dtype, g, positions=None, tokens=1):
    """cos, sin [B, T, D] as LlamaRotaryEmbedding makes them (frequencies repeated over both halves)."""
    inv_freq = 1.0 / (10000 ** (torch.arange(0, head_dim, 2).float() / head_dim))
    pos = torch.randint(0, 40000, (batch, tokens), generator=g).float() if positions is None else positions
    emb = torch.cat([pos[..., None] * inv_freq] * 2, dim=-1)
    cos, sin = emb.cos(), emb.sin()
    cos[..., 0] = 0.0  # exact zeros meet the signed-zero cases
    return cos.to(dtype).to(DEVICE), sin.to(dtype).to(DEVICE)


def bits(t):
    return t.view(torch.int16) if t.element_size() == 2 else t.view(torch.int32)


def assert_matches_transformers(q, k, cos, sin, kernel_cos=None, kernel_sin=None):
    """The kernel's q and k equal transformers' own function bit for bit (optionally fed other cos/sin views)."""
    want_q, want_k = apply_rotary_pos_emb(q, k, cos, sin)
    got_q, got_k = rope_triton(q, k, cos if kernel_cos is None else kernel_cos,
                               sin if kernel_sin is None else kernel_sin)
    assert got_q.shape == want_q.shape and got_k.shape == want_k.shape
    assert torch.equal(bits(got_q), bits(want_q))
    assert torch.equal(bits(got_k), bits(want_k))
    return want_q, want_k


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("shape", SHAPES)
def test_rope_decode_equals_transformers_bit_for_bit(shape, dtype):
    batch, hq, hkv, head_dim = shape
    g = gen("rope", shape, dtype)
    q, k = projected(batch, hq, head_dim, dtype, g), projected(batch, hkv, head_dim, dtype, g)
    cos, sin = rotary(batch, head_dim, dtype, g)
    assert rope_supported(q, k, cos, sin)
    want_q, want_k = assert_matches_transformers(q, k, cos, sin)
    twin_q, twin_k = rope_torch(q, k, cos, sin)
    assert torch.equal(bits(twin_q), bits(want_q)) and torch.equal(bits(twin_k), bits(want_k))


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("shape", slow_except(PREFILL_SHAPES, keep=[PREFILL_SHAPES[1]]))  # the others: 7-45 s each
@pytest.mark.parametrize("cos_rows", ["per_row", "broadcast"])
def test_rope_prefill_equals_transformers_bit_for_bit(shape, dtype, cos_rows):
    """Many tokens per row, each with its own position (a left-padded batch's per-row positions, or one row of
    positions for every row as an unpadded prefill's rotary embedding makes them)."""
    batch, hq, hkv, head_dim, tokens = shape
    g = gen("rope-prefill", shape, dtype, cos_rows)
    q, k = projected(batch, hq, head_dim, dtype, g, tokens), projected(batch, hkv, head_dim, dtype, g, tokens)
    cos, sin = rotary(batch if cos_rows == "per_row" else 1, head_dim, dtype, g, tokens=tokens)
    assert rope_supported(q, k, cos, sin)
    want_q, want_k = assert_matches_transformers(q, k, cos, sin)
    got_q, _ = rope_triton(q, k, cos, sin)
    assert got_q.transpose(1, 2).is_contiguous()  # the projection's [B, T, H, D] layout, as attention reads it
    twin_q, twin_k = rope_torch(q, k, cos, sin)
    assert torch.equal(bits(twin_q), bits(want_q)) and torch.equal(bits(twin_k), bits(want_k))


def test_rope_reads_contiguous_query_and_key_too():
    """[B, H, T, D] tensors laid out head-major (a caller that made them contiguous) give the same values."""
    g = gen("rope-contiguous")
    q = projected(2, 4, 32, torch.bfloat16, g, tokens=6).contiguous()
    k = projected(2, 2, 32, torch.bfloat16, g, tokens=6).contiguous()
    cos, sin = rotary(2, 32, torch.bfloat16, g, tokens=6)
    assert_matches_transformers(q, k, cos, sin)


def test_rope_decode_broadcasts_one_position_row_over_the_batch():
    g = gen("rope-broadcast")
    q, k = projected(4, 8, 64, torch.bfloat16, g), projected(4, 2, 64, torch.bfloat16, g)
    cos, sin = rotary(1, 64, torch.bfloat16, g)
    assert rope_supported(q, k, cos, sin)
    assert_matches_transformers(q, k, cos, sin)


def test_rope_decode_reads_cos_and_sin_of_different_strides():
    g = gen("rope-strides")
    q, k = projected(2, 4, 32, torch.float16, g), projected(2, 2, 32, torch.float16, g)
    cos, sin = rotary(2, 32, torch.float16, g)
    wide = torch.zeros((2, 1, 64), dtype=sin.dtype, device=sin.device)
    wide[..., ::2] = sin
    sin_strided = wide[..., ::2]
    assert sin_strided.stride() != cos.stride()
    assert_matches_transformers(q, k, cos, sin, kernel_sin=sin_strided)


@pytest.mark.parametrize(
    "change",
    ["fp32", "kv_tokens", "cos_tokens", "odd_dim", "cos_dtype", "cos_rows", "cos_4d"],
)
def test_rope_supported_refuses_what_it_cannot_do_exactly(change):
    g = gen("rope-refuse", change)
    dtype = torch.float32 if change == "fp32" else torch.bfloat16
    head_dim = 7 if change == "odd_dim" else 16
    q, k = projected(2, 4, head_dim, dtype, g), projected(2, 2, head_dim, dtype, g)
    cos, sin = rotary(2, head_dim, dtype, g)
    if change == "kv_tokens":
        k = torch.cat([k, k], dim=2)
    if change == "cos_tokens":
        q, k = torch.cat([q, q], dim=2), torch.cat([k, k], dim=2)
    if change == "cos_dtype":
        cos = cos.float()
    if change == "cos_rows":
        cos, sin = cos[:1].expand(3, 1, head_dim), sin[:1].expand(3, 1, head_dim)
    if change == "cos_4d":
        cos, sin = cos[:, None], sin[:, None]
    assert not rope_supported(q, k, cos, sin)


def test_rope_launches_directly_not_through_wrap_triton(monkeypatch):
    """An eager launch through torch's wrap_triton op cost ~300 us of host time per call on an H200 (measured): the
    launcher turns it off as a triton_op's own eager implementation does."""
    from hf_rocketkv.kernels import launch

    def refuse(kernel):
        raise AssertionError("launched through wrap_triton")

    monkeypatch.setattr(launch, "wrap_triton", refuse)
    g = gen("rope-direct")
    q, k = projected(1, 4, 16, torch.bfloat16, g), projected(1, 2, 16, torch.bfloat16, g)
    cos, sin = rotary(1, 16, torch.bfloat16, g)
    got_q, _ = rope_triton(q, k, cos, sin)
    assert torch.equal(bits(got_q), bits(apply_rotary_pos_emb(q, k, cos, sin)[0]))
