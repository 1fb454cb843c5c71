"""Stage 2 of a decode step on a compressed layer: score its KT pages, take the top-k per KV head, exact attention
over their tokens, all read from the layer's pages through its block table.

Shapes (B batch, Hq query heads, Hkv KV heads, G = Hq / Hkv, D head_dim): the step's query ``[B, Hq, 1, D]`` is
viewed as ``q`` ``[B, Hkv, G, D]`` (query head h reads KV head ``h // G``); the output ``[B, Hkv, G, D]`` is returned
to the attention function as ``[B, 1, Hq, D]``.
"""

from __future__ import annotations

import torch

from ..kernels.fused_decode import fused_decode_supported
from ..policies.stage2 import every_page
from .op_graphs import buffers_key


def decode_attention(layer, query: torch.Tensor, scaling: float) -> torch.Tensor:
    """``RocketKVLayer.attend_decode``: stage 2 for one new token per row, ``query`` ``[B, Hq, 1, D]`` ->
    ``[B, 1, Hq, D]``. Eager steps on CUDA run the launches through the layer's "attention" OpGraph
    (``RocketKVLayer.eager_graphs``, ``cache/op_graphs.py``); the query then joins decode-time compression's window."""
    batch, num_q_heads, _, head_dim = query.shape
    num_kv_heads = layer.num_kv_heads
    q = query.reshape(batch, num_kv_heads, num_q_heads // num_kv_heads, head_dim)  # a view for decode layouts
    # the layer's arrival counters, made at its first decode step (before an OpGraph captures them)
    counters = layer.arrivals.get(batch * num_kv_heads, q.device)
    if layer.eager_graphs():
        store = layer.store
        key = buffers_key(store.kt, store.k, store.v, store.table, layer.lengths, store.k_scale, store.v_scale,
                          counters)
        out = layer.op_graphs["attention"](key + (scaling,),
                                           lambda q_: stage2_attention(layer, q_, scaling, counters), q,
                                           hints=layer.hints)
    else:
        out = stage2_attention(layer, q, scaling, counters)
    layer.record_decode_query(query)  # decode-time compression's scoring window (no-op when it is off)
    # [B, Hkv, G, D] -> [B, 1, Hq, D]: the size-1 axes make this transpose a contiguous view
    return out.reshape(batch, num_q_heads, 1, head_dim).transpose(1, 2)


# RocketKVConfig.stage2_kernel="auto": whether the Triton backend runs a plain layer's stage 2 as the fused op
# (kernels/fused_decode.py). Off until it is measured against the split ops on a GPU (benchmarks/fused_decode.py).
AUTO_FUSED = False


def fused_stage2(layer) -> bool:
    """Whether ``stage2_attention`` runs the fused op (``ops.paged_fused_decode``) for this plain layer: the one
    place where the choice is made and where the fused op declines. Host-side facts only (no device sync): the
    config asks for it (``stage2_kernel`` "fused", or "auto" with ``AUTO_FUSED``), the backend is Triton (the
    PyTorch backend's reference is the same composition either way), stage 2 selects pages (``stage2="kt_pages"``)
    and the rows' KT pages fit the fused selection (``fused_decode_supported``); a layer with soft-capping or sinks
    (``layer.features``) takes the split ops, which apply them."""
    config, store = layer.config, layer.store
    wanted = config.stage2_kernel == "fused" or (config.stage2_kernel == "auto" and AUTO_FUSED)
    if not wanted or layer.ops.name != "triton" or config.stage2 != "kt_pages" or not layer.features.plain:
        return False
    return fused_decode_supported(store.kt, store.table) is None


def stage2_attention(layer, q: torch.Tensor, scaling: float, counters: torch.Tensor | None = None) -> torch.Tensor:
    """The launches of a decode step's stage 2: ``q`` [B, Hkv, G, D] -> attention output [B, Hkv, G, D];
    ``counters``: the layer's arrival counters (``RocketKVLayer.arrivals``; None: two-launch selection merge and
    attention combine).

    A layer whose logits are soft-capped and/or have sinks (``layer.features``) passes them to the same ops: the
    page selection scores soft-capped page logits at the model's scale (``stage2_pages.capped_page_scores``; sinks,
    a per-head constant, leave the page scores alone) and the attention over the selected tokens applies the cap
    and the sinks."""
    num_kv_heads = layer.num_kv_heads
    config, ops, store, features = layer.config, layer.ops, layer.store, layer.features
    if fused_stage2(layer):  # scoring, selection and attention in one op (1-3 launches)
        sink_pages, recent_pages = config.stage2_forced_pages
        return ops.paged_fused_decode(q, store.kt, store.k, store.v, store.table, layer.lengths, config.page_size,
                                      config.topr, config.topk, scaling, sink_pages=sink_pages,
                                      recent_pages=recent_pages, per_head_bound=config.stage2_per_head_bound,
                                      k_scale=store.k_scale, v_scale=store.v_scale)
    capped = {} if features.softcap is None else {"softcap": features.softcap, "scaling": scaling}
    featured = {} if features.plain else {"softcap": features.softcap, "sinks": features.sinks}
    if config.stage2 == "none":  # stage 1 only: every kept page, no scoring
        page_idx, page_valid = every_page(layer.lengths, num_kv_heads, store.capacity // config.page_size,
                                          config.page_size)
    else:
        # top_pages derives the page counts from the token counts itself (no num_pages launches) and, in Triton,
        # selects from the scoring pass's logits without writing the page probabilities; the sink and recent pages
        # (stage2_sink_tokens / stage2_recent_tokens, Python ints) are forced in, inside the topk
        sink_pages, recent_pages = config.stage2_forced_pages
        page_idx, page_valid = ops.paged_top_pages(q, store.kt, store.table, layer.lengths, config.page_size,
                                                   config.topr, config.topk, sink_pages=sink_pages,
                                                   recent_pages=recent_pages,
                                                   per_head_bound=config.stage2_per_head_bound, counters=counters,
                                                   **capped)
    return ops.paged_sparse_decode_attention(
        q, store.k, store.v, store.table, page_idx, page_valid, layer.lengths, config.page_size, scaling,
        k_scale=store.k_scale, v_scale=store.v_scale, counters=counters, **featured
    )
