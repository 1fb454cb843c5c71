"""BatchedDecodeCache (cache/batch_view.py): rows of several pool-backed RocketKVCaches decoding as one batch.

Oracle: each prompt alone through model.generate with its own pool-backed RocketKVCache; before ``leave`` a row must
hold exactly what that generate() left in its cache (lengths, kept positions, logical length, K/V in its pages), and
``leave`` gives every page back.
"""

from __future__ import annotations

import pytest
import torch

from hf_rocketkv import RocketKVCache
from hf_rocketkv.cache.batch_view import BatchedDecodeCache, BatchedDecodeLayer
from hf_rocketkv.cache.paged_store import PagedStore
from hf_rocketkv.integration.compat import cache_kwargs
from tests.cache.helpers import engine_prefill
from tests.support.tiny_models import compressing_config, cpu_pool, greedy, random_ids

CFG = compressing_config(kt_cache_dtype="float32")
STEPS = 6


def prefill(model, pool, prompt, new_tokens):
    """A prompt through the model with its own cache, as BatchingEngine prefills; returns (cache, first token)."""
    return engine_prefill(model, pool, CFG, prompt, new_tokens)


def row_state(layer: BatchedDecodeLayer, row: int, width: int):
    """Row ``row`` of a batch layer as a one-row cache layer would show it: length, positions, logical length, and
    K/V / KT gathered through its table row (``width`` slots, the request cache's capacity)."""
    pages = width // layer.page_tokens
    store = PagedStore.over(layer.storage, layer.table_buf[row : row + 1, :pages], (pages,), layer.dtype)
    keys, values = store.gather()
    return (layer.lengths_buf[row : row + 1], layer.positions_buf[row : row + 1, :, :width], layer.seen_buf[row],
            keys, values, store.gather_kt())


def test_rows_decode_together_and_hold_what_generate_leaves(model):
    pool = cpu_pool(model, CFG, 2 << 20)
    prompts = [random_ids(1, n, seed=n)[0] for n in (30, 13, 41)]  # one within the budget, two compressed
    alone = []
    for prompt in prompts:
        cache = RocketKVCache(CFG, pool=pool)
        out = greedy(model, prompt[None], STEPS + 1, cache=cache)
        alone.append((out[0, len(prompt):].tolist(), cache))
    batch = BatchedDecodeCache(pool, max_rows=4)
    tokens, widths = [], []
    for row, prompt in enumerate(prompts):
        cache, first = prefill(model, pool, prompt, STEPS + 1)
        held = cache.stats.pages_held
        widths.append(cache.layers[0].positions.shape[2])
        before = pool.free_pages()
        batch.join(row, cache)
        assert cache.stats.pages_held == 0 and not cache.layers  # the row holds the request now
        cache.close()
        assert pool.free_pages() == before  # closing the emptied cache gives nothing back: the row holds it
        tokens.append([first])
        assert held > 0
    assert batch.ensure_scratch()
    for _ in range(STEPS):
        batch.prepare(3, 4)  # one padding row
        ids = torch.tensor([[t[-1]] for t in tokens] + [[5]])
        with torch.no_grad():
            out = model(input_ids=ids, position_ids=batch.next_positions(), **cache_kwargs(batch), use_cache=True)
        batch.stepped()
        for row in range(3):
            tokens[row].append(int(out.logits[row, -1].argmax()))
    for row, (want_tokens, want) in enumerate(alone):
        assert tokens[row] == want_tokens
        for mine, theirs in zip(batch.layers, want.layers):
            lengths, positions, seen, keys, values, kt = row_state(mine, row, widths[row])
            assert theirs.positions.shape[2] == widths[row]
            assert torch.equal(lengths, theirs.lengths)
            assert torch.equal(positions, theirs.positions)
            assert int(seen) == want.get_seq_length()
            # K/V computed by other kernels than generate()'s (the prefill's mask, batched decode projections) may
            # round differently by a few ULPs; which tokens are kept, where, and the sampled tokens are the same
            for a, b in ((keys, theirs.keys), (values, theirs.values)):
                torch.testing.assert_close(a, b, rtol=0, atol=1e-5)
            torch.testing.assert_close(kt, theirs.kt, rtol=0, atol=1e-5)
    held = sum(cache.stats.pages_held for _, cache in alone)
    for _, cache in alone:
        cache.close()
    free = pool.free_pages()
    for row in range(3):
        batch.leave(row)
    assert pool.free_pages() > free and batch.joined == 0
    batch.close()
    assert pool.free_pages() == pool.total_pages() and held > 0


def test_moves_and_padding_keep_rows_apart(model):
    """A row that left gives its pages back and is filled by the last one (move); the padding rows write only the
    scratch page."""
    pool = cpu_pool(model, CFG, 2 << 20, page_size=16)
    prompts = [random_ids(1, n, seed=100 + n)[0] for n in (27, 35)]
    batch = BatchedDecodeCache(pool, max_rows=2)
    widths, kept = [], []
    for row, prompt in enumerate(prompts):
        cache, _ = prefill(model, pool, prompt, 4)
        widths.append(cache.layers[0].positions.shape[2])
        kept.append(int(cache.layers[0].lengths.item()))
        batch.join(row, cache)
    layer = batch.layers[0]
    before = [row_state(layer, row, widths[row])[3].clone() for row in range(2)]
    free = pool.free_pages()
    batch.leave(0)
    assert pool.free_pages() > free  # the row that left gave its pages back
    batch.move(1, 0)
    assert batch.holds(0) and not batch.holds(1)
    assert batch.ensure_scratch()
    batch.prepare(1, 2)
    with torch.no_grad():
        model(input_ids=torch.tensor([[7], [9]]), position_ids=batch.next_positions(), **cache_kwargs(batch),
              use_cache=True)
    batch.stepped()
    after = row_state(layer, 0, widths[1])
    assert int(after[0]) == kept[1] + 1  # the moved row took its token
    assert torch.equal(after[3][:, :, : kept[1]], before[1][:, :, : kept[1]])  # its old tokens are untouched
    assert batch.scratch.pages[0] not in layer.table_buf[0].tolist()  # the padding row writes a page of its own
    batch.leave(0)
    batch.close()
    assert pool.free_pages() == pool.total_pages()


def test_checks(model):
    pool = cpu_pool(model, CFG, 2 << 20)
    batch = BatchedDecodeCache(pool, max_rows=2)
    cache, _ = prefill(model, pool, random_ids(1, 30, seed=1)[0], 2)
    with pytest.raises(ValueError, match="compressed"):  # a cache whose prefill has not run
        batch.join(1, RocketKVCache(CFG, pool=pool))
    batch.join(0, cache)
    with pytest.raises(ValueError, match="row 0 is taken"):
        batch.join(0, cache)
    with pytest.raises(RuntimeError, match="scratch page"):
        batch.prepare(1, 2)
    batch.prepare(1, 1)
    with pytest.raises(ValueError, match="prepared for 1 rows"):
        model(input_ids=torch.tensor([[3], [4]]), position_ids=torch.tensor([[30], [0]]), **cache_kwargs(batch))
    with pytest.raises(ValueError, match="one token per row"):
        model(input_ids=torch.tensor([[3, 4]]), position_ids=torch.tensor([[30, 31]]), **cache_kwargs(batch))
    with pytest.raises(RuntimeError, match="position_ids"):
        batch.get_seq_length()
    for _ in range(batch.room[0]):  # the admitted view: kept + max_new_tokens, rounded up to whole pool pages
        batch.prepare(1, 1)
        with torch.no_grad():
            model(input_ids=torch.tensor([[3]]), position_ids=batch.next_positions(), **cache_kwargs(batch))
        batch.stepped()
    with pytest.raises(RuntimeError, match="no room"):
        batch.prepare(1, 1)
    with pytest.raises(RuntimeError, match="rows are still joined"):
        batch.close()
    batch.leave(0)
    with pytest.raises(ValueError, match="row 0 is free"):
        batch.leave(0)
    batch.close()
    assert pool.free_pages() == pool.total_pages()


def test_prepare_rebuilds_views_only_when_the_layout_changes(model, monkeypatch):
    """Steps of an unchanged batch keep the layers' views (no per-layer work) but still empty the padding rows; a
    join, a leave or a new bucket rebuilds them. Padding rows decode from length 0 at every step (their lengths
    would otherwise grow by one per step)."""
    pool = cpu_pool(model, CFG, 2 << 20, page_size=16)
    batch = BatchedDecodeCache(pool, max_rows=4)
    calls = []
    real_select = BatchedDecodeLayer.select
    monkeypatch.setattr(BatchedDecodeLayer, "select", lambda self, *a: (calls.append(a[0]), real_select(self, *a)))
    for row, n in enumerate((27, 35)):
        cache, _ = prefill(model, pool, random_ids(1, n, seed=200 + n)[0], 8)
        batch.join(row, cache)
    layers = len(batch.layers)
    assert batch.ensure_scratch()

    def step(rows, bucket):
        batch.prepare(rows, bucket)
        with torch.no_grad():
            model(input_ids=torch.full((bucket, 1), 7), position_ids=batch.next_positions(), **cache_kwargs(batch),
                  use_cache=True)
        batch.stepped()

    step(2, 4)
    assert len(calls) == layers
    for _ in range(3):
        step(2, 4)
    assert len(calls) == layers  # unchanged layout: views kept
    batch.prepare(2, 4)
    for layer in batch.layers:  # padding rows emptied before each step, in every layer
        assert layer.lengths_buf[2:4].tolist() == [0, 0] and layer.seen_buf[2:4].tolist() == [0, 0]
    step(2, 2)  # a new bucket
    assert len(calls) == 2 * layers
    batch.leave(1)
    step(1, 4)  # a row left
    assert len(calls) == 3 * layers
    batch.leave(0)
    batch.close()
    assert pool.free_pages() == pool.total_pages()


def test_a_batch_dropped_with_rows_joined_gives_their_pages_back(model):
    """An engine that dies with rows joined drops its batch: the rows' pages are queued and released at the pool's
    next call, as those of a RocketKVCache dropped without close()."""
    import gc

    pool = cpu_pool(model, CFG, 2 << 20)
    batch = BatchedDecodeCache(pool, max_rows=2)
    cache, _ = prefill(model, pool, random_ids(1, 30, seed=4)[0], 3)
    batch.join(0, cache)
    assert pool.free_pages() < pool.total_pages()
    del batch, cache
    gc.collect()
    assert pool.free_pages() == pool.total_pages()  # free_pages() is a pool call: the queued release ran first


def test_release_rows_the_scratch_page_and_what_the_batch_refuses(model):
    """release_rows gives back every joined row (not the free ones) and counts them; the scratch page is exactly one
    page; the batch's length questions: 0 before the first join, refused word for word after it (the rows differ)."""
    pool = cpu_pool(model, CFG, 2 << 20)
    batch = BatchedDecodeCache(pool, max_rows=3)
    assert batch.get_seq_length() == 0 and batch.release_rows() == 0
    for row, n in ((0, 30), (2, 41)):
        cache, _ = prefill(model, pool, random_ids(1, n, seed=n)[0], STEPS)
        batch.join(row, cache)
        cache.close()
    assert pool.free_pages() < pool.total_pages()
    assert batch.release_rows() == 2
    assert batch.joined == 0 and pool.free_pages() == pool.total_pages()
    assert batch.ensure_scratch() and pool.free_pages() == pool.total_pages() - 1
    batch.close()
    assert pool.free_pages() == pool.total_pages()
    with pytest.raises(RuntimeError) as refused:
        batch.get_seq_length()
    assert str(refused.value) == (
        "BatchedDecodeCache rows have different lengths: pass position_ids (each row's next position, "
        "BatchedDecodeCache.next_positions) to the model instead of asking the cache for one length")
    with pytest.raises(NotImplementedError) as refused:
        batch.layers[0].reset()
    assert str(refused.value) == "BatchedDecodeLayer.reset: rows leave one at a time (BatchedDecodeCache.leave)"


def test_a_record_is_the_request_layers_decode_state_and_reading_it_changes_nothing(model):
    """KVRecord.of(cache): per layer the request's own table row, length, positions and logical length (the cache's
    tensors, row 0), its room and pages as the layer counts them; the cache still decodes as an unread twin does."""
    from hf_rocketkv.cache.decode_record import KVRecord, PagedRow

    pool = cpu_pool(model, CFG, 2 << 20)
    prompt = random_ids(1, 41, seed=2)[0]
    cache, first = prefill(model, pool, prompt, STEPS + 1)
    twin, _ = prefill(model, pool, prompt, STEPS + 1)
    record = KVRecord.of(cache)
    assert len(record.layers) == len(cache.layers)
    for row, layer in zip(record.layers, cache.layers):
        assert isinstance(row, PagedRow)
        assert torch.equal(row.table, layer.store.table[0]) and torch.equal(row.length, layer.lengths[0])
        assert torch.equal(row.positions, layer.positions[0]) and int(row.seen) == len(prompt)
        assert row.room == layer.capacity - int(layer.lengths.max()) - layer.host_slack
        assert row.runs_with.page_tokens == pool.page_size and row.runs_with.num_kv_heads == 2
    assert record.row_pages == cache.layers[0].store.row_pages[0] and record.width == record.layers[0].table.shape[0]
    assert record.room == min(row.room for row in record.layers)
    ids = torch.tensor([[first]])
    for _ in range(2):
        position = torch.tensor([[cache.get_seq_length()]])
        with torch.no_grad():
            ours = model(input_ids=ids, position_ids=position, **cache_kwargs(cache), use_cache=True).logits
            theirs = model(input_ids=ids, position_ids=position, **cache_kwargs(twin), use_cache=True).logits
        assert torch.equal(ours, theirs)
        ids = ours[:, -1:].argmax(-1)
    for request in (cache, twin):
        request.close()
    assert pool.free_pages() == pool.total_pages()


def test_a_record_refuses_what_a_batch_row_cannot_take(model):
    from hf_rocketkv.cache.decode_record import KVRecord

    pool = cpu_pool(model, CFG, 2 << 20)
    with pytest.raises(ValueError, match="needs a pool-backed RocketKVCache"):
        KVRecord.of(RocketKVCache(CFG))
    with pytest.raises(ValueError, match="needs a compressed RocketKVCache of batch 1"):
        KVRecord.of(RocketKVCache(CFG, pool=pool))
    two = RocketKVCache(CFG, pool=pool)
    greedy(model, random_ids(2, 41, seed=3), 3, cache=two)  # compressed, but two rows: a batch row takes one
    assert two.is_compressed
    with pytest.raises(ValueError, match="needs a compressed RocketKVCache of batch 1"):
        KVRecord.of(two)
