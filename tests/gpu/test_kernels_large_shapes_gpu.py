"""The Triton decode and prefill ops, compiled for the GPU, against their PyTorch references at Llama-3.1-8B shapes
(32 query heads, 8 KV heads, head_dim 128, bf16) and long contexts, where the kernel tests' small shapes never go:
many pages per head, several splits per head, ragged rows with partial last pages.

Compared: the KT page summaries (build and one decode update) bit for bit; page scores within 1e-4 relative (where
the top-r channel set is unambiguous); the selected pages tie-tolerantly (same count, newest page in, no chosen page
worse than the reference's worst); sparse attention over the selected pages within 1e-2 relative (bf16 K/V); sparse
attention over EVERY page against SDPA's dense attention (the default launch and two tile shapes) within 1e-2; stage
1's window scores within 1e-4 with each query's row summing to one; and one whole decode step inside
``torch.compile(fullgraph=True)`` against eager (within 1e-2, the KT updated alike).
Shapes: batch 1 and 16 at 2,048 kept tokens (RocketKV's defaults), batch 4 at 32,768 and batch 1 at 100,000.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

HQ, HKV, D = 32, 8, 128
G = HQ // HKV
PAGE, TOPK, WINDOW = 4, 64, 32
SCALE = D**-0.5
SHAPES = [(1, 2048), (16, 2048), (4, 32768), (1, 100_000)]
SCORES_REL, ATTENTION_REL, WINDOW_REL = 1e-4, 1e-2, 1e-4


def rel_err(got: torch.Tensor, want: torch.Tensor) -> float:
    got, want = got.double(), want.double()
    return float((got - want).norm() / want.norm().clamp_min(1e-30))


def decode_inputs(batch: int, ctx: int, seed: int):
    """q ``[B, Hkv, G, D]``, K/V ``[B, Hkv, ctx + 256, D]`` and ragged lengths (row 0 full, others up to 37 short)."""
    gen = torch.Generator("cuda").manual_seed(seed)
    capacity = ctx + 256
    keys = torch.randn(batch, HKV, capacity, D, device="cuda", dtype=torch.bfloat16, generator=gen)
    values = torch.randn(batch, HKV, capacity, D, device="cuda", dtype=torch.bfloat16, generator=gen)
    lengths = ctx - torch.randint(0, 38, (batch,), device="cuda", generator=gen)
    lengths[0] = ctx
    q = torch.randn(batch, HKV, G, D, device="cuda", dtype=torch.bfloat16, generator=gen) * 2
    return q, keys, values, lengths


def channel_ties(q: torch.Tensor, kt_dtype: torch.dtype, topr: int) -> torch.Tensor:
    """``[B, Hkv]``: True where the group-summed |q| (rounded to the KT dtype, as both scorers round it) ties at the
    top-``topr`` boundary. There the channel set is ambiguous (torch.topk leaves the order of ties unspecified), so
    those (row, KV head) pairs are left out of the page-score comparison."""
    if topr >= q.shape[-1]:
        return torch.zeros(q.shape[:2], dtype=torch.bool, device=q.device)
    summed = q.to(kt_dtype).float().abs().sum(dim=2).sort(dim=-1, descending=True).values
    return summed[..., topr - 1] == summed[..., topr]


@pytest.fixture(scope="module")
def ops():
    from hf_rocketkv.kernels.triton_ops import TRITON_OPS

    return TRITON_OPS


@pytest.mark.parametrize("batch,ctx", SHAPES)
@pytest.mark.parametrize("kt_dtype", [torch.float8_e5m2, torch.bfloat16], ids=["kt_fp8", "kt_bf16"])
def test_decode_ops_match_their_references(ops, batch, ctx, kt_dtype):
    from hf_rocketkv.kernels.sparse_decode_attention import sparse_decode_attention_torch
    from hf_rocketkv.selection import stage2_pages as s2

    q, keys, values, lengths = decode_inputs(batch, ctx, seed=batch * ctx)
    kt = ops.build_kt(keys, lengths, PAGE, kt_dtype)
    kt_ref = s2.build_kt(keys, lengths, PAGE, kt_dtype)
    assert torch.equal(kt.float(), kt_ref.float()), "build_kt differs from its reference"

    key_new = torch.randn(batch, HKV, D, device="cuda", dtype=torch.bfloat16,
                          generator=torch.Generator("cuda").manual_seed(1))
    ops.update_kt(kt, key_new, lengths, PAGE)  # one decode step: the new key folded into its page's summary
    s2.update_kt(kt_ref, key_new, lengths, PAGE)
    assert torch.equal(kt.float(), kt_ref.float()), "update_kt differs from its reference"

    n_pages = s2.num_pages(lengths + 1, PAGE)
    for topr in (128,) if kt_dtype == torch.float8_e5m2 else (128, 64):
        probs = ops.page_scores(q, kt, n_pages, topr)
        probs_ref = s2.page_scores(q, kt_ref, n_pages, topr)
        clear = ~channel_ties(q, kt_dtype, topr)
        assert clear.float().mean() > 0.5, "too many channel ties to compare page scores"
        err = rel_err(probs[clear], probs_ref[clear])
        assert err < SCORES_REL, f"page_scores topr={topr}: {err:.2e}"

    idx, valid = ops.select_pages(probs_ref, n_pages, TOPK)
    ridx, rvalid = s2.select_pages(probs_ref, n_pages, TOPK)
    # tie-tolerant: the same number of pages, the newest page chosen, and every chosen page (the forced newest one
    # aside) scoring at least the reference's worst chosen page
    newest = (n_pages - 1)[:, None, None]
    worst = probs_ref.gather(-1, idx).masked_fill(~valid | (idx == newest), float("inf")).amin(-1)
    worst_ref = probs_ref.gather(-1, ridx).masked_fill(~rvalid | (ridx == newest), float("inf")).amin(-1)
    assert torch.equal(valid.sum(-1), rvalid.sum(-1)), "select_pages chose another number of pages"
    assert ((idx == newest) & valid).any(-1).all(), "select_pages left out the newest page"
    assert (worst >= worst_ref).all(), "select_pages chose a page scoring below the reference's choice"

    out = ops.sparse_decode_attention(q, keys, values, idx, valid, lengths + 1, PAGE, SCALE)
    out_ref = sparse_decode_attention_torch(q, keys, values, idx, valid, lengths + 1, PAGE, SCALE)
    assert rel_err(out, out_ref) < ATTENTION_REL, f"sparse_decode_attention: {rel_err(out, out_ref):.2e}"


@pytest.mark.parametrize("batch,ctx", SHAPES)
def test_attention_over_every_page_matches_sdpa(ops, batch, ctx):
    """A large budget: every page of the context selected, against SDPA's masked dense attention, for the default
    launch and two other tile shapes of the kernel."""
    from hf_rocketkv.kernels.sparse_decode_attention import sparse_decode_attention_launch
    from hf_rocketkv.selection import stage2_pages as s2

    q, keys, values, lengths = decode_inputs(batch, ctx, seed=batch * ctx + 1)
    capacity = keys.shape[2]
    all_pages = int(s2.num_pages(lengths, PAGE).max())
    idx = torch.arange(all_pages, device="cuda").expand(batch, HKV, all_pages).contiguous()
    valid = idx < s2.num_pages(lengths, PAGE)[:, None, None]
    mask = (torch.arange(capacity, device="cuda")[None, :] < lengths[:, None])[:, None, None, :]
    dense = F.scaled_dot_product_attention(q.reshape(batch, HQ, 1, D), keys, values, enable_gqa=True, attn_mask=mask,
                                           scale=SCALE).reshape(batch, HKV, G, D)
    launches = {
        "default": lambda: ops.sparse_decode_attention(q, keys, values, idx, valid, lengths, PAGE, SCALE),
        "n32w4s2": lambda: sparse_decode_attention_launch(q, keys, values, idx, valid, lengths, PAGE, SCALE,
                                                          block_n=32, num_warps=4, num_stages=2),
        "n64w4": lambda: sparse_decode_attention_launch(q, keys, values, idx, valid, lengths, PAGE, SCALE,
                                                        block_n=64, num_warps=4),
    }
    for name, launch in launches.items():
        err = rel_err(launch(), dense)
        assert err < ATTENTION_REL, f"{name}: {err:.2e} from SDPA"


@pytest.mark.parametrize("batch,ctx", SHAPES)
def test_window_scores_match_their_reference(ops, batch, ctx):
    from hf_rocketkv.selection import stage1_snapkv as s1

    gen = torch.Generator("cuda").manual_seed(batch * ctx + 2)
    keys = torch.randn(batch, HKV, ctx, D, device="cuda", dtype=torch.bfloat16, generator=gen)
    q = torch.randn(batch, HQ, WINDOW, D, device="cuda", dtype=torch.bfloat16, generator=gen) * 2
    start = torch.randint(0, max(ctx // 8, 1), (batch,), device="cuda", generator=gen)
    start[0] = 0
    end = torch.full((batch,), ctx, device="cuda")
    got = ops.window_scores(q, keys, start, end, SCALE)
    for b in range(batch):  # the reference materialises [Hq, w, N] fp32 logits: one row at a time
        want = s1.window_scores(q[b : b + 1], keys[b : b + 1], start[b : b + 1], end[b : b + 1], SCALE)
        assert rel_err(got[b : b + 1], want) < WINDOW_REL, f"row {b}: {rel_err(got[b : b + 1], want):.2e}"
    # each of the G x WINDOW queries of a KV head contributes a softmax row summing to one
    sums = got.sum(-1)
    assert torch.allclose(sums, torch.full_like(sums, G * WINDOW), rtol=1e-3)


def test_decode_step_compiles_without_graph_breaks_and_matches_eager(ops):
    from hf_rocketkv.selection import stage2_pages as s2

    q, keys, values, lengths = decode_inputs(2, 3000, seed=7)
    kt = ops.build_kt(keys, lengths, PAGE, torch.float8_e5m2)
    key_new = torch.randn(2, HKV, D, device="cuda", dtype=torch.bfloat16,
                          generator=torch.Generator("cuda").manual_seed(8))

    def step(kt, lengths):
        ops.update_kt(kt, key_new, lengths, PAGE)
        n_pages = s2.num_pages(lengths + 1, PAGE)
        probs = ops.page_scores(q, kt, n_pages, 96)
        idx, valid = ops.select_pages(probs, n_pages, TOPK)
        return ops.sparse_decode_attention(q, keys, values, idx, valid, lengths + 1, PAGE, SCALE)

    kt_eager = kt.clone()
    want = step(kt_eager, lengths)
    compiled = torch.compile(step, fullgraph=True)
    for _ in range(2):  # the second call runs the compiled graph without compiling again
        kt_compiled = kt.clone()
        got = compiled(kt_compiled, lengths)
    assert rel_err(got, want) < ATTENTION_REL, f"compiled step: {rel_err(got, want):.2e} from eager"
    assert torch.equal(kt_compiled.float(), kt_eager.float()), "the compiled step updated the KT differently"
