"""Random request sequences on the plain-number planner and the core, against an independent model of the pool.

Requests are given as plain numbers (``RowDemand``s as ``cfg``), so no policy is involved. The model below is written
from docs/memory.md ("Free pages and eviction order", "Accounting", "Prefix hashing"), with plain Python lists and a
dict, not from the pool's code: it predicts which page ids every admission and allocation gets, the prefix hits of
every row (the longest indexed chain under its hit cap), ``pages_needed``, the free order, and every page's
reference count and prefix. After every step: free + held + reserved == total; every page's reference count equals
the number of the test's live tables holding it; the free pages, in allocation order, are the model's; a page holds
a prefix exactly when the model says it is cached or held under that prefix (cached pages stay hittable until
evicted or reset).
"""

from __future__ import annotations

import random

import pytest
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from hf_rocketkv.memory import PoolExhaustedError, PoolStateError, PrefixKeys, RowDemand
from tests.memory.helpers import make_pool

PAGES, PAGE = 32, 8
DEFAULT_PRIORITY = 35
BASES = [[100 + i for i in range(64)], [300 + i for i in range(64)], [100 + i for i in range(24)] + [9] * 40]
SALTS = [None, "tenant-b"]


def ceil(a: int, b: int) -> int:
    return -(-a // b)


class Model:
    """The pool as docs/memory.md describes it, device tier only.

    Free pages: an "uncached" list (taken from the front; a released private page goes to the front) and one list per
    priority of cached pages (released pages appended; evicted lowest priority first, from the front). ``key`` of a
    page is the content it is indexed under: (salt, the token ids of the whole prefix up to the end of the page).
    """

    def __init__(self, pages: int):
        self.total = pages
        self.ref = [0] * pages
        self.key: list[tuple | None] = [None] * pages
        self.priority = [DEFAULT_PRIORITY] * pages
        self.uncached = list(range(pages))
        self.cached: dict[int, list[int]] = {}
        self.index: dict[tuple, int] = {}
        self.reserved = 0

    # -------------------------------------------------------------------------------------------- free lists
    def free_order(self) -> list[int]:
        return self.uncached + [page for prio in sorted(self.cached) for page in self.cached[prio]]

    def free_count(self) -> int:
        return len(self.free_order())

    def take(self) -> int:
        if self.uncached:
            page = self.uncached.pop(0)
        else:
            prio = min(p for p, pages in self.cached.items() if pages)
            page = self.cached[prio].pop(0)
            del self.index[self.key[page]]  # evicted: its prefix is gone
            self.key[page] = None
        self.ref[page] = 1
        return page

    def touch(self, page: int) -> None:
        if self.ref[page] == 0:
            self.cached[self.priority[page]].remove(page)
        self.ref[page] += 1

    def unref(self, pages: list[int]) -> None:
        for page in reversed(pages):  # tail first
            self.ref[page] -= 1
            if self.ref[page] == 0:
                if self.key[page] is not None:
                    self.cached.setdefault(self.priority[page], []).append(page)
                else:
                    self.uncached.insert(0, page)

    def evict(self, limit: int | None) -> int:
        evicted = []
        while limit is None or len(evicted) < limit:
            queues = [p for p, pages in self.cached.items() if pages]
            if not queues:
                break
            page = self.cached[min(queues)].pop(0)
            del self.index[self.key[page]]
            self.key[page] = None
            evicted.append(page)
        for page in evicted:
            self.uncached.insert(0, page)
        return len(evicted)

    def register(self, page: int, key: tuple, priority: int) -> None:
        if self.key[page] == key or key in self.index:
            return  # already this page's prefix, or computed twice: the second copy stays private
        self.key[page], self.priority[page] = key, priority
        self.index[key] = page

    def reset(self) -> None:
        self.key = [None] * self.total
        self.priority = [DEFAULT_PRIORITY] * self.total
        self.uncached, self.cached, self.index = list(range(self.total)), {}, {}


def row_keys(ids: list[int], salt: str | None) -> list[tuple]:
    return [(salt, tuple(ids[: (i + 1) * PAGE])) for i in range(len(ids) // PAGE)]


class PlannerMachine(RuleBasedStateMachine):
    def __init__(self):
        super().__init__()
        self.pool = make_pool(PAGES, page_size=PAGE)
        # no cache exists here, so a refusal has nothing to collect first: skip the collection (~0.5 s each)
        self.pool._planner.reclaim_unreachable = lambda: False
        self.model = Model(PAGES)
        self.admissions = []  # (admission, the model's content keys of its full prompt pages)
        self.tables = []
        self.reservations = []
        self.reservation_counts = {}  # id(reservation) -> the pages the model says it still sets aside
        self.rng = random.Random(0)

    def tables_held(self):
        return [t for adm, _ in self.admissions for t in (adm.prompt, adm.view)] + self.tables

    # -------------------------------------------------------------------------------------------- rules
    ROWS = st.lists(st.tuples(st.integers(0, 2), st.integers(1, 64), st.integers(0, 1), st.integers(0, 8),
                              st.integers(0, 24), st.integers(0, 16), st.booleans()), min_size=1, max_size=3)

    @rule(rows=ROWS, use_reservation=st.booleans())
    def admit(self, rows, use_reservation):
        """Rows of (base prompt, length, salt, new tokens, view tokens, tokens never hit, keep the prompt table)."""
        model, p = self.model, PAGE
        ids, keys, demands, chains = [], [], [], []
        for base, length, salt, new, view, recompute, keep in rows:
            row_ids = BASES[base][:length]
            table = length + new if keep else length
            demands.append(RowDemand(length, new, view, max(0, length - recompute), table, keep))
            ids.append(row_ids)
            keys.append(PrefixKeys(cache_salt=SALTS[salt]))
            chains.append(row_keys(row_ids, SALTS[salt]))
        # the model's plan
        hits = []
        for demand, chain in zip(demands, chains):
            row_hits = []
            for key in chain[: demand.hit_cap_tokens // p]:
                if key not in model.index:
                    break
                row_hits.append(model.index[key])
            hits.append(row_hits)
        prompt = [ceil(d.prompt_table_tokens, p) for d in demands]
        view = [ceil(d.view_tokens, p) for d in demands]
        steady = [pr + v if d.keep_prompt else v for d, pr, v in zip(demands, prompt, view)]
        free_hits = {page for row in hits for page in row if model.ref[page] == 0}
        fresh = sum(pr - len(h) + v for pr, h, v in zip(prompt, hits, view))
        peak = fresh + len(free_hits)
        needed = self.pool.pages_needed([d.prompt_tokens for d in demands], [d.new_tokens for d in demands], demands,
                                        token_ids=ids, keys=keys)
        assert (needed.prefill_peak, needed.steady_state, needed.prompt_pages, needed.view_pages) == (
            peak, sum(steady), sum(prompt), sum(view))
        assert (needed.hit_pages, needed.hit_pages_free, needed.hit_tokens, needed.new_pages, needed.rows) == (
            sum(map(len, hits)), len(free_hits), sum(map(len, hits)) * p, fresh, len(demands))
        reservation = self.rng.choice(self.reservations) if use_reservation and self.reservations else None
        available = model.free_count() - model.reserved + (reservation.count if reservation else 0)
        lens, news = [d.prompt_tokens for d in demands], [d.new_tokens for d in demands]
        try:
            got = self.pool.admit_batch(lens, news, demands, token_ids=ids, keys=keys, reservation=reservation)
        except PoolExhaustedError as err:
            assert peak > available and (err.pages_needed, err.pages_free) == (peak, available)
            return
        assert peak <= available
        for row in hits:
            for page in row:
                model.touch(page)
        for adm, demand, row_hits, chain, pr, v in zip(got, demands, hits, chains, prompt, view):
            want_prompt = row_hits + [model.take() for _ in range(pr - len(row_hits))]
            want_view = [model.take() for _ in range(v)]
            assert (list(adm.prompt.pages), list(adm.view.pages)) == (want_prompt, want_view)
            assert adm.reused_tokens == len(row_hits) * p
            assert adm.computed_tokens == demand.prompt_tokens - adm.reused_tokens
            self.admissions.append((adm, chain))
        if reservation is not None:  # what the admission took comes off its reservation first
            taken = min(self.reservation_counts[id(reservation)], peak)
            model.reserved -= taken
            self.reservation_counts[id(reservation)] -= taken
            assert reservation.count == self.reservation_counts[id(reservation)]

    @rule(rows=ROWS, priority=st.sampled_from([None, 10, 60]))
    def prefill(self, rows, priority):
        """A whole prefill: admit, index the written prompt, drop the prompt table (the view stays)."""
        count = len(self.admissions)
        self.admit(rows, use_reservation=False)
        for which in range(count, len(self.admissions)):
            self.commit(which, partial=False, priority=priority)
            self.release_prompt(which)

    @precondition(lambda self: self.admissions)
    @rule(which=st.integers(0, 1000), partial=st.booleans(), priority=st.sampled_from([None, 10, 60]))
    def commit(self, which, partial, priority):
        adm, chain = self.admissions[which % len(self.admissions)]
        tokens = adm.prompt_len // 2 if partial else adm.prompt_len
        full = min(tokens // PAGE, len(chain))
        if len(adm.prompt) < full and full > adm.committed_pages:
            try:
                self.pool.commit_prompt(adm, tokens, priority)
            except PoolStateError:
                return
            raise AssertionError("committing a released prompt must be refused")
        start = adm.committed_pages
        self.pool.commit_prompt(adm, tokens, priority)
        for i in range(start, full):
            self.model.register(adm.prompt.pages[i], chain[i], DEFAULT_PRIORITY if priority is None else priority)

    @precondition(lambda self: self.admissions)
    @rule(which=st.integers(0, 1000))
    def release_prompt(self, which):
        adm, _ = self.admissions[which % len(self.admissions)]
        self.model.unref(list(adm.prompt.pages))
        self.pool.release(adm.prompt)

    @precondition(lambda self: self.admissions)
    @rule(which=st.integers(0, 1000))
    def finish(self, which):
        adm, _ = self.admissions.pop(which % len(self.admissions))
        self.model.unref(list(adm.prompt.pages))
        self.model.unref(list(adm.view.pages))
        self.pool.release(adm)

    @rule(pages=st.integers(0, 6))
    def allocate(self, pages):
        table = self.pool.new_table("view")
        if pages > self.model.free_count() - self.model.reserved:
            try:
                self.pool.allocate(table, pages)
            except PoolExhaustedError:
                return
            raise AssertionError("an allocation beyond the free pages must be refused")
        self.pool.allocate(table, pages)
        assert list(table.pages) == [self.model.take() for _ in range(pages)]
        self.tables.append(table)

    @precondition(lambda self: self.tables)
    @rule(which=st.integers(0, 1000), keep=st.integers(0, 3))
    def truncate(self, which, keep):
        table = self.tables[which % len(self.tables)]
        self.model.unref(list(table.pages[keep:]))
        self.pool.truncate(table, keep)

    @rule(limit=st.none() | st.integers(0, 5))
    def evict(self, limit):
        assert self.pool.evict(limit) == self.model.evict(limit)

    @rule(pages=st.integers(0, 8))
    def reserve(self, pages):
        if pages > self.model.free_count() - self.model.reserved:
            try:
                self.pool.reserve(pages)
            except PoolExhaustedError:
                return
            raise AssertionError("a reservation beyond the free pages must be refused")
        reservation = self.pool.reserve(pages)
        self.model.reserved += pages
        self.reservations.append(reservation)
        self.reservation_counts[id(reservation)] = pages

    @precondition(lambda self: self.reservations)
    @rule(which=st.integers(0, 1000))
    def unreserve(self, which):
        reservation = self.reservations.pop(which % len(self.reservations))
        self.model.reserved -= self.reservation_counts.pop(id(reservation))
        self.pool.unreserve(reservation)
        assert reservation.count == 0

    @rule()
    def reset(self):
        if any(self.model.ref):
            try:
                self.pool.reset()
            except PoolStateError:
                return
            raise AssertionError("reset must be refused while pages are held")
        self.pool.reset()
        self.model.reset()

    # -------------------------------------------------------------------------------------------- invariants
    @invariant()
    def accounting_is_exact(self):
        pool, model = self.pool, self.model
        held = sum(ref > 0 for ref in model.ref)
        assert pool.free_pages() == model.free_count() - model.reserved
        assert pool.reserved_pages() == model.reserved
        assert pool.free_pages() + held + pool.reserved_pages() == pool.total_pages()
        assert pool.used_pages() == held
        holders = [0] * PAGES
        for table in self.tables_held():
            for page in table.pages:
                holders[page] += 1
        infos = [pool.page_info(i) for i in range(PAGES)]
        assert [info.ref for info in infos] == holders == model.ref
        assert pool.free_page_ids() == model.free_order()
        assert pool.cached_pages() == sum(len(pages) for pages in model.cached.values())
        indexed = {page for page in model.index.values()}
        assert {i for i, info in enumerate(infos) if info.hash is not None} == indexed

    @invariant()
    def cached_prefixes_stay_hittable(self):
        """Every page the model holds indexed carries that prefix's hash, and a prefix whose pages are all indexed is
        found whole, on the model's pages (a page whose parent was evicted first is not reachable: it ages out)."""
        for (salt, ids), page in self.model.index.items():
            keys = PrefixKeys(cache_salt=salt)
            assert self.pool.page_info(page).hash == self.pool.hash_pages(list(ids), keys)[-1]
            chain = row_keys(list(ids), salt)
            if all(key in self.model.index for key in chain):
                found = self.pool.resident_prefix(list(ids), keys)
                assert [info.index for info in found] == [self.model.index[key] for key in chain]

    def teardown(self):
        for adm, _ in self.admissions:
            self.pool.release(adm)
        for table in self.tables:
            self.pool.release(table)
        for reservation in self.reservations:
            self.pool.unreserve(reservation)
        assert self.pool.free_pages() == self.pool.total_pages()


PlannerMachine.TestCase.settings = settings(
    max_examples=200, stateful_step_count=50, derandomize=True, deadline=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.filter_too_much],
)
TestPlannerMachine = pytest.mark.slow(PlannerMachine.TestCase)  # ~20 s of hypothesis steps; CI runs it
