"""Attention logits beyond ``q k^T * scaling``: soft-capping (Gemma 2) and learned sinks (gpt-oss), and the exact
attention with them (PyTorch paths; the decode kernels take them too: ``kernels/sparse_decode_attention.py``).

Pure functions over tensors: they know nothing of caches or transformers.

- soft-capping with cap ``c``: ``logits = tanh(logits / c) * c`` on the scaled logits, before the mask and the
  softmax (transformers' eager attention of Gemma 2).
- sinks: one learned logit per query head (``s_aux``, ``[Hq]``), a column that joins the softmax and is dropped
  after it: it only enlarges the denominator, ``p_j = exp(l_j) / (sum_i exp(l_i) + exp(sink))`` (transformers' eager
  attention of gpt-oss).

Shapes (B batch, Hq query heads, Hkv KV heads, G = Hq / Hkv, n queries, N keys, D head_dim): grouped logits are
``[B, Hkv, G, ..., N]`` and query head ``h`` is KV head ``h // G``'s group member ``h % G`` (transformers'
``repeat_kv`` order), so sinks ``[Hq]`` are viewed as ``[Hkv, G]``.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F


@dataclass(frozen=True, eq=False)
class LogitFeatures:
    """What a layer's attention adds to its logits. ``softcap``: the cap ``c`` (None: none); ``sinks``: the learned
    sink logit of each query head, ``[Hq]`` (None: none)."""

    softcap: float | None = None
    sinks: torch.Tensor | None = None

    def __post_init__(self) -> None:
        if self.softcap is not None and not (isinstance(self.softcap, (int, float)) and self.softcap > 0):
            raise ValueError(f"LogitFeatures.softcap must be a positive number or None, got {self.softcap!r}")
        if self.sinks is not None and (not isinstance(self.sinks, torch.Tensor) or self.sinks.dim() != 1):
            got = list(self.sinks.shape) if isinstance(self.sinks, torch.Tensor) else type(self.sinks).__name__
            raise ValueError(f"LogitFeatures.sinks must be a 1-D tensor [num_attention_heads] or None, got {got}")

    @property
    def plain(self) -> bool:
        """No soft-capping and no sinks: plain scaled dot-product attention."""
        return self.softcap is None and self.sinks is None

    def grouped_sinks(self, num_kv_heads: int) -> torch.Tensor | None:
        """The sinks as fp32 ``[Hkv, G]`` (None without sinks)."""
        if self.sinks is None:
            return None
        return self.sinks.float().reshape(num_kv_heads, -1)

    def same_as(self, other: LogitFeatures) -> bool:
        """Whether ``other`` describes the same logits: the same cap, and the very same sinks tensor or a view of the
        same memory (a tensor-parallel plan that shards the sinks hands the attention a fresh local view of its
        shard at every forward). Host-side only (no sync)."""
        return self.softcap == other.softcap and same_tensor(self.sinks, other.sinks)


PLAIN = LogitFeatures()


def same_tensor(a: torch.Tensor | None, b: torch.Tensor | None) -> bool:
    """``a is b``, or two views of the same elements (same memory, shape, strides, dtype and device)."""
    if a is b:
        return True
    if a is None or b is None:
        return False
    return (a.data_ptr() == b.data_ptr() and a.shape == b.shape and a.stride() == b.stride() and a.dtype == b.dtype
            and a.device == b.device)


def soft_cap(logits: torch.Tensor, softcap: float | None) -> torch.Tensor:
    """``tanh(logits / softcap) * softcap`` (``logits`` unchanged for None). Apply it before masking: a masked
    logit of -inf would become ``-softcap``, a finite value."""
    if softcap is None:
        return logits
    return torch.tanh(logits / softcap) * softcap


def softmax_with_sinks(logits: torch.Tensor, sinks: torch.Tensor | None) -> torch.Tensor:
    """Softmax over the last axis (fp32), with one sink logit per row joining the denominator.

    ``logits`` fp32 ``[..., N]`` (masked entries -inf); ``sinks`` broadcastable to ``logits[..., :1]`` or None.
    A row whose every logit is masked gets zeros (no NaN), with or without a sink.
    """
    if sinks is None:
        return torch.softmax(logits, dim=-1).nan_to_num_(0.0)
    sink = sinks.to(logits.dtype).expand(*logits.shape[:-1], 1)
    probs = torch.softmax(torch.cat([logits, sink], dim=-1), dim=-1)
    return probs[..., :-1]


def with_sinks(out: torch.Tensor, lse: torch.Tensor, sinks: torch.Tensor) -> torch.Tensor:
    """Attention over the keys turned into attention with one sink logit per query head.

    ``out`` ``[B, L, Hq, D]`` (any strides) is the softmax-weighted values over the keys alone and ``lse``
    ``[B, Hq, L]`` or ``[B, Hq, L, 1]`` each row's natural log-sum-exp of its scaled logits; ``sinks`` ``[Hq]``. The
    sink joins the denominator with a zero value, so each row keeps the share ``exp(lse) / (exp(lse) + exp(sink))
    = sigmoid(lse - sink)`` of its output. Returns ``[B, L, Hq, D]`` contiguous in ``out``'s dtype, scaled in fp32.
    """
    batch, length, heads, _ = out.shape
    keep = torch.sigmoid(lse.reshape(batch, heads, length).float() - sinks.float()[None, :, None])
    return (out.float() * keep.transpose(1, 2)[..., None]).to(out.dtype).contiguous()


def allowed_of(mask: torch.Tensor | None) -> torch.Tensor | None:
    """A transformers attention mask as bool (True = may attend): bool masks as they are, additive float masks
    where they are 0."""
    if mask is None or mask.dtype == torch.bool:
        return mask
    return mask == 0


def attention_reference(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    allowed: torch.Tensor | None,
    scaling: float,
    features: LogitFeatures = PLAIN,
) -> torch.Tensor:
    """Exact attention of ``query`` ``[B, Hq, n, D]`` over ``key`` / ``value`` ``[B, Hkv, N, D]`` -> ``[B, n, Hq, D]``
    in the query's dtype, computed in fp32.

    ``allowed`` bool, broadcastable to ``[B, 1 or Hq, n, N]`` (True = may attend); None = lower-right causal (query
    j sees keys ``<= N - n + j``; with ``n == N`` the usual causal mask, with ``n == 1`` every key). The logits are
    ``q k^T * scaling``, soft-capped by ``features.softcap``, masked, then softmax with ``features.sinks``.
    """
    batch, num_q_heads, n, head_dim = query.shape
    num_kv_heads, num_keys = key.shape[1], key.shape[2]
    group = num_q_heads // num_kv_heads
    q = query.float().reshape(batch, num_kv_heads, group, n, head_dim)
    logits = soft_cap(torch.einsum("bhgnd,bhkd->bhgnk", q, key.float()) * scaling, features.softcap)
    if allowed is None:
        allowed = lower_right_rows(n, num_keys, 0, n, query.device)
    allowed = allowed.expand(batch, num_q_heads, n, num_keys).reshape(batch, num_kv_heads, group, n, num_keys)
    logits = logits.masked_fill(~allowed, float("-inf"))
    sinks = features.grouped_sinks(num_kv_heads)
    probs = softmax_with_sinks(logits, sinks[None, :, :, None, None] if sinks is not None else None)
    out = torch.einsum("bhgnk,bhkd->bhgnd", probs, value.float())
    return out.reshape(batch, num_q_heads, n, head_dim).transpose(1, 2).to(query.dtype).contiguous()


def lower_right_rows(n: int, num_keys: int, start: int, end: int, device) -> torch.Tensor:
    """Rows ``[start, end)`` of the lower-right causal mask of ``n`` queries over ``num_keys`` keys, bool ``[end -
    start, num_keys]``: query j sees keys ``<= num_keys - n + j``."""
    column = torch.arange(num_keys, device=device)
    last = num_keys - n + torch.arange(start, end, device=device)
    return column[None, :] <= last[:, None]


QUERY_BLOCK_BYTES = 1 << 30  # featured_attention: fp32 logits of one query block stay under this


def featured_attention(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    allowed: torch.Tensor | None,
    scaling: float,
    features: LogitFeatures,
    block_bytes: int = QUERY_BLOCK_BYTES,
) -> torch.Tensor:
    """``attention_reference``'s result, in memory bounded by the query block rather than the whole
    ``n x N`` logits (a 32k-token prefill of gpt-oss-20b shapes would need 256 GiB of fp32 logits at once).

    Sinks without a cap run through PyTorch's SDPA (``sink_attention``), ``block_bytes`` of mask per block of
    queries; soft-capped logits through the reference, ``block_bytes`` of fp32 logits per block of queries. Same
    shapes and arguments as ``attention_reference``."""
    batch, num_q_heads, n, _ = query.shape
    num_keys = key.shape[2]
    if features.softcap is None and features.sinks is not None:
        run, per_query = sink_attention, 4 * batch * num_keys  # SDPA's mask (bool, then additive): no logits
    else:
        run, per_query = attention_reference, 4 * batch * num_q_heads * num_keys  # fp32 logits
    block = max(1, min(n, block_bytes // per_query))
    if block >= n:
        return run(query, key, value, allowed, scaling, features)
    parts = []
    for start in range(0, n, block):
        end = min(n, start + block)
        if allowed is None:  # lower-right causal, made explicit for this block's rows only (not an n x N mask)
            rows = lower_right_rows(n, num_keys, start, end, query.device)[None, None]
        else:
            rows = allowed[..., start:end, :] if allowed.shape[-2] == n else allowed
        parts.append(run(query[:, :, start:end], key, value, rows, scaling, features))
    return torch.cat(parts, dim=1)


def sink_attention(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    allowed: torch.Tensor | None,
    scaling: float,
    features: LogitFeatures,
) -> torch.Tensor:
    """Attention with per-head sinks (no cap) through PyTorch's SDPA: one more channel and one more key carry the
    sink. Query head ``h`` gets the channel value ``sink_h / scaling``, every real key 0 there, and an extra key is 0
    everywhere but 1 in that channel, with a zero value: its logit is ``sink_h`` for every query, so it joins each
    softmax denominator and adds nothing to the output, exactly the sink. Channels are zero-padded to a multiple
    of 8 (what the fused SDPA kernels take). Same shapes and arguments as ``attention_reference``."""
    batch, num_q_heads, n, head_dim = query.shape
    num_kv_heads, num_keys = key.shape[1], key.shape[2]
    width = (head_dim + 1 + 7) // 8 * 8
    sink_channel = (features.sinks.to(query.dtype) / scaling)[None, :, None, None].expand(batch, -1, n, 1)
    q = F.pad(torch.cat([query, sink_channel], dim=-1), (0, width - head_dim - 1))
    k = F.pad(key, (0, width - head_dim))
    sink_key = k.new_zeros(batch, num_kv_heads, 1, width)
    sink_key[..., head_dim] = 1
    k = torch.cat([k, sink_key], dim=2)
    v = torch.cat([value, value.new_zeros(batch, num_kv_heads, 1, head_dim)], dim=2)
    if allowed is None:
        allowed = lower_right_rows(n, num_keys, 0, n, query.device)[None, None]
    allowed = allowed.expand(*allowed.shape[:-1], num_keys)
    allowed = torch.cat([allowed, allowed.new_ones(*allowed.shape[:-1], 1)], dim=-1)  # the sink: always seen
    if num_q_heads != num_kv_heads:  # one K/V head per query head: SDPA's memory-efficient kernel takes a mask
        k = k.repeat_interleave(num_q_heads // num_kv_heads, dim=1)  # but not every PyTorch build's takes GQA too,
        v = v.repeat_interleave(num_q_heads // num_kv_heads, dim=1)  # and the math fallback holds n x N logits
    out = F.scaled_dot_product_attention(q, k, v, attn_mask=allowed, scale=scaling)
    return out.transpose(1, 2).contiguous()


def masked_attention(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    allowed: torch.Tensor,
    scaling: float,
    features: LogitFeatures = PLAIN,
) -> torch.Tensor:
    """``featured_attention`` where features need it, PyTorch's SDPA (grouped-query heads) where they do not:
    ``[B, Hq, n, D]`` x ``[B, Hkv, N, D]`` with ``allowed`` bool ``[B, 1, n, N]`` -> ``[B, n, Hq, D]``."""
    if not features.plain:
        return featured_attention(query, key, value, allowed, scaling, features)
    gqa = query.shape[1] != key.shape[1]
    out = F.scaled_dot_product_attention(query, key, value, attn_mask=allowed, scale=scaling, enable_gqa=gqa)
    return out.transpose(1, 2).contiguous()


def sparse_attention_reference(
    q: torch.Tensor,
    keys: torch.Tensor,
    values: torch.Tensor,
    slots: torch.Tensor,
    valid: torch.Tensor,
    scaling: float,
    features: LogitFeatures = PLAIN,
) -> torch.Tensor:
    """Exact attention of one decode query per group over selected slots: ``q`` ``[B, Hkv, G, D]``, ``keys`` /
    ``values`` ``[B, Hkv, C, D]``, ``slots`` / ``valid`` ``[B, Hkv, S]`` (slots in range; ``valid`` False = not a
    token) -> ``[B, Hkv, G, D]`` in q's dtype. Logits soft-capped, softmax with the sinks, in fp32."""
    head_dim = q.shape[-1]
    index = slots[..., None].expand(-1, -1, -1, head_dim)
    k = keys.gather(2, index).float()
    v = values.gather(2, index).float()
    logits = soft_cap(torch.einsum("bhgd,bhnd->bhgn", q.float(), k) * scaling, features.softcap)
    logits = logits.masked_fill(~valid[:, :, None, :], float("-inf"))
    sinks = features.grouped_sinks(q.shape[1])
    probs = softmax_with_sinks(logits, sinks[None, :, :, None] if sinks is not None else None)
    return torch.einsum("bhgn,bhnd->bhgd", probs, v).to(q.dtype)
