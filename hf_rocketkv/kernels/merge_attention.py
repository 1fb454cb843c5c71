"""Two attention outputs over disjoint sets of keys, merged by their log-sum-exps into the attention over all keys.

Why: a chunk of a chunked prefill (or a prefix hit's new tokens) attends causally to the last of its keys: query j of
``L`` sees keys ``<= P + j`` of ``P + L``. PyTorch runs that lower-right causal mask only through its own flash
attention kernel, while cuDNN's, about twice as fast on an H100 (``integration/attention.py``), takes no mask or an
upper-left causal one. So the chunk's queries attend to the ``P`` keys before it (no mask) and to its own ``L`` keys
(causal, square) in two cuDNN calls that also return each row's log-sum-exp, and this kernel merges the two in one
pass, writing the ``[B, L, H, D]`` layout the attention module reads next.

Shapes (B batch, H query heads, L queries, D head dim):
    out_a, out_b: [B, H, L, D] any strides, bfloat16 or float16 (the same dtype)
    lse_a, lse_b: [B, H, L] or [B, H, L, 1], float32: each row's ``log(sum(exp(scaled logits)))``, natural log
    returns       [B, L, H, D] contiguous, in out_a's dtype

Formula (per row, ``m = max(lse_a, lse_b)``): ``(out_a * exp(lse_a - m) + out_b * exp(lse_b - m)) / (exp(lse_a - m)
+ exp(lse_b - m))`` in fp32, rounded once to the output dtype (``round_to``: the same on every backend). A row with
no key in either part (both -inf) gives zeros. The inputs are already rounded attention outputs, so the result is
within about one unit in the last place of the dtype of the attention over all keys (``tests/kernels/
test_merge_attention.py`` bounds it against a float64 oracle).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ._triton_common import DT_BF16, DT_FP16, cdiv, next_pow2, round_to
from .launch import TritonLaunch, direct_launches

HEADS_PER_PROGRAM = 8
MERGE_DTYPES = {torch.bfloat16: DT_BF16, torch.float16: DT_FP16}


# ``queries`` unspecialised: one compiled kernel for every chunk length (not one per divisibility by 16)
@triton.jit(do_not_specialize=["queries"])
def _merge_kernel(a_ptr, b_ptr, la_ptr, lb_ptr, out_ptr,
                  s_ab, s_ah, s_al, s_ad, s_bb, s_bh, s_bl, s_bd,
                  s_lab, s_lah, s_lal, s_lbb, s_lbh, s_lbl,
                  queries, heads, head_dim,
                  DT: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_D: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)  # b * queries + l: the output's row of [B * L, H, D]
    b = row // queries
    q = row % queries
    h = (tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)).to(tl.int64)
    d = tl.arange(0, BLOCK_D)
    h_ok = h < heads
    ok = h_ok[:, None] & (d < head_dim)[None, :]
    lse_a = tl.load(la_ptr + b * s_lab + h * s_lah + q * s_lal, mask=h_ok, other=float("-inf"))
    lse_b = tl.load(lb_ptr + b * s_lbb + h * s_lbh + q * s_lbl, mask=h_ok, other=float("-inf"))
    top = tl.maximum(lse_a, lse_b)
    top = tl.where(top == float("-inf"), 0.0, top)  # no key on either side: both weights 0
    w_a = tl.exp(lse_a - top)
    w_b = tl.exp(lse_b - top)
    total = w_a + w_b
    total = tl.where(total == 0.0, 1.0, total)
    x_a = tl.load(a_ptr + b * s_ab + h[:, None] * s_ah + q * s_al + d[None, :] * s_ad, mask=ok, other=0.0)
    x_b = tl.load(b_ptr + b * s_bb + h[:, None] * s_bh + q * s_bl + d[None, :] * s_bd, mask=ok, other=0.0)
    merged = (x_a.to(tl.float32) * (w_a / total)[:, None] + x_b.to(tl.float32) * (w_b / total)[:, None])
    out = round_to(merged, DT)
    tl.store(out_ptr + row * (heads * head_dim) + h[:, None] * head_dim + d[None, :],
             out.to(out_ptr.dtype.element_ty), mask=ok)  # exact: already rounded


_merge_launch = TritonLaunch(_merge_kernel)


def merge_supported(out_a: torch.Tensor, out_b: torch.Tensor) -> bool:
    """Whether ``merge_attention_triton`` takes these outputs: 16-bit, the same dtype, shape and device."""
    return (out_a.dtype in MERGE_DTYPES and out_b.dtype == out_a.dtype and out_a.dim() == 4
            and out_b.shape == out_a.shape and out_b.device == out_a.device)


def _rows(lse: torch.Tensor, shape) -> torch.Tensor:
    """[B, H, L] view of a [B, H, L] or [B, H, L, 1] log-sum-exp."""
    if lse.dim() == 4:
        lse = lse.squeeze(-1)
    if tuple(lse.shape) != tuple(shape[:3]) or lse.dtype != torch.float32:
        raise ValueError(f"merge_attention: log-sum-exp must be float32 [B, H, L] (or [B, H, L, 1]) for outputs "
                         f"{tuple(shape)}, got {lse.dtype} {tuple(lse.shape)}")
    return lse


def merge_attention_torch(out_a, lse_a, out_b, lse_b) -> torch.Tensor:
    """PyTorch twin: the formula of the module docstring in fp32, rounded once; returns [B, L, H, D]."""
    lse_a, lse_b = _rows(lse_a, out_a.shape), _rows(lse_b, out_a.shape)
    top = torch.maximum(lse_a, lse_b)
    top = torch.where(top == float("-inf"), torch.zeros_like(top), top)
    w_a, w_b = torch.exp(lse_a - top), torch.exp(lse_b - top)
    total = w_a + w_b
    total = torch.where(total == 0, torch.ones_like(total), total)
    merged = out_a.float() * (w_a / total)[..., None] + out_b.float() * (w_b / total)[..., None]
    return merged.to(out_a.dtype).transpose(1, 2).contiguous()


def merge_attention_triton(out_a, lse_a, out_b, lse_b) -> torch.Tensor:
    """Same contract as ``merge_attention_torch`` (``merge_supported`` must hold)."""
    batch, heads, queries, head_dim = out_a.shape
    lse_a, lse_b = _rows(lse_a, out_a.shape), _rows(lse_b, out_a.shape)
    out = torch.empty((batch, queries, heads, head_dim), dtype=out_a.dtype, device=out_a.device)
    if out.numel() == 0:
        return out
    with direct_launches():
        _merge_launch[(batch * queries, cdiv(heads, HEADS_PER_PROGRAM))](
            out_a, out_b, lse_a, lse_b, out,
            *out_a.stride(), *out_b.stride(), *lse_a.stride(), *lse_b.stride(),
            queries, heads, head_dim,
            DT=MERGE_DTYPES[out_a.dtype], BLOCK_H=HEADS_PER_PROGRAM, BLOCK_D=next_pow2(head_dim), num_warps=4,
        )
    return out
