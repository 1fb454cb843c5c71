"""RocketKVLayer / RocketKVCache (cache/layer.py, cache/cache.py) driven directly, without a model: dense prefill
store, stage-1 compaction, decode appends with incremental KT, capacity growth, beam reordering, later turns, the
attention paths over the store, and the layer's bookkeeping over random request sequences (hypothesis).

Oracles: values recomputed here from what was fed, dense attention over the stored tokens, and the float64 stage-2
references of tests/support/stage2_oracle.py.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from hf_rocketkv import RocketKVCache, RocketKVConfig, RocketKVLayer
from hf_rocketkv.cache.layer import UNCONSUMED_KEYS, GenerationHints, layer_of
from hf_rocketkv.integration.attention import padding_offsets
from hf_rocketkv.selection.stage1_snapkv import snapkv_keep_slots
from hf_rocketkv.selection.stage2_pages import build_kt
from tests.support.stage2_oracle import brute_force_pages, ref_build_kt, ref_sparse_attention

HKV, G, D = 2, 3, 16


def config(**overrides):
    kwargs = dict(prompt_budget=12, window_size=4, kernel_size=3, topk=2, topr=16, page_size=4,
                  kt_cache_dtype="float32", backend="torch")
    kwargs.update(overrides)
    return RocketKVConfig(**kwargs)


def prefill(layer, length, batch=2, row_start=None, seed=0):
    """Run the dense prefill of a layer with random K/V/Q; returns (keys, values, queries) of the prompt."""
    g = torch.Generator().manual_seed(seed)
    keys = torch.randn(batch, HKV, length, D, generator=g)
    values = torch.randn(batch, HKV, length, D, generator=g)
    queries = torch.randn(batch, HKV * G, length, D, generator=g)
    k_out, v_out = layer.update(keys, values)
    assert torch.equal(k_out, keys) and torch.equal(v_out, values)
    layer.observe_prefill(queries, row_start, D**-0.5)
    return keys, values, queries


def test_dense_phase_is_a_dynamic_layer():
    layer = RocketKVLayer(config(), GenerationHints())
    assert layer.get_seq_length() == 0 and layer.get_max_length() == -1
    keys, values, _ = prefill(layer, 10)
    assert layer.get_seq_length() == 10
    assert layer.get_mask_sizes(1) == (11, 0)
    more_k, more_v = torch.randn(2, HKV, 3, D), torch.randn(2, HKV, 3, D)
    k_out, v_out = layer.update(more_k, more_v)  # a second prefill chunk
    assert torch.equal(k_out, torch.cat([keys, more_k], 2)) and torch.equal(v_out, torch.cat([values, more_v], 2))
    assert layer.get_seq_length() == 13
    assert layer.kept_tokens().tolist() == [[13, 13], [13, 13]]
    assert not layer.compressed


@pytest.mark.parametrize("row_start", [None, [0, 7]])
def test_compress_keeps_stage1_slots_and_builds_kt(row_start):
    cfg = config(prompt_budget=12, page_size=4)
    hints = GenerationHints(max_length=40 + 5)
    layer = RocketKVLayer(cfg, hints)
    start = torch.tensor(row_start) if row_start is not None else None
    keys, values, queries = prefill(layer, 40, row_start=start)
    layer.compress()
    assert layer.compressed
    starts = start.tolist() if start is not None else [0, 0]
    expected = snapkv_keep_slots(
        queries[:, :, -cfg.window_size :], keys, torch.tensor(starts), torch.tensor([40, 40]),
        window_size=cfg.window_size, prompt_budget=cfg.prompt_budget, kernel_size=cfg.kernel_size, scaling=D**-0.5,
    )
    assert layer.lengths.tolist() == [12, 12]
    # capacity: kept + tokens still to come (45 - 40), rounded up to whole pages
    assert layer.capacity == 20 and layer.capacity % cfg.page_size == 0
    assert layer.keys.shape == (2, HKV, 20, D) and layer.kt.shape == (2, HKV, 5, 2, D)
    for b in range(2):
        assert torch.equal(layer.positions[b, :, :12].long(), expected[b])
        assert torch.all(layer.positions[b, :, 12:] == -1)
        assert layer.positions[b].min() == -1 and layer.positions[b, :, :12].min() >= starts[b]
        idx = expected[b][..., None].expand(-1, -1, D)
        assert torch.equal(layer.keys[b, :, :12], keys[b].gather(1, idx))
        assert torch.equal(layer.values[b, :, :12], values[b].gather(1, idx))
    assert torch.equal(layer.kt, ref_build_kt(layer.keys, layer.lengths, cfg.page_size, torch.float32))
    assert layer.get_seq_length() == 40  # logical length is unchanged by eviction
    assert layer.stage1.pending_queries is None


def test_short_prompt_kept_whole_padding_dropped():
    layer = RocketKVLayer(config(prompt_budget=12), GenerationHints(max_length=20))
    keys, _, _ = prefill(layer, 10, row_start=torch.tensor([0, 4]))
    layer.compress()
    assert layer.lengths.tolist() == [10, 6]
    assert layer.positions[0, 0, :10].tolist() == list(range(10))
    assert layer.positions[1, 0, :6].tolist() == list(range(4, 10))
    assert torch.equal(layer.keys[1, :, :6], keys[1, :, 4:])
    assert layer.kept_tokens().tolist() == [[10, 10], [6, 6]]


def test_padding_offset_comes_from_latest_prefill_chunk():
    """Chunked prefill: a first chunk lying entirely in row 1's padding reports offset 8 (its length); the second
    chunk's mask shows the real offset 11. Stage 1 must use 11, never keeping a padding column."""
    layer = RocketKVLayer(config(prompt_budget=6, window_size=4), GenerationHints(max_length=20))
    g = torch.Generator().manual_seed(0)
    for offsets in ([0, 8], [0, 11]):
        layer.update(torch.randn(2, HKV, 8, D, generator=g), torch.randn(2, HKV, 8, D, generator=g))
        layer.observe_prefill(torch.randn(2, HKV * G, 8, D, generator=g), torch.tensor(offsets), D**-0.5)
    layer.compress()
    assert layer.lengths.tolist() == [6, 5]
    assert layer.positions[1, :, :5].tolist() == [list(range(11, 16))] * HKV


@pytest.mark.parametrize("kt_dtype", ["float32", "bfloat16", "float8_e5m2"])
def test_decode_appends_update_kt_incrementally(kt_dtype):
    cfg = config(kt_cache_dtype=kt_dtype, page_size=4, prompt_budget=10)
    layer = RocketKVLayer(cfg, GenerationHints(max_length=30 + 9))
    prefill(layer, 30, row_start=torch.tensor([0, 25]))  # row 1 keeps 5 tokens, row 0 keeps 10
    layer.compress()
    assert layer.kt.dtype == cfg.kt_torch_dtype
    for step in range(9):
        k, v = torch.randn(2, HKV, 1, D), torch.randn(2, HKV, 1, D)
        slots = layer.lengths.clone()
        k_out, v_out = layer.update(k, v)
        assert layer_of(k_out) is layer and k_out.numel() == 0 and v_out.numel() == 0  # handles: data is in pages
        for b in range(2):
            assert torch.equal(layer.keys[b, :, slots[b]], k[b, :, 0])
            assert torch.equal(layer.values[b, :, slots[b]], v[b, :, 0])
            assert torch.all(layer.positions[b, :, slots[b]] == 30 + step)
        assert torch.equal(layer.lengths, slots + 1)
        assert torch.equal(layer.kt.float(), build_kt(layer.keys, layer.lengths, 4, cfg.kt_torch_dtype).float())
    assert layer.lengths.tolist() == [19, 14]
    assert layer.get_seq_length() == 39


def test_capacity_grows_without_hints():
    cfg = config(prompt_budget=8, page_size=4, capacity_headroom=3)  # rounded up to whole pages
    layer = RocketKVLayer(cfg, GenerationHints())
    prefill(layer, 20, batch=1)
    layer.compress()
    assert layer.capacity == 12  # 8 kept + 3 headroom -> 12
    written = []
    for _ in range(10):
        k = torch.randn(1, HKV, 1, D)
        written.append(k[0, :, 0])
        layer.update(k, torch.randn(1, HKV, 1, D))
    assert layer.lengths.tolist() == [18]
    assert layer.capacity >= 18 and layer.capacity % 4 == 0
    assert torch.equal(layer.keys[0, :, 8:18], torch.stack(written, dim=1))
    assert layer.positions[0, 0, :18].tolist()[8:] == list(range(20, 30))
    assert torch.all(layer.positions[0, :, 18:] == -1)
    assert torch.equal(layer.kt, build_kt(layer.keys, layer.lengths, 4, torch.float32))


def test_reorder_cache_for_beams():
    layer = RocketKVLayer(config(), GenerationHints(max_length=40))
    prefill(layer, 30, batch=3, row_start=torch.tensor([0, 10, 20]))
    layer.compress()
    layer.update(torch.randn(3, HKV, 1, D), torch.randn(3, HKV, 1, D))
    before = {name: getattr(layer, name).clone() for name in ("keys", "values", "kt", "positions", "lengths")}
    beam_idx = torch.tensor([2, 2, 0])
    layer.reorder_cache(beam_idx)
    for name, tensor in before.items():
        assert torch.equal(getattr(layer, name), tensor[beam_idx]), name


def test_later_turn_appends_and_recompresses():
    cfg = config(prompt_budget=12, window_size=4, page_size=4)
    layer = RocketKVLayer(cfg, GenerationHints(max_length=100))
    prefill(layer, 30, batch=2, row_start=torch.tensor([0, 22]))
    layer.compress()
    for _ in range(3):
        layer.update(torch.randn(2, HKV, 1, D), torch.randn(2, HKV, 1, D))
    assert layer.lengths.tolist() == [15, 11]
    new_k, new_v = torch.randn(2, HKV, 6, D), torch.randn(2, HKV, 6, D)
    layer.update(new_k, new_v)  # a second turn of 6 tokens on a compressed layer: staged until the mask is known
    assert layer.lengths.tolist() == [15, 11]
    layer.store_new_tokens(None)  # the attention function stores them (no padding here)
    assert layer.lengths.tolist() == [21, 17]
    assert layer.get_seq_length() == 39
    for b, n in enumerate([15, 11]):
        assert torch.equal(layer.keys[b, :, n : n + 6], new_k[b])
        assert layer.positions[b, 0, n : n + 6].tolist() == list(range(33, 39))
    assert torch.equal(layer.kt, build_kt(layer.keys, layer.lengths, 4, torch.float32))
    layer.observe_prefill(torch.randn(2, HKV * G, 6, D), None, D**-0.5)
    positions_before = layer.positions.clone()
    layer.compress()
    assert layer.lengths.tolist() == [12, 12]
    for b in range(2):
        kept = layer.positions[b, 0, :12].tolist()
        assert kept == sorted(kept) and kept[-4:] == [35, 36, 37, 38]  # the new turn's window is kept
        assert set(kept) <= set(positions_before[b, 0].tolist()) - {-1}
    assert torch.equal(layer.kt, build_kt(layer.keys, layer.lengths, 4, torch.float32))


def test_unsupported_operations_raise():
    layer = RocketKVLayer(config(), GenerationHints())
    layer.crop(-1)  # nothing stored yet: nothing to undo (as DynamicLayer)
    with pytest.raises(NotImplementedError, match="crop"):
        layer.crop(3)  # an absolute length: assisted decoding's legacy call
    with pytest.raises(NotImplementedError, match="offload"):
        layer.offload()
    cache = RocketKVCache(config())
    with pytest.raises(NotImplementedError, match="assisted"):
        cache.crop(2)
    with pytest.raises(TypeError, match="RocketKVConfig"):
        RocketKVCache({"prompt_budget": 12})


def test_cache_container():
    cache = RocketKVCache(config(), topk=7)
    assert cache.config.topk == 7 and cache.config.prompt_budget == 12
    with pytest.raises(ValueError, match="page_size"):
        RocketKVCache(config(), page_size=3)
    assert not cache.is_compressed
    with pytest.raises(IndexError):
        cache.kept_tokens(0)
    for layer_idx in range(2):
        keys, _ = cache.update(torch.randn(1, HKV, 20, D), torch.randn(1, HKV, 20, D), layer_idx)
        assert layer_of(keys) is cache.layers[layer_idx]  # the attention function of this call finds its layer
        cache.layers[layer_idx].attention_ran()
    assert layer_of(torch.randn(1, HKV, 20, D)) is None  # any other tensor: no RocketKV layer
    assert cache.get_seq_length() == 20
    with pytest.raises(ValueError, match="not compressed"):
        cache.kept_positions(0)
    for layer in cache.layers:
        layer.observe_prefill(torch.randn(1, HKV * G, 20, D), None, D**-0.5)
        layer.compress()
    assert cache.is_compressed
    assert cache.kept_tokens(1).tolist() == [[12, 12]]
    expected = 0
    for layer in cache.layers:
        for t in (layer.keys, layer.values, layer.kt, layer.positions, layer.lengths, layer.store.table):
            expected += t.numel() * t.element_size()
    assert cache.memory_bytes() == expected


def test_unconsumed_keys_are_detected_per_cache():
    """Keys no attention call consumed: the next layer's update (same forward) or the same layer's next update
    (next forward: one-layer models, interrupted forwards) raises. The state is the cache's own: another cache is
    unaffected."""
    cache = RocketKVCache(config())
    cache.update(torch.randn(1, HKV, 4, D), torch.randn(1, HKV, 4, D), 0)
    with pytest.raises(RuntimeError, match="rocketkv") as info:
        cache.update(torch.randn(1, HKV, 4, D), torch.randn(1, HKV, 4, D), 1)  # layer 0's keys never consumed
    assert str(info.value) == UNCONSUMED_KEYS
    one_layer = RocketKVCache(config())
    one_layer.update(torch.randn(1, HKV, 4, D), torch.randn(1, HKV, 4, D), 0)
    with pytest.raises(RuntimeError, match="interrupted"):
        one_layer.update(torch.randn(1, HKV, 1, D), torch.randn(1, HKV, 1, D), 0)  # the next forward
    other = RocketKVCache(config())
    keys, _ = other.update(torch.randn(1, HKV, 4, D), torch.randn(1, HKV, 4, D), 0)
    layer_of(keys).attention_ran()
    other.update(torch.randn(1, HKV, 4, D), torch.randn(1, HKV, 4, D), 1)  # fine: its own keys were consumed


# ------------------------------------------------------------------------------------------------ attention paths


def compressed_layer(topk, batch=2, seed=0, decode_steps=3):
    cfg = config(topk=topk, page_size=4, prompt_budget=12)
    layer = RocketKVLayer(cfg, GenerationHints(max_length=60))
    prefill(layer, 30, batch=batch, row_start=torch.tensor([0, 21][:batch]), seed=seed)
    layer.compress()
    for _ in range(decode_steps):
        layer.update(torch.randn(batch, HKV, 1, D), torch.randn(batch, HKV, 1, D))
    return layer


def test_decode_attention_all_pages_equals_dense_over_stored_tokens():
    layer = compressed_layer(topk=1000)
    query = torch.randn(2, HKV * G, 1, D)
    out = layer.attend_decode(query, D**-0.5)
    assert out.shape == (2, 1, HKV * G, D)
    for b in range(2):
        n = int(layer.lengths[b])
        dense = F.scaled_dot_product_attention(
            query[b : b + 1], layer.keys[b : b + 1, :, :n], layer.values[b : b + 1, :, :n], scale=D**-0.5,
            enable_gqa=True,
        )
        torch.testing.assert_close(out[b : b + 1], dense.transpose(1, 2), rtol=1e-5, atol=1e-5)


def test_decode_attention_sparse_matches_dense_over_the_selected_pages():
    """Stage 2 with 2 of 4-5 pages: exact attention over exactly the pages an independent float64 oracle selects."""
    layer = compressed_layer(topk=2)
    query = torch.randn(2, HKV * G, 1, D)
    out = layer.attend_decode(query, D**-0.5)
    q = query.reshape(2, HKV, G, D)
    page_idx, page_valid = brute_force_pages(q, layer.kt, layer.lengths.tolist(), 4, layer.config.topr, 2)
    assert torch.all(page_valid.sum(-1) == 2)
    ref = ref_sparse_attention(q, layer.keys, layer.values, page_idx, page_valid, layer.lengths, 4, D**-0.5)
    torch.testing.assert_close(out.transpose(1, 2).reshape(2, HKV, G, D).double(), ref, rtol=1e-5, atol=1e-5)
    dense = compressed_layer(topk=1000).attend_decode(query, D**-0.5)
    assert not torch.allclose(out, dense, atol=1e-3), "topk=2 of 4-5 pages should differ from dense attention"


def test_continuation_attention_is_causal_over_kept_and_new():
    layer = compressed_layer(topk=2, decode_steps=2)
    n = 5
    before = layer.lengths.clone()
    layer.update(torch.randn(2, HKV, n, D), torch.randn(2, HKV, n, D))
    layer.store_new_tokens(None)
    query = torch.randn(2, HKV * G, n, D)
    out = layer.attend_later_turn(query, D**-0.5)
    assert out.shape == (2, n, HKV * G, D)
    for b in range(2):
        for i in range(n):
            m = int(before[b]) + i + 1
            dense = F.scaled_dot_product_attention(
                query[b : b + 1, :, i : i + 1], layer.keys[b : b + 1, :, :m], layer.values[b : b + 1, :, :m],
                scale=D**-0.5, enable_gqa=True,
            )
            torch.testing.assert_close(out[b, i], dense[0, :, 0], rtol=1e-5, atol=1e-5)


def test_padded_later_turn_stores_and_attends_only_real_tokens():
    """A batched later turn: row 0 adds 5 real tokens; row 1 has its previous turn's last token, 3 padding tokens,
    then 1 new token (padding sits between the turns). Padding is neither stored nor attended; each real query sees
    the kept tokens and the real new tokens up to itself; the stage-1 window holds only real queries."""
    layer = compressed_layer(topk=2, decode_steps=2)
    n = 5
    valid = torch.tensor([[True] * 5, [True, False, False, False, True]])
    before = layer.lengths.tolist()
    new_k, new_v = torch.randn(2, HKV, n, D), torch.randn(2, HKV, n, D)
    layer.update(new_k, new_v)
    layer.store_new_tokens(valid)
    assert layer.lengths.tolist() == [before[0] + 5, before[1] + 2]
    assert torch.equal(layer.keys[1, :, before[1] : before[1] + 2], new_k[1][:, [0, 4]])
    first_column = layer.get_seq_length() - n
    assert layer.positions[1, 0, before[1] : before[1] + 2].tolist() == [first_column, first_column + 4]
    assert torch.equal(layer.kt, build_kt(layer.keys, layer.lengths, 4, torch.float32))
    query = torch.randn(2, HKV * G, n, D)
    out = layer.attend_later_turn(query, D**-0.5, valid)
    for b in range(2):
        real = valid[b].nonzero()[:, 0].tolist()
        for r, i in enumerate(real):
            m = before[b] + r + 1  # kept tokens + real new tokens up to query i
            dense = F.scaled_dot_product_attention(
                query[b : b + 1, :, i : i + 1], layer.keys[b : b + 1, :, :m], layer.values[b : b + 1, :, :m],
                scale=D**-0.5, enable_gqa=True,
            )
            torch.testing.assert_close(out[b, i], dense[0, :, 0], rtol=1e-5, atol=1e-5)
    assert torch.isfinite(out).all()  # padding queries get a finite (unused) output
    layer.observe_prefill(query, None, D**-0.5, valid=valid)
    assert layer.stage1.pending_valid.tolist() == [4, 2]  # window_size 4; row 1 has only 2 real queries
    assert torch.equal(layer.stage1.pending_queries[1, :, -2:], query[1][:, [0, 4]])


def test_padding_offsets_from_mask():
    mask = torch.ones(3, 1, 4, 6, dtype=torch.bool)
    mask[1, ..., :2] = False
    mask[2, ..., :5] = False
    assert padding_offsets(mask, 6).tolist() == [0, 2, 5]
    assert padding_offsets(None, 6) is None
    right = torch.ones(1, 1, 1, 6, dtype=torch.bool)
    right[..., 4:] = False
    with pytest.raises(ValueError, match="left"):
        padding_offsets(right, 6)


# ------------------------------------------------------------------------------------------------ random requests
# a layer driven through random prefills (left-padded, optionally chunked), decode steps and later turns with padding
# between the turns; after every step lengths, positions, KT and host mirrors agree with what was fed (hypothesis)
SETTINGS = settings(
    max_examples=25, deadline=None, derandomize=True, suppress_health_check=[HealthCheck.too_slow]
)


@st.composite
def layer_script(draw):
    heads = draw(st.integers(1, 3))
    group = draw(st.sampled_from([1, 2, 4, 8]))
    page = draw(st.sampled_from([1, 2, 4]))
    window = draw(st.integers(1, 4))
    budget = draw(st.integers(window, 12))
    batch = draw(st.integers(1, 3))
    prompt = draw(st.integers(1, 20))
    pads = draw(st.lists(st.integers(0, prompt - 1), min_size=batch, max_size=batch))
    chunks = draw(st.sampled_from([None, 3, 5]))
    steps = draw(
        st.lists(
            st.one_of(
                st.tuples(st.just("decode"), st.integers(1, 4)),
                st.tuples(st.just("turn"), st.lists(st.integers(1, 6), min_size=batch, max_size=batch)),
            ),
            max_size=4,
        )
    )
    seed = draw(st.integers(0, 2**16))
    return heads, group, page, window, budget, batch, prompt, pads, chunks, steps, seed


class Shadow:
    """The oracle's own record of what each row has stored: (column, key) in slot order, per row and KV head."""

    def __init__(self, batch):
        self.rows = [[] for _ in range(batch)]


def _check(layer: RocketKVLayer, seen: int, shadow_counts: list[int]) -> None:
    cfg = layer.config
    lengths = layer.lengths.tolist()
    assert lengths == shadow_counts
    assert layer.host_max_length == max(lengths)
    assert layer.host_seen == seen == int(layer.seen)
    assert layer.capacity % cfg.page_size == 0 and layer.capacity >= max(lengths)
    for b, n in enumerate(lengths):
        columns = layer.positions[b, :, :n]
        if n > 1:
            assert bool((columns[:, 1:] > columns[:, :-1]).all())  # ascending, unique
        assert bool((columns >= 0).all()) and bool((columns < seen).all())
        assert bool((layer.positions[b, :, n:] == -1).all())
    torch.testing.assert_close(
        layer.kt.float(), ref_build_kt(layer.keys, layer.lengths, cfg.page_size, torch.float32), rtol=0, atol=0
    )


@SETTINGS
@given(layer_script())
def test_layer_bookkeeping_over_random_request_sequences(script):
    heads, group, page, window, budget, batch, prompt, pads, chunks, steps, seed = script
    g = torch.Generator().manual_seed(seed)
    dim = 8
    config = RocketKVConfig(
        prompt_budget=budget, window_size=window, kernel_size=3, topk=2, topr=dim, page_size=page,
        kt_cache_dtype="float32", backend="torch", capacity_headroom=4,
    )
    layer = RocketKVLayer(config, GenerationHints())

    def qkv(n):
        return (torch.randn(batch, heads, n, dim, generator=g), torch.randn(batch, heads, n, dim, generator=g),
                torch.randn(batch, heads * group, n, dim, generator=g))

    # prefill, left-padded, in chunks or at once
    start = torch.tensor(pads)
    fed = 0
    for size in ([prompt] if chunks is None else [min(chunks, prompt - i) for i in range(0, prompt, chunks)]):
        k, v, q = qkv(size)
        layer.update(k, v)
        fed += size
        column = torch.arange(fed - size, fed)
        layer.observe_prefill(q, start, dim**-0.5, valid=column[None, :] >= start[:, None])
    layer.compress()
    counts = [min(prompt - p, budget) for p in pads]
    seen = prompt
    _check(layer, seen, counts)

    for kind, arg in steps:
        if kind == "decode":
            for _ in range(arg):
                k, v, _ = qkv(1)
                layer.update(k, v)
                seen += 1
                counts = [c + 1 for c in counts]
                _check(layer, seen, counts)
        else:  # a later turn: row b adds arg[b] real tokens, padding between the turns (one forward)
            n = max(arg) + 1
            valid = torch.zeros(batch, n, dtype=torch.bool)
            valid[:, 0] = True  # the previous turn's last token, fed back now
            for b, m in enumerate(arg):
                valid[b, n - m :] = True
            k, v, q = qkv(n)
            layer.update(k, v)
            layer.store_new_tokens(valid)
            seen += n
            counts = [c + int(valid[b].sum()) for b, c in enumerate(counts)]
            _check(layer, seen, counts)
            layer.observe_prefill(q, None, dim**-0.5, valid=valid)
            layer.compress()
            counts = [min(c, budget) for c in counts]
            _check(layer, seen, counts)
            for b in range(batch):
                stored = set(layer.positions[b, 0, : counts[b]].tolist())
                real_new = {seen - n + j for j in range(n) if valid[b, j]}
                padding = {seen - n + j for j in range(n) if not valid[b, j]}
                assert not stored & padding  # padding is never stored
                last_real = sorted(real_new)[-min(window, len(real_new)) :]
                assert set(last_real) <= stored  # the turn's window (its last real tokens) is always kept
