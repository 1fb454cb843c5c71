"""Where stage 1's outcome is written: a first turn's whole prompt into the pages that keep it (the pool's prompt
pages, keep_all's history), and each row's kept slots into a fresh paged view with their KT and positions.

Shapes (B batch, Hkv KV heads, T dense width, C view capacity, D head_dim): the dense store or working set
``layer.dense.keys`` / ``dense.values`` ``[B, Hkv, T, D]``; kept slots per row ``KeptSlots.slots`` ``[Hkv, M_b]``;
the view's positions ``[B, Hkv, C]`` int32; lengths ``[B]`` (or ``[B, Hkv]`` with per-head budgets).
"""

from __future__ import annotations

import torch

from ..host_copy import device_tensor, filled
from ..policies import KeptSlots
from .capacity import fit_slots, headroom, private_history, private_view, round_up, slack_of, slots_for
from .history import History, real_tokens_left_aligned
from .paged_store import write_tokens


def store_prompt(layer, row_start: torch.Tensor, host_row_start: list[int] | None) -> None:
    """A request's first stage 1: the prompt's real tokens (from each row's padding offset ``row_start`` ``[B]``, or
    its host mirror) go, whole, into the pages that keep them: the pool's prompt pages (shareable prefix pages;
    keep_all's history) and, without a pool, keep_all's private history. Pages a prefix hit shares with other
    requests are never written."""
    keep_all = layer.config.multi_turn == "keep_all"
    pool_prompt = layer.pages is not None and layer.pages.wants_prompt_pages()
    if not (keep_all or pool_prompt):
        return
    starts = host_row_start if host_row_start is not None else row_start.tolist()
    keys, values, positions, counts = real_tokens_left_aligned(layer.dense.keys, layer.dense.values, starts)
    if layer.pages is not None:
        store, fixed = layer.pages.prompt_store(layer)
        if keep_all:  # the history is read by decode steps: bucket its table width too
            store = store.widened(slots_for(layer, store.capacity))
    else:
        needed = round_up(max(counts) + headroom(layer), layer.config.page_size)
        store = private_history(layer, keys.shape[0], slots_for(layer, needed))
        fixed = [0] * len(counts)
    write_tokens(store, keys, values, fixed, counts)
    if keep_all:
        lengths = device_tensor(counts, torch.long, layer.device)
        layer.hold_history(History(store, fit_slots(positions, store.capacity, -1), lengths, max(counts), fixed,
                                   slack_of(store, counts)))


def compact(layer, kept: list[KeptSlots], columns: torch.Tensor | None, queries: torch.Tensor | None) -> None:
    """Gather the kept slots of every row, write them into a fresh paged view with their KT and positions
    (``ops.paged_compact_row``: one launch per row on the Triton backend); the dense store (or the working set)
    and the previous view are released. Per-head budgets (``per_head_lengths``): each row is as wide as its
    longest head, head h keeps ``counts[h]`` slots and ``lengths`` becomes ``[B, Hkv]``.

    ``columns`` ``[B, Hkv, T]``: the input column of each slot of a later turn's working set (None: a dense store,
    slot s is column s). ``queries``: stage 1's window ``[B, Hq, w, D]``, which tells decode-time compression's
    query buffer its head count."""
    batch, heads, _, dim = layer.dense.keys.shape
    head_counts = [row.counts.to(layer.device, torch.long) for row in kept] if layer.per_head_lengths else None
    counts = [row.slots.shape[1] for row in kept]  # the longest head of each row (host ints: no sync)
    needed = round_up(max(max(counts), 1) + headroom(layer), layer.config.page_size)
    if layer.pages is not None:  # the pool's pages hold what the request needs; only the table is bucketed
        store = layer.pages.view_store(layer, counts, needed - max(max(counts), 1))
        store = store.widened(slots_for(layer, store.capacity))
    else:
        store = private_view(layer, batch, slots_for(layer, needed))
    positions = torch.empty((batch, heads, store.capacity), dtype=torch.int32, device=layer.device)
    for b, row in enumerate(kept):  # one launch per row on the Triton backend (kernels/compact.py)
        layer.ops.paged_compact_row(
            layer.dense.keys[b], layer.dense.values[b], row.slots, columns[b] if columns is not None else None, store.k,
            store.v, store.kt, store.table[b], store.row_pages[b], positions[b], layer.config.page_size,
            k_scale=store.k_scale, v_scale=store.v_scale,
            counts=head_counts[b] if head_counts is not None else None,
        )
    if head_counts is not None:
        lengths = torch.stack(head_counts)  # [B, Hkv]
    else:
        lengths = filled(batch, counts, torch.long, layer.device)  # no pageable copy (a sync) per layer
    layer.hold_view(store, positions, lengths, max(counts), slack_of(store, counts), queries)
