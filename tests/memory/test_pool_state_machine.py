"""Random request sequences against KVBlockPool: after every step, the accounting and ref counts are exact; at the
end every page is free again. Hit pages must hold the bytes that were written under their hash (through offload,
onload and eviction)."""

import random

import pytest
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from hf_rocketkv.memory import PoolExhaustedError, PoolStateError, PrefixKeys
from tests.memory.helpers import fill_pages, make_pool, page_bytes_of, rocket_config

CFG = rocket_config(prompt_budget=16, window_size=4)
BASES = [[1000 + i for i in range(48)], [2000 + i for i in range(48)], [1000 + i for i in range(20)] + [7] * 28]
SALTS = [None, "tenant-a"]


def snapshot(pool):
    return (pool.free_page_ids(), pool.free_page_ids("host"),
            [pool.page_info(i) for i in range(pool.total_pages())],
            [pool.page_info(i, "host") for i in range(pool.host_slots)], pool.stats())


class PoolMachine(RuleBasedStateMachine):
    def __init__(self):
        super().__init__()
        self.pool = make_pool(24, host_pages=6)
        self.admissions = []
        self.tables = []  # low-level view tables
        self.content = {}  # page hash -> bytes written when it was indexed
        self.seed = 0

    # ------------------------------------------------------------------------------------------ helpers
    def held_tables(self):
        return [t for adm in self.admissions for t in (adm.prompt, adm.view)] + self.tables

    def prompt_ids(self, base, extra, seed):
        rng = random.Random(seed)
        return BASES[base][: 48 - extra] + [rng.randrange(50, 60) for _ in range(extra)]

    def check_hits(self, adm):
        for i in range(adm.hit_pages):
            page = adm.prompt.pages[i]
            page_hash = adm.page_hashes[i]
            assert self.pool.page_info(page).hash == page_hash
            assert page_bytes_of(self.pool, page) == self.content[page_hash], "a hit page lost its bytes"

    def admit_rows(self, rows, max_new):
        lengths = [len(ids) for ids, _ in rows]
        ids = [ids for ids, _ in rows]
        keys = [PrefixKeys(cache_salt=salt) for _, salt in rows]
        needed = self.pool.pages_needed(lengths, max_new, CFG, token_ids=ids, keys=keys)
        fits = self.pool.can_admit(lengths, max_new, CFG, token_ids=ids, keys=keys)
        assert fits == (needed.prefill_peak <= self.pool.free_pages())
        before = snapshot(self.pool)
        try:
            admitted = self.pool.admit_batch(lengths, max_new, CFG, token_ids=ids, keys=keys)
        except PoolExhaustedError as err:
            assert not fits and err.pages_needed == needed.prefill_peak
            assert snapshot(self.pool) == before  # a refused admission changes nothing
            return
        assert fits
        assert before[4].free_pages - self.pool.free_pages() == needed.prefill_peak
        for adm in admitted:
            self.check_hits(adm)
            assert adm.reused_tokens + adm.computed_tokens == adm.prompt_len
            assert adm.reused_tokens % self.pool.page_size == 0
        self.admissions.extend(admitted)

    # ------------------------------------------------------------------------------------------ rules
    @rule(base=st.integers(0, 2), extra=st.integers(0, 30), cut=st.integers(0, 40), salt=st.integers(0, 1),
          max_new=st.integers(0, 12))
    def admit(self, base, extra, cut, salt, max_new):
        self.seed += 1
        ids = self.prompt_ids(base, extra, self.seed)
        ids = ids[: max(1, len(ids) - cut)]
        self.admit_rows([(ids, SALTS[salt])], max_new)

    @rule(base=st.integers(0, 2), extra=st.integers(0, 12), salt=st.integers(0, 1), max_new=st.integers(0, 8))
    def prefill(self, base, extra, salt, max_new):
        """A whole prefill: admit, write and index the prompt, drop the prompt table (the view stays)."""
        count = len(self.admissions)
        self.seed += 1
        self.admit_rows([(self.prompt_ids(base, extra, self.seed), SALTS[salt])], max_new)
        if len(self.admissions) > count:
            self.commit(len(self.admissions) - 1, partial=False)
            self.pool.release(self.admissions[-1].prompt)

    @rule(base=st.integers(0, 2), cut=st.integers(0, 30), max_new=st.integers(0, 4))
    def admit_two_rows(self, base, cut, max_new):
        ids = BASES[base][: 48 - cut]
        self.admit_rows([(ids, None), (ids, None)], max_new)

    @precondition(lambda self: self.admissions)
    @rule(which=st.integers(0, 1000), partial=st.booleans())
    def commit(self, which, partial):
        adm = self.admissions[which % len(self.admissions)]
        if not len(adm.prompt):
            return
        written = adm.prompt_len // 2 if partial else adm.prompt_len
        self.seed += 1
        first_new = max(adm.committed_pages, adm.hit_pages)
        fill_pages(self.pool, adm.prompt.pages[first_new:], self.seed)  # never into shared (hit) pages
        self.pool.commit_prompt(adm, num_tokens=written)
        for i in range(first_new, adm.committed_pages):
            page = adm.prompt.pages[i]
            if self.pool.page_info(page).hash == adm.page_hashes[i]:
                self.content[adm.page_hashes[i]] = page_bytes_of(self.pool, page)

    @precondition(lambda self: self.admissions)
    @rule(which=st.integers(0, 1000))
    def release_prompt(self, which):
        self.pool.release(self.admissions[which % len(self.admissions)].prompt)

    @precondition(lambda self: self.admissions)
    @rule(which=st.integers(0, 1000))
    def finish(self, which):
        self.pool.release(self.admissions.pop(which % len(self.admissions)))

    @rule(pages=st.integers(0, 8))
    def allocate_view(self, pages):
        table = self.pool.new_table("view")
        before = snapshot(self.pool)
        try:
            self.pool.allocate(table, pages)
        except PoolExhaustedError:
            assert pages > before[4].free_pages and snapshot(self.pool) == before
            return
        self.tables.append(table)

    @precondition(lambda self: self.tables)
    @rule(which=st.integers(0, 1000), keep=st.integers(0, 4))
    def shrink_or_release_table(self, which, keep):
        table = self.tables[which % len(self.tables)]
        self.pool.truncate(table, min(keep, len(table)))
        if not len(table):
            self.tables.remove(table)

    @rule(pages=st.none() | st.integers(0, 6))
    def evict(self, pages):
        self.pool.evict(pages)

    @rule()
    def reset(self):
        if any(len(t) for t in self.held_tables()):
            with pytest.raises(PoolStateError):
                self.pool.reset()
            return
        self.pool.reset()
        self.content.clear()
        assert self.pool.cached_pages() == 0 and self.pool.stats().host_cached == 0

    # ------------------------------------------------------------------------------------------ invariants
    @invariant()
    def accounting_is_exact(self):
        pool = self.pool
        total = pool.total_pages()
        assert pool.free_pages() + pool.used_pages() == total
        holders = [0] * total
        private_owners = {}
        for table in self.held_tables():
            assert len(set(table.pages)) == len(table.pages), "a page twice in one table"
            for page in table.pages:
                holders[page] += 1
        infos = [pool.page_info(i) for i in range(total)]
        assert [info.ref for info in infos] == holders
        free = pool.free_page_ids()
        assert len(free) == len(set(free)) == pool.free_pages()
        assert set(free) == {i for i, info in enumerate(infos) if info.ref == 0}
        assert all(info.free == (info.ref == 0) for info in infos)
        for i, info in enumerate(infos):
            if info.hash is None and info.ref > 1:
                private_owners[i] = info.ref
        assert not private_owners, f"unhashed pages shared by several tables: {private_owners}"
        host = pool.free_page_ids("host")
        assert len(host) == len(set(host)) == pool.host_slots
        hashes = [info.hash for info in infos if info.hash] + \
                 [pool.page_info(i, "host").hash for i in range(pool.host_slots) if pool.page_info(i, "host").hash]
        assert len(hashes) == len(set(hashes)), "a prefix page indexed twice"
        assert pool.cached_pages() == sum(1 for info in infos if info.ref == 0 and info.hash is not None)

    def teardown(self):
        for adm in self.admissions:
            self.pool.release(adm)
        for table in self.tables:
            self.pool.release(table)
        assert self.pool.free_pages() == self.pool.total_pages()
        assert all(self.pool.page_info(i).ref == 0 for i in range(self.pool.total_pages()))


PoolMachine.TestCase.settings = settings(
    max_examples=40, stateful_step_count=30, derandomize=True, deadline=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.filter_too_much],
)
TestPoolMachine = pytest.mark.slow(PoolMachine.TestCase)  # ~3 min of hypothesis steps on 2 cores; CI runs it
