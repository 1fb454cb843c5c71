"""SlidingWindowLayer against its oracle, transformers' DynamicSlidingWindowLayer (the same updates: prompts, chunks,
decode steps; the same returned keys, mask sizes and lengths for prompts, the same visible keys through the decode
ring), its memory bound, crop and row operations, and the layer kinds read from model configs."""

from __future__ import annotations

import pytest
import torch
from transformers import (
    Cohere2Config,
    Gemma3TextConfig,
    GptOssConfig,
    Llama4TextConfig,
    LlamaConfig,
    MistralConfig,
    Qwen2Config,
)
from transformers.cache_utils import DynamicSlidingWindowLayer  # the oracle (public class, not exported at the top)

from hf_rocketkv.cache import SlidingWindowLayer, sliding_windows
from hf_rocketkv.memory.layer_kinds import chunked_layers

H, D = 2, 4


def chunk(batch: int, n: int, start: int) -> torch.Tensor:
    """Keys whose every value is its logical position (so a wrong column is visible)."""
    return (torch.arange(start, start + n, dtype=torch.float32)[None, None, :, None]
            .expand(batch, H, n, D).clone())


def visible(keys: torch.Tensor, allowed: torch.Tensor, query_pos: int, offset: int, window: int) -> list[float]:
    """The positions (key values) the query at ``query_pos`` may see among ``keys``' columns, ``allowed`` bool per
    column or None (transformers' sliding causal rule from the columns' positions ``offset + c``)."""
    if allowed is None:
        cols = torch.arange(keys.shape[2]) + offset
        allowed = (cols <= query_pos) & (cols > query_pos - window)
    return sorted(keys[0, 0, allowed, 0].tolist())


@pytest.mark.parametrize("window", [1, 2, 5, 8])
@pytest.mark.parametrize("steps", [[13, 1, 1, 1, 1], [3, 1, 1, 1, 1, 1, 1], [4, 4, 4, 1, 1], [7, 1, 9, 1]],
                         ids=["prompt", "short-prompt", "chunks", "later-turn"])
def test_same_as_dynamic_sliding_window_layer(window, steps):
    """Forwards of several tokens: the very keys, mask sizes and stored columns of the oracle. Decode steps: the
    ring's ``window`` columns (transformers' static sliding sizes), and through ``ring_mask`` exactly the keys the
    oracle's query sees."""
    mine, oracle = SlidingWindowLayer(window), DynamicSlidingWindowLayer(sliding_window=window)
    seen = 0
    for n in steps:
        sizes, want_sizes = mine.get_mask_sizes(n), oracle.get_mask_sizes(n)
        keys = chunk(2, n, seen)
        got_k, got_v = mine.update(keys, -keys)
        want_k, want_v = oracle.update(keys, -keys)
        if n == 1:
            assert mine.ring and sizes == (window, max(0, seen - window + 1))
            assert got_k.shape[2] == window and torch.equal(got_v, -got_k)
            columns = torch.arange(window) + sizes[1]
            mask = ((columns <= seen) & (columns > seen - window))[None, None, None, :]  # transformers' sliding rule
            slots = mine.ring_mask(mask)[0, 0, 0]
            if window > 1:  # (transformers' window-1 layer keeps every column, see below)
                assert visible(got_k, slots, seen, 0, window) == visible(want_k, None, seen, want_sizes[1], window)
            assert visible(got_k, mine.ring_mask(None)[0, 0, 0], seen, 0, window) == list(
                map(float, range(max(0, seen - window + 1), seen + 1)))
        elif window > 1:  # transformers keeps every column when window - 1 == 0 (its slice -0:), so sizes differ there
            assert not mine.ring and sizes == want_sizes
            assert torch.equal(got_k, want_k) and torch.equal(got_v, want_v)
            assert torch.equal(mine.keys, oracle.keys)
        seen += n
        assert mine.get_seq_length() == oracle.get_seq_length() == seen
        assert mine.stored == min(seen, window - 1)
        assert mine.kept_tokens().tolist() == [[min(seen, window - 1)] * H] * 2


def test_memory_is_bounded_by_the_window():
    layer = SlidingWindowLayer(6)
    layer.update(chunk(1, 500, 0), chunk(1, 500, 0))
    for step in range(200):
        layer.update(chunk(1, 1, 500 + step), chunk(1, 1, 500 + step))
        # the storage behind the stored view, not only the view: the prompt's 500 columns are gone
        assert layer.memory_bytes() <= 2 * 6 * H * D * 4
    assert layer.get_seq_length() == 700 and sorted(layer.keys[0, 0, :, 0].tolist()) == list(range(694, 700))
    layer.update(chunk(1, 2, 700), chunk(1, 2, 700))  # a later turn: the ring back into ordered columns
    assert not layer.ring and layer.keys[0, 0, :, 0].tolist() == list(range(697, 702))


def test_crop_inside_the_window_and_refused_past_it():
    layer = SlidingWindowLayer(8)
    layer.update(chunk(1, 5, 0), chunk(1, 5, 0))
    layer.update(chunk(1, 1, 5), chunk(1, 1, 5))
    layer.crop(-1)
    assert layer.get_seq_length() == 5 and layer.keys[0, 0, :, 0].tolist() == [0, 1, 2, 3, 4]
    layer.update(chunk(1, 4, 5), chunk(1, 4, 5))  # 9 seen: the first columns are gone
    with pytest.raises(NotImplementedError, match="window 8.*cannot be removed once 9 tokens were seen"):
        layer.crop(-1)


@pytest.mark.parametrize("window", [4, 8])
@pytest.mark.parametrize("steps", [[3], [2, 1, 1], [1, 1, 1, 1, 1, 1, 1], [5, 2]], ids=["prompt", "decode", "ones", "chunks"])
@pytest.mark.parametrize("floor", [0, 3])
def test_crop_of_every_count_against_the_positions_seen(window, steps, floor):
    """Every ``crop(-count)``, ``count`` from 0 to one past what is held, after prompts, chunks and decode steps (the
    ring too), from a replay start (``floor``) or not. The oracle is the list of positions seen: a crop of ``count``
    inside the window leaves exactly the first ``seen - count`` of them (keys and values), the length and the
    host-side count drop by ``count``, and the next forward returns what a layer that never saw the cropped tokens
    returns; past the window or past what is held, it raises and changes nothing."""

    def fed(counts):
        layer = SlidingWindowLayer(window)
        if floor:
            layer.seed_replay(floor)
        seen = floor
        for n in counts:
            layer.update(chunk(1, n, seen), -chunk(1, n, seen))
            seen += n
        return layer, seen

    total = sum(steps)
    for count in range(total + 2):
        layer, seen = fed(steps)
        if total >= window or count > total:
            before = (layer.get_seq_length(), layer.host_seen)
            if count:
                with pytest.raises(NotImplementedError):
                    layer.crop(-count)
                assert (layer.get_seq_length(), layer.host_seen) == before
            continue
        layer.crop(-count)
        positions = list(range(floor, seen - count))  # what a layer holding every token it saw keeps
        assert layer.get_seq_length() == seen - count and layer.host_seen == seen - count
        if positions and count:  # (crop(0) changes nothing: a decode ring stays a ring)
            assert layer.keys[0, 0, :, 0].tolist() == positions and layer.values[0, 0, :, 0].tolist() == [
                -p for p in positions]
        # the next forward: the same as a layer that never saw the cropped tokens
        oracle = SlidingWindowLayer(window)
        if floor:
            oracle.seed_replay(floor)
        if positions:
            oracle.update(chunk(1, len(positions), floor), -chunk(1, len(positions), floor))
        nxt = chunk(1, 2, seen - count)
        got, want = layer.update(nxt, -nxt), oracle.update(nxt, -nxt)
        assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])


def test_crop_takes_a_negative_count_and_an_empty_layer_has_nothing_to_crop():
    layer = SlidingWindowLayer(4)
    layer.crop(-3)  # nothing stored yet: nothing to remove, no error
    assert layer.get_seq_length() == 0 and not layer.is_initialized
    layer.update(chunk(1, 2, 0), chunk(1, 2, 0))
    layer.crop(0)
    assert layer.get_seq_length() == 2
    with pytest.raises(NotImplementedError, match="negative count of tokens to remove"):
        layer.crop(1)
    assert layer.get_seq_length() == 2


def test_rows_reorder_select_and_stack():
    layer = SlidingWindowLayer(4)
    keys = chunk(3, 6, 0) + torch.arange(3.0)[:, None, None, None] * 100
    layer.update(keys, keys)
    layer.reorder_cache(torch.tensor([2, 0, 1]))
    assert layer.keys[:, 0, 0, 0].tolist() == [203, 3, 103]
    layer.batch_select_indices(torch.tensor([1]))
    assert layer.keys.shape[0] == 1 and layer.keys[0, 0, 0, 0].item() == 3
    other = SlidingWindowLayer(4)
    other.update(keys[:1], keys[:1])
    stacked = SlidingWindowLayer.stack_rows([layer, other], lambda: SlidingWindowLayer(4))
    assert stacked.keys.shape[0] == 2 and stacked.get_seq_length() == 6


@pytest.mark.parametrize("window", [0, -3, 2.5, True, None])
def test_bad_window_names_the_field(window):
    with pytest.raises(ValueError, match="window must be a positive integer.*sliding_window"):
        SlidingWindowLayer(window)


def test_sliding_windows_from_model_configs():
    assert sliding_windows(LlamaConfig(num_hidden_layers=3)) == (None, None, None)
    assert sliding_windows(MistralConfig(num_hidden_layers=3, sliding_window=16)) == (16, 16, 16)
    assert sliding_windows(MistralConfig(num_hidden_layers=2, sliding_window=None)) == (None, None)
    qwen = Qwen2Config(num_hidden_layers=3, use_sliding_window=True, sliding_window=16, max_window_layers=1)
    assert sliding_windows(qwen) == (None, 16, 16)
    assert sliding_windows(Gemma3TextConfig(num_hidden_layers=7, sliding_window=32)) == (32,) * 5 + (None, 32)
    assert sliding_windows(Cohere2Config(num_hidden_layers=4, sliding_window=64)) == (64, 64, 64, None)
    assert sliding_windows(GptOssConfig(num_hidden_layers=2)) == (128, None)


def test_chunked_layers_keep_their_chunk_as_window():
    """Llama 4's chunked-attention layers: window = attention_chunk_size (transformers keeps chunk - 1 tokens too)."""
    config = Llama4TextConfig(num_hidden_layers=4, attention_chunk_size=8, no_rope_layers=[1, 1, 1, 0])
    assert sliding_windows(config) == (8, 8, 8, None)
    assert chunked_layers(config) == (True, True, True, False)
    assert chunked_layers(Gemma3TextConfig(num_hidden_layers=2, sliding_window=32)) == (False, False)
    config.attention_chunk_size = 0
    with pytest.raises(ValueError, match="attention_chunk_size must be a positive integer.*'chunked_attention'"):
        sliding_windows(config)


def test_layer_types_rocketkv_cannot_serve_name_the_field():
    config = LlamaConfig(num_hidden_layers=2)
    config.layer_types = ["full_attention", "linear_attention"]
    with pytest.raises(ValueError, match="layer_types has 'linear_attention' layers"):
        sliding_windows(config)
    config.layer_types = ["full_attention"]
    with pytest.raises(ValueError, match="layer_types lists 1 layers, num_hidden_layers is 2"):
        sliding_windows(config)
    config.layer_types = ["sliding_attention", "full_attention"]
    config.sliding_window = 0
    with pytest.raises(ValueError, match="sliding_window must be a positive integer"):
        sliding_windows(config)


def test_rows_of_a_decoding_ring_reorder_and_select_as_the_ordered_columns_would():
    """After decode steps (the ring laid out): beam reordering and row selection keep each row's window, read back in
    order against the positions written."""
    layer = SlidingWindowLayer(4)
    keys = chunk(3, 6, 0) + torch.arange(3.0)[:, None, None, None] * 100
    layer.update(keys, keys)
    for position in (6, 7):
        token = chunk(3, 1, position) + torch.arange(3.0)[:, None, None, None] * 100
        layer.update(token, token)
    assert layer.ring is not None and int(layer.position) == 8
    layer.reorder_cache(torch.tensor([2, 0, 1]))
    layer.batch_select_indices(torch.tensor([0, 2]))
    assert layer.ring is not None and layer.batch_size == 2
    layer.to_ordered()  # the last window - 1 positions in order: 5, 6, 7 of rows 2 and 1
    assert layer.keys[:, 0, :, 0].tolist() == [[205, 206, 207], [105, 106, 107]]


class SlabPool:
    """What a batch row's layer asks of a KVBlockPool: its sliding slab (``sliding_slab``)."""

    def __init__(self, slots: int, window: int):
        self.slab = (torch.zeros(slots, H, window, D), torch.zeros(slots, H, window, D))

    def sliding_slab(self, layer_idx, probe):
        return self.slab


@pytest.mark.parametrize("chunked", [False, True])
def test_a_batch_rows_layer_writes_each_row_at_its_own_count_and_answers_no_length(chunked):
    """The engine's rows (``join_batch``): each row's token at slot ``seen % window`` of its own slab slot, its count
    advanced; its attention reads the slots its row has filled (a chunked row: its own chunk only) against a softmax
    written out here; no length, no reset, no mask read."""
    from hf_rocketkv.selection.logit_features import PLAIN

    window, pool = 4, SlabPool(5, 4)
    slots, seen = torch.tensor([3, 0, 1]), torch.tensor([2, 9, 5])
    layer = SlidingWindowLayer(window, layer_idx=0, chunked=chunked, backend="torch")
    layer.join_batch(torch.float32, torch.device("cpu"), H, D, pool, slots, seen)
    # (slot, position) -> the key at that position: zeros before the test (an empty slab), then every token written
    history = {(int(slot), p): torch.zeros(H, D) for slot, count in zip(slots, seen) for p in range(int(count))}
    for step in range(6):
        token = torch.randn(3, H, 1, D, generator=torch.Generator().manual_seed(step))
        for row in range(3):
            history[(int(slots[row]), int(seen[row]))] = token[row, :, 0]
        keys, _ = layer.update(token, token)
        assert keys.shape[0] == 5  # the whole slab, read through the slot ids
        query = torch.randn(3, 2 * H, 1, D, generator=torch.Generator().manual_seed(100 + step))
        out = layer.attend_ring(query, None, 0.5, PLAIN)
        for row in range(3):
            newest = int(seen[row]) - 1
            first = newest - newest % window if chunked else max(0, newest - window + 1)
            kv = torch.stack([history[(int(slots[row]), p)] for p in range(first, newest + 1)], dim=1)  # [H, n, D]
            q = query[row, :, 0].reshape(H, 2, D)
            probs = torch.softmax(torch.einsum("hgd,hnd->hgn", q, kv) * 0.5, dim=-1)
            want = torch.einsum("hgn,hnd->hgd", probs, kv).reshape(2 * H, D)
            torch.testing.assert_close(out[row, 0], want)
    assert seen.tolist() == [8, 15, 11]
    assert layer.get_mask_sizes(1) == (window, 0) and not layer.reads_mask
    with pytest.raises(RuntimeError, match="different lengths"):
        layer.get_seq_length()
    with pytest.raises(NotImplementedError, match="leave one at a time"):
        layer.reset()


def test_decode_slot_needs_a_pool_backed_one_row_layer():
    layer = SlidingWindowLayer(4)
    layer.update(chunk(1, 3, 0), chunk(1, 3, 0))
    with pytest.raises(ValueError, match="decode_slot: a batch row takes the ring of a one-row, pool-backed"):
        layer.decode_slot()
