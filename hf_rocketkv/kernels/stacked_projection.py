"""A decode step's projections of one input in one launch: ``x @ w.T`` for up to three weights (an attention layer's
``q_proj``, ``k_proj`` and ``v_proj``), each weight read once.

Why: a Llama-style attention layer projects its hidden states three times. At a few rows each projection is a
weight-bound GEMM, and the two narrow ones (``k_proj`` / ``v_proj``: ``Hkv * D`` outputs, 1,024 for Llama-3.1-8B) are
too few columns to keep a GPU's memory busy: cuBLAS reads them at about a third of the card's bandwidth (the GEMM-floor
table in docs/kernels.md). Here one launch covers the columns of all three: each program owns ``BLOCK_C`` output
columns of one weight and walks the whole reduction dimension (no split-K, no reduce kernel), so the narrow weights'
columns share the launch's waves with the wide one's.

Shapes: ``x`` [..., hidden] with at most ``MAX_ROWS`` rows (the caller's [B, T, hidden]), each weight [out_i, hidden]
(``nn.Linear`` weights without a bias, the reduction dimension contiguous), all in one 16-bit dtype; returns one
tensor [..., out_i] per weight, in that dtype.

Formula and rounding (``stacked_projection_reference``): each output is ``F.linear(x, w)``, accumulated in fp32 and
rounded once to the dtype, as cuBLAS rounds a GEMM's output. Not bit for bit: the reduction runs in another order than
cuBLAS's, so an output may differ from eager PyTorch by a unit in the last place (``tests/kernels/
test_stacked_projection.py`` bounds it against a float64 oracle).

Rotated (``rotary=(cos, sin, head_dim)``): the first two outputs (the query and the key) leave the kernel with the
rotary embedding applied, transformers' ``apply_rotary_pos_emb`` on the rounded projection (``x * cos +
rotate_half(x) * sin``, each product and sum rounded where eager PyTorch rounds it: ``kernels/rope.py``), so a decode
step needs no RoPE launch. A program then owns ``BLOCK_C / 2`` columns of one head's first half and the matching
columns of its second half, the pairs the rotation mixes. ``cos``, ``sin``: [B or 1, T, D] in x's dtype for x
[B, T, hidden]; each output width a multiple of ``head_dim`` (even).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ._triton_common import DT_BF16, DT_FP16, PLAIN_TENSORS, cdiv, interpreting, round_to
from .projection_tile import column_sums
from .launch import TritonLaunch, direct_launches
from .rope import rope_torch, rotary_operands, rotate_pair

STACKED_DTYPES = {torch.bfloat16: DT_BF16, torch.float16: DT_FP16}
MAX_ROWS = 64  # a decode step's tokens; beyond, cuBLAS at full tiles is the faster way
MAX_WEIGHTS = 3


@triton.jit
def _project_tile(x_ptr, w_ptr, out_ptr, pid_c, pid_r, rows, cols, hidden, s_xr, s_wc, DT: tl.constexpr,
                  EVEN_K: tl.constexpr, IEEE: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_C: tl.constexpr,
                  BLOCK_K: tl.constexpr):
    """Columns ``[pid_c * BLOCK_C, +BLOCK_C)`` of rows ``[pid_r * BLOCK_R, +BLOCK_R)`` of ``x @ w.T`` (fp32 sums,
    one rounding at the store)."""
    r = pid_r * BLOCK_R + tl.arange(0, BLOCK_R)
    c = pid_c * BLOCK_C + tl.arange(0, BLOCK_C)
    r_ok, c_ok = r < rows, c < cols
    acc, _ = column_sums(x_ptr, w_ptr, w_ptr, r, c, r_ok, c_ok, hidden, s_xr, s_wc, s_wc, False, EVEN_K, IEEE, BLOCK_R,
                         BLOCK_C, BLOCK_K)
    out_ptrs = out_ptr + r[:, None].to(tl.int64) * cols + c[None, :]
    tl.store(out_ptrs, round_to(acc, DT).to(out_ptr.dtype.element_ty), mask=r_ok[:, None] & c_ok[None, :])


@triton.jit
def _rotated_tile(x_ptr, w_ptr, out_ptr, pid_c, pid_r, rows, cols, hidden, s_xr, s_wc, cos_ptr, sin_ptr, tokens,
                  s_cb, s_ct, s_cd, head_dim, DT: tl.constexpr, EVEN_K: tl.constexpr, IEEE: tl.constexpr,
                  BLOCK_R: tl.constexpr, BLOCK_C: tl.constexpr, BLOCK_K: tl.constexpr):
    """Tile ``pid_c`` of a rotated output: columns ``j`` (``BLOCK_C / 2`` of them) of one head's first half and
    ``j + head_dim / 2`` of its second, for rows ``[pid_r * BLOCK_R, +BLOCK_R)``; each projection rounded once, then
    rotated by its row's ``cos`` / ``sin`` (row ``r`` is token ``r % tokens`` of batch row ``r // tokens``)."""
    HALF_C: tl.constexpr = BLOCK_C // 2
    half = head_dim // 2
    per_head = tl.cdiv(half, HALF_C)
    j = (pid_c % per_head) * HALF_C + tl.arange(0, HALF_C)
    first_col = (pid_c // per_head) * head_dim + j
    r = pid_r * BLOCK_R + tl.arange(0, BLOCK_R)
    r_ok, j_ok = r < rows, (j < half) & (first_col < cols)
    # each column j beside its partner j + half: weight rows half * s_wc further on
    acc1, acc2 = column_sums(x_ptr, w_ptr, w_ptr + half * s_wc, r, first_col, r_ok, j_ok, hidden, s_xr, s_wc, s_wc,
                             True, EVEN_K, IEEE, BLOCK_R, HALF_C, BLOCK_K)
    p1, p2 = round_to(acc1, DT), round_to(acc2, DT)  # the projection, rounded as the plain tile rounds it
    ok = r_ok[:, None] & j_ok[None, :]
    c_rows = (r // tokens).to(tl.int64)[:, None] * s_cb + (r % tokens).to(tl.int64)[:, None] * s_ct
    c1_ptrs = c_rows + j[None, :] * s_cd
    c2_ptrs = c_rows + (j + half)[None, :] * s_cd
    cos1 = tl.load(cos_ptr + c1_ptrs, mask=ok, other=0.0).to(tl.float32)
    cos2 = tl.load(cos_ptr + c2_ptrs, mask=ok, other=0.0).to(tl.float32)
    sin1 = tl.load(sin_ptr + c1_ptrs, mask=ok, other=0.0).to(tl.float32)
    sin2 = tl.load(sin_ptr + c2_ptrs, mask=ok, other=0.0).to(tl.float32)
    first, second = rotate_pair(p1, p2, cos1, cos2, sin1, sin2, DT)
    out_ptrs = out_ptr + r[:, None].to(tl.int64) * cols + first_col[None, :]
    tl.store(out_ptrs, first.to(out_ptr.dtype.element_ty), mask=ok)
    tl.store(out_ptrs + half, second.to(out_ptr.dtype.element_ty), mask=ok)


@triton.jit
def _weight_tile(x_ptr, w_ptr, out_ptr, pid_c, pid_r, rows, cols, hidden, s_xr, s_wc, cos_ptr, sin_ptr, tokens, s_cb,
                 s_ct, s_cd, head_dim, DT: tl.constexpr, EVEN_K: tl.constexpr, IEEE: tl.constexpr,
                 ROTATE: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_C: tl.constexpr, BLOCK_K: tl.constexpr):
    """Tile ``pid_c`` of one weight's output: rotated (``_rotated_tile``) or plain (``_project_tile``)."""
    if ROTATE:
        _rotated_tile(x_ptr, w_ptr, out_ptr, pid_c, pid_r, rows, cols, hidden, s_xr, s_wc, cos_ptr, sin_ptr, tokens,
                      s_cb, s_ct, s_cd, head_dim, DT, EVEN_K, IEEE, BLOCK_R, BLOCK_C, BLOCK_K)
    else:
        _project_tile(x_ptr, w_ptr, out_ptr, pid_c, pid_r, rows, cols, hidden, s_xr, s_wc, DT, EVEN_K, IEEE, BLOCK_R,
                      BLOCK_C, BLOCK_K)


@triton.jit
def _stacked_projection_kernel(x_ptr, w0_ptr, w1_ptr, w2_ptr, o0_ptr, o1_ptr, o2_ptr, cols0, cols1, cols2, rows,
                               hidden, s_xr, s_w0, s_w1, s_w2, cos_ptr, sin_ptr, tokens, s_cb, s_ct, s_cd, head_dim,
                               DT: tl.constexpr, EVEN_K: tl.constexpr, IEEE: tl.constexpr, ROTARY: tl.constexpr,
                               BLOCK_R: tl.constexpr, BLOCK_C: tl.constexpr, BLOCK_K: tl.constexpr):
    # axis 0 walks the column tiles of weight 0, then weight 1's, then weight 2's (a weight of 0 columns has none);
    # with ROTARY, weights 0 and 1 are tiled by head (``_rotated_tile``: BLOCK_C / 2 column pairs per tile)
    pid = tl.program_id(0)
    pid_r = tl.program_id(1)
    if ROTARY:
        per_head = tl.cdiv(head_dim // 2, BLOCK_C // 2)
        tiles0 = (cols0 // head_dim) * per_head
        tiles1 = (cols1 // head_dim) * per_head
    else:
        tiles0 = tl.cdiv(cols0, BLOCK_C)
        tiles1 = tl.cdiv(cols1, BLOCK_C)
    if pid < tiles0:
        _weight_tile(x_ptr, w0_ptr, o0_ptr, pid, pid_r, rows, cols0, hidden, s_xr, s_w0, cos_ptr, sin_ptr, tokens,
                     s_cb, s_ct, s_cd, head_dim, DT, EVEN_K, IEEE, ROTARY, BLOCK_R, BLOCK_C, BLOCK_K)
    elif pid < tiles0 + tiles1:
        _weight_tile(x_ptr, w1_ptr, o1_ptr, pid - tiles0, pid_r, rows, cols1, hidden, s_xr, s_w1, cos_ptr, sin_ptr,
                     tokens, s_cb, s_ct, s_cd, head_dim, DT, EVEN_K, IEEE, ROTARY, BLOCK_R, BLOCK_C, BLOCK_K)
    else:
        _project_tile(x_ptr, w2_ptr, o2_ptr, pid - tiles0 - tiles1, pid_r, rows, cols2, hidden, s_xr, s_w2, DT,
                      EVEN_K, IEEE, BLOCK_R, BLOCK_C, BLOCK_K)


_stacked_projection_launch = TritonLaunch(_stacked_projection_kernel)


def stacked_projection_supported(x: torch.Tensor, weights: tuple[torch.Tensor, ...]) -> bool:
    """Whether ``stacked_projection_triton`` applies: plain CUDA tensors (CPU ones under Triton's interpreter), one
    16-bit dtype, ``x`` [..., hidden] with 1 to ``MAX_ROWS`` rows and a contiguous last dimension, 1 to
    ``MAX_WEIGHTS`` weights [out_i, hidden] with the hidden dimension contiguous. Called on every attention layer of a
    RocketKV forward: cheap checks first."""
    dtype = x.dtype
    if (dtype not in STACKED_DTYPES or type(x) is not torch.Tensor or x.dim() < 1
            or not 1 <= len(weights) <= MAX_WEIGHTS):
        return False  # no subclass (DTensor, quantized weights): raw pointers
    hidden, device = x.shape[-1], x.device
    if not (0 < x.numel() // max(hidden, 1) <= MAX_ROWS and hidden > 0 and x.stride(-1) == 1
            and (device.type == "cuda" or (device.type == "cpu" and interpreting()))):
        return False
    return all(type(w) in PLAIN_TENSORS and w.dtype == dtype and w.dim() == 2 and w.shape[1] == hidden
               and w.shape[0] > 0 and w.stride(1) == 1 and w.device == device for w in weights)


def stacked_projection_reference(x: torch.Tensor, weights: tuple[torch.Tensor, ...],
                                 rotary: tuple[torch.Tensor, torch.Tensor, int] | None = None
                                 ) -> tuple[torch.Tensor, ...]:
    """PyTorch twin: one bias-free ``nn.Linear`` per weight, as transformers' eager modules run them; with ``rotary``
    (cos, sin, head_dim), the first two outputs rotated by transformers' formula (``rope.rope_torch``)."""
    outs = tuple(torch.nn.functional.linear(x, w) for w in weights)
    if rotary is None:
        return outs
    cos, sin, head_dim = rotary
    batch, tokens = x.shape[:2]
    q, k = (out.view(batch, tokens, -1, head_dim).transpose(1, 2) for out in outs[:2])
    q, k = rope_torch(q, k, cos, sin)
    return tuple(t.transpose(1, 2).reshape(batch, tokens, -1) for t in (q, k)) + outs[2:]


def _tiles(rows: int) -> tuple[int, int, int, int, int]:
    """(BLOCK_R, BLOCK_C, BLOCK_K, warps, stages): the least row block ``tl.dot`` takes that holds ``rows``, and the
    column and reduction tiles measured best (``benchmarks/probes/tune_gated_projection.py --parts attention``, 14 tile
    choices at 1, 16 and 64 rows, Llama-3.1-8B and Gemma-3-12B shapes, one H100,
    ``results/h100_2026-12-05_tune_qkv_projection.json``): 20.6-24.6 us against three cuBLAS calls' 33.6-37.7 at 1
    and 16 rows with 32 columns and five stages of 128-wide reduction tiles, 26.5-29.1 against 34.0-34.6 at 64 rows
    with 64 columns and three stages (five stages of that row block exceed the H100's shared memory)."""
    block_r = 16 if rows <= 16 else (32 if rows <= 32 else 64)
    if rows <= 16:
        return block_r, 32, 128, 4, 5
    return block_r, 64, 128, 4, 3


def rotary_supported(x: torch.Tensor, weights: tuple[torch.Tensor, ...], cos: torch.Tensor, sin: torch.Tensor,
                     head_dim: int) -> bool:
    """Whether ``stacked_projection_triton(x, weights, rotary=(cos, sin, head_dim))`` applies, given
    ``stacked_projection_supported(x, weights)``: ``x`` [B, T, hidden], at least two weights (query and key) whose
    widths are multiples of an even ``head_dim``, ``cos`` / ``sin`` of shape [B or 1, T, head_dim] in x's dtype on its
    device (transformers' rotary embedding output for this forward)."""
    if x.dim() != 3 or len(weights) < 2 or head_dim <= 0 or head_dim % 2:
        return False
    shape = cos.shape
    return (type(cos) in PLAIN_TENSORS and type(sin) in PLAIN_TENSORS and cos.dim() == 3 and sin.shape == shape
            and shape[0] in (1, x.shape[0]) and shape[1] == x.shape[1] and shape[2] == head_dim
            and cos.dtype == sin.dtype == x.dtype and cos.device == sin.device == x.device
            and weights[0].shape[0] % head_dim == 0 and weights[1].shape[0] % head_dim == 0)


def stacked_projection_triton(x: torch.Tensor, weights: tuple[torch.Tensor, ...],
                              tiles: tuple[int, int, int, int, int] | None = None,
                              rotary: tuple[torch.Tensor, torch.Tensor, int] | None = None) -> tuple[torch.Tensor, ...]:
    """Same contract as ``stacked_projection_reference`` (``stacked_projection_supported`` must hold). ``tiles``:
    (BLOCK_R, BLOCK_C, BLOCK_K, warps, stages) instead of the default (the tuning probe). ``rotary``: (cos, sin,
    head_dim), the first two outputs rotated (``rotary_supported`` must hold; the module docstring)."""
    hidden = x.shape[-1]
    rows = x.numel() // hidden
    outs = tuple(torch.empty((*x.shape[:-1], w.shape[0]), dtype=x.dtype, device=x.device) for w in weights)
    x2 = x.reshape(rows, hidden)
    block_r, block_c, block_k, warps, stages = tiles or _tiles(rows)
    ws = tuple(weights) + (weights[0],) * (MAX_WEIGHTS - len(weights))  # absent weights: 0 columns, never read
    os_ = outs + (outs[0],) * (MAX_WEIGHTS - len(outs))
    cols = tuple(w.shape[0] for w in weights) + (0,) * (MAX_WEIGHTS - len(weights))
    if rotary is None:
        cos = sin = x2  # never read
        tokens, head_dim, rotary_strides = 1, 2, (0, 0, 0)
        tiles_per_weight = [cdiv(n, block_c) for n in cols]
    else:
        cos, sin, head_dim = rotary
        if block_c < 32:
            raise ValueError(f"stacked_projection_triton: a rotated projection needs BLOCK_C >= 32, not {block_c}")
        cos, sin, rotary_strides = rotary_operands(cos, sin)
        tokens = x.shape[1]
        per_head = cdiv(head_dim // 2, block_c // 2)
        tiles_per_weight = [n // head_dim * per_head for n in cols[:2]] + [cdiv(cols[2], block_c)]
    grid = (sum(tiles_per_weight), cdiv(rows, block_r))
    with direct_launches():
        _stacked_projection_launch[grid](
            x2, *ws, *os_, *cols, rows, hidden, x2.stride(0), *(w.stride(0) for w in ws), cos, sin, tokens,
            *rotary_strides, head_dim,
            DT=STACKED_DTYPES[x.dtype], EVEN_K=hidden % block_k == 0, IEEE=interpreting(), ROTARY=rotary is not None,
            BLOCK_R=block_r, BLOCK_C=block_c, BLOCK_K=block_k, num_warps=warps, num_stages=stages,
        )
    return outs
