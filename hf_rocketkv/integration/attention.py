"""The ``rocketkv`` attention function registered with transformers' AttentionInterface.

generate -> attention module -> ``cache.update`` (stores the tokens) -> ``rocketkv_attention`` (this file):
    dense layer (prefill)  exact causal attention over the whole prompt, then stage 1 evicts (cache layer)
    compressed, 1 query    stage 2: score KT pages, take the top-k, exact attention over their tokens
    compressed, n queries  a later turn: exact attention over the kept tokens + the new ones, then stage 1 again
Without a RocketKVCache (a plain forward, ``use_cache=False``) it is exactly transformers' sdpa attention.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from transformers.integrations.sdpa_attention import sdpa_attention_forward

from ..cache.layer import RocketKVLayer
from ..selection.stage2_pages import num_pages
from . import handoff

UNSUPPORTED_KWARGS = ("sliding_window", "softcap", "s_aux")


def rocketkv_attention(
    module: torch.nn.Module,
    query: torch.Tensor,  # [B, Hq, Lq, D] post-RoPE
    key: torch.Tensor,  # [B, Hkv, Lk, D] what cache.update returned
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,  # sdpa-style bool mask [B, 1, Lq, Lk] or None
    scaling: float | None = None,
    dropout: float = 0.0,
    **kwargs,
) -> tuple[torch.Tensor, None]:
    cache = handoff.take(module.layer_idx)
    if cache is None:
        return sdpa_attention_forward(module, query, key, value, attention_mask, dropout=dropout, scaling=scaling, **kwargs)
    check_supported(module, kwargs)
    layer: RocketKVLayer = cache.layers[module.layer_idx]
    scaling = scaling if scaling is not None else query.shape[-1] ** -0.5

    if not layer.compressed:
        out, _ = sdpa_attention_forward(module, query, key, value, attention_mask, scaling=scaling, **kwargs)
        layer.observe_prefill(query, padding_offsets(attention_mask, key.shape[2]), scaling)
        if not cache.hints.defer_compression:
            layer.compress()
        return out, None
    if query.shape[2] == 1:
        return decode_attention(layer, query, scaling), None
    out = continuation_attention(layer, query, scaling)
    layer.observe_prefill(query, None, scaling)
    if not cache.hints.defer_compression:
        layer.compress()
    return out, None


def check_supported(module: torch.nn.Module, kwargs: dict) -> None:
    """Raise at the first forward for attention RocketKV cannot serve, instead of silently running dense."""
    for name in UNSUPPORTED_KWARGS:
        if kwargs.get(name) is not None:
            raise NotImplementedError(
                f"RocketKV does not support attention with `{name}` ({type(module).__name__}, layer "
                f"{module.layer_idx}): sliding-window/hybrid layers, logit soft-capping and attention sinks are not "
                f"implemented. Use a model with full causal attention on every layer (Llama, Mistral, Qwen2, Qwen3)."
            )
    if getattr(module, "is_causal", True) is False:
        raise NotImplementedError(f"RocketKV serves causal self-attention only; {type(module).__name__} is not causal")


def padding_offsets(attention_mask: torch.Tensor | None, kv_length: int) -> torch.Tensor | None:
    """Left-padding length of each row, from the last query row of a [B, 1, Lq, Lk] mask (None = no padding)."""
    if attention_mask is None:
        return None
    last_row = attention_mask[:, 0, -1, :]
    valid = last_row if last_row.dtype == torch.bool else last_row == 0
    counts = valid.sum(dim=-1)
    start = kv_length - counts
    expected = torch.arange(kv_length, device=valid.device)[None, :] >= start[:, None]
    if not torch.equal(valid, expected):
        raise ValueError(
            "RocketKV needs left-padded batches (padding before each prompt): set tokenizer.padding_side='left'."
        )
    return start


def decode_attention(layer: RocketKVLayer, query: torch.Tensor, scaling: float) -> torch.Tensor:
    """Stage 2 for one new token per row: top-k KT pages per KV head, exact attention over their tokens."""
    batch, num_q_heads, _, head_dim = query.shape
    num_kv_heads = layer.keys.shape[1]
    q = query.reshape(batch, num_kv_heads, num_q_heads // num_kv_heads, head_dim)  # a view for decode layouts
    config, ops = layer.config, layer.ops
    # top_pages derives the page counts from the token counts itself (no num_pages launches) and, in Triton,
    # selects from the scoring pass's logits without writing the page probabilities
    page_idx, page_valid = ops.top_pages(q, layer.kt, layer.lengths, config.page_size, config.topr, config.topk)
    out = ops.sparse_decode_attention(
        q, layer.keys, layer.values, page_idx, page_valid, layer.lengths, config.page_size, scaling
    )
    # [B, Hkv, G, D] -> [B, 1, Hq, D]: the size-1 axes make this transpose a contiguous view
    return out.reshape(batch, num_q_heads, 1, head_dim).transpose(1, 2)


def continuation_attention(layer: RocketKVLayer, query: torch.Tensor, scaling: float) -> torch.Tensor:
    """n new tokens on a compressed layer: each sees every kept token and the new tokens up to itself."""
    n = query.shape[2]
    slot = torch.arange(layer.capacity, device=query.device)
    limit = (layer.lengths - n)[:, None] + torch.arange(n, device=query.device)[None, :]  # [B, n]
    mask = slot[None, None, :] <= limit[:, :, None]
    out = F.scaled_dot_product_attention(
        query, layer.keys, layer.values, attn_mask=mask[:, None], scale=scaling, enable_gqa=True
    )
    return out.transpose(1, 2).contiguous()
