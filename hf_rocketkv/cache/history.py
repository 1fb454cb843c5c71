"""keep_all multi-turn (``RocketKVConfig(multi_turn="keep_all")``, RocketKV-MT): every token of the conversation
stays in pages, so each later turn re-runs stage 1 over all of it. This file holds the history's record, its growth
and the prompt's real tokens left-aligned for it.

A row's history holds its real tokens in order (prompt, then every token fed back: generated ones, later turns),
padding never: slot s of row b is the row's s-th real token, ``positions[b, :, s]`` its input column. The view
(stage-1 survivors + generated tokens) is what decode attends to; decode appends to both. A later turn starts its
working set from the history instead of the view.

    store      PagedStore without KT (pool: the request's prompt tables, extended as the conversation grows; else the
               layer's own pages)
    positions  [B, Hkv, Ch] int32, -1 past a row's tokens
    lengths    [B] int64 tokens per row
    fixed      per row: leading tokens in pages that may be shared with other requests (prefix hits and committed
               prompt pages): never rewritten
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from .capacity import fit_slots, headroom, private_history, round_up, slack_of, slots_for
from .paged_store import PagedStore


@dataclass
class History:
    store: PagedStore
    positions: torch.Tensor
    lengths: torch.Tensor
    host_max_length: int
    fixed: list[int]
    slack: int = 0  # as RocketKVLayer.host_slack, for the history's rows

    def room(self) -> int:
        """Tokens every row can still take without growing (host mirror)."""
        return self.store.capacity - self.host_max_length - self.slack

    def move_to(self, store: PagedStore) -> None:
        """The history now lives in ``store`` (its tokens already there): the positions widened to its capacity,
        the slack recomputed from its pages."""
        self.store = store
        self.positions = fit_slots(self.positions, store.capacity, -1)
        self.slack = slack_of(store, self.lengths.tolist())

    def note_stored(self, count: int) -> None:
        """Every row took ``count`` more tokens (a decode step) or lost them (a crop: negative); host mirror."""
        self.host_max_length += count

    def drop_last(self, count: int) -> None:
        """Every row's last ``count`` tokens leave the history (a crop of decoded tokens; their K/V past the length
        is never read)."""
        rows = torch.arange(self.lengths.shape[0], device=self.lengths.device)
        for _ in range(count):
            self.lengths.sub_(1)
            self.positions[rows, :, self.lengths] = -1
        self.note_stored(-count)

    def move_rows(self, store: PagedStore, positions: torch.Tensor, lengths: torch.Tensor) -> None:
        """Other rows (picked by index, a batch of another size) in ``store``, pages of their own: none shared."""
        self.store, self.positions, self.lengths = store, positions, lengths
        self.fixed = [0] * lengths.shape[0]

    def hold_rows(self, positions: torch.Tensor, lengths: torch.Tensor) -> None:
        """The rows now hold ``lengths`` ``[B]`` tokens (already written into the store) at input columns
        ``positions`` ``[B, Hkv, *]``: a later turn's tokens joined the history."""
        counts = lengths.tolist()
        self.positions = fit_slots(positions, self.store.capacity, -1)
        self.lengths = lengths.clone()
        self.host_max_length = max(counts)
        self.slack = slack_of(self.store, counts)


def grow_history(layer, extra: int) -> None:
    """Make room for ``extra`` more tokens in every row of ``layer``'s keep_all history (eager): a private store is
    reallocated and copied; a pool-backed one takes more pages (reserved before the forward by generate())."""
    history = layer.history
    if history.room() >= extra:
        return
    capacity = round_up(history.host_max_length + extra + headroom(layer), layer.config.page_size)
    if layer.pages is not None:
        store = layer.pages.history_store(layer, capacity).widened(slots_for(layer, capacity))
    else:
        keys, values = history.store.gather()
        store = private_history(layer, keys.shape[0], slots_for(layer, capacity))
        store.write(keys, values)
    history.move_to(store)
    layer.mark_static()


def real_tokens_left_aligned(
    keys: torch.Tensor, values: torch.Tensor, row_start: list[int]
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, list[int]]:
    """A dense store's real tokens (columns ``[row_start[b], T)``) moved to the front of each row.

    ``keys``/``values`` ``[B, Hkv, T, D]``, ``row_start`` ``[B]`` host ints -> (keys, values ``[B, Hkv, W, D]``, positions
    ``[B, Hkv, W]`` int32 (input columns, -1 past the row's tokens), counts per row), W = the longest row.
    """
    batch, heads, width, dim = keys.shape
    starts = list(row_start)
    counts = [width - s for s in starts]
    if not any(starts):  # no padding: already left-aligned (no copy of the whole prompt, once per layer)
        positions = torch.arange(width, dtype=torch.int32, device=keys.device).expand(batch, heads, width)
        return keys, values, positions, counts
    out_w = max(counts)
    out_k = keys.new_zeros(batch, heads, out_w, dim)
    out_v = values.new_zeros(batch, heads, out_w, dim)
    positions = torch.full((batch, heads, out_w), -1, dtype=torch.int32, device=keys.device)
    for b, (start, count) in enumerate(zip(starts, counts)):
        out_k[b, :, :count] = keys[b, :, start:]
        out_v[b, :, :count] = values[b, :, start:]
        positions[b, :, :count] = torch.arange(start, width, dtype=torch.int32, device=keys.device)
    return out_k, out_v, positions, counts
