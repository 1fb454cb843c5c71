"""A decoder layer's residual add and the RMSNorms around it in one launch, in bfloat16 and float16.

Why: a decoder layer adds each sublayer's output to its residual stream and normalizes the sum for the next sublayer:
in eager PyTorch one add and one norm launch (``kernels/rms_norm.py``), and Gemma 2/3 also normalize the sublayer's
output before the add (four norms and two adds per layer). Each is a pass over one row of hidden states: at batch 1
a few microseconds of a decode step each, 32 adds in a Llama-3.1-8B step, 96 adds and norms in a Gemma-3-12B one.

Shapes: ``x`` (the sublayer's output) and ``residual`` [..., H] in one dtype (the leading dimensions are rows, one
program each; H up to ``rms_norm.MAX_HIDDEN``); ``pre`` / ``post``: ``(weight [H] in x's dtype, eps)`` or None.
Returns ``(summed, normed)``, both [..., H] in x's dtype and contiguous (``normed`` None without ``post``):

    a      = x                                  without pre
             rms_norm(x, *pre, formula)         with pre (Gemma's post_attention / post_feedforward norms)
    summed = residual + a                       the next residual stream
    normed = rms_norm(summed, *post, formula)   with post (the next sublayer's input norm)

``formula`` is one of ``rms_norm.FORMULAS`` and each norm rounds where that formula does (within one unit in the
last place of eager PyTorch, ``kernels/rms_norm.py``). The add is eager PyTorch's: both operands in fp32, one rounding
to x's dtype, bit for bit.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ._triton_common import next_pow2, round_to
from .launch import TritonLaunch, direct_launches
from .rms_norm import FORMULAS, NORM_DTYPES, Norm, normalized, rms_norm_reference, rms_norm_supported, warps_for


@triton.jit
def _residual_norm_kernel(x_ptr, r_ptr, pre_ptr, post_ptr, sum_ptr, out_ptr, s_xr, s_rr, hidden, pre_eps,
                          post_eps, DT: tl.constexpr, BLOCK: tl.constexpr, FORMULA: tl.constexpr,
                          PRE: tl.constexpr, POST: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK)
    ok = cols < hidden
    a = tl.load(x_ptr + row * s_xr + cols, mask=ok, other=0.0).to(tl.float32)
    if PRE:
        a = normalized(a, tl.load(pre_ptr + cols, mask=ok, other=0.0).to(tl.float32), hidden, pre_eps, DT, FORMULA)
    r = tl.load(r_ptr + row * s_rr + cols, mask=ok, other=0.0).to(tl.float32)
    summed = round_to(r + a, DT)  # eager PyTorch's add: fp32 operands, one rounding
    tl.store(sum_ptr + row * hidden + cols, summed.to(sum_ptr.dtype.element_ty), mask=ok)
    if POST:
        w = tl.load(post_ptr + cols, mask=ok, other=0.0).to(tl.float32)
        out = normalized(summed, w, hidden, post_eps, DT, FORMULA)
        tl.store(out_ptr + row * hidden + cols, out.to(out_ptr.dtype.element_ty), mask=ok)


_residual_norm_launch = TritonLaunch(_residual_norm_kernel)


def residual_norm_supported(x: torch.Tensor, residual: torch.Tensor, pre: Norm | None = None,
                            post: Norm | None = None) -> bool:
    """Whether ``residual_norm_triton`` applies: ``rms_norm_supported`` for x with each given weight (the first
    one's when neither is given), and a residual of x's shape, dtype and device with a contiguous last dimension."""
    weights = [norm[0] for norm in (pre, post) if norm is not None]
    if not all(rms_norm_supported(x, weight) for weight in weights or [x.new_empty(x.shape[-1:])]):
        return False
    return (type(residual) is torch.Tensor and residual.shape == x.shape and residual.dtype == x.dtype
            and residual.device == x.device and (residual.stride(-1) == 1 or x.shape[-1] == 1))


def residual_norm_reference(x: torch.Tensor, residual: torch.Tensor, formula: str = "llama",
                            pre: Norm | None = None, post: Norm | None = None
                            ) -> tuple[torch.Tensor, torch.Tensor | None]:
    """PyTorch twin: the module docstring's steps in eager PyTorch (``rms_norm_reference`` for each norm)."""
    a = x if pre is None else rms_norm_reference(x, pre[0], pre[1], formula)
    summed = residual + a
    return summed, (None if post is None else rms_norm_reference(summed, post[0], post[1], formula))


def _rows(t: torch.Tensor, rows: int, hidden: int) -> torch.Tensor:
    t2 = t.reshape(rows, hidden)  # a view for the usual [B, 1, H] activations; a copy only for odd leading strides
    return t2 if t2.stride(-1) == 1 else t2.contiguous()


def residual_norm_triton(x: torch.Tensor, residual: torch.Tensor, formula: str = "llama", pre: Norm | None = None,
                         post: Norm | None = None) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Same contract as ``residual_norm_reference`` (``residual_norm_supported`` must hold)."""
    hidden = x.shape[-1]
    summed = torch.empty(x.shape, dtype=x.dtype, device=x.device)
    normed = torch.empty_like(summed) if post is not None else None
    rows = summed.numel() // hidden
    if rows == 0:
        return summed, normed
    x2, r2 = _rows(x, rows, hidden), _rows(residual, rows, hidden)
    block = next_pow2(hidden)
    pre_weight, pre_eps = pre if pre is not None else (summed, 0.0)  # unread placeholders when absent
    post_weight, post_eps = post if post is not None else (summed, 0.0)
    with direct_launches():
        _residual_norm_launch[(rows,)](
            x2, r2, pre_weight, post_weight, summed, normed if normed is not None else summed, x2.stride(0),
            r2.stride(0), hidden, float(pre_eps), float(post_eps), DT=NORM_DTYPES[x.dtype], BLOCK=block,
            FORMULA=FORMULAS[formula], PRE=pre is not None, POST=post is not None, num_warps=warps_for(block),
        )
    return summed, normed
