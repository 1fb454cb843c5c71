"""``RocketOps``: the bundle of hot ops that every backend (PyTorch reference, Triton) provides.

Kept in its own module so that ``dispatch`` (which builds the bundles) and ``triton_ops`` (which fills the Triton
one) both import it without importing each other.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable


@dataclass(frozen=True)
class RocketOps:
    """Every hot op of both stages; see each reference for shapes.

    window_scores(q_window, keys, start, end, scaling) -> [B, Hkv, N] fp32        (stage 1, prefill)
    build_kt(keys, lengths, page_size, kt_dtype) -> kt [B, Hkv, C/P, 2, D]         (after stage 1)
    update_kt(kt, key_new, slot, page_size) -> None (in place)
    page_scores(q, kt, n_pages, topr, per_head_bound=False) -> probs [B, Hkv, NP]
    select_pages(probs, n_pages, topk, sink_pages=0, recent_pages=1) -> (page_idx, page_valid)
    sparse_decode_attention(q, keys, values, page_idx, page_valid, lengths, page_size, scaling, softcap=None,
                            sinks=None) -> [B, Hkv, G, D]
    append_token(keys, values, positions, kt, lengths, seen, key_new, value_new, page_size) -> None (in place)
    top_pages(q, kt, lengths, page_size, topr, topk, sink_pages=0, recent_pages=1, per_head_bound=False,
              softcap=None, scaling=None)
        -> (page_idx, page_valid)

    Paged decode (what RocketKVLayer uses; layout in kernels/paged.py):
    paged_append_token(k_pages, v_pages, kt_pages, table, positions, lengths, seen, key_new, value_new,
                       kt_page_size, k_scale=None, v_scale=None, advance_seen=False) -> None (in place;
                       advance_seen: seen is the count before the token and advances by 1)
    paged_append_kv(k_pages, v_pages, table, positions, lengths, seen, key_new, value_new, k_scale=None,
                    v_scale=None) -> None (no KT)
    paged_page_scores(q, kt_pages, table, n_pages, topr, per_head_bound=False) -> probs [B, Hkv, MP * R]
    paged_top_pages(q, kt_pages, table, lengths, kt_page_size, topr, topk, sink_pages=0, recent_pages=1,
                    per_head_bound=False, softcap=None, scaling=None, counters=None)
        -> (page_idx, page_valid)
    paged_sparse_decode_attention(q, k_pages, v_pages, table, page_idx, page_valid, lengths, kt_page_size,
                                  scaling, k_scale=None, v_scale=None, softcap=None, sinks=None, counters=None)
        -> [B, Hkv, G, D]
    (counters: int32 [>= B * Hkv] zeros, left 0: the Triton kernels' arrival counters, kernels/arrivals.py, one
    launch fewer each; the references ignore them)
    paged_fused_decode(q, kt_pages, k_pages, v_pages, table, lengths, kt_page_size, topr, topk, scaling,
                       sink_pages=0, recent_pages=1, per_head_bound=False, k_scale=None, v_scale=None)
        -> [B, Hkv, G, D]: paged_top_pages then paged_sparse_decode_attention in one op (kernels/fused_decode.py;
        the Triton op serves rows of up to FUSED_MAX_PAGES KT pages, fused_decode_supported says which; plain
        layers only: soft-capped or sink layers take the two ops above)

    softcap / sinks (logit features, ``selection/logit_features.py``): the scaled logits soft-capped as
    ``tanh(x / softcap) * softcap`` (top_pages: at the model's ``scaling`` instead of 1/sqrt(D)), and one sink logit
    per query head ``[Hq]`` in each softmax denominator.

    Stage 1's compaction (prefill, eager; one call per row):
    Sliding-window layers (decode, the ring read in place; kernels/ring_attention.py):
    ring_decode_attention(q, keys, values, seen, scaling, rows=None, mask=None, softcap=None, sinks=None)
        -> [B, Hkv, G, D]: q [B, Hkv, G, D] over rings [N, Hkv, W, D] (row b reads store row rows[b], or b),
        seen [B] or [] int64 counts with this step's token, mask [B or 1, W] bool in transformers' column order
    ring_append(keys, values, seen, key_new, value_new, rows=None, advance_seen=False, kept_keys=None,
                kept_values=None) -> None (in place: row b's token into slot seen[b] % W of store row rows[b]; seen
        is the count before it, advanced by 1 with advance_seen; kept_* [B, Hkv, 1, D]: the slots as they were;
        kernels/ring_append.py)

    paged_compact_row(keys, values, slots, columns, k_pages, v_pages, kt_pages, table, row_pages, positions,
                      kt_page_size, k_scale=None, v_scale=None, counts=None) -> None (in place: the row's pages,
                      their KT, positions; fp8: and their scales; counts [Hkv]: per-head kept counts, AdaKV)

    lengths / n_pages / slot: [B] (per row) or [B, Hkv] (per row and KV head) everywhere in decode.

    fp8 pages (the pool's float8_e4m3fn storage, arithmetic of kernels/fp8.py): k_scale / v_scale are float32 [N]
    (granularity "page": one scale per pool page, all KV heads) or [N, Hkv] ("head"), indexed by pool page id.
    Scales given <=> k_pages and v_pages are float8_e4m3fn; anything else (scales with float pages, fp8 pages
    without scales, a shape other than [N] / [N, Hkv], a dtype other than float32) raises ValueError
    (kernels/paged.check_fp8_scales).
    - reads (paged_sparse_decode_attention) dequantize: k = float(k_fp8) * k_scale[page(, head)].
    - decode appends (paged_append_token / paged_append_kv) follow the append rule (append_token.fp8_append_torch:
      scale reset at a page's first slot; the page re-quantized only when the token's amax grows its scale; the
      token quantized with the new scale), graph-safe; KT (from the unquantized key), positions and lengths as for
      float pages. [B, Hkv] lengths need "head" scales (ValueError with "page" scales). Triton backend: the append
      kernel applies the rule in place (the twin's bytes), still one launch and no host sync.
    - paged_compact_row quantizes the row's written pages over their valid tokens (kernels/fp8.quantize_pages) and
      writes their scales; Triton backend: its kernel stages the pages in float32, PyTorch quantizes them.
    """

    name: str
    window_scores: Callable
    build_kt: Callable
    update_kt: Callable
    page_scores: Callable
    select_pages: Callable
    sparse_decode_attention: Callable
    append_token: Callable
    top_pages: Callable
    paged_append_token: Callable
    paged_append_kv: Callable
    paged_page_scores: Callable
    paged_top_pages: Callable
    paged_sparse_decode_attention: Callable
    paged_fused_decode: Callable
    paged_compact_row: Callable
    ring_decode_attention: Callable
    ring_append: Callable
