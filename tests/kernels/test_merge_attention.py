"""``kernels/merge_attention``: two attention outputs over disjoint key sets, merged by their log-sum-exps, against
the float64 attention over all keys (the oracle never calls the function under test).

Each part's output is computed in float64 and rounded to the 16-bit dtype, as cuDNN returns it; the merged value may
then differ from the exact attention by each part's rounding (weighted) plus the final rounding, which is the bound
checked element by element. Cases: a chunk after a prefix (the split the attention module makes: keys before the
chunk, no mask; the chunk's own keys, causal), arbitrary disjoint key sets, rows with no key on one side or on
either, outputs in the projection's transposed layout, log-sum-exps as [B, H, L] or [B, H, L, 1].
"""

import pytest
import torch

from tests.kernels.kernel_utils import DEVICE, gen

pytest.importorskip("triton")

from hf_rocketkv.kernels.merge_attention import (  # noqa: E402
    merge_attention_torch,
    merge_attention_triton,
    merge_supported,
)

pytestmark = pytest.mark.gpu  # compiled for the GPU where one is present (pytest -m gpu); interpreted on CPU

UNIT_ROUNDOFF = {torch.bfloat16: 2.0**-8, torch.float16: 2.0**-11}


def part(q, k, v, allowed, scale):
    """Exact attention of ``q`` [B, H, L, D] over the keys ``allowed`` [L, K] marks: (output, log-sum-exp [B, H, L]);
    a row with no allowed key gets output 0 and log-sum-exp -inf."""
    logits = (q @ k.transpose(-1, -2)) * scale
    logits = logits.masked_fill(~allowed, float("-inf"))
    lse = torch.logsumexp(logits, dim=-1)
    weights = torch.exp(logits - torch.where(lse == float("-inf"), 0.0, lse)[..., None])
    return weights @ v, lse


def split_case(batch, heads, queries, keys, head_dim, g, allowed_a=None):
    """Float64 q, k, v and a split of the keys: by default the chunk's split (the first ``keys - queries`` keys with
    no mask, the last ``queries`` causal)."""
    q = torch.randn((batch, heads, queries, head_dim), generator=g, dtype=torch.float64)
    k = torch.randn((batch, heads, keys, head_dim), generator=g, dtype=torch.float64)
    v = torch.randn((batch, heads, keys, head_dim), generator=g, dtype=torch.float64) * 3
    if allowed_a is None:
        prefix = keys - queries
        column, row = torch.arange(keys), torch.arange(queries)
        allowed_a = (column[None, :] < prefix).expand(queries, keys)
        allowed_b = (column[None, :] >= prefix) & (column[None, :] <= prefix + row[:, None])
    else:
        allowed_b = ~allowed_a
    return q, k, v, allowed_a, allowed_b


def merged_inputs(q, k, v, allowed_a, allowed_b, dtype, scale=0.2, transposed=True, lse_4d=False):
    out_a, lse_a = part(q, k, v, allowed_a, scale)
    out_b, lse_b = part(q, k, v, allowed_b, scale)
    exact, _ = part(q, k, v, allowed_a | allowed_b, scale)

    def stored(out):  # 16-bit, in the [B, L, H, D] memory of the projection when transposed
        out = out.to(dtype)
        out = out.transpose(1, 2).contiguous().transpose(1, 2) if transposed else out.contiguous()
        return out.to(DEVICE)

    def lse(x):
        x = x.float()
        return (x[..., None] if lse_4d else x).to(DEVICE)

    return (stored(out_a), lse(lse_a), stored(out_b), lse(lse_b)), (out_a, lse_a, out_b, lse_b), exact


def assert_within_the_rounding_bound(got, exact_parts, exact, dtype):
    """|got - exact| <= u * (w_a |out_a| + w_b |out_b|) + u * |exact| (+ fp32 slack), element by element."""
    out_a, lse_a, out_b, lse_b = exact_parts
    top = torch.maximum(lse_a, lse_b)
    top = torch.where(top == float("-inf"), 0.0, top)
    w_a, w_b = torch.exp(lse_a - top), torch.exp(lse_b - top)
    total = torch.where(w_a + w_b == 0, 1.0, w_a + w_b)
    w_a, w_b = (w_a / total)[..., None], (w_b / total)[..., None]
    u = UNIT_ROUNDOFF[dtype]
    bound = 1.01 * u * (w_a * out_a.abs() + w_b * out_b.abs() + exact.abs()) + 1e-6
    got = got.double().cpu().transpose(1, 2)  # [B, L, H, D] -> [B, H, L, D]
    error = (got - exact).abs()
    assert bool((error <= bound).all()), f"max excess {float((error - bound).max())}"


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("shape", [(1, 8, 5, 40, 16), (2, 3, 7, 7, 8), (1, 12, 9, 33, 64), (2, 5, 1, 9, 48)])
def test_a_chunk_after_its_prefix_merges_to_the_whole_attention(shape, dtype):
    batch, heads, queries, keys, head_dim = shape
    g = gen("merge-chunk", shape, dtype)
    q, k, v, allowed_a, allowed_b = split_case(batch, heads, queries, keys, head_dim, g)
    args, exact_parts, exact = merged_inputs(q, k, v, allowed_a, allowed_b, dtype)
    assert merge_supported(args[0], args[2])
    got = merge_attention_triton(*args)
    assert got.shape == (batch, queries, heads, head_dim) and got.dtype == dtype and got.is_contiguous()
    assert_within_the_rounding_bound(got, exact_parts, exact, dtype)
    twin = merge_attention_torch(*args)
    assert_within_the_rounding_bound(twin, exact_parts, exact, dtype)
    spacing = torch.finfo(dtype).eps * twin.float().abs().clamp_min(2.0**-14)
    assert bool(((got.float() - twin.float()).abs() <= spacing).all())  # at most an ulp apart (exp, order)


def test_arbitrary_disjoint_key_sets_empty_rows_and_layouts():
    """Random disjoint key sets (some rows with every key on one side: -inf on the other), contiguous [B, H, L, D]
    outputs and [B, H, L, 1] log-sum-exps."""
    g = gen("merge-random")
    queries, keys = 6, 20
    allowed_a = torch.rand((queries, keys), generator=g) < 0.5
    allowed_a[0] = True  # row 0: every key in part a, none in b
    allowed_a[1] = False  # row 1: every key in part b
    q, k, v, allowed_a, allowed_b = split_case(2, 4, queries, keys, 32, g, allowed_a=allowed_a)
    args, exact_parts, exact = merged_inputs(q, k, v, allowed_a, allowed_b, torch.bfloat16, transposed=False,
                                             lse_4d=True)
    got = merge_attention_triton(*args)
    assert_within_the_rounding_bound(got, exact_parts, exact, torch.bfloat16)
    assert torch.equal(got[:, 0].transpose(0, 1), args[0][:, :, 0].transpose(0, 1))  # row 0 is part a's, exactly


def test_a_row_with_no_key_on_either_side_is_zero():
    g = gen("merge-empty")
    out = torch.randn((1, 2, 3, 8), generator=g).to(torch.bfloat16).to(DEVICE)
    lse = torch.full((1, 2, 3), float("-inf"), device=DEVICE)
    got = merge_attention_triton(out, lse, out, lse)
    assert torch.equal(got, torch.zeros_like(got))
    assert torch.equal(merge_attention_torch(out, lse, out, lse), torch.zeros_like(got))


def test_bad_log_sum_exps_are_refused_naming_them():
    out = torch.zeros((1, 2, 3, 8), dtype=torch.bfloat16, device=DEVICE)
    with pytest.raises(ValueError, match="log-sum-exp must be float32"):
        merge_attention_triton(out, torch.zeros((1, 2, 3), dtype=torch.bfloat16, device=DEVICE), out,
                               torch.zeros((1, 2, 3), device=DEVICE))
    with pytest.raises(ValueError, match=r"log-sum-exp must be float32 \[B, H, L\]"):
        merge_attention_torch(out, torch.zeros((1, 2, 4), device=DEVICE), out, torch.zeros((1, 2, 3), device=DEVICE))
    assert not merge_supported(out.float(), out.float()) and not merge_supported(out, out.half())
