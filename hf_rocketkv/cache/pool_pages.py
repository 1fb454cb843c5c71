"""PoolPages: the pool side of one RocketKVCache (``RocketKVCache(cfg, pool=pool)``), shared by its layers.

A request's pages are the same page ids in every layer (the pool allocates pages across layers), so the block tables
and the turn bookkeeping live here, once per cache, and each layer asks for its ``PagedStore`` views over its own
layer tensors of the pool.

Life of a request (docs/pool-cache.md):

    begin()            before the prefill forward (generate()'s prefill hook): admission of every row at once,
                       prompt pages found in the prefix index first (``KVBlockPool.admit_batch``), or for a later
                       turn the pages of its new view (and keep_all's history growth). Raises PoolExhaustedError
                       naming pages needed and free before anything is written; a forward without generate() begins
                       implicitly at its first stage 1 (without prefix lookup).
    setup_prefix()     a prefix hit: every layer starts its dense store with the hit tokens (``prefix_keys``) and the
                       cache's logical length starts after them, so generate() prefills only the rest (a model with
                       sliding-window layers replays the hit's last ``replay_tokens`` first: its sliding layers'
                       windows are in no page)
    prompt_store()     each layer writes the prompt's new tokens into the prompt pages (shareable, keep_all history)
    view_store()       each layer compacts its stage-1 survivors into the turn's view pages
    after_compaction() once every layer has: full prompt pages join the prefix index (``commit_prompt``), the prompt
                       table goes back to the pool (cached, hittable) or stays as keep_all's history, the previous
                       view goes back
    release_all()      cache.close() / reset(); a garbage-collected cache queues its tables (``release_later``):
                       the pool releases them at its next call

Row-group prefill splits one PoolPages into parts (``split``) that share the rows' tables; the cache that adopts the
groups (``adopt_parts``) rebuilds the device tables.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from ..host_copy import device_tensor
from ..memory import Admission, BlockTable, KVBlockPool, PrefixKeys, Reservation
from ..memory.errors import PoolExhaustedError
from ..memory.fp8 import FP8_DTYPE, dequantize_fp8
from ..memory.layer_kinds import replay_tokens
from .page_budget import decode_tokens, request_pages, row_demand
from .paged_store import PagedStore, ceil_div
from .stats import RequestCounters


@dataclass
class RowPages:
    """One batch row's tables."""

    admission: Admission | None = None
    view: list[BlockTable] = field(default_factory=list)  # the current view (extensions appended on growth)
    history: list[BlockTable] = field(default_factory=list)  # keep_all: the admission's prompt table, extensions
    hit_tokens: int = 0  # prompt tokens in prefix-hit pages (shared: never written)
    pad: int = 0  # left padding of the row in the first turn's input

    def padded(self, pad: int) -> None:
        self.pad = pad

    def admitted(self, admission: Admission) -> None:
        """Its admission (prompt and view tables, prefix hit) for the first turn."""
        self.admission, self.hit_tokens = admission, admission.reused_tokens

    def compacted_into(self, view: list[BlockTable], history: list[BlockTable] | None = None) -> list[BlockTable]:
        """A turn's compaction wrote this row into ``view`` (and keep_all keeps ``history``); returns the old view."""
        old, self.view = self.view, view
        if history is not None:
            self.history = history
        return old

    def tables(self) -> list[BlockTable]:
        tables = list(self.view) + list(self.history)
        if self.admission is not None:
            tables += [self.admission.prompt, self.admission.view]
        return tables

    def held(self) -> list:
        """What this row gives back: its tables and its sliding-window slot (a model with sliding layers)."""
        slot = self.admission.slot if self.admission is not None else None
        return self.tables() + ([slot] if slot is not None else [])

    @property
    def view_pages(self) -> int:
        return sum(len(t) for t in self.view)

    @property
    def history_pages(self) -> int:
        return sum(len(t) for t in self.history)


@dataclass
class Turn:
    """A prefill forward in progress: the view it compacts into and the layers done so far."""

    first: bool
    view: list[list[BlockTable]]  # per row
    done: set[int] = field(default_factory=set)
    table: torch.Tensor | None = None  # device table of ``view``, built at the first layer's compaction
    row_pages: tuple[int, ...] = ()
    # the prompt tables' and the prefix hit's device tables, built once per turn (not once per layer)
    prompt_table: tuple[torch.Tensor, tuple[int, ...]] | None = None
    hit_table: torch.Tensor | None = None

    def remember_hit_table(self, table: torch.Tensor) -> None:
        self.hit_table = table

    def remember_prompt_table(self, table: torch.Tensor, row_pages: tuple[int, ...]) -> None:
        self.prompt_table = (table, row_pages)

    def lay_out_view(self, device) -> None:
        """The device table of ``view`` and its pages per row, built at the first layer's compaction."""
        self.table, self.row_pages = _table_tensor(self.view, device)


def _table_tensor(rows: list[list[BlockTable]], device) -> tuple[torch.Tensor, tuple[int, ...]]:
    """``[B, MP]`` int32 of each row's pages (its tables concatenated), padded with -1; and pages per row."""
    pages = [[p for table in row for p in table.pages] for row in rows]
    width = max(1, max(len(p) for p in pages))
    padded = [p + [-1] * (width - len(p)) for p in pages]
    return device_tensor(padded, torch.int32, device), tuple(len(p) for p in pages)


def _read_pages(pages: torch.Tensor, scale: torch.Tensor | None, index: torch.Tensor,
                dtype: torch.dtype) -> torch.Tensor:
    """Pages ``index`` of a pool tensor ``[N, Hkv, S, D]``, dequantized to ``dtype`` when they are fp8."""
    selected = pages.index_select(0, index)
    return selected if scale is None else dequantize_fp8(selected, scale.index_select(0, index), dtype)


def check_fp8_kernels(backend: str, device: torch.device, capability: tuple[int, int] | None = None) -> None:
    """The Triton kernels convert to and from e4m3 in registers, which needs compute capability 8.9 or newer (Ada,
    Hopper, Blackwell): on an older GPU an fp8 pool is refused before any page is written, naming the ways out."""
    if backend != "triton" or device.type != "cuda":
        return
    capability = capability or torch.cuda.get_device_capability(device)
    if tuple(capability) < (8, 9):
        raise ValueError(
            f"KVBlockPool(dtype=float8_e4m3fn) with the Triton kernels needs a GPU of compute capability 8.9 or newer "
            f"(Ada, Hopper, Blackwell); {device} has {capability[0]}.{capability[1]}. Build the pool in the model's "
            f"dtype, or use RocketKVConfig(backend='torch')"
        )


def copy_pages_into(dest: torch.Tensor, pages: torch.Tensor, n: int) -> None:
    """``dest[:, :n] = `` the first ``n`` tokens of ``pages`` ``[P, Hkv, S, D]`` laid out as ``[Hkv, P * S, D]``:
    whole pages through a 4-d view of ``dest`` (one strided copy, no intermediate tensor), the last partial page
    on its own. ``dest`` ``[Hkv, >= n, D]`` with unit stride on D."""
    page = pages.shape[2]
    full = n // page
    if full:
        dest[:, : full * page].unflatten(1, (full, page)).copy_(pages[:full].transpose(0, 1))
    if n > full * page:
        dest[:, full * page : n].copy_(pages[full, :, : n - full * page])


def release_rows_later(pool: KVBlockPool, rows: list[RowPages], extra: list[Reservation]) -> None:
    """Finalizer of a garbage-collected cache: queue its tables; the pool releases them at its next call (never
    here: a finalizer may run inside a pool method)."""
    pool.release_later([item for row in rows for item in row.held()] + list(extra))


@dataclass
class GroupPlan:
    """Row-group prefill's plan (the rows per group generate() chose): the whole batch reserved up front, then
    admitted group by group out of the reservation, so a group's prompt pages are held only while it prefills."""

    reserve: Reservation  # free pages set aside for the groups not admitted yet (counted, not held)
    prompt_lens: list[int]
    token_ids: list | None
    peak: list[int]  # per row: pages at its prefill peak (cold)
    steady: list[int]  # per row: pages it keeps after its prefill
    groups_left: int

    def group_done(self) -> int:
        """One more group is prefilled; returns how many are left."""
        self.groups_left -= 1
        return self.groups_left


class PoolPages:
    def __init__(self, pool: KVBlockPool, config, keys: PrefixKeys | list[PrefixKeys] | None,
                 counters: RequestCounters, rows: list[RowPages] | None = None):
        self.pool = pool
        self.config = config
        self.keys = keys
        self.counters = counters
        self.rows: list[RowPages] = rows if rows is not None else []
        self.keep_all = config.multi_turn == "keep_all"
        self.model_layers = pool.geometry.num_layers
        self.num_layers = len(pool.hybrid.global_layers)  # the layers whose compaction closes a turn (RocketKV ones)
        self._slot_ids: tuple[torch.Tensor, list[int]] | None = None
        self.page_tokens = pool.page_size
        self.turn: Turn | None = None
        self.max_new_tokens = 0
        self.reservations: list[Reservation] = []  # a row-group reservation (the finalizer gives it back too)
        self.plan: GroupPlan | None = None  # row-group prefill in progress (the whole batch's object)
        self.parent: PoolPages | None = None  # a row group's part: the whole batch's object
        self.group: slice | None = None
        self._view_table: tuple[torch.Tensor, tuple[int, ...]] | None = None
        self._history_table: tuple[torch.Tensor, tuple[int, ...]] | None = None
        self.device: torch.device | None = None

    # ------------------------------------------------------------------------------------------ admission
    def begin(self, input_ids: torch.Tensor, attention_mask: torch.Tensor | None, max_new_tokens: int,
              layer0=None, allow_prefix_lookup: bool = True, rows_per_group: int | None = None) -> None:
        """Take this forward's pages before anything runs (see the module docstring). ``layer0``: the cache's first
        layer (a later turn sizes its view from what it holds). ``rows_per_group``: row-group prefill of a first
        turn: reserve the batch's pages now (``GroupPlan``); each group is admitted when it starts."""
        batch, width = input_ids.shape
        mask = attention_mask if attention_mask is not None else torch.ones_like(input_ids)
        # decode-time compression bounds the generated tokens a view holds: reserve that, not max_new_tokens
        max_new_tokens = decode_tokens(self.config, max_new_tokens)
        self.max_new_tokens = max_new_tokens
        if not self.rows:
            pads = (width - mask.sum(dim=1)).tolist()  # left padding (right padding is refused by the attention)
            ids = [input_ids[b, pad:] for b, pad in enumerate(pads)] if allow_prefix_lookup else None
            lens = [width - pad for pad in pads]
            if rows_per_group is not None:
                self._reserve_groups(lens, max_new_tokens, ids, rows_per_group)
            else:
                self._admit(lens, max_new_tokens, ids)
            for row, pad in zip(self.rows, pads):
                row.padded(pad)
            return
        if self.num_layers == 0:  # every layer slides: a later turn keeps the rows' slots, it needs no pages
            return
        if layer0 is None or not layer0.compressed:
            raise RuntimeError("PoolPages.begin: a later turn needs the cache's compressed layers")
        seen = layer0.get_seq_length()
        new = mask[:, seen:].sum(dim=1).tolist()
        stored = (layer0.history.lengths if layer0.history is not None else layer0.lengths).tolist()
        self._reserve_turn([s + m for s, m in zip(stored, new)], max_new_tokens)

    def _reserve_groups(self, prompt_lens: list[int], max_new_tokens: int, token_ids, rows_per_group: int) -> None:
        """Hold, in one allocation, every row's steady pages plus the largest group's prefill-only pages: enough for
        any group's admission whatever it hits (a hit replaces a fresh page; an evictable or host hit needs at most
        that one). PoolExhaustedError before anything changes when it does not fit."""
        plans = [request_pages(self.config, self.pool, n, max_new_tokens, keep_all=self.keep_all)
                 for n in prompt_lens]
        peak = [plan.peak_pages for plan in plans]
        steady = [plan.steady_pages for plan in plans]
        groups = range(0, len(plans), rows_per_group)
        extra = max(sum(peak[g:g + rows_per_group]) - sum(steady[g:g + rows_per_group]) for g in groups)
        what = (f"reserving {len(plans)} rows of a row-group prefill (every row's steady pages + the largest "
                f"group's prompt pages)")
        slots = len(plans) if self.pool.has_sliding_layers else 0  # every row's sliding slot, taken by its group
        try:
            reserve = self.pool.reserve(sum(steady) + extra, what, slots=slots)
        except PoolExhaustedError:  # a finished request in a reference cycle may still hold pages: collect once
            if not self.pool.reclaim_unreachable():
                raise
            reserve = self.pool.reserve(sum(steady) + extra, what, slots=slots)
        self.reservations.append(reserve)
        self.rows[:] = [RowPages() for _ in prompt_lens]
        self.plan = GroupPlan(reserve, prompt_lens, token_ids, peak, steady, len(groups))

    def _admit_group(self) -> None:
        """A row group's part: admit its rows out of the whole batch's reservation."""
        plan, rows = self.parent.plan, self.group
        ids = plan.token_ids[rows] if plan.token_ids is not None else None
        before = self.pool.copied_bytes()
        admissions = self.pool.admit_batch(plan.prompt_lens[rows], self.max_new_tokens, self.config, token_ids=ids,
                                           keys=self.keys, keep_all=self.keep_all, reservation=plan.reserve)
        self._count_copies(before)
        for row, adm in zip(self.rows, admissions):
            row.admitted(adm)
        self.turn = Turn(first=True, view=[[a.view if a.view.max_pages else a.prompt] for a in admissions])

    def _group_done(self, released: int) -> None:
        """A group's turn is over and its prompt pages went back (cached: still hittable by the next groups): set the
        ``released`` pages aside again for the groups to come (under the same lock, so no one takes them in
        between), or give the reservation back after the last group."""
        plan = self.parent.plan
        if plan.group_done() > 0:
            self.pool.add_to_reservation(plan.reserve, released)
        else:
            self.pool.unreserve(plan.reserve)

    def _admit(self, prompt_lens: list[int], max_new_tokens: int, token_ids) -> None:
        before = self.pool.copied_bytes()
        admissions = self.pool.admit_batch(prompt_lens, max_new_tokens, self.config, token_ids=token_ids,
                                           keys=self.keys, keep_all=self.keep_all)
        self._count_copies(before)
        # in place: the finalizer registered by the cache holds this very list
        self.rows[:] = [RowPages(admission=a, hit_tokens=a.reused_tokens) for a in admissions]
        # the view: its own table, or (prefix reuse off) the prompt table compacted in place
        self.turn = Turn(first=True, view=[[a.view if a.view.max_pages else a.prompt] for a in admissions])

    def _reserve_turn(self, totals: list[int], max_new_tokens: int) -> None:
        """A later turn: a fresh view per row for min(total, prompt_budget) + max_new_tokens tokens, and keep_all's
        history room for the new tokens and the tokens to come, all at once or PoolExhaustedError."""
        p = self.page_tokens
        views = [BlockTable("view") for _ in self.rows]
        requests = [(table, row_demand(self.config, total, max_new_tokens, p, self.keep_all).view_pages(p))
                    for table, total in zip(views, totals)]
        extensions = []
        if self.keep_all:  # every row as wide as the longest (what the layers' growth asks for)
            pages = row_demand(self.config, max(totals), max_new_tokens, p, keep_all=True).prompt_table_pages(p)
            for row in self.rows:
                missing = pages - row.history_pages
                if missing > 0:
                    table = BlockTable("prompt")
                    extensions.append((row, table))
                    requests.append((table, missing))
        before = self.pool.copied_bytes()
        self.pool.allocate_batch(requests, f"a later turn of {len(self.rows)} row(s) (views and history)")
        self._count_copies(before)
        for row, table in extensions:
            row.history.append(table)
        if extensions:
            self._history_table = None
        self.turn = Turn(first=False, view=[[table] for table in views])

    def _count_copies(self, before: tuple[int, int]) -> None:
        """Add the pool's copies since ``before`` (``pool.copied_bytes()``) to this request's counters."""
        offloaded, onloaded = self.pool.copied_bytes()
        self.counters.moved(offloaded - before[0], onloaded - before[1])

    def _implicit_turn(self, layer, counts: list[int], headroom: int) -> Turn:
        """A stage 1 that no ``begin`` announced (forwards outside generate()): admit now, without prefix lookup."""
        self.max_new_tokens = headroom
        if not self.rows:
            prompt_lens = (layer.dense.keys.shape[2] - layer.row_start).tolist()
            self._admit(prompt_lens, headroom, None)
        else:
            self._reserve_turn(layer.lengths.tolist(), headroom)
        return self.turn

    # ------------------------------------------------------------------------------------------ prefix hits
    def setup_prefix(self, layers: list) -> int:
        """Seed every layer with the longest prefix every row of this forward can take from its hit pages: input
        columns ``[0, L)``, ``L = min_b(pad_b + hit_b)`` (a row whose hit is longer recomputes the rest; hit pages are
        never written). Returns the first input column the forwards must compute: L, or on a model with
        sliding-window layers ``S = max(0, L - R)`` (``R = replay_tokens``): those replay ``[S, L)`` to rebuild the
        sliding layers' windows, the full-attention layers reading the hit's K/V ``[0, L)`` (``seed_prefix``).
        0: no reuse."""
        if self.turn is None or not self.turn.first:
            return 0
        tokens = min(row.pad + row.hit_tokens for row in self.rows)
        if tokens <= 0 or not any(row.hit_tokens for row in self.rows):
            return 0
        start = max(0, tokens - replay_tokens(self.pool.layer_windows)) if self.pool.has_sliding_layers else tokens
        for layer in layers:
            if layer.is_sliding:
                layer.seed_replay(start)
            else:
                layer.seed_prefix(tokens, start)
        self.counters.reused(sum(max(0, tokens - row.pad) for row in self.rows))
        return start

    def prefix_keys(self, layer, key_states: torch.Tensor, room: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
        """The dense store ``[B, Hkv, L + room, D]`` of a prefix hit: in its first ``L = layer.prefix.tokens``
        columns, row b's padding (zeros), then its first ``L - pad_b`` prompt tokens from its prompt table's hit
        pages; the last ``room`` columns are left for the caller to write (the forward's own tokens).

        Two passes over the prefix per tensor (gather the pages, one strided copy into the dense layout), and the
        hit table is built once per turn: this runs in every layer of a prefix hit, on its time to first token."""
        storage = self.pool.layer(layer.layer_idx, key_states)
        tokens = layer.prefix.tokens
        batch, heads, _, dim = key_states.shape
        padded = any(row.pad for row in self.rows)
        make = key_states.new_zeros if padded else key_states.new_empty  # padding columns must read as zeros
        keys, values = make(batch, heads, tokens + room, dim), make(batch, heads, tokens + room, dim)
        hit = ceil_div(tokens, self.page_tokens)  # no row reads past its hit pages: tokens - pad_b <= hit_b
        table = self.turn.hit_table if self.turn is not None else None
        if table is None:
            rows = [list(row.admission.prompt.pages[:hit]) for row in self.rows]
            table = device_tensor([r + [-1] * (hit - len(r)) for r in rows], torch.int32, key_states.device)
            if self.turn is not None:
                self.turn.remember_hit_table(table)
        for b, row in enumerate(self.rows):
            n = tokens - row.pad
            if n > 0:
                index = table[b, : ceil_div(n, self.page_tokens)].long()
                copy_pages_into(keys[b, :, row.pad :], _read_pages(storage.k, storage.k_scale, index, keys.dtype), n)
                copy_pages_into(values[b, :, row.pad :], _read_pages(storage.v, storage.v_scale, index, keys.dtype), n)
        return keys, values

    # ------------------------------------------------------------------------------------------ layer views
    def check_layer(self, layer, key_states: torch.Tensor) -> None:
        """The pool's storage must match the model's K/V (checked at the first update, before any page is written)."""
        if self.pool.dtype == FP8_DTYPE:
            if not key_states.dtype.is_floating_point or key_states.dtype.itemsize < 2:
                raise ValueError(f"a KVBlockPool of {FP8_DTYPE} pages stores a model's bfloat16 / float16 / float32 "
                                 f"K/V, got {key_states.dtype}")
            check_fp8_kernels(layer.ops.name, key_states.device)
        elif key_states.dtype != self.pool.dtype:
            raise ValueError(
                f"KVBlockPool.dtype is {self.pool.dtype} but the model's keys are {key_states.dtype}: build the pool "
                f"with dtype={key_states.dtype} (the pages hold the model's K/V as they are)"
            )
        if layer.layer_idx is None or not 0 <= layer.layer_idx < self.model_layers:
            raise ValueError(f"layer index {layer.layer_idx} outside the pool's {self.model_layers} layers")
        self.device = key_states.device
        self.pool.layer(layer.layer_idx, key_states)  # allocates the layer's pages (checks heads and head_dim)

    def wants_prompt_pages(self) -> bool:
        """The first stage 1 writes the prompt into its prompt pages when they will be shared (hashed) or kept."""
        return (self.turn is not None and self.turn.first and self.rows[0].admission is not None
                and (self.keep_all or any(row.admission.page_hashes for row in self.rows)))

    def prompt_store(self, layer) -> tuple[PagedStore, list[int]]:
        """The prompt tables as a store without KT (token t of row b at slot t), and each row's shared tokens."""
        storage = self.pool.layer(layer.layer_idx)
        if self.keep_all:
            table, row_pages = self.history_table(layer.device)
        elif self.turn is not None and self.turn.prompt_table is not None:
            table, row_pages = self.turn.prompt_table
        else:
            table, row_pages = _table_tensor([[row.admission.prompt] for row in self.rows], layer.device)
            if self.turn is not None:
                self.turn.remember_prompt_table(table, row_pages)
        return PagedStore.over(storage, table, row_pages, layer.dtype, kt=False), [row.hit_tokens for row in self.rows]

    def view_store(self, layer, counts: list[int], headroom: int) -> PagedStore:
        """The current turn's view pages for ``layer`` (the turn begins now when nothing announced it)."""
        turn = self.turn or self._implicit_turn(layer, counts, headroom)
        if turn.table is None:
            if turn.first and self.rows[0].admission.view.max_pages == 0:
                # prefix reuse off: the prompt table is the view, compacted in place; its tail goes back now
                for row, count in zip(self.rows, counts):
                    self.pool.truncate(row.admission.prompt, ceil_div(count + self.max_new_tokens, self.page_tokens))
            turn.lay_out_view(layer.device)
        capacities = [n * self.page_tokens for n in turn.row_pages]
        for b, (count, capacity) in enumerate(zip(counts, capacities)):
            if count > capacity:
                raise RuntimeError(
                    f"RocketKVCache row {b} keeps {count} tokens after stage 1, more than the {capacity} slots its "
                    f"admission planned (prompt_budget={self.config.prompt_budget} + max_new_tokens): a stage-1 "
                    f"policy kept more than the budget"
                )
        storage = self.pool.layer(layer.layer_idx)
        return PagedStore.over(storage, turn.table, turn.row_pages, layer.dtype)

    def after_compaction(self, layer) -> None:
        """Count the layers done; when every layer has compacted, close the turn (module docstring)."""
        turn = self.turn
        if turn is None:
            return
        turn.done.add(layer.layer_idx)
        if len(turn.done) < self.num_layers:
            return
        with self.pool.exclusive():  # a row group re-reserves exactly what it releases, before anyone else can
            free_before = self.pool.free_pages()
            for row, view in zip(self.rows, turn.view):
                history = None
                if turn.first:
                    adm = row.admission
                    self.pool.commit_prompt(adm)
                    if self.keep_all:
                        history = [adm.prompt]
                    elif adm.view.max_pages:  # (reuse off: the prompt table is the view)
                        self.pool.release(adm.prompt)
                old_view = row.compacted_into(view, history)
                for table in old_view:
                    self.pool.release(table)
            if turn.first and self.parent is not None:
                # the pages that became free (hit pages other requests still hold do not): re-reserving exactly
                # these leaves the reservation >= every later group's steady pages + the largest group's prompt
                self._group_done(self.pool.free_pages() - free_before)
        self._view_table = (turn.table, turn.row_pages)
        self.turn = None

    def slot_ids(self, device, batch: int, seen: int) -> tuple[torch.Tensor, list[int]]:
        """The rows' sliding-window slots ``[B]`` int64 on ``device`` and as a list (a model with sliding layers).
        A cache whose rows were never admitted (plain forwards of a model whose layers all slide: no stage 1 admits
        them) is admitted now, ``seen`` tokens per row."""
        if not self.rows:
            self.max_new_tokens = self.config.capacity_headroom
            self._admit([seen] * batch, self.max_new_tokens, None)
        if self._slot_ids is None or self._slot_ids[0].device != torch.device(device):
            ids = [row.admission.slot.index for row in self.rows]
            self._slot_ids = (device_tensor(ids, torch.long, device), ids)
        if len(self._slot_ids[1]) != batch:
            raise RuntimeError(f"RocketKVCache: {batch} rows decode, the pool admitted {len(self._slot_ids[1])}")
        return self._slot_ids

    def view_table(self, device) -> tuple[torch.Tensor, tuple[int, ...]]:
        if self._view_table is None:
            self._view_table = _table_tensor([row.view for row in self.rows], device)
        return self._view_table

    def history_table(self, device) -> tuple[torch.Tensor, tuple[int, ...]]:
        if self._history_table is None:
            rows = [row.history or [row.admission.prompt] for row in self.rows]
            self._history_table = _table_tensor(rows, device)
        return self._history_table

    # ------------------------------------------------------------------------------------------ growth (eager)
    def grow_view(self, layer, capacity: int) -> PagedStore:
        """Every row's view holds at least ``capacity`` slots (more pages, all rows at once); the first layer to
        grow allocates, the others find the pages there."""
        pages = ceil_div(capacity, self.page_tokens)
        requests = [(BlockTable("view"), pages - row.view_pages) for row in self.rows if row.view_pages < pages]
        if requests:
            grow = [row for row in self.rows if row.view_pages < pages]
            before = self.pool.copied_bytes()
            self.pool.allocate_batch(requests, "growing the views past their admitted size")
            self._count_copies(before)
            for row, (table, _) in zip(grow, requests):
                row.view.append(table)
            self._view_table = None
        table, row_pages = self.view_table(layer.device)
        storage = self.pool.layer(layer.layer_idx)
        return PagedStore.over(storage, table, row_pages, layer.dtype)

    def history_store(self, layer, capacity: int) -> PagedStore:
        """keep_all: the history pages as a store without KT, with at least ``capacity`` slots per row."""
        pages = ceil_div(capacity, self.page_tokens)
        grow = [row for row in self.rows if row.history_pages < pages]
        if grow:
            requests = [(BlockTable("prompt"), pages - row.history_pages) for row in grow]
            before = self.pool.copied_bytes()
            self.pool.allocate_batch(requests, "growing the keep_all history")
            self._count_copies(before)
            for row, (table, _) in zip(grow, requests):
                row.history.append(table)
            self._history_table = None
        table, row_pages = self.history_table(layer.device)
        storage = self.pool.layer(layer.layer_idx)
        return PagedStore.over(storage, table, row_pages, layer.dtype, kt=False)

    def stacked_view(self, layer, stores: list[PagedStore]) -> PagedStore:
        table, row_pages = self.view_table(layer.device)
        storage = self.pool.layer(layer.layer_idx)
        return PagedStore.over(storage, table, row_pages, layer.dtype)

    # ------------------------------------------------------------------------------------------ row groups
    def split(self, rows: slice, counters: RequestCounters) -> "PoolPages":
        """A part for row-group prefill: the same row objects (tables), admitted now out of the reservation."""
        keys = self.keys[rows] if isinstance(self.keys, list) else self.keys
        part = PoolPages(self.pool, self.config, keys, counters, rows=self.rows[rows])
        part.join_group(self, rows)
        return part

    def join_group(self, parent: PoolPages, rows: slice) -> None:
        """This part holds ``rows`` of ``parent``'s batch, with its room for new tokens; admitted out of the batch's
        reservation when the parent has planned one."""
        self.max_new_tokens = parent.max_new_tokens
        self.parent, self.group = parent, rows
        if parent.plan is not None:
            self._admit_group()

    def adopt_parts(self) -> None:
        """The parts have closed their turns on the shared rows: this (whole-batch) object's turn is over too."""
        self.turn = None
        self.plan = None
        self._view_table = self._history_table = None

    # ------------------------------------------------------------------------------------------ lifetime
    def held_pages(self) -> int:
        """Pool pages this request's tables hold."""
        tables = {id(table): table for row in self.rows for table in row.tables()}
        return sum(len(table) for table in tables.values())

    def held_slots(self) -> int:
        """Sliding-window slots this request's rows hold."""
        return sum(row.admission is not None and row.admission.slot is not None and not row.admission.slot.released
                   for row in self.rows)

    def hand_over(self) -> list:
        """What the rows hold in the pool (their tables and sliding-window slots, in row order), handed to a new
        owner that releases them (a batched decode row, ``BatchedDecodeCache.join``); this object holds nothing
        afterwards, so closing or collecting its cache releases nothing. Only between turns (no turn in progress,
        no row-group reservation)."""
        # (a model whose layers all slide runs no stage 1, so its admission's turn is never closed: nothing pending)
        if (self.turn is not None and self.num_layers) or self.plan is not None or self.reservations:
            raise RuntimeError("PoolPages.hand_over: a prefill is still in progress on this cache")
        self.turn = None
        held = [item for row in self.rows for item in row.held()]
        self.rows.clear()  # in place: the finalizer holds this list
        self._slot_ids = None
        self._view_table = self._history_table = None
        return held

    def release_all(self) -> None:
        """Every page of every row back to the pool now (cache.close(), reset())."""
        tables = [item for row in self.rows for item in row.held()]
        self.rows.clear()  # in place: the finalizer holds these lists
        self._slot_ids = None
        for reservation in self.reservations:
            self.pool.unreserve(reservation)
        self.reservations.clear()
        self.plan = None
        self.turn = None
        self._view_table = self._history_table = None
        for table in tables:
            self.pool.release(table)
