"""The pool's core (core.py, deferred.py, block_table.py): low-level allocation that is all or nothing, releases
queued from finalizers (``release_later``) and drained by the lock, tail-first truncation, block table tensors."""

from __future__ import annotations

import gc
import threading
import weakref

import pytest
import torch

from hf_rocketkv.memory import BlockTable, PoolExhaustedError
from hf_rocketkv.memory.deferred import DrainingLock, weakly_bound
from tests.memory.helpers import make_pool, snapshot


def test_release_later_is_processed_at_the_next_call_and_never_inside_one():
    pool = make_pool(num_pages=8)
    table = BlockTable("view")
    pool.allocate(table, 3)
    res = pool.reserve(2)
    with pool.exclusive():  # as if a finalizer fired inside a pool method on this thread
        pool.release_later([table, res])
        assert pool.pending_releases() == 1
        assert pool.free_pages() == 3  # re-entrant calls do not process the queue
    assert pool.free_pages() == 8 and pool.pending_releases() == 0 and len(table) == 0 and res.count == 0


def test_release_later_from_another_thread_while_the_pool_is_busy():
    pool = make_pool(num_pages=8)
    tables = [BlockTable("view") for _ in range(4)]
    for table in tables:
        pool.allocate(table, 2)
    with pool.exclusive():
        threads = [threading.Thread(target=pool.release_later, args=(table,)) for table in tables]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join()  # release_later takes no lock: it returns while this thread holds the pool
        assert pool.pending_releases() == 4
    assert pool.free_pages() == 8


def test_allocate_batch_is_all_or_nothing():
    pool = make_pool(num_pages=8)
    a, b = BlockTable("view"), BlockTable("view")
    with pytest.raises(PoolExhaustedError, match="needs 9 pages but only 8"):
        pool.allocate_batch([(a, 4), (b, 5)])
    assert len(a) == len(b) == 0 and pool.free_pages() == 8
    pool.allocate_batch([(a, 4), (b, 4)])
    assert pool.free_pages() == 0


def test_the_pool_is_in_no_reference_cycle():
    """Its lock calls the pool back through a weak reference: dropping the last reference frees the pool and its
    page tensors at once, not at the next run of the cyclic garbage collector."""
    gc.collect()
    gc.disable()
    try:
        pool = make_pool(num_pages=8, host_pages=4)
        table = BlockTable("view")
        pool.allocate(table, 3)
        pool.release_later(table)
        assert pool.free_pages() == 8  # the lock still drains the queue
        refs = weakref.ref(pool), weakref.ref(pool.layer(0).tensors()["k"].untyped_storage())
        del pool
        assert [ref() for ref in refs] == [None, None]
    finally:
        gc.enable()


def test_weakly_bound_calls_the_method_while_its_object_lives():
    class Counter:
        calls = 0

        def bump(self):
            self.calls += 1

    counter = Counter()
    lock = DrainingLock(weakly_bound(counter.bump))
    with lock, lock:  # re-entrant: one call
        pass
    assert counter.calls == 1
    ref = weakref.ref(counter)
    del counter
    assert ref() is None
    with lock:  # the object is gone: nothing to call
        pass


def test_low_level_allocate_refusal_changes_nothing():
    pool = make_pool(4)
    table = pool.new_table("view")
    pool.allocate(table, 3)
    before = snapshot(pool)
    with pytest.raises(PoolExhaustedError, match="needs 2 pages but only 1 of 4"):
        pool.allocate(table, 2)
    assert snapshot(pool) == before and len(table) == 3
    capped = pool.new_table("view", max_pages=0)
    with pytest.raises(ValueError, match="exceed its max_pages=0"):
        pool.allocate(capped, 1)
    assert snapshot(pool) == before


def test_truncate_returns_tail_pages():
    pool = make_pool(16)
    table = pool.new_table("prompt")
    pool.allocate(table, 6)
    pages = table.pages
    pool.truncate(table, 2)
    assert table.pages == pages[:2] and pool.free_pages() == 14
    assert pool.free_page_ids()[:4] == list(pages[2:])  # unhashed pages are reused first (hot)
    pool.release(table)


def test_block_table_tensor_is_padded_and_fixed():
    pool = make_pool(16)
    table = pool.new_table("view", max_pages=6)
    pool.allocate(table, 2)
    tensor = table.as_tensor("cpu")
    assert tensor.dtype == torch.int32 and tensor.tolist() == list(table.pages) + [-1] * 4
    pool.allocate(table, 3)
    assert table.as_tensor() is tensor and tensor.tolist() == list(table.pages) + [-1]
    pool.release(table)
    assert tensor.tolist() == [-1] * 6
    with pytest.raises(ValueError, match="BlockTable.kind"):
        pool.new_table("decode")
