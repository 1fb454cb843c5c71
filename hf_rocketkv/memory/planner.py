"""Planner: admission of requests into the pool, from plain per-row numbers.

A plan says, for each row, its tables' sizes (``RowDemand.pages``), the chained hashes of its full prompt pages and
the prefix hits among them (the longest indexed chain, capped at ``RowDemand.hit_cap_tokens``), and for the batch
the pages it takes from the free count (``PagesNeeded``; formulas in ``accounting.py``). ``admit`` / ``admit_batch``
check the plan against the free pages and raise PoolExhaustedError before anything changes, or take every page:
touch device hits, bring host hits back (offload), allocate the rest. Reservations set free pages aside for a later
admission (``reservation.py``).

The request's policy reaches the planner only as numbers: ``cfg`` goes through ``as_budget`` (``budget.py``).
"""

from __future__ import annotations

import dataclasses
import gc
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch

from .accounting import PagesNeeded, RowDemand, RowPages
from .admission import Admission
from .block_table import BlockTable
from .budget import PoolSpec, as_budget
from .core import PageCore
from .errors import PoolExhaustedError, check_int
from .hashing import PrefixKeys, as_token_list
from .offload import HostOffload
from .page_meta import PageMeta, Tier
from .prefix_index import PrefixIndex
from .reservation import Reservation

NO_PAGES = RowPages(0, 0, 0, 0)
SLIDING_ONLY_PREFIX_REUSE = (
    "KVBlockPool: prefix reuse (token_ids) needs full-attention layers, whose K/V the pages hold; every layer of "
    "this model slides, so the pool has no pages to share: admit without token_ids")


@dataclass
class RowPlan:
    """One row of a plan: what it asks, its tables' sizes, its page hashes and the indexed pages it hits."""

    demand: RowDemand
    keys: PrefixKeys
    pages: RowPages
    hashes: list[bytes]
    hits: list[PageMeta]

    @property
    def new_prompt_pages(self) -> int:
        return self.pages.prompt_pages - len(self.hits)


@dataclass
class Plan:
    rows: list[RowPlan]
    needed: PagesNeeded
    host_hits: list[PageMeta]  # unique host slots hit, in first-seen order


@dataclass(frozen=True)
class RowInput:
    """One row as the caller gave it, validated."""

    prompt_len: int
    max_new_tokens: int
    token_ids: list[int] | None
    keys: PrefixKeys


def row_inputs(prompt_len, max_new_tokens, token_ids, keys) -> list[RowInput]:
    """The rows of a request (``prompt_len`` an int) or a batch (a list), each checked, with messages naming the
    argument and the row."""
    batch = not isinstance(prompt_len, int)
    if batch and not isinstance(prompt_len, Sequence):  # a float, a 0-d tensor: neither a row nor a list of rows
        raise ValueError(f"prompt_len must be an integer >= 1 (one row) or a list of them (a batch), got "
                         f"{prompt_len!r} ({type(prompt_len).__name__})")
    lengths = list(prompt_len) if batch else [prompt_len]
    count = len(lengths)
    if batch and count == 0:
        raise ValueError("prompt_len must name at least one row")
    news = list(max_new_tokens) if isinstance(max_new_tokens, Sequence) else [max_new_tokens] * count
    if len(news) != count:
        raise ValueError(f"max_new_tokens has {len(news)} entries for {count} rows")
    if token_ids is None:
        ids_per_row = [None] * count
    elif batch:
        if isinstance(token_ids, torch.Tensor) and token_ids.dim() == 2:
            token_ids = list(token_ids)
        ids_per_row = list(token_ids)
        if len(ids_per_row) != count:
            raise ValueError(f"token_ids has {len(ids_per_row)} rows, prompt_len has {count}")
    else:
        ids_per_row = [token_ids]
    if keys is None or isinstance(keys, PrefixKeys):
        keys_per_row = [keys or PrefixKeys()] * count
    else:
        keys_per_row = list(keys)
        if len(keys_per_row) != count or not all(isinstance(k, PrefixKeys) for k in keys_per_row):
            raise ValueError(f"keys must be a PrefixKeys or a list of {count} PrefixKeys, got {keys!r}")
    rows = []
    for row, (length, new, ids, row_keys) in enumerate(zip(lengths, news, ids_per_row, keys_per_row)):
        where = f"[{row}]" if batch else ""
        check_int(length, f"prompt_len{where}", 1)
        check_int(new, f"max_new_tokens{where}", 0)
        if ids is not None:
            ids = as_token_list(ids, f"token_ids{where}")
            if len(ids) != length:
                raise ValueError(f"token_ids{where} has {len(ids)} ids but prompt_len{where} is {length}")
        rows.append(RowInput(length, new, ids, row_keys))
    return rows


class Planner:
    """Admission plans and reservations over one pool's core, prefix index and host tier."""

    def __init__(self, core: PageCore, index: PrefixIndex, offload: HostOffload, spec: PoolSpec,
                 bytes_per_page: int = 0, paged: bool = True):
        self.core = core
        self.index = index
        self.offload = offload
        self.spec = spec
        self.bytes_per_page = bytes_per_page
        self.paged = paged  # False: a model whose layers all slide (no page holds anything; rows take slots only)


    def use_spec(self, spec: PoolSpec) -> None:
        """Admissions planned from now on follow ``spec`` (``KVBlockPool.prefix_reuse`` changed)."""
        self.spec = spec
    def _slots_needed(self, rows: int) -> int:
        return rows if self.core.slab is not None else 0

    # ============================================================================================ reservations
    def reserve(self, num_pages: int, what: str = "reserving pages", slots: int = 0) -> Reservation:
        """Set ``num_pages`` free pages (and ``slots`` sliding-window slots) aside, or raise PoolExhaustedError and
        change nothing."""
        core = self.core
        with core.lock:
            check_int(num_pages, "num_pages", 0)
            check_int(slots, "slots", 0)
            if num_pages > core.available():
                raise PoolExhaustedError(what, num_pages, core.available(), core.num_pages)
            self.check_slots(what, slots)
            reservation = Reservation(0)
            core.set_aside(reservation, num_pages, slots)
            return reservation

    def check_slots(self, what: str, slots: int, reservation: Reservation | None = None) -> None:
        """Raise PoolExhaustedError (naming ``what``) unless ``slots`` sliding-window slots are available (to
        ``reservation`` when given); ValueError on a pool without sliding-window slots."""
        if not slots:
            return
        slab = self.core.slab
        if slab is None:
            raise ValueError(f"{what}: this pool has no sliding-window slots (its model has no sliding layers)")
        if slots > slab.available(reservation):
            raise PoolExhaustedError(what, slots, slab.available(reservation), slab.num_slots,
                                     unit="sliding-window slots")

    def add_to_reservation(self, reservation: Reservation, num_pages: int) -> None:
        """Set ``num_pages`` more free pages aside for ``reservation``."""
        core = self.core
        with core.lock:
            check_int(num_pages, "num_pages", 0)
            if num_pages > core.available():
                raise PoolExhaustedError(f"adding to {reservation.name}", num_pages, core.available(), core.num_pages)
            core.set_aside(reservation, num_pages)

    def unreserve(self, reservation: Reservation, num_pages: int | None = None) -> None:
        """Give ``num_pages`` (default: all) of a reservation's pages back to everyone."""
        with self.core.lock:
            count = reservation.count if num_pages is None else min(check_int(num_pages, "num_pages", 0),
                                                                    reservation.count)
            self.core.give_back(reservation, count, reservation.slots if num_pages is None else 0)

    # ============================================================================================ plans
    def plan(self, prompt_len, max_new_tokens, cfg: Any, token_ids, keys, keep_all) -> Plan:
        """Check ``cfg`` (``as_budget``), validate the rows, and plan them (call under the lock)."""
        budget = as_budget(cfg, self.spec)
        if self.core.slab is not None and not self.core.storage.paged_layers and token_ids is not None:
            raise NotImplementedError(SLIDING_ONLY_PREFIX_REUSE)
        if keep_all is not None and not isinstance(keep_all, bool):
            raise ValueError(f"keep_all must be True or False, got {keep_all!r}")
        inputs = row_inputs(prompt_len, max_new_tokens, token_ids, keys)
        demands = budget.rows([row.prompt_len for row in inputs], [row.max_new_tokens for row in inputs], keep_all)
        return self.plan_rows(demands, [row.token_ids for row in inputs], [row.keys for row in inputs])

    def plan_rows(self, demands: Sequence[RowDemand], token_ids: Sequence[list[int] | None],
                  keys: Sequence[PrefixKeys]) -> Plan:
        """The plan of rows given as plain numbers (token ids already validated)."""
        p = self.spec.page_size
        plans = []
        for demand, ids, row_keys in zip(demands, token_ids, keys):
            pages = demand.pages(p, self.spec.prefix_reuse) if self.paged else NO_PAGES
            hashes = self.index.hash_ids(ids, row_keys) if self.spec.prefix_reuse and ids is not None else []
            hits = self.index.chain(hashes[: demand.hit_cap_tokens // p])
            plans.append(RowPlan(demand, row_keys, pages, hashes, hits))
        free_hits = {m.index for plan in plans for m in plan.hits if m.tier is Tier.DEVICE and m.ref == 0}
        host_hits = list({id(m): m for plan in plans for m in plan.hits if m.tier is Tier.HOST}.values())
        fresh = sum(plan.new_prompt_pages + plan.pages.view_pages for plan in plans)
        hit_pages = sum(len(plan.hits) for plan in plans)
        needed = PagesNeeded(
            prefill_peak=fresh + len(free_hits) + len(host_hits),
            steady_state=sum(plan.pages.steady_pages for plan in plans),
            prompt_pages=sum(plan.pages.prompt_pages for plan in plans),
            view_pages=sum(plan.pages.view_pages for plan in plans),
            hit_pages=hit_pages,
            hit_pages_free=len(free_hits),
            hit_pages_host=len(host_hits),
            hit_tokens=hit_pages * p,
            new_pages=fresh + len(host_hits),
            rows=len(plans),
            slots=self._slots_needed(len(plans)),
        )
        slot_bytes = needed.slots * (self.core.slab.bytes_per_slot if self.core.slab is not None else 0)
        needed = dataclasses.replace(needed, prefill_peak_bytes=needed.prefill_peak * self.bytes_per_page + slot_bytes,
                                     steady_state_bytes=needed.steady_state * self.bytes_per_page + slot_bytes)
        return Plan(plans, needed, host_hits)

    def pages_needed(self, prompt_len, max_new_tokens, cfg, token_ids=None, keys=None, keep_all=None) -> PagesNeeded:
        with self.core.lock:
            return self.plan(prompt_len, max_new_tokens, cfg, token_ids, keys, keep_all).needed

    def can_admit(self, prompt_len, max_new_tokens, cfg, token_ids=None, keys=None, keep_all=None) -> bool:
        with self.core.lock:
            needed = self.plan(prompt_len, max_new_tokens, cfg, token_ids, keys, keep_all).needed
            slots_free = self.core.slab.available() if self.core.slab is not None else 0
            return needed.prefill_peak <= self.core.available() and needed.slots <= slots_free

    # ============================================================================================ admission
    def admit(self, prompt_len, max_new_tokens, cfg, token_ids=None, keys=None, keep_all=None,
              reservation: Reservation | None = None) -> list[Admission]:
        """Every row gets its pages or none does; before a refusal for lack of pages, unreachable caches are
        collected once (``reclaim_unreachable``)."""
        args = (prompt_len, max_new_tokens, cfg, token_ids, keys, keep_all, reservation)
        try:
            return self._admit_now(*args)
        except PoolExhaustedError:
            if not self.reclaim_unreachable():
                raise
            return self._admit_now(*args)

    def reclaim_unreachable(self) -> bool:
        """Run Python's cyclic garbage collector once (call it without holding the pool); True if pages came back.

        A cache nobody can reach any more still holds its pages until it is collected, and a reference cycle (one
        made by torch.compile while tracing a cache, or by a user's own objects) delays that until the collector
        happens to run. Before an admission is refused for lack of pages, those pages are worth one collection (a
        refusal is rare, a collection takes milliseconds): the caches' finalizers queue their releases, which the
        next acquisition of the lock applies. ``reserve`` does not collect: a scheduler asks it at every step."""
        before = self._free_pages()
        gc.collect()
        return self._free_pages() > before

    def _free_pages(self) -> int:
        with self.core.lock:
            return self.core.available()

    def _admit_now(self, prompt_len, max_new_tokens, cfg, token_ids, keys, keep_all, reservation) -> list[Admission]:
        core = self.core
        with core.lock:
            plan = self.plan(prompt_len, max_new_tokens, cfg, token_ids, keys, keep_all)
            need = plan.needed.prefill_peak
            available = core.available(reservation)
            if need > available:
                rows = f"{plan.needed.rows} row(s), " if plan.needed.rows > 1 else ""
                raise PoolExhaustedError(
                    f"admitting {rows}{plan.needed.prompt_pages} prompt + {plan.needed.view_pages} view pages "
                    f"({plan.needed.hit_pages} hit)", need, available, core.num_pages)
            self.check_slots(f"admitting {plan.needed.rows} row(s)", plan.needed.slots, reservation)
            admissions = self._take(plan)
            if reservation is not None:  # what was taken comes off the reservation first
                core.give_back(reservation, min(reservation.count, need), min(reservation.slots, plan.needed.slots))
            return admissions

    def _take(self, plan: Plan) -> list[Admission]:
        """Execute a plan that fits: touch device hits, onload host hits, allocate the rest. Nothing here raises
        for lack of pages (the plan was checked against the free count)."""
        core = self.core
        core.events.poll()
        core.tick()
        for row in plan.rows:
            for meta in row.hits:
                if meta.tier is Tier.DEVICE:
                    core.touch(meta)
        onloaded = self.offload.onload(plan.host_hits) if plan.host_hits else {}
        admissions = []
        for row in plan.rows:
            hits = []
            for meta in row.hits:
                if meta.tier is Tier.HOST:  # now on the device: this row's reference
                    meta = onloaded[id(meta)]
                    core.touch(meta)
                hits.append(meta)
            prompt_new = core.take_pages(row.new_prompt_pages)
            view_new = core.take_pages(row.pages.view_pages)
            prompt = BlockTable("prompt", max_pages=row.pages.prompt_pages)
            prompt.extend([m.index for m in hits] + [m.index for m in prompt_new], core.token)
            view = BlockTable("view", max_pages=row.pages.view_pages)
            view.extend([m.index for m in view_new], core.token)
            core.counters["hit_pages"] += len(hits)
            core.counters["missed_pages"] += len(row.hashes) - len(hits)
            admissions.append(Admission(
                prompt=prompt, view=view, prompt_len=row.demand.prompt_tokens,
                max_new_tokens=row.demand.new_tokens, page_size=self.spec.page_size, keys=row.keys,
                page_hashes=tuple(row.hashes), hit_pages=len(hits),
                onloaded_pages=sum(id(meta) in onloaded for meta in row.hits), committed_pages=len(hits),
                slot=core.slab.take(1)[0] if core.slab is not None else None,
            ))
        core.events.wait_for(meta for row in plan.rows for meta in row.hits if meta.tier is Tier.DEVICE)
        core.events.wait_for(onloaded.values())
        return admissions
