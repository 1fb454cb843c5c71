"""Bytes one RocketKV decode step reads from a layer: what a benchmark divides by the step's time to report GB/s.

Stage 2 reads, per row and KV head, the KT summary (min and max keys) of every page in use, to score the pages, then
the keys and values of the tokens on the pages it selects. Counting the selected tokens needs the selection itself
(page scores, top-k, the slots of the chosen pages), which lives in the kernels and the selection math: the cache
floor may use them, the tools above may not, so the count is a function of this floor's public API.

The count follows the plain top-k over the layer's KT summaries with ``topr`` and ``topk`` (the query's own choice of
pages); it reads the layer through its contiguous views (``keys``, ``kt``: copies for a compressed layer), so it is
for measurement, never for a decode step's hot path.
"""

from __future__ import annotations

import torch

from ..kernels.sparse_decode_attention import selected_slots
from ..selection.stage2_pages import num_pages, per_head


def decode_read_bytes(layer, query: torch.Tensor) -> int:
    """Bytes a decode step of ``layer`` (a compressed ``RocketKVLayer``) reads for ``query`` ``[B, Hq, 1, D]``: the
    KT pages in use (min and max rows) plus K and V of every token on the pages stage 2 selects for this query.
    The query and the attention output themselves are not counted (the caller adds them: they are the same for
    every cache)."""
    keys, kt, config = layer.keys, layer.kt, layer.config
    batch, kv_heads, capacity, head_dim = keys.shape
    n_pages = num_pages(layer.lengths, config.page_size)  # [B] or, per-head budgets (AdaKV), [B, Hkv]
    kt_bytes = int(per_head(n_pages, batch, kv_heads).sum()) * kt.shape[-1] * 2 * kt.element_size()
    grouped = query.reshape(batch, kv_heads, -1, head_dim)
    scores = layer.ops.page_scores(grouped, kt, n_pages, config.topr)
    page_idx, page_valid = layer.ops.select_pages(scores, n_pages, config.topk)
    tokens = int(selected_slots(page_idx, page_valid, layer.lengths, config.page_size, capacity)[1].sum())
    return kt_bytes + tokens * head_dim * 2 * keys.element_size()
