"""The two pieces of flash-decoding that the sparse and the ring decode kernels share, as ``@triton.jit`` helpers.

Both kernels walk their share of a row's K/V in blocks and keep, for the G query heads of one KV head, an online
softmax in log2 units (``m_i`` the running maximum, ``l_i`` the running denominator, ``acc [G, D]`` the running
weighted sum); both end the same way: the sink of each query head joins the denominator (one split only; with splits
the reduce kernel adds it), then either the output is written, or the split's normalised partial output and
log-sum-exp for ``combine_splits`` (``sparse_decode_attention.py``).

    online_softmax_step(logits [G, N] fp32, -inf where hidden; m_i [G]; l_i [G])
        -> (p [G, N] the block's weights, alpha [G] the factor that rescales acc, m_new [G], l_new [G])
    finish_split(acc [G, D] fp32, m_i, l_i, ...): the sink, the normalisation and the stores

A Triton helper is inlined into its caller: the kernels compile to the code they had when these lines were theirs.
"""

from __future__ import annotations

import triton
import triton.language as tl

from ._triton_common import cast_to


@triton.jit
def online_softmax_step(logits, m_i, l_i):
    """One block of the online softmax; a row whose logits are all -inf so far keeps ``m_i`` -inf and weight 0."""
    m_new = tl.maximum(m_i, tl.max(logits, axis=1))
    m_safe = tl.where(m_new > float("-inf"), m_new, 0.0)
    alpha = tl.exp2(m_i - m_safe)
    p = tl.exp2(logits - m_safe[:, None])
    l_new = l_i * alpha + tl.sum(p, axis=1)
    return p, alpha, m_new, l_new


@triton.jit
def finish_split(acc, m_i, l_i, sink_ptr, out_ptr, part_o_ptr, part_lse_ptr, b, h, bh, split, num_splits,
                 group, head_dim, s_ob, s_oh, s_og, s_od,
                 BLOCK_G: tl.constexpr, BLOCK_D: tl.constexpr, OUT_DT: tl.constexpr, DIRECT: tl.constexpr,
                 SINKS: tl.constexpr):
    """The program's result for (row ``b``, KV head ``h``, ``split``): with DIRECT (one split) the sinks ``[Hq]``
    (query head ``h * group + g``) join the denominator and ``out [B, Hkv, G, D]`` is written in OUT_DT; otherwise
    the normalised partial output (row ``(bh * num_splits + split) * BLOCK_G + g`` of ``part_o``, fp32) and its
    log-sum-exp in log2 units (``part_lse``, -inf for a row that saw nothing). A row with nothing visible is zeros."""
    g = tl.arange(0, BLOCK_G)
    d = tl.arange(0, BLOCK_D)
    g_ok = g < group
    d_ok = d < head_dim
    if SINKS:  # noqa: SIM102 - nested constexpr branches, the form every Triton version compiles
        if DIRECT:
            sink = tl.load(sink_ptr + h * group + g, mask=g_ok, other=float("-inf")).to(tl.float32)
            sink = sink * 1.4426950408889634  # log2(e), literal: a jit function reads no module global
            m_fin = tl.maximum(m_i, sink)
            m_fin = tl.where(m_fin > float("-inf"), m_fin, 0.0)
            rescale = tl.exp2(m_i - m_fin)
            l_i = l_i * rescale + tl.exp2(sink - m_fin)
            acc = acc * rescale[:, None]
    inv = tl.where(l_i > 0, 1.0 / tl.maximum(l_i, 1e-30), 0.0)
    o = acc * inv[:, None]
    if DIRECT:
        tl.store(out_ptr + b * s_ob + h * s_oh + g[:, None] * s_og + d[None, :] * s_od, cast_to(o, OUT_DT),
                 mask=g_ok[:, None] & d_ok[None, :])
    else:
        row = (bh * num_splits + split).to(tl.int64) * BLOCK_G + g
        tl.store(part_o_ptr + row[:, None] * BLOCK_D + d[None, :], o)
        lse = tl.where(l_i > 0, m_i + tl.log2(tl.maximum(l_i, 1e-30)), float("-inf"))
        tl.store(part_lse_ptr + row, lse)
