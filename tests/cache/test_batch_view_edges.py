"""Batched decode rows and row-group prefills at the edges a mutation run found untested.

Each test names the mutant it kills (docs/testing.md, "The batch view against the engine's tests"). Oracles: a row's
buffers before a move (the row must hold the same after it), the pool pages the batch holds (a page it gave back is
never written), the buffers' addresses (a reallocation must change the version that captured graphs key on), the
positions a step was given (a step must not change them), and the device lengths after a row-group prefill (the host
mirrors must equal what they say).
"""
import pytest
import torch

from hf_rocketkv import RocketKVCache
from hf_rocketkv.cache.batch_view import BatchedDecodeCache
from hf_rocketkv.cache.row_index import selected_rows
from hf_rocketkv.integration.compat import cache_kwargs
from tests.cache.helpers import engine_prefill
from tests.support.tiny_models import compressing_config, cpu_pool, greedy, left_pad, make_models, random_ids


@pytest.fixture(scope="module")
def model():
    return make_models("llama")[0]


def step(model, batch, rows, bucket, last):
    batch.prepare(rows, bucket)
    ids = torch.tensor([[t] for t in last] + [[5]] * (bucket - rows))
    with torch.no_grad():
        out = model(input_ids=ids, position_ids=batch.next_positions(), **cache_kwargs(batch), use_cache=True)
    batch.stepped()
    return [int(out.logits[r, -1].argmax()) for r in range(rows)]


def test_a_moved_row_holds_what_it_held(model):
    """Kills: move_row leaving out positions, move leaving out row_pages."""
    """move(src, dst): dst's row state equals src's before the move, every buffer (table, lengths, positions, seen)
    and the host counts (row_pages, room)."""
    cfg = compressing_config(kt_cache_dtype="float32")
    pool = cpu_pool(model, cfg, 2 << 20, page_size=16)
    batch = BatchedDecodeCache(pool, max_rows=2)
    for row, n in enumerate((27, 35)):
        cache, _ = engine_prefill(model, pool, cfg, random_ids(1, n, seed=300 + n)[0], 4)
        batch.join(row, cache)
    before = [(l.table_buf[1].clone(), l.lengths_buf[1].clone(), l.positions_buf[1].clone(), l.seen_buf[1].clone())
              for l in batch.layers]
    host = (batch.row_pages[1], batch.room[1])
    batch.leave(0)
    batch.move(1, 0)
    for layer, want in zip(batch.layers, before):
        got = (layer.table_buf[0], layer.lengths_buf[0], layer.positions_buf[0], layer.seen_buf[0])
        assert all(torch.equal(a, b) for a, b in zip(got, want))
    assert (batch.row_pages[0], batch.room[0]) == host
    batch.leave(0)
    batch.close()


def test_padding_rows_write_only_the_scratch_page_the_batch_holds_now(model):
    """Kills: prepare's key without the layout counter."""
    """(rows, bucket) unchanged across a full turnover in which the scratch page went back to the pool and another
    was taken: the padding row must write the new scratch page, never a page the batch no longer holds."""
    cfg = compressing_config(kt_cache_dtype="float32")
    pool = cpu_pool(model, cfg, 2 << 20, page_size=16)
    batch = BatchedDecodeCache(pool, max_rows=2)
    a, first_a = engine_prefill(model, pool, cfg, random_ids(1, 30, seed=11)[0], 4)
    batch.join(0, a)
    assert batch.ensure_scratch()
    old = batch.scratch.pages[0]
    step(model, batch, 1, 2, [first_a])
    batch.leave(0)
    batch.release_scratch()
    hog = pool.new_table("view")  # someone else takes the old scratch page
    while old not in hog.pages:
        pool.allocate(hog, 1)
    b, first_b = engine_prefill(model, pool, cfg, random_ids(1, 33, seed=12)[0], 5)
    batch.join(0, b)
    assert batch.ensure_scratch() and batch.scratch.pages[0] != old
    storages = [pool.layer(i) for i in range(len(batch.layers))]
    for s in storages:  # its new owner's data (not what the old padding token left there)
        s.k[old].fill_(7.0)
        s.v[old].fill_(7.0)
    before = [(s.k[old].clone(), s.v[old].clone()) for s in storages]
    step(model, batch, 1, 2, [first_b])
    for s, (k, v) in zip(storages, before):
        assert torch.equal(s.k[old], k) and torch.equal(s.v[old], v)  # a page the batch does not hold is untouched
    batch.leave(0)
    batch.close()
    pool.release(hog)
    assert pool.free_pages() == pool.total_pages()


def test_reallocated_buffers_bump_the_version(model):
    """Kills: a widen that does not bump the version."""
    """A wider join reallocates the tables (new addresses): captured graphs must be dropped, so version changes."""
    cfg = compressing_config(kt_cache_dtype="float32")
    pool = cpu_pool(model, cfg, 2 << 20, page_size=8)
    batch = BatchedDecodeCache(pool, max_rows=2)
    small, _ = engine_prefill(model, pool, cfg, random_ids(1, 10, seed=1)[0], 2)
    batch.join(0, small)
    ptr, version = batch.layers[0].table_buf.data_ptr(), batch.version
    wide, _ = engine_prefill(model, pool, cfg, random_ids(1, 41, seed=2)[0], 40)
    batch.join(1, wide)
    assert batch.layers[0].table_buf.data_ptr() != ptr  # widened (precondition)
    assert batch.version != version
    batch.release_rows()
    batch.close()


def test_next_positions_is_a_snapshot(model):
    """Kills: next_positions without its clone."""
    """next_positions() is this step's positions: a step (which advances every row) must not change it."""
    cfg = compressing_config(kt_cache_dtype="float32")
    pool = cpu_pool(model, cfg, 2 << 20)
    batch = BatchedDecodeCache(pool, max_rows=1)
    cache, first = engine_prefill(model, pool, cfg, random_ids(1, 30, seed=3)[0], 3)
    batch.join(0, cache)
    batch.prepare(1, 1)
    positions = batch.next_positions()
    want = positions.tolist()
    with torch.no_grad():
        model(input_ids=torch.tensor([[first]]), position_ids=positions, **cache_kwargs(batch), use_cache=True)
    assert positions.tolist() == want == [[30]]
    batch.leave(0)
    batch.close()


@pytest.mark.parametrize("use_pool", [False, True])
def test_row_groups_stack_the_host_counts_of_one_forward(model, use_pool):
    """Kills: the stacked host room as the loosest row's, the stacked longest row as the shortest group's."""
    """Row-group prefill (groups of different kept lengths) leaves the host mirrors a one-forward prefill leaves:
    the longest row (= the device lengths' max) and each row's room (pages * PP - length, tightest row)."""
    ids, mask = left_pad([random_ids(1, n, seed=n)[0] for n in (60, 45, 20, 15)])  # group 2 keeps at most 20 < 24
    cfg = compressing_config(kt_cache_dtype="float32", prefill_batch_size=2)
    pool = cpu_pool(model, cfg, 4 << 20) if use_pool else None
    cache = RocketKVCache(cfg, pool=pool) if use_pool else RocketKVCache(cfg)
    greedy(model, ids, attention_mask=mask, cache=cache, max_new_tokens=4)
    for layer in cache.layers:
        lengths = layer.lengths.view(layer.lengths.shape[0], -1).max(dim=1).values
        assert layer.host_max_length == int(lengths.max())
        if use_pool:
            rows = [p * layer.store.page_tokens - int(n) for p, n in zip(layer.store.row_pages, lengths)]
            assert layer.decode_room() == min(rows)
        else:
            assert layer.decode_room() == layer.capacity - int(lengths.max())
    cache.close()


def test_selected_rows_in_place_keeps_the_address():
    """Kills: selected_rows never copying in place (beam search's reorder must keep the buffers captured graphs
    read)."""
    t = torch.arange(6).view(3, 2)
    address = t.data_ptr()
    (same, none), = [selected_rows((t, None), torch.tensor([2, 0, 1]), in_place=True)]
    assert same is t and t.data_ptr() == address and t.tolist() == [[4, 5], [0, 1], [2, 3]] and none is None
    (other,) = selected_rows((t,), torch.tensor([1]), in_place=True)  # another shape: a new tensor
    assert other.tolist() == [[0, 1]] and t.tolist() == [[4, 5], [0, 1], [2, 3]]
    (copied,) = selected_rows((t,), torch.tensor([2, 0, 1]), in_place=False)  # not in place: a new tensor
    assert copied.data_ptr() != address and copied.tolist() == [[2, 3], [4, 5], [0, 1]]
