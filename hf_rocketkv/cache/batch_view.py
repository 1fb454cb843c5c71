"""BatchedDecodeCache: the decoding rows of several single-row, pool-backed RocketKVCaches as one batch.

A continuous-batching engine prefills each request with its own ``RocketKVCache(cfg, pool=pool)`` (batch 1:
admission, prefix reuse and stage 1 exactly as generate() does them), then decodes every running request in one
forward. This cache is what that forward takes as ``past_key_values``: each of its layers is a compressed
``RocketKVLayer`` whose store is the pool's page tensors read through a block table made of the rows' own view
tables, so the normal decode path runs unchanged (``paged_append_token`` writes each row's token into that row's own
pages, stage 2 scores that row's KT pages, sparse attention reads them). No K/V is copied: the pages are the pool's.

    batch = BatchedDecodeCache(pool, max_rows=8)
    batch.join(row, request_cache)     # the request moves in: its table row, lengths, positions, logical length,
                                       # and its pool pages (the request cache is left empty)
    batch.move(src, dst)               # a packed batch: the last row fills a finished one
    batch.prepare(rows, bucket)        # rows [rows, bucket) become padding rows
    model(ids [bucket, 1], position_ids=batch.next_positions(bucket), past_key_values=batch)
    batch.leave(row)                   # the request is over: its pages go back to the pool

One owner per request (the choice made here): a request is prefilled in its own cache and then *moves* into a row:
``join`` copies its decode state, its ``KVRecord`` (``decode_record.py``), into the row (one copy per layer; the
batch reads records, never the cache's layers, and builds its own layers from the first one) and takes its pool
holdings
(``RocketKVCache.hand_over``: block tables and sliding-window slot), so from then on this object alone holds the
request's KV: its per-row tensors are the truth for the row's lengths, positions and logical length, and ``leave``
gives the pages back. Nothing is written back and no cache waits for its row: a row costs one copy when it joins or
moves, and the buffers never move while their width holds (static views per bucket, which a CUDA graph of the
decode step can capture).

Buffers per layer (R = ``max_rows``, MP = table width in pool pages, PP = tokens per pool page, C = MP * PP):

    table      [R, MP] int32        row r's view pages (its request's view table), -1 after them
    lengths    [R] int64            tokens stored per row
    positions  [R, Hkv, C] int32    input column of every stored token, -1 for empty slots
    seen       [R] int64            logical tokens of each row's request: the row's next position

A step over ``bucket`` rows uses the first ``bucket`` entries (views of the buffers). Rows ``[rows, bucket)`` are
padding: their table row names one scratch page that this object takes from the pool while padding rows exist
(``ensure_scratch``; no request's table names it; ``release_scratch`` gives it back when the batch empties), their
length and logical length start at 0, so a padding row writes its token into that page, attends to that
token alone (no empty softmax, no NaN) and its output is dropped. Real rows never read the scratch page, so padding
changes no real row's output (tested by comparing bucketed runs with runs on exact batch sizes).

Consistency checks are those of a RocketKVCache (``check_layers_consistent``: keys consumed by a rocketkv attention
call, every layer at the same host count), plus: one token per row, the batch size of the prepared bucket, and each
row's room (a row past its admitted pages raises before the step: the paged kernels would drop such a write
silently).
"""

from __future__ import annotations

import weakref

import torch
from transformers import Cache

from ..memory import KVBlockPool
from ..memory.errors import PoolExhaustedError
from .cache import RocketKVCache
from .consistency import check_layers_consistent
from .decode_record import KVRecord, LayerSettings, PagedRow, RingRow
from .layer import GenerationHints, RocketKVLayer
from .paged_store import PagedStore
from .sliding_layer import SlidingWindowLayer


class BatchedDecodeLayer(RocketKVLayer):
    """One model layer of a ``BatchedDecodeCache``: a compressed RocketKVLayer over persistent per-row buffers.

    Only one-token decode steps: ``update`` appends one token per row (``seen`` is per row, so each row's token is
    recorded at its own input column) and returns the per-bucket handles the attention function finds this layer by.
    Eager steps launch plainly (no OpGraphs): rows join, move and leave between steps.
    """

    EAGER_GRAPHS = False

    def __init__(self, config, hints: GenerationHints, layer_idx: int, scales_rows_by_position: bool = False):
        super().__init__(config, hints, pages=None, layer_idx=layer_idx)
        # the model scales this layer's queries by position (Llama 4's NoPE layers): the attention function scales
        # each row's by its own (integration/position_temperature.py), the batch answering 0 for its length
        self.scales_rows_by_position = scales_rows_by_position
        self.table_buf: torch.Tensor | None = None  # [R, MP] int32
        self.lengths_buf: torch.Tensor | None = None  # [R] int64
        self.positions_buf: torch.Tensor | None = None  # [R, Hkv, C] int32
        self.seen_buf: torch.Tensor | None = None  # [R] int64
        self._handles: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}

    def init_from(self, spec: LayerSettings, max_rows: int, width: int, pool: KVBlockPool, lengths: torch.Tensor,
                  seen: torch.Tensor) -> None:
        """Settings, dtype, device and kernels of a request's compressed layer (its record's ``runs_with``); buffers
        for ``max_rows`` rows of ``width`` pool pages (all rows padding). ``lengths`` / ``seen``: ``[max_rows]``
        int64 zeros, this layer's buffers (views of the batch's ``[layers, max_rows]`` tensors, so padding rows are
        reset for every layer in one op)."""
        self.config = spec.config  # the effective config (stage-2 options, KT page size)
        self.dtype, self.device, self.ops = spec.dtype, spec.device, spec.ops
        self.num_kv_heads, self.head_dim = spec.num_kv_heads, spec.head_dim
        self.policy, self.features = spec.policy, spec.features  # soft-capping / sinks (stage 2's logits)
        self.storage = pool.layer(self.layer_idx)
        self.page_tokens = self.storage.k.shape[2]
        self.table_buf = torch.full((max_rows, width), -1, dtype=torch.int32, device=self.device)
        self.lengths_buf = lengths
        self.positions_buf = torch.full((max_rows, self.num_kv_heads, width * self.page_tokens), -1,
                                        dtype=torch.int32, device=self.device)
        self.seen_buf = seen
        self.arrivals.reserve(max_rows * self.num_kv_heads, self.device)  # every bucket's steps share them
        self.compressed = self.is_initialized = True

    @property
    def width(self) -> int:
        return self.table_buf.shape[1]

    def copy_in(self, record: PagedRow, row: int) -> None:
        """Row ``row`` takes the request's table row and positions (its record's layer; the batch writes the row's
        length and logical length into its ``[layers, rows]`` counts)."""
        if record.runs_with.page_tokens != self.page_tokens:
            raise ValueError("BatchedDecodeCache.join: the cache's pages are not this pool's")
        pages, width = record.width, record.positions.shape[1]
        self.table_buf[row].fill_(-1)
        self.table_buf[row, :pages] = record.table
        self.positions_buf[row].fill_(-1)
        self.positions_buf[row, :, :width] = record.positions

    def move_row(self, src: int, dst: int) -> None:
        """Row ``src``'s table and positions move to row ``dst`` (its counts are the batch's to move)."""
        for buf in (self.table_buf, self.positions_buf):
            buf[dst] = buf[src]

    def clear_row(self, row: int) -> None:
        """Row ``row``'s table and positions back to padding (its counts are the batch's to reset)."""
        self.table_buf[row].fill_(-1)
        self.positions_buf[row].fill_(-1)

    def widen(self, width: int) -> None:
        """Tables of ``width`` pages (a row with more view pages than any before joined); contents kept."""
        rows, old = self.table_buf.shape
        table = torch.full((rows, width), -1, dtype=torch.int32, device=self.device)
        table[:, :old] = self.table_buf
        positions = torch.full((rows, self.num_kv_heads, width * self.page_tokens), -1, dtype=torch.int32,
                               device=self.device)
        positions[:, :, : self.positions_buf.shape[2]] = self.positions_buf
        self.table_buf, self.positions_buf = table, positions

    def select(self, bucket: int, row_pages: tuple[int, ...]) -> None:
        """Point the decode path (store, lengths, positions, seen, handles) at rows ``[0, bucket)``."""
        table = self.table_buf[:bucket]
        self.store = PagedStore.over(self.storage, table, row_pages, self.dtype)
        self.lengths = self.lengths_buf[:bucket]
        self.positions = self.positions_buf[:bucket]
        self.seen = self.seen_buf[:bucket]
        if bucket not in self._handles:
            handle = torch.empty((bucket, self.num_kv_heads, 0, self.head_dim), dtype=self.dtype, device=self.device)
            self._handles[bucket] = (handle, torch.empty_like(handle))
        self.key_handle, self.value_handle = self._handles[bucket]
        self.tag_keys()

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args, **kwargs):
        """Append one token per row through the rows' tables (no host sync); returns the bucket's handles."""
        if self.host_bookkeeping():
            self.awaiting_attention = True  # cleared by the attention function (BatchedDecodeCache checks it)
            self.host_seen += 1
        store = self.store
        self.ops.paged_append_token(  # each row's count advances in the same launch
            store.k, store.v, store.kt, store.table, self.positions, self.lengths, self.seen,
            key_states[:, :, 0], value_states[:, :, 0], self.config.page_size,
            k_scale=store.k_scale, v_scale=store.v_scale, advance_seen=True,
        )
        return self.key_handle, self.value_handle

    def get_seq_length(self) -> int:
        raise RuntimeError(
            "BatchedDecodeCache rows have different lengths: pass position_ids (each row's next position, "
            "BatchedDecodeCache.next_positions) to the model instead of asking the cache for one length"
        )

    def reset(self) -> None:
        raise NotImplementedError("BatchedDecodeLayer.reset: rows leave one at a time (BatchedDecodeCache.leave)")


class BatchedDecodeCache(Cache):
    """Rows of single-row pool-backed RocketKVCaches decoding as one batch (see the module docstring).

    Args:
        pool: the KVBlockPool every joining cache draws its pages from (one scratch page is taken from it while
            padding rows exist: ``ensure_scratch`` / ``release_scratch``).
        max_rows: rows at most (the largest decode bucket).
        position_scaled_layers: the layers whose attention reads the cache's length to scale its queries by
            position (``memory.layer_kinds.position_scaled_layers``, Llama 4): ``get_seq_length(layer)`` is 0 there
            and the ``rocketkv`` attention function scales each row's query by the row's own position.
    """

    def __init__(self, pool: KVBlockPool, max_rows: int, position_scaled_layers: frozenset[int] = frozenset()):
        if not isinstance(pool, KVBlockPool):
            raise TypeError(f"BatchedDecodeCache(pool=...) takes a KVBlockPool, got {type(pool).__name__}")
        if not isinstance(max_rows, int) or max_rows < 1:
            raise ValueError(f"BatchedDecodeCache.max_rows must be an integer >= 1, got {max_rows!r}")
        super().__init__(layers=[])
        self.pool = pool
        self.max_rows = max_rows
        self.position_scaled_layers = frozenset(position_scaled_layers)
        self.hints = GenerationHints()
        self.held: list[list | None] = [None] * max_rows  # each row's pool holdings (RocketKVCache.hand_over)
        # a batch dropped with rows still joined (an engine that died) queues their holdings; the pool releases them
        # at its next call (as a RocketKVCache dropped without close() does)
        weakref.finalize(self, _release_later, pool, self.held)
        self.row_pages: list[int] = [0] * max_rows  # view pages of each row's table
        self.room: list[int] = [0] * max_rows  # decode steps each row can still take (host mirror)
        self.steps: list[int] = [0] * max_rows  # decode steps since the row joined
        self.bucket = 0
        self.rows = 0
        self.version = 0  # bumped whenever a buffer is reallocated (a captured step must be captured again)
        self._zero = None
        # every layer's lengths / logical lengths as rows of one tensor each ([layers, max_rows] int64): a step's
        # padding rows are reset in one op, not 2 per layer
        self._lengths_all: torch.Tensor | None = None
        self._seen_all: torch.Tensor | None = None
        self._slots: torch.Tensor | None = None  # [max_rows] int64: each row's sliding-window slot (hybrid models)
        # what the layers' views point at: (rows, bucket, version, layout); ``prepare`` redoes the per-layer views
        # and the padding rows' tables only when it changes (join, leave, move, widen, scratch page), so a step of
        # an unchanged batch costs two ops instead of ~4 per layer
        self._layout = 0
        self._prepared: tuple | None = None
        self.scratch = pool.new_table("view")  # the padding rows' page, held only while padding is needed
        self.scratch_slot = None  # and their sliding-window slot (a model with sliding layers)

    # ------------------------------------------------------------------------------------------ rows
    def join(self, row: int, cache: RocketKVCache) -> None:
        """The request of ``cache`` (one row, compressed, pool-backed) moves into row ``row``: its decode state (its
        ``KVRecord``, copied into the row) and its pool holdings; ``cache`` is left empty
        (``RocketKVCache.hand_over``). On an error nothing moved."""
        self._check_row(row)
        if self.held[row] is not None:
            raise ValueError(f"BatchedDecodeCache row {row} is taken (leave it first)")
        if cache.pool is not self.pool:
            raise ValueError("BatchedDecodeCache.join: the cache draws its pages from another pool (or none)")
        record = KVRecord.of(cache)
        try:
            self._ensure_layers(record)
            for index, (mine, theirs) in enumerate(zip(self.layers, record.layers)):
                self._seen_all[index, row] = theirs.seen
                if isinstance(theirs, RingRow):  # a sliding layer's row: its slot and count (the batch's buffers)
                    self._slots[row] = theirs.slot
                else:
                    self._lengths_all[index, row] = theirs.length
                    mine.copy_in(theirs, row)
            held = cache.hand_over()  # the last step: from here on the row owns the request's pages
        except BaseException:
            self._clear(row)
            raise
        self.held[row], self.row_pages[row], self.room[row], self.steps[row] = held, record.row_pages, record.room, 0
        self._layout += 1

    def leave(self, row: int) -> None:
        """Row ``row``'s request is over: its pool pages (and slot) go back, the row is free."""
        held = self._held_at(row)
        self._clear(row)
        for item in held:
            self.pool.release(item)

    def holds(self, row: int) -> bool:
        """Whether a request occupies row ``row``."""
        self._check_row(row)
        return self.held[row] is not None

    def move(self, src: int, dst: int) -> None:
        """Row ``src`` moves to the free row ``dst`` (packing after a row left)."""
        self._held_at(src)
        self._check_row(dst)
        if self.held[dst] is not None:
            raise ValueError(f"BatchedDecodeCache.move: row {dst} is taken")
        for layer in self.layers:
            if not layer.is_sliding:
                layer.move_row(src, dst)
        for counts in (self._lengths_all, self._seen_all):
            counts[:, dst] = counts[:, src]
        self._slots[dst] = self._slots[src]
        for values in (self.held, self.row_pages, self.room, self.steps):
            values[dst] = values[src]
        self._clear(src)  # (bumps the layout)

    def prepare(self, rows: int, bucket: int) -> None:
        """The next step decodes rows ``[0, rows)`` (all joined) padded to ``bucket`` rows: rows ``[rows,
        bucket)`` become padding (scratch page, length 0). Raises when a real row has no room left."""
        if not 1 <= rows <= bucket <= self.max_rows:
            raise ValueError(f"BatchedDecodeCache.prepare: need 1 <= rows ({rows}) <= bucket ({bucket}) <= "
                             f"max_rows ({self.max_rows})")
        for row in range(rows):
            self._held_at(row)
            if self.room[row] < 1:
                raise RuntimeError(
                    f"BatchedDecodeCache row {row} has no room for another token ({self.steps[row]} decoded): its "
                    f"request was admitted for fewer new tokens than it is decoding")
        if any(held is not None for held in self.held[rows:bucket]):
            raise ValueError(f"BatchedDecodeCache.prepare: rows [{rows}, {bucket}) must be free (padding)")
        if bucket > rows and not self._has_scratch():
            raise RuntimeError("BatchedDecodeCache.prepare: padding rows need the scratch page (ensure_scratch)")
        if bucket > rows:  # the last step advanced the padding rows too: back to empty
            self._lengths_all[:, rows:bucket] = 0
            self._seen_all[:, rows:bucket] = 0
        key = (rows, bucket, self.version, self._layout)
        if key != self._prepared:
            scratch = self.scratch.pages[0] if bucket > rows and len(self.scratch) else -1
            slot = self.scratch_slot.index if bucket > rows and self.scratch_slot is not None else None
            row_pages = tuple(self.row_pages[:rows]) + (1,) * (bucket - rows)
            if bucket > rows and slot is not None:
                self._slots[rows:bucket] = slot  # padding rows write into (and read) the scratch slot
            for index, layer in enumerate(self.layers):
                if layer.is_sliding:
                    layer.decode_rows(self._slots[:bucket], self._seen_all[index, :bucket])
                    continue
                layer.table_buf[rows:bucket, 0] = scratch  # (their other entries are -1 already: _clear)
                layer.select(bucket, row_pages)
            self._prepared = key
        self.rows, self.bucket = rows, bucket

    def next_positions(self, bucket: int | None = None) -> torch.Tensor:
        """``[bucket, 1]`` int64: each row's next position (its logical length; padding rows 0)."""
        bucket = bucket or self.bucket
        return self._seen_all[0, :bucket, None].clone()

    def stepped(self) -> None:
        """Host bookkeeping after a decode step over ``rows`` real rows (counts for ``leave`` and room checks)."""
        for row in range(self.rows):
            self.steps[row] += 1
            self.room[row] -= 1

    def _has_scratch(self) -> bool:
        paged = bool(self.pool.hybrid.global_layers)
        return (len(self.scratch) > 0 or not paged) and (self.scratch_slot is not None
                                                         or not self.pool.has_sliding_layers)

    def ensure_scratch(self) -> bool:
        """Take the padding rows' page (and, for a model with sliding layers, their sliding-window slot) from the
        pool if not held yet. False when the pool has none free (then decode without padding rows: the exact batch
        size is just as correct)."""
        if self._has_scratch():
            return True
        try:
            if self.pool.has_sliding_layers and self.scratch_slot is None:
                self.scratch_slot = self.pool.take_slot("the padding rows' sliding-window slot")
            if self.pool.hybrid.global_layers and not len(self.scratch):
                self.pool.allocate(self.scratch, 1)
        except PoolExhaustedError:
            self.release_scratch()
            return False
        self._layout += 1  # padding rows name the new page
        return True

    def release_scratch(self) -> None:
        """Give the scratch page (and slot) back (no padding row may step until ``ensure_scratch`` again)."""
        if len(self.scratch):
            self.pool.release(self.scratch)
            self._layout += 1
        if self.scratch_slot is not None:
            self.pool.release(self.scratch_slot)
            self.scratch_slot = None
            self._layout += 1

    def close(self) -> None:
        """Give the scratch page back (every row must have left)."""
        if any(held is not None for held in self.held):
            raise RuntimeError("BatchedDecodeCache.close: rows are still joined (leave them first)")
        self.release_scratch()

    def release_rows(self) -> int:
        """Every row's request leaves (its pages back to the pool), e.g. after a failed step; returns how many."""
        rows = [row for row, held in enumerate(self.held) if held is not None]
        for row in rows:
            self.leave(row)
        return len(rows)

    @property
    def table_width(self) -> int:
        """Pool pages per row of the batch's tables (0 before the first join, or when every layer slides)."""
        tables = [layer for layer in self.layers if isinstance(layer, BatchedDecodeLayer)]
        return tables[0].width if tables else 0

    @property
    def joined(self) -> int:
        return sum(held is not None for held in self.held)

    # ------------------------------------------------------------------------------------------ Cache interface
    def update(self, key_states, value_states, layer_idx, *args, **kwargs):
        """One token per row of the prepared bucket; RocketKVCache's consistency checks in eager mode."""
        if not (torch.compiler.is_compiling() or self.hints.in_graph):
            if key_states.shape[2] != 1:
                raise ValueError(f"BatchedDecodeCache decodes one token per row, got {key_states.shape[2]}")
            if key_states.shape[0] != self.bucket:
                raise ValueError(f"BatchedDecodeCache was prepared for {self.bucket} rows, the forward has "
                                 f"{key_states.shape[0]} (call prepare(rows, bucket) first)")
            if layer_idx >= len(self.layers):
                raise ValueError(f"BatchedDecodeCache has {len(self.layers)} layers, the model updates layer "
                                 f"{layer_idx}")
            check_layers_consistent(self.layers, layer_idx, 1)
        return self.layers[layer_idx].update(key_states, value_states)

    def get_seq_length(self, layer_idx: int = 0) -> int:
        if layer_idx in self.position_scaled_layers:
            return 0  # the rows' positions differ: the attention function scales each row's query (constructor)
        return self.layers[layer_idx].get_seq_length() if self.layers else 0

    def get_query_offset(self, layer_idx: int = 0):
        """The mask transformers builds is not read by compressed decode (validity comes from ``lengths``): a
        0-d zero keeps its shape constant per bucket and needs no host sync."""
        if self._zero is None:
            self._zero = torch.zeros((), dtype=torch.long, device=self.layers[0].device)
        return self._zero

    @property
    def is_compileable(self) -> bool:
        return True

    # ------------------------------------------------------------------------------------------ internals
    def _ensure_layers(self, record: KVRecord) -> None:
        """Layers on the first join, as the record's (a sliding layer's row: a ``SlidingWindowLayer`` over the pool's
        slab, ``join_batch``); wider tables when the record's view has more pages than the width."""
        width = record.width
        if not self.layers:
            hints = self.hints
            shape, device = (len(record.layers), self.max_rows), record.layers[0].device
            self._lengths_all = torch.zeros(shape, dtype=torch.long, device=device)
            self._seen_all = torch.zeros(shape, dtype=torch.long, device=device)
            self._slots = torch.zeros(self.max_rows, dtype=torch.long, device=device)
            for index, row in enumerate(record.layers):
                if isinstance(row, RingRow):
                    layer = SlidingWindowLayer(row.window, hints, index, row.chunked, row.backend)
                    layer.join_batch(row.dtype, row.device, row.num_kv_heads, row.head_dim, self.pool, self._slots,
                                     self._seen_all[index])
                else:
                    layer = BatchedDecodeLayer(row.runs_with.config, hints, index,
                                               index in self.position_scaled_layers)
                    layer.init_from(row.runs_with, self.max_rows, width, self.pool, self._lengths_all[index],
                                    self._seen_all[index])
                self.layers.append(layer)
            self.version += 1
            return
        if len(record.layers) != len(self.layers):
            raise ValueError(f"BatchedDecodeCache has {len(self.layers)} layers, the cache {len(record.layers)}")
        tables = [layer for layer in self.layers if isinstance(layer, BatchedDecodeLayer)]
        if tables and width > tables[0].width:
            for layer in tables:
                layer.widen(width)
            self.version += 1

    def _clear(self, row: int) -> None:
        for layer in self.layers:
            if not layer.is_sliding:
                layer.clear_row(row)
        if self._seen_all is not None:  # the rows' counts: one writer, the batch (layers advance them in a step)
            self._lengths_all[:, row] = 0
            self._seen_all[:, row] = 0
        self.held[row] = None
        self.row_pages[row] = self.room[row] = self.steps[row] = 0
        self._layout += 1

    def _check_row(self, row: int) -> None:
        if not 0 <= row < self.max_rows:
            raise IndexError(f"BatchedDecodeCache row {row} outside [0, {self.max_rows})")

    def _held_at(self, row: int) -> list:
        self._check_row(row)
        held = self.held[row]
        if held is None:
            raise ValueError(f"BatchedDecodeCache row {row} is free")
        return held


def _release_later(pool: KVBlockPool, held: list[list | None]) -> None:
    """Finalizer of a dropped batch: queue the holdings of the rows still joined (never released here: a finalizer may
    run inside a pool method)."""
    items = [item for row in held if row is not None for item in row]
    if items:
        pool.release_later(items)
