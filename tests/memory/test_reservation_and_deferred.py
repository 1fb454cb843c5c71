"""Reservations (free pages set aside, counted not held) and releases queued from finalizers (``release_later``)."""

from __future__ import annotations

import gc
import threading
import weakref

import pytest

from hf_rocketkv.memory import BlockTable, PoolExhaustedError, Reservation
from hf_rocketkv.memory.deferred import DrainingLock, weakly_bound

from .helpers import make_pool, rocket_config


def test_reservation_sets_pages_aside_without_holding_them():
    pool = make_pool(num_pages=16)
    cfg = rocket_config()
    table = BlockTable("view")
    pool.allocate(table, 4)
    pool.register(table, pool.hash_pages(list(range(16)))[:2])  # two pages that will be cached once released
    pool.release(table)
    assert pool.cached_pages() == 2
    res = pool.reserve(10)
    assert isinstance(res, Reservation) and res.count == 10
    assert pool.free_pages() == 6 and pool.reserved_pages() == 10 and pool.used_pages() == 0
    assert pool.cached_pages() == 2  # nothing evicted: a reservation holds no page
    with pytest.raises(PoolExhaustedError, match="needs 7 pages but only 6 of 16"):
        pool.allocate(BlockTable("view"), 7)
    with pytest.raises(PoolExhaustedError):
        pool.reserve(7)
    # an admission naming the reservation may use it; what it takes comes off the reservation
    adm = pool.admit_batch([16], 8, cfg, reservation=res)[0]
    taken = len(adm.prompt) + len(adm.view)
    assert res.count == 10 - taken and pool.reserved_pages() == 10 - taken
    assert pool.free_pages() == 16 - taken - res.count
    pool.release(adm)
    pool.add_to_reservation(res, taken)
    assert res.count == 10 and pool.free_pages() == 6
    pool.unreserve(res, 3)
    assert res.count == 7 and pool.free_pages() == 9
    pool.unreserve(res)
    assert res.count == 0 and pool.free_pages() == 16 and pool.reserved_pages() == 0


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
