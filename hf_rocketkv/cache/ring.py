"""Ring: where a sliding-window layer's decoding rows keep their last ``window`` tokens, and how many each has seen.

A sliding layer decodes into a ring of ``W`` slots per row and KV head: logical position ``p`` lives in slot ``p % W``
(``sliding_layer.py``). The ring is data, the same for the three places a sliding layer decodes:

    generate() without a pool   the layer's own storage, ``N = B`` (row b in storage row b), one count for all rows
    generate() over a pool      the pool's slab (``KVBlockPool.sliding_slab``), row b in its request's slot
    the engine's batch          the pool's slab, each row in its request's slot with its own count

Tensors (B rows, N storage rows, Hkv KV heads, W window, D head_dim):

    keys, values   [N, Hkv, W, D]     the storage, written in place (never reallocated: fixed addresses)
    rows           [B] int64 or None  the storage row of batch row b (None: b itself)
    seen           [] or [B] int64    tokens seen (this step's included once appended): one count when every row
                                      has seen the same (one left-padded batch, transformers' mask saying which
                                      slots hold padding), one per row when rows have their own lengths
    first          int or None        the rows as one consecutive span ``storage[first : first + B]`` (a view)
    overwritten    (k, v) or None     ``[B, Hkv, 1, D]`` each: what the last ``append`` replaced in the rows' slots,
                                      kept once ``keep_overwritten`` is called (one count for all rows), so that
                                      ``undo_append`` can take that step back (generate()'s deferred stop check)

Every op is a device op on these tensors (the slot ids and the counts are device tensors): no host sync, so a CUDA
graph of the decode step captures it. The layer owns its ring; the engine's batch owns the buffers its rows' slot ids
and counts are views of.
"""

from __future__ import annotations

import torch


class Ring:
    """A sliding layer's decode ring (module docstring)."""

    def __init__(self, keys: torch.Tensor, values: torch.Tensor, rows: torch.Tensor | None, seen: torch.Tensor,
                 first: int | None = None):
        self.keys, self.values = keys, values
        self.rows = rows
        self.seen = seen
        self.first = first
        self.overwritten: tuple[torch.Tensor, torch.Tensor] | None = None

    @classmethod
    def laid_out(cls, ordered_k: torch.Tensor, ordered_v: torch.Tensor, seen_tokens: int, window: int,
                 slab: tuple[torch.Tensor, torch.Tensor] | None = None, slots: torch.Tensor | None = None,
                 slot_ids: list[int] | None = None) -> "Ring":
        """A ring holding ``ordered_k`` / ``ordered_v`` ``[B, Hkv, stored, D]``, the columns of positions ``seen_tokens
        - stored`` ... ``seen_tokens - 1``, with one count ``seen_tokens``: in storage of its own (zeros elsewhere), or
        in the rows' ``slots`` of the pool's ``slab`` (``slot_ids`` the same on the host; their earlier owner's bytes
        zeroed first)."""
        stored, device = ordered_k.shape[2], ordered_k.device
        positions = torch.remainder(torch.arange(stored, device=device) + seen_tokens - stored, window)
        seen = torch.tensor(seen_tokens, dtype=torch.long, device=device)
        if slab is None:
            batch, heads, _, dim = ordered_k.shape
            keys = ordered_k.new_zeros(batch, heads, window, dim).index_copy_(2, positions, ordered_k)
            values = ordered_v.new_zeros(batch, heads, window, ordered_v.shape[3]).index_copy_(2, positions, ordered_v)
            return cls(keys, values, None, seen)
        for storage, ordered in zip(slab, (ordered_k, ordered_v)):
            rows = storage.index_select(0, slots)
            rows.zero_()
            rows.index_copy_(2, positions, ordered)
            storage.index_copy_(0, slots, rows)
        first = slot_ids[0] if slot_ids == list(range(slot_ids[0], slot_ids[0] + len(slot_ids))) else None
        return cls(*slab, slots, seen, first)

    # ------------------------------------------------------------------------------------------ reads
    @property
    def batch_size(self) -> int:
        return self.rows.shape[0] if self.rows is not None else self.keys.shape[0]

    @property
    def window(self) -> int:
        return self.keys.shape[2]

    @property
    def per_row(self) -> bool:
        """Whether each row has its own count (the engine's batch)."""
        return self.seen.dim() == 1

    def row_tensors(self) -> tuple[torch.Tensor, torch.Tensor]:
        """The rows' rings ``[B, Hkv, W, D]`` in slot order: the storage, a view of it, or a gather of the rows."""
        if self.rows is None:
            return self.keys, self.values
        if self.first is not None:
            end = self.first + self.rows.shape[0]
            return self.keys[self.first : end], self.values[self.first : end]
        return self.keys.index_select(0, self.rows), self.values.index_select(0, self.rows)

    def returned(self) -> tuple[torch.Tensor, torch.Tensor]:
        """What a decode step's ``update`` hands the attention function (which reads the ring through
        ``SlidingWindowLayer.ring_store``): the storage itself when the rows are its rows, the rows' view when
        consecutive, else a fresh view of the whole storage (never a gather)."""
        if self.rows is None or self.first is not None:
            return self.row_tensors()
        return self.keys[:], self.values[:]

    def ordered(self, stored: int, seen_tokens: int) -> tuple[torch.Tensor, torch.Tensor]:
        """The last ``stored`` positions before ``seen_tokens`` as ordered columns ``[B, Hkv, stored, D]`` (copies)."""
        positions = torch.remainder(torch.arange(stored, device=self.keys.device) + seen_tokens - stored, self.window)
        keys, values = self.row_tensors()
        return keys.index_select(2, positions), values.index_select(2, positions)

    def mask(self, attention_mask: torch.Tensor | None) -> torch.Tensor:
        """A decode step's mask over a ring of one count, ``[B or 1, 1, 1, W]`` in slot order: transformers' mask
        (``W`` columns, column ``c`` being position ``max(0, seen - W) + c``) reordered, or without one the filled
        slots. Device arithmetic only (graph-safe); call it after ``append``."""
        window = self.window
        newest = self.seen - 1  # the new token's position
        offset = (newest - window + 1).clamp(min=0)
        column = torch.remainder(torch.arange(window, device=self.seen.device) - offset, window)
        if attention_mask is None:
            return (column <= newest - offset)[None, None, None, :]
        return attention_mask.index_select(-1, column)

    def nbytes(self) -> int:
        """Bytes of the rows' rings (their slots, not the whole slab)."""
        per_row = self.keys[0].numel() * self.keys.element_size() + self.values[0].numel() * self.values.element_size()
        return self.batch_size * per_row

    # ------------------------------------------------------------------------------------------ writes
    def append(self, ops, key_new: torch.Tensor, value_new: torch.Tensor) -> None:
        """Each row's ``[B, Hkv, 1, D]`` token at slot ``seen % W`` of its ring, then every count advances (in the
        append's launch where each program owns its row's count). While ``overwritten`` is kept, the same launch
        copies each slot's previous contents there first."""
        kept = self.overwritten or (None, None)
        ops.ring_append(self.keys, self.values, self.seen, key_new, value_new, self.rows, advance_seen=True,
                        kept_keys=kept[0], kept_values=kept[1])

    def keep_overwritten(self) -> None:
        """From the next ``append`` on, keep what each one replaces, so that the last one can be undone."""
        if self.per_row:
            raise NotImplementedError("Ring.keep_overwritten: rows with counts of their own (the engine's batch) "
                                      "take no step back")
        if self.overwritten is None:
            keys, values = self.row_tensors()
            self.overwritten = (keys.new_zeros(*keys.shape[:2], 1, keys.shape[3]),
                                values.new_zeros(*values.shape[:2], 1, values.shape[3]))

    def undo_append(self) -> None:
        """Take the last ``append`` back: its slot holds what it held before, the count is one lower (device ops)."""
        if self.overwritten is None:
            raise RuntimeError("Ring.undo_append: nothing kept (keep_overwritten before the append)")
        slot = torch.remainder(self.seen - 1, self.window).reshape(1)
        rows = self.rows if self.rows is not None else torch.arange(self.overwritten[0].shape[0], device=slot.device)
        for kept, storage in zip(self.overwritten, (self.keys, self.values)):
            storage[rows[:, None], :, slot] = kept[:, :, 0][:, None]  # [B, 1, Hkv, D] into each row's slot
        self.seen.sub_(1)

    def reorder(self, index: torch.Tensor) -> None:
        """Beam search: row b takes row ``index[b]``'s ring (in place: the rows keep their storage)."""
        if self.rows is None:
            self.keys.copy_(self.keys.index_select(0, index))
            self.values.copy_(self.values.index_select(0, index))
            return
        source = self.rows.index_select(0, index)
        for storage in (self.keys, self.values):
            storage.index_copy_(0, self.rows, storage.index_select(0, source))


__all__ = ["Ring"]
