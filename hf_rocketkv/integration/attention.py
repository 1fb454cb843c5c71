"""The ``rocketkv`` attention function registered with transformers' AttentionInterface.

generate -> attention module -> ``cache.update`` (stores the tokens) -> ``rocketkv_attention`` (this file), which
routes by the layer's state and keeps what faces transformers (the mask, sdpa, the kwargs it refuses):
    dense layer (prefill)  exact causal attention over the whole prompt here, then stage 1 evicts (cache layer)
    compressed, 1 query    stage 2, the layer's ``attend_decode`` (cache/stage2.py): score KT pages, take the
                           top-k, exact attention over their tokens
    compressed, n queries  a later turn: the layer stores the new real tokens and attends over the kept tokens + the
                           new ones (``attend_later_turn``, cache/working_set.py), then stage 1 again
    sliding layer          exact attention over the stored window + the new tokens with transformers' own sliding
                           mask (``SlidingWindowLayer``: nothing to select, it keeps only what the model can see),
                           one flash call with the window where the mask is exactly its band (window_prefill.py);
                           a decode step reads the layer's ring in place (``attend_ring``, kernels/ring_attention.py)
    packed step            the batching engine's decoding rows and a prompt chunk in one forward: split, each half
                           routed as above (packed_attention.py)
Soft-capped logits (Gemma 2's ``softcap``) and learned sinks (gpt-oss' ``s_aux``) reach every path as a
``LogitFeatures``: the exact attentions apply them (``selection/logit_features.py``), and a RocketKV layer scores its
stage 1 and stage 2 with them (``RocketKVLayer.use_features``).
The layer of this call is found from ``key`` itself: it is the buffer the layer's ``update()`` returned, tagged
with a weak reference to that layer (``layer_of``; docs/seam.md). Without a RocketKVCache (a plain forward with the
model's own DynamicCache, ``use_cache=False``) it is exactly transformers' sdpa attention.
"""

from __future__ import annotations

import torch

from ..cache.batch_view import BatchedDecodeLayer
from ..cache.layer import RocketKVLayer, layer_of
from ..cache.packed_step import PackedLayer
from ..cache.sliding_layer import SlidingWindowLayer
from ..cache.dense_layer import DenseLayer
from ..memory.layer_kinds import CHUNKED
from ..selection.logit_features import PLAIN, LogitFeatures, allowed_of, featured_attention
from .call_state import call_state
from .causal_prefill import causal_prefill_attention, cudnn_causal_attention, cudnn_runs, flash_attention_runs
from .compat import sdpa_attention_forward
from .packed_attention import packed_attention
from .position_temperature import scale_rows_by_position, scales_by_position
from .window_prefill import flash_window_attention, flash_window_runs, is_window_band, window_band

FEATURE_KWARGS = ("softcap", "s_aux")  # what transformers passes for soft-capping (Gemma 2) and sinks (gpt-oss)


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
    layer = layer_of(key)
    if isinstance(layer, PackedLayer):  # decoding rows and a prompt chunk in one forward: each half on its own path
        return packed_attention(rocketkv_attention, module, query, layer, attention_mask, scaling, dropout,
                                **kwargs), None
    features = logit_features(kwargs)
    if features.sinks is not None:
        check_sinks_follow_heads(module, features.sinks, query)
    if layer is None:
        if not features.plain:  # transformers' sdpa takes neither soft-capping nor sinks
            scaling = scaling if scaling is not None else query.shape[-1] ** -0.5
            return featured_attention(query, key, value, allowed_of(attention_mask), scaling, features), None
        return sdpa_attention_forward(module, query, key, value, attention_mask, dropout=dropout, scaling=scaling, **kwargs)
    if not (torch.compiler.is_compiling() or layer.hints.in_graph):
        layer.attention_ran()
        check_supported(module, kwargs, layer, key, features)
    scaling = scaling if scaling is not None else query.shape[-1] ** -0.5

    if isinstance(layer, DenseLayer):  # a dense layer (dense_layers) or a sliding-window one: exact attention
        if isinstance(layer, SlidingWindowLayer) and layer.ring and query.shape[2] == 1:  # a decode step
            out = layer.attend_ring(query, attention_mask, scaling, features)  # the ring read where it lies
            if out is not None:
                return out, None
            attention_mask = layer.ring_mask(attention_mask)  # a per-head mask: in slot order, transformers' path
            key, value = layer.ring_rows()
            return window_attention(module, query, key, value, attention_mask, scaling, features, **kwargs), None
        sliding = layer if isinstance(layer, SlidingWindowLayer) else None  # the band route is a sliding layer's
        return window_attention(module, query, key, value, attention_mask, scaling, features, layer=sliding,
                                **kwargs), None
    if not layer.compressed:
        check_all_heads_here(layer, module, key)
        layer.use_features(features)
        replayed = layer.prefix.replayed_now  # queries that replay a prefix hit (sliding-window models): not observed
        if replayed == query.shape[2]:  # all of them (a chunk inside the hit): its keys are the hit's, no more
            count_replayed(layer, real_query_count(attention_mask, layer.prefix.replay_first, query.shape[0], replayed))
            return dense_attention(layer, module, query, key, value, attention_mask, scaling, None, features,
                                   **kwargs), None
        start, host_start = padding_of_forward(layer, attention_mask, key.shape[2])
        out = dense_attention(layer, module, query, key, value, attention_mask, scaling, host_start, features,
                              **kwargs)
        first_query = key.shape[2] - query.shape[2]
        all_real = host_start is not None and max(host_start) <= first_query  # no query is padding: no mask needed
        valid = None if all_real else real_queries(start, key.shape[2], query.shape[2])
        if replayed:
            count_replayed(layer, query.shape[0] * replayed if valid is None else int(valid[:, :replayed].sum()))
            query, valid = query[:, :, replayed:], (valid[:, replayed:] if valid is not None else None)
        layer.observe_prefill(query, start, scaling, valid=valid, host_row_start=host_start)
        if not layer.hints.defer_compression:
            layer.compress()
        return out, None
    if query.shape[2] == 1:
        if isinstance(layer, BatchedDecodeLayer) and layer.scales_rows_by_position:
            query = scale_rows_by_position(module, query, layer.seen)  # rows at their own positions (Llama 4)
        return layer.attend_decode(query, scaling), None
    valid = new_token_validity(attention_mask, query.shape[2])
    layer.store_new_tokens(valid)
    out = layer.attend_later_turn(query, scaling, valid)
    layer.observe_prefill(query, None, scaling, valid=valid)
    if not layer.hints.defer_compression:
        layer.compress()
    return out, None


def count_replayed(layer: RocketKVLayer, tokens: int) -> None:
    """Add the real tokens a forward replayed (a prefix hit on a sliding-window model) to the request's computed
    tokens: stage 1 observes, and counts, only the queries after the hit."""
    if layer.counters is not None and layer.counts_tokens:
        layer.counters.computed(tokens)


def real_query_count(attention_mask: torch.Tensor | None, first_column: int, batch: int, n: int) -> int:
    """Real (non-padding) queries of a dense forward whose ``n`` queries sit at input columns ``first_column + j``:
    a real query sees its own column in the sdpa-style mask ``[B, 1, n, Lk]``."""
    if attention_mask is None:
        return batch * n
    rows = torch.arange(n, device=attention_mask.device)
    own = attention_mask[:, 0, rows, first_column + rows]  # [B, n]: each query's own column (no mask-sized temporary)
    return int((own if own.dtype == torch.bool else own == 0).sum())


def check_all_heads_here(layer: RocketKVLayer, module: torch.nn.Module, key: torch.Tensor) -> None:
    """Per-head budgets (AdaKV) rank the scores of every KV head of a row against each other: refuse a layer that
    holds only some of them (tensor parallelism shards the KV heads), whose rank would split the budget among its own
    heads and keep other tokens than one process. Host-side shapes only (no sync)."""
    if not layer.per_head_lengths:
        return
    total = getattr(module.config, "num_key_value_heads", None) or module.config.num_attention_heads
    if key.shape[1] != total:
        raise NotImplementedError(
            f"RocketKVConfig.stage1={layer.policy.name!r} allots one budget across all {total} KV heads of a row, "
            f"but this process holds {key.shape[1]} of them (tensor parallelism shards the KV heads): each rank would "
            f"split the budget among its own heads and keep other tokens than one process. Use a uniform stage1 "
            f"(snapkv, streaming, knorm, h2o, random) under tensor parallelism."
        )


def logit_features(kwargs: dict) -> LogitFeatures:
    """The soft-capping and sinks of this attention call (``PLAIN`` when it has neither, as Llama-style models)."""
    softcap, sinks = (kwargs.get(name) for name in FEATURE_KWARGS)
    if softcap is None and sinks is None:
        return PLAIN
    return LogitFeatures(softcap=softcap, sinks=sinks)


def check_supported(module: torch.nn.Module, kwargs: dict, layer, key: torch.Tensor,
                    features: LogitFeatures) -> None:
    """Raise at the first forward for attention RocketKV cannot serve, instead of silently running something else:
    non-causal attention, a layer whose sliding window or chunking is not the one its cache layer keeps (a cache that
    was not told the model's layer types; a chunked layer passes no window, ``check_chunked``), other logit features
    than the layer was prefilled with, and dense layers, budget schedules or chunked layers under tensor parallelism.
    Sliding windows, soft-capping and sinks run on a shard of the heads as on all of them: a sliding layer keeps its
    window of whatever heads it receives, soft-capping is per logit, and the sinks are checked against the query
    heads of this process (``check_sinks_follow_heads``)."""
    name, index = type(module).__name__, getattr(module, "layer_idx", "?")
    if getattr(module, "is_causal", True) is False:
        raise NotImplementedError(f"RocketKV serves causal self-attention only; {name} is not causal")
    window = kwargs.get("sliding_window")
    kept = layer.window if isinstance(layer, SlidingWindowLayer) else None
    chunked = module_is_chunked(module)
    if getattr(layer, "chunked", False):
        check_chunked(name, index, window, chunked, layer)
    elif window != kept or chunked:
        held = f"a sliding-window layer of {kept} tokens" if kept is not None else "a full-attention RocketKV layer"
        attends = "chunked attention (layer_types)" if chunked else f"sliding_window={window}"
        raise ValueError(
            f"{name} (layer {index}) attends with {attends}, but its RocketKVCache holds {held} there: "
            f"the cache was not given this model's layer types. generate() gives them itself; for plain forwards use "
            f"RocketKVCache(config, model_config=model.config)."
        )
    what = unsharded_only(layer)
    if what is not None:
        total = getattr(module.config, "num_key_value_heads", None) or module.config.num_attention_heads
        if key.shape[1] != total:
            raise NotImplementedError(
                f"RocketKV does not support {what} under tensor parallelism yet ({name}, layer {index}: this process "
                f"holds {key.shape[1]} of {total} KV heads). Run the model on one device."
            )
    if isinstance(layer, BatchedDecodeLayer) and layer.scales_rows_by_position != scales_by_position(module):
        raise ValueError(f"{name} (layer {index}): the batch was {'' if layer.scales_rows_by_position else 'not '}told "
                         f"that this attention scales its queries by position (BatchedDecodeCache("
                         f"position_scaled_layers=...), memory.layer_kinds.position_scaled_layers of the model config)")
    if isinstance(layer, RocketKVLayer) and layer.compressed and not features.same_as(layer.features):
        raise ValueError(f"{name} (layer {index}): the attention's soft-capping / sinks differ from those the layer "
                         f"was prefilled with; one RocketKVCache serves one model")


def unsharded_only(layer) -> str | None:
    """What this cache layer serves only with every KV head in one process (tensor parallelism refused), or None."""
    if getattr(layer, "is_dense", False):
        return "RocketKVConfig.dense_layers"
    if isinstance(layer, RocketKVLayer) and layer.config.budget_schedule != "flat":
        return "RocketKVConfig.budget_schedule"
    if getattr(layer, "chunked", False):
        return "chunked-attention layers (layer_types 'chunked_attention', Llama 4)"
    return None


def module_is_chunked(module: torch.nn.Module) -> bool:
    """Whether the model's config makes this attention module a chunked-attention layer (Llama 4)."""
    layer_types = getattr(getattr(module, "config", None), "layer_types", None)
    index = getattr(module, "layer_idx", None)
    if not isinstance(index, int) or not isinstance(layer_types, (list, tuple)) or index >= len(layer_types):
        return False
    return layer_types[index] == CHUNKED


def check_chunked(name: str, index, window: int | None, module_chunked: bool, layer: SlidingWindowLayer) -> None:
    """A chunked-attention layer (Llama 4) passes no ``sliding_window`` (transformers' chunked mask decides what it
    sees; its cache layer keeps the last ``attention_chunk_size - 1`` tokens): refuse a module that attends with a
    window, or with full attention."""
    if window is None and module_chunked:
        return
    attends = f"sliding_window={window}" if window is not None else "full attention (layer_types)"
    raise ValueError(f"{name} (layer {index}) attends with {attends}, but its RocketKVCache holds a "
                     f"chunked-attention layer of {layer.window} tokens there (the model config's layer_types); "
                     f"one RocketKVCache serves one model")


def check_sinks_follow_heads(module: torch.nn.Module, sinks: torch.Tensor, query: torch.Tensor) -> None:
    """Sinks are one logit per query head, viewed as ``[Hkv, G]`` from this process's own head counts: refuse sinks
    that do not match the query heads this process holds (a tensor-parallel plan that shards the query heads but
    passes every head's sinks), which would pair heads with other heads' sinks. Host-side shapes only."""
    if sinks.dim() == 1 and sinks.shape[0] == query.shape[1]:
        return
    name, index = type(module).__name__, getattr(module, "layer_idx", "?")
    raise NotImplementedError(
        f"{name} (layer {index}) passes attention sinks of shape {list(sinks.shape)} for the {query.shape[1]} query "
        f"heads this process holds: under tensor parallelism the model's plan must shard its sinks with the heads. "
        f"Run the model on one device."
    )


def window_attention(module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                     attention_mask: torch.Tensor | None, scaling: float, features: LogitFeatures,
                     layer=None, **kwargs) -> torch.Tensor:
    """A sliding layer's attention, ``[B, Lq, Hq, D]``: the stored window and the new tokens under transformers'
    sliding mask (built from the layer's ``get_mask_sizes``, exactly as for its own cache). Given the sliding
    ``layer`` with ``flash_window`` on (``RocketKVConfig.flash_window_prefill``), outside graphs and compilation, on
    CUDA in 16-bit without soft-capping, and where the mask is exactly the window's band: one flash call with the
    window (window_prefill.py; sinks through its log-sum-exp). Otherwise through transformers' sdpa, or the reference
    with soft-capping / sinks; a long first forward runs in query blocks over the keys each block can see
    (``attend_in_spans``)."""
    window = kwargs.get("sliding_window")
    if (layer is not None and layer.flash_window and not (layer.hints.in_graph or torch.compiler.is_compiling())
            and flash_window_runs(query, key, value, window, features)
            and window_band(layer, attention_mask, query.shape[2], key.shape[2], window)):
        return flash_window_attention(query, key, value, scaling, window, features.sinks)
    if not features.plain:
        def attend(q, k, v, mask):
            return featured_attention(q, k, v, allowed_of(mask), scaling, features)
    else:
        def attend(q, k, v, mask):
            return sdpa_attention_forward(module, q, k, v, mask, scaling=scaling, **kwargs)[0]
    narrow = window is not None or not features.plain  # a window, or SDPA under a mask for the caps / sinks
    block = min(FIRST_FORWARD_QUERY_BLOCK, WINDOW_SPAN_BLOCK) if narrow else FIRST_FORWARD_QUERY_BLOCK
    if spans_pay_off(query, key, attention_mask, window, needs_mask=features.plain, block=block):
        return attend_in_spans(attend, query, key, value, attention_mask, window, block)
    return attend(query, key, value, attention_mask)


FIRST_FORWARD_QUERY_BLOCK = 2048  # queries per span of a long first forward (attend_in_spans)
# at most this many per span of a sliding layer, and of a layer with soft-capping or sinks (SDPA under the span's
# mask; a span is at least the window): gpt-oss-20b's window of 128 at 8k, 2.86 ms per layer against 3.70 in spans of
# 2,048 and 5.32 in spans of 512, Gemma-3-12B's window of 1,024 at 8k 1.44 ms against 1.82 in spans of 2,048 on an
# H200 (results/h200_2026-12-04_hybrid_prefill_gpt_oss_8k.json, results/h200_2026-12-04_hybrid_prefill_gemma3_8k.json)
WINDOW_SPAN_BLOCK = 1024


def spans_pay_off(query: torch.Tensor, key: torch.Tensor, mask: torch.Tensor | None, window: int | None,
                  needs_mask: bool, block: int | None = None) -> bool:
    """Whether ``attend_in_spans`` may run this call and saves work: a first forward (its keys are its own tokens,
    ``Lq == Lk``: key column j is query j's token) of at least two spans, with the mask ``[B, 1 or H, Lq, Lk]``
    transformers built for it, or none where ``attend`` reads None as lower-right causal (``needs_mask`` False)."""
    n, block = query.shape[2], block or FIRST_FORWARD_QUERY_BLOCK
    if n != key.shape[2] or n < 2 * max(block, window or 0):
        return False
    if mask is None:
        return not needs_mask
    return mask.dim() == 4 and tuple(mask.shape[2:]) == (n, n)


def attend_in_spans(attend, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                    mask: torch.Tensor | None, window: int | None, block: int | None = None) -> torch.Tensor:
    """``attend(query, key, value, mask)`` -> ``[B, Lq, Hq, D]`` of a first forward (``spans_pay_off``), computed
    per block of queries ``[start, end)`` over the only keys any of them can see: ``[start - window, end)`` (causal,
    and within the sliding window when there is one), with the matching block of the mask. Each block's queries are
    the last of its keys, so a ``None`` mask stays lower-right causal. Exact: the keys left out are masked for every
    query of the block. Why: transformers' sliding mask makes one forward of ``n`` tokens attend ``n x n`` logits
    (100k tokens of Gemma 3: 40 sliding layers of 10^10 masked logits, 48 s to the first token on an H100) where
    ``n x window`` can be seen; causal layers without flash attention (sinks) skip the upper half."""
    n = query.shape[2]
    block = max(block or FIRST_FORWARD_QUERY_BLOCK, window or 0)
    parts = []
    for start in range(0, n, block):
        end = min(n, start + block)
        low = 0 if window is None else max(0, start - window)
        rows = None if mask is None else mask[:, :, start:end, low:end]
        parts.append(attend(query[:, :, start:end], key[:, :, low:end], value[:, :, low:end], rows))
    return torch.cat(parts, dim=1)


def dense_attention(
    layer: RocketKVLayer,
    module: torch.nn.Module,
    query: torch.Tensor,  # [B, Hq, Lq, D]
    key: torch.Tensor,  # [B, Hkv, Lk, D], Lk >= Lq
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    scaling: float,
    host_start: list[int] | None,
    features: LogitFeatures = PLAIN,
    **kwargs,
) -> torch.Tensor:
    """Exact attention of a dense (prefill) forward, ``[B, Lq, Hq, D]``.

    With sinks and no soft-capping (gpt-oss) where cuDNN runs and the mask is plain causal with the queries at the
    end: ``cudnn_causal_attention`` with the sinks applied through each row's log-sum-exp (``with_sinks``; an 8k
    prompt's full-attention layer at gpt-oss-20b shapes: 1.35 ms on an H200 against 7.5 ms for the SDPA-with-a-sink-key
    path, ``results/h200_2026-12-04_hybrid_prefill_gpt_oss_8k.json``). Other soft-capping or sinks:
    ``featured_attention`` with transformers' mask (a long first forward in spans of causal keys, ``attend_in_spans``).
    Otherwise, where flash attention can run (CUDA, 16-bit) and the mask is plain causal with the queries at the end (no
    mask and ``Lq == Lk``, a whole prompt, where cuDNN runs it; or no padding and ``Lq <= Lk``: a prefix hit's new
    tokens, a chunk of a chunked prefill): causal_prefill.py's ``cudnn_causal_attention`` for the former,
    ``causal_prefill_attention`` for the latter (cuDNN in bucketed shapes, flash's lower-right causal mode otherwise).
    There transformers would hand every new prompt length to cuDNN (a new execution graph, ~70 ms, per length) and, for
    a chunk, materialise the mask and copy every key and value once per query head (``repeat_kv``: 0.5 GiB per layer for
    32k keys at 8B shapes, as SDPA takes no mask together with grouped-query heads). Elsewhere (CPU, float32, padding)
    transformers' sdpa path: there the lower-right path would fall back to a materialised mask and the math kernel, no
    faster."""
    if not features.plain:
        prefix = key.shape[2] - query.shape[2]
        if features.softcap is None and cudnn_runs(query, key, value, prefix) and (
                square_causal(module, attention_mask, query, key)
                or lower_right_causal(layer, attention_mask, host_start, query.shape[2], key.shape[2])):
            return cudnn_causal_attention(query, key, value, scaling, prefix, features.sinks)

        def attend(q, k, v, mask):
            return featured_attention(q, k, v, allowed_of(mask), scaling, features)

        if spans_pay_off(query, key, attention_mask, None, needs_mask=False):
            return attend_in_spans(attend, query, key, value, attention_mask, None)
        return attend(query, key, value, attention_mask)
    if flash_attention_runs(query, key):
        if square_causal(module, attention_mask, query, key) and cudnn_runs(query, key, value, 0):
            return cudnn_causal_attention(query, key, value, scaling, 0)
        if lower_right_causal(layer, attention_mask, host_start, query.shape[2], key.shape[2]):
            return causal_prefill_attention(query, key, value, scaling)
    out, _ = sdpa_attention_forward(module, query, key, value, attention_mask, scaling=scaling, **kwargs)
    return out


def square_causal(module: torch.nn.Module, attention_mask: torch.Tensor | None, query: torch.Tensor,
                  key: torch.Tensor) -> bool:
    """Whether transformers' sdpa would run this call as plain causal attention: no mask (no padding), queries that
    are all the keys, more than one, a causal module (the ``is_causal`` it derives itself)."""
    return (attention_mask is None and query.shape[2] == key.shape[2] > 1
            and getattr(module, "is_causal", True) is not False)


def lower_right_causal(
    layer: RocketKVLayer, attention_mask: torch.Tensor | None, host_start: list[int] | None, n: int, kv_length: int
) -> bool:
    """Whether a dense forward's sdpa-style mask ``[B, 1, n, kv_length]`` is exactly lower-right causal (query j sees
    columns up to ``kv_length - n + j``) in every row. Compared on the device once per forward (every layer gets the
    same mask object; the answer is memoised with a weak reference to it) and only for masks that can be: no
    padding, no more queries than keys. Lower-right causal is the band of a window as wide as the keys
    (``window_prefill.is_window_band``, which checks the mask's shape too)."""
    if attention_mask is None or host_start is None or any(host_start) or n > kv_length:
        return False
    return call_state(layer).answer_of_mask("causal", attention_mask, (n, kv_length),
                                            lambda: is_window_band(attention_mask, n, kv_length, kv_length))


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


def padding_of_forward(
    layer: RocketKVLayer, attention_mask: torch.Tensor | None, kv_length: int
) -> tuple[torch.Tensor | None, list[int] | None]:
    """``padding_offsets`` and its host copy, read from the device once per forward: every layer of a forward gets
    the same mask object, so the later layers find the first one's answer in the cache's hints (a weak reference
    to the mask: a new forward's mask is a new object) instead of syncing again."""
    if attention_mask is None:
        return None, None
    def offsets() -> tuple[torch.Tensor, list[int]]:
        start = padding_offsets(attention_mask, kv_length)
        return start, start.tolist()

    return call_state(layer).answer_of_mask("padding", attention_mask, (kv_length,), offsets)


def real_queries(start: torch.Tensor | None, kv_length: int, n: int) -> torch.Tensor | None:
    """Which of a dense forward's ``n`` queries are real tokens, bool ``[B, n]`` (None: no padding): query j sits at
    column ``kv_length - n + j``, real from the row's padding offset ``start`` on."""
    if start is None:
        return None
    column = kv_length - n + torch.arange(n, device=start.device)
    return column[None, :] >= start[:, None]


def new_token_validity(attention_mask: torch.Tensor | None, n: int) -> torch.Tensor | None:
    """Which of a later turn's ``n`` new tokens are real, bool ``[B, n]`` (None: all), from the mask's last row.

    A batched later turn carries padding where rows added less text: after the previous turn's last generated token
    (fed back only now) and before the row's new text. The last query is a real token in every row and sees every
    real new token, so its mask row marks them.
    """
    if attention_mask is None:
        return None
    last_row = attention_mask[:, 0, -1, -n:]
    valid = last_row if last_row.dtype == torch.bool else last_row == 0
    if not bool(valid[:, -1].all()):
        raise ValueError(
            "RocketKV needs the last token of every row to be a real token (left padding): set "
            "tokenizer.padding_side='left'."
        )
    return None if bool(valid.all()) else valid
