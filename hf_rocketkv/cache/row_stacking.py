"""Row stacking: compressed layers of several row groups (row-group prefill) become one layer holding all their rows,
for a batched decode.

Each part's per-row tensors are padded on the slot axis to the widest part and concatenated on the batch axis:
positions ``[B_i, Hkv, C_i]`` -> ``[sum B_i, Hkv, C]`` (-1 padding), lengths ``[B_i]`` / ``[B_i, Hkv]``; a private
store's gathered K/V ``[B_i, Hkv, C_i, D]`` and KT ``[B_i, Hkv, C_i / KP, 2, D]`` the same way (zeros).
"""

from __future__ import annotations

import torch

from .capacity import fit_slots, pad_slots, private_history, private_view, slack_of
from .history import History


def stack_rows(parts: list, new_layer):
    """``RocketKVLayer.stack_rows``: one compressed layer holding the rows of ``parts`` in order.

    ``new_layer()`` makes the empty layer to fill: the adopting cache's own layer factory, so the stacked layer
    keeps its kind (stage-1 policy) and shares that cache's hints and pages. The parts saw the same input
    columns (one padded batch), so they share ``seen``; capacities may differ (rows shorter than the budget
    keep fewer tokens), so every part is padded with empty slots to the largest. Private stores are copied
    into one store; pool-backed views only concatenate their tables.
    """
    first = parts[0]
    if not all(part.compressed for part in parts):
        raise RuntimeError("RocketKVLayer.stack_rows needs compressed layers (stage 1 done on every row group)")
    layer = new_layer()
    layer.initialize_like(first)
    if layer.pages is not None:
        store = layer.pages.stacked_view(layer, [part.store for part in parts]).widened(
            max(part.capacity for part in parts))  # the parts' (bucketed) table width
    else:
        capacity = max(part.capacity for part in parts)
        gathered = [part.store.gather() for part in parts]
        kts = [part.store.gather_kt() for part in parts]
        store = private_view(layer, sum(part.batch_size for part in parts), capacity)
        store.write(torch.cat([pad_slots(k, capacity, 0) for k, _ in gathered]),
                    torch.cat([pad_slots(v, capacity, 0) for _, v in gathered]),
                    torch.cat([pad_slots(kt, capacity // first.config.page_size, 0) for kt in kts]))
    positions = torch.cat([pad_slots(part.positions, store.capacity, -1) for part in parts])
    host_max_length = max(part.host_max_length for part in parts)
    # every row of a stacked private store is as wide as the store; pool-backed rows keep their own pages
    host_slack = 0 if layer.pages is None else store.capacity - host_max_length - min(
        part.decode_room() for part in parts)
    if first.history is not None:
        layer.hold_history(_stack_histories(layer, [part.history for part in parts]))
    layer.hold_view(store, positions, torch.cat([part.lengths for part in parts]), host_max_length, host_slack,
                    first.generated.decode_queries)
    return layer


def _stack_histories(layer, parts: list[History]) -> History:
    """keep_all: the row groups' histories as one (private stores copied, pool-backed ones re-tabled)."""
    lengths = torch.cat([h.lengths for h in parts])
    counts = lengths.tolist()
    if layer.pages is not None:
        store = layer.pages.history_store(layer, 0).widened(max(h.store.capacity for h in parts))
    else:
        capacity = max(h.store.capacity for h in parts)
        store = private_history(layer, len(counts), capacity)
        gathered = [h.store.gather() for h in parts]
        store.write(torch.cat([pad_slots(k, capacity, 0) for k, _ in gathered]),
                    torch.cat([pad_slots(v, capacity, 0) for _, v in gathered]))
    positions = torch.cat([fit_slots(h.positions, store.capacity, -1) for h in parts])
    fixed = [f for h in parts for f in h.fixed]
    return History(store, positions, lengths, max(counts), fixed, slack_of(store, counts))
