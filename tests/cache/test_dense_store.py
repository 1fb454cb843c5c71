"""A chunked prefill's dense store (cache/dense_store.py): written chunk by chunk into one buffer of the prompt's
width, holding exactly transformers' DynamicCache K/V after every chunk, and gone with the store at stage 1."""

from __future__ import annotations

import pytest
import torch
from transformers import DynamicCache

from hf_rocketkv import RocketKVCache
from hf_rocketkv.cache.dense_store import DenseStore
from hf_rocketkv.integration import compat
from tests.support.tiny_models import (
    compressing_config,
    cpu_pool,
    make_models,
    random_ids,
)


def _chunks(model, cache, ids: torch.Tensor, chunk: int, after_chunk=None) -> None:
    for start in range(0, ids.shape[1], chunk):
        end = min(ids.shape[1], start + chunk)
        with torch.no_grad():
            model(input_ids=ids[:, start:end], position_ids=torch.arange(start, end)[None], use_cache=True,
                  **compat.cache_kwargs(cache))
        if after_chunk is not None:
            after_chunk(end)


@pytest.mark.parametrize("pooled", [False, True])
@pytest.mark.parametrize("length, chunk", [(40, 8), (37, 16), (9, 8)])
def test_chunks_fill_one_buffer_with_transformers_keys_and_values(pooled, length, chunk):
    rocket, _ = make_models("llama")
    config = compressing_config()
    ids = random_ids(1, length, seed=length)
    reference = DynamicCache(config=rocket.config)
    _chunks(rocket, reference, ids, chunk)  # the same chunks through transformers' own cache
    cache = RocketKVCache(config, pool=cpu_pool(rocket, config) if pooled else None)
    buffers = []

    def check(end):
        for layer_idx, layer in enumerate(cache.layers):
            assert layer.dense.keys.shape[2] == end
            torch.testing.assert_close(layer.dense.keys,
                                       reference.layers[layer_idx].keys[:, :, :end].to(layer.dense.keys.dtype))
            torch.testing.assert_close(layer.dense.values,
                                       reference.layers[layer_idx].values[:, :, :end].to(layer.dense.values.dtype))
        if end > chunk:  # every chunk after the first writes into the same buffer of the whole prompt's width
            base = cache.layers[0].dense.keys._base
            assert base is not None and base.shape[2] == length
            buffers.append(base)

    cache.hints.defer_compression = True
    with cache.prefill(ids, max_new_tokens=4):
        _chunks(rocket, cache, ids, chunk, after_chunk=check)
        alive = [layer.dense.buffers[0] for layer in cache.layers if layer.dense.buffers is not None]
    assert all(buffer is buffers[0] for buffer in buffers)
    assert len(alive) == (len(cache.layers) if length > chunk else 0)
    buffers.clear()
    assert all(ref() is None for ref in alive), "the buffers must go with the dense store at stage 1"
    assert all(layer.compressed for layer in cache.layers)
    cache.close()


def test_without_the_prompt_width_chunks_concatenate():
    """Forwards outside ``cache.prefill(ids)`` (no width known): the store grows by concatenation, as before."""
    rocket, _ = make_models("llama")
    cache = RocketKVCache(compressing_config())
    cache.hints.defer_compression = True
    ids = random_ids(1, 20)
    _chunks(rocket, cache, ids, 8)
    assert cache.layers[0].dense.keys.shape[2] == 20 and cache.layers[0].dense.buffers is None


def test_a_width_given_without_ids_fills_one_buffer_and_is_forgotten_after_the_prefill():
    """A row group's cache is admitted by the whole batch's, so its prefill gets no ids: ``columns=`` gives the
    prompt's width, and the hint lives only as long as the prefill."""
    rocket, _ = make_models("llama")
    cache = RocketKVCache(compressing_config())
    cache.hints.defer_compression = True
    ids = random_ids(1, 24, seed=2)
    widths = []
    with cache.prefill(columns=24):
        _chunks(rocket, cache, ids, 8, after_chunk=lambda end: widths.append(
            cache.layers[0].dense.keys._base.shape[2] if end > 8 else None))
        assert cache.hints.prefill_columns == 24
    assert widths == [None, 24, 24]
    assert cache.hints.prefill_columns is None
    assert all(layer.compressed for layer in cache.layers)


def test_a_buffer_the_store_no_longer_views_is_never_written_again():
    """The whole-prompt buffer is reused only while the store is a view of its first columns: once the store holds
    other tensors (``hold``), the next chunk goes to a fresh buffer holding those, and the old buffer (alive through
    a view somebody kept) keeps its contents."""
    def cols(*values):
        return torch.tensor(values, dtype=torch.float32).view(1, 1, -1, 1)

    store = DenseStore()
    store.start(cols(0.0)[:, :, :0], cols(0.0)[:, :, :0])
    store.append(cols(1, 1), cols(1, 1), prefill_columns=8)
    store.append(cols(2), cols(2), prefill_columns=8)  # a buffer 8 wide, the store its first 3 columns
    kept, kept_values = store.keys, store.values  # views that keep both buffers alive
    assert torch.equal(kept.flatten(), torch.tensor([1.0, 1, 2]))
    store.hold(cols(7, 7, 7), cols(7, 7, 7))
    store.append(cols(9), cols(9), prefill_columns=8)
    assert torch.equal(store.keys.flatten(), torch.tensor([7.0, 7, 7, 9]))
    assert torch.equal(store.values.flatten(), torch.tensor([7.0, 7, 7, 9]))
    assert torch.equal(kept.flatten(), torch.tensor([1.0, 1, 2]))
    assert torch.equal(kept_values.flatten(), torch.tensor([1.0, 1, 2]))
