"""BatchedSlidingLayer: a sliding-window layer of a ``BatchedDecodeCache`` (continuous batching of a hybrid model).

Each request decodes its sliding layers in its own slot of the pool's slab (``PooledSlidingLayer``, ``memory/
sliding_slab.py``): slot ``s`` holds, at ``[s, :, p % window]``, logical position ``p`` of that request. The batch
only needs, per row, which slot and how many tokens were seen, in fixed buffers (R = ``max_rows``):

    slots   [R] int64    row r's slot (padding rows: the batch's scratch slot)
    seen    [R] int64    tokens row r's request has seen: its next position (padding rows: 0)

A step over ``bucket`` rows writes each row's token at ``[slots[r], :, seen[r] % window]`` (``ring_append``),
then attends over the rows' rings where they lie in the slab (``ring_decode_attention`` through the slot ids, no
gather), each row over the slots it filled so far (``slot < min(seen, window)`` once the token is written: a ring
holds the last ``window`` positions, so its order does not matter to the softmax). Device ops only, fixed buffers: a CUDA graph per
bucket captures it (``integration/batch_graphs.py``). No K/V is copied when rows join, move or leave: only the slot
id and the length.
"""

from __future__ import annotations

import torch

from ..kernels.dispatch import get_ops
from .decode_record import RingRow
from .seam import tag
from .sliding_layer import SlidingWindowLayer


class BatchedSlidingLayer(SlidingWindowLayer):
    """One sliding layer of a ``BatchedDecodeCache`` (module docstring)."""

    def __init__(self, window: int, hints, layer_idx: int, chunked: bool = False, backend: str = "auto"):
        super().__init__(window, hints, layer_idx, chunked=chunked, backend=backend)
        self.slots_buf: torch.Tensor | None = None  # [R] int64
        self.seen_buf: torch.Tensor | None = None  # [R] int64 (a row of the batch's [layers, R] tensor)
        self.k_slab = self.v_slab = None

    def init_from(self, record: RingRow, max_rows: int, pool, seen: torch.Tensor) -> None:
        """dtype, device and shapes of a request's sliding layer (its record); buffers for ``max_rows`` rows."""
        self.dtype, self.device = record.dtype, record.device
        self.num_kv_heads, self.head_dim = record.num_kv_heads, record.head_dim
        probe = torch.empty(0, self.num_kv_heads, 0, self.head_dim, dtype=self.dtype, device=self.device)
        self.k_slab, self.v_slab = pool.sliding_slab(self.layer_idx, probe)
        self.slots_buf = torch.zeros(max_rows, dtype=torch.long, device=self.device)
        self.seen_buf = seen
        self.ring = self.is_initialized = True
        self.ops = get_ops(self.backend, self.device)

    # ------------------------------------------------------------------------------------------ rows
    def copy_in(self, record: RingRow, row: int) -> None:
        """Row ``row`` takes the request layer's slot and length (its record's layer)."""
        self.slots_buf[row] = record.slot
        self.seen_buf[row] = record.seen

    def move_row(self, src: int, dst: int) -> None:
        self.slots_buf[dst] = self.slots_buf[src]
        self.seen_buf[dst] = self.seen_buf[src]

    def clear_row(self, row: int) -> None:
        self.seen_buf[row] = 0

    def select(self, bucket: int, rows: int, scratch_slot: int | None) -> None:
        """Rows ``[rows, bucket)`` are padding: they write into (and read) the scratch slot."""
        if bucket > rows:
            self.slots_buf[rows:bucket] = scratch_slot
        self.row_slots = self.slots_buf[:bucket]
        self.row_seen = self.seen_buf[:bucket]

    # ------------------------------------------------------------------------------------------ the step
    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args, **kwargs):
        """Each row's token at ``[slot, :, seen % window]``; returns the rows' rings (tagged for the attention)."""
        if not (self.hints.in_graph or torch.compiler.is_compiling()):
            self.awaiting_attention = True
            self.host_seen += 1
        self.ops.ring_append(self.k_slab, self.v_slab, self.row_seen, key_states, value_states, self.row_slots)
        self.row_seen.add_(1)
        keys, values = self.k_slab[:], self.v_slab[:]  # fresh views, tagged as this layer's (the slab is shared)
        tag(keys, self)
        return keys, values

    reads_mask = False  # the rows have different lengths: each row's count says which slots it filled, so
    # ``attend_ring`` always reads the slab in place (it never hands back to the per-head-mask path of
    # ``SlidingWindowLayer.ring_mask`` / ``ring_rows``)

    def ring_store(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None, torch.Tensor]:
        """The pool's slab and the rows' slot ids and counts: the attention reads each row's ring where it lies. A
        chunked layer's row (ring of ``chunk`` slots) sees only its own chunk: after this step's token, at position
        ``p = seen - 1``, that is positions ``p - p % chunk`` ... ``p``, in slots ``0 .. p % chunk`` (slot of position
        ``q`` is ``q % chunk``), so its count is ``(seen - 1) % chunk + 1`` (device arithmetic, graph-safe)."""
        seen = self.row_seen
        if self.chunked:
            seen = torch.remainder(seen - 1, self.window) + 1
        return self.k_slab, self.v_slab, self.row_slots, seen

    def get_mask_sizes(self, query_length: int) -> tuple[int, int]:
        return self.window, 0

    def get_seq_length(self) -> int:
        raise RuntimeError("BatchedDecodeCache rows have different lengths: pass position_ids")

    def decode_room(self) -> int:
        return 1 << 62  # a ring never fills

    def reset(self) -> None:
        raise NotImplementedError("BatchedSlidingLayer.reset: rows leave one at a time (BatchedDecodeCache.leave)")
