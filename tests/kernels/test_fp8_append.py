"""fp8 (e4m3) pool pages in the decode append (``paged_append_token`` / ``paged_append_kv``): the fp8 write rule
(a fresh page's scale resets, a growing one rescales, a kept one stays), token by token as the pool's reference
``write_tokens``, per-head lengths, no host read-back and a fullgraph compile; every backend, with ``k_scale`` /
``v_scale`` [N] ("page") or [N, Hkv] ("head"). Reads and compaction: tests/kernels/test_fp8_pages.py.

Oracles are independent of the ops under test: stored bytes and scales come from ``memory/fp8.py`` and
``memory/page_io.write_tokens`` over float data. Pools start with random (finite) e4m3 bytes and scales in every
page, so a stale byte that entered a scale would show. Triton runs under the interpreter on CPU (TRITON_INTERPRET=1,
tests/conftest.py and this folder's conftest.py).
"""

import collections

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from hf_rocketkv.kernels.append_token import fp8_append_torch, paged_append_kv_torch, paged_append_token_torch
from hf_rocketkv.memory.fp8 import FP8_MAX, dequantize_fp8, fp8_scales, quantize_fp8
from hf_rocketkv.memory.page_io import read_tokens, write_tokens
from hf_rocketkv.memory.storage import LayerStorage
from tests.kernels.fp8_pages_support import (
    GRANULARITIES,
    _assert_bytes_equal,
    _bytes,
    _clone,
    _fill_rows,
    _fp8_step,
    _head_view,
    _pool,
    _row_pages,
    _scale_of,
)
from tests.kernels.kernel_utils import DEVICE, gen, ops, page_table

pytestmark = pytest.mark.gpu  # compiled for the GPU where one is present (pytest -m gpu); interpreted on CPU


# ----------------------------------------------------------------------------------------------------- the append
def _append(backend, layer, table, positions, lengths, seen, key, value, kt_page, with_kt=True):
    if backend == "torch":
        fn = paged_append_token_torch if with_kt else paged_append_kv_torch
    elif backend == "triton":
        fn = ops().paged_append_token if with_kt else ops().paged_append_kv
    else:
        fn = ops().paged_append_token.op if with_kt else ops().paged_append_kv.op
    scales = (layer.k_scale, layer.v_scale)  # positional: see _calls on torch 2.11's registered ops
    if with_kt:
        fn(layer.k, layer.v, layer.kt, table, positions, lengths, seen, key, value, kt_page, *scales)
    else:
        fn(layer.k, layer.v, table, positions, lengths, seen, key, value, *scales)


@pytest.mark.parametrize("granularity", GRANULARITIES)
@pytest.mark.parametrize("backend", ["torch", "triton", "registered"])
def test_append_rule_fresh_grow_and_keep(granularity, backend):
    """Three rows: row 0's next slot opens a page of garbage (the scale resets, the other slots are zeroed); row 1's
    token is 3x the page's largest value (head 1: 3x too with "page" scales, 0.25x with "head" scales); row 2's is a
    quarter of it (no re-quantization: the stored bytes stay bit for bit)."""
    heads, page_tokens, kt_page, dim = 2, 8, 4, 16
    g = gen("fp8-rule", granularity)
    layer = _pool(8, heads, page_tokens, kt_page, dim, granularity, g)
    table = page_table([2, 1, 1], 8, g)
    lengths = torch.tensor([page_tokens, 3, 5], device=DEVICE)
    _fill_rows(layer, table, lengths, g, key_scale=torch.tensor([1.0, 0.5]))
    before = _clone(layer)
    # the tokens: scaled relative to each row page's largest stored magnitude, per KV head
    key = torch.randn((3, heads, dim), generator=g).to(DEVICE)
    value = torch.randn((3, heads, dim), generator=g).to(DEVICE)
    pages = [int(table[0, 1]), int(table[1, 0]), int(table[2, 0])]
    factors = {1: [3.0, 3.0 if granularity == "page" else 0.25], 2: [0.25, 0.25]}
    for row, per_head_factor in factors.items():
        for h, f in enumerate(per_head_factor):
            for new, store, scale in ((key, layer.k, layer.k_scale), (value, layer.v, layer.v_scale)):
                stored = dequantize_fp8(store[pages[row] : pages[row] + 1],
                                        scale[pages[row] : pages[row] + 1])[0]  # [Hkv, PP, D]
                peak = stored.abs().amax() if granularity == "page" else stored[h].abs().amax()
                new[row, h] = new[row, h] / new[row, h].abs().amax() * peak * f
    positions = torch.zeros((3, heads, 2 * page_tokens), dtype=torch.int32, device=DEVICE)
    seen = torch.tensor(50, device=DEVICE)
    got = _clone(layer)
    got_lengths = lengths.clone()
    _append(backend, got, table, positions, got_lengths, seen, key, value, kt_page)
    assert got_lengths.tolist() == [page_tokens + 1, 4, 6]

    for which, new in (("k", key), ("v", value)):
        old_pages, old_scale = getattr(before, which), getattr(before, f"{which}_scale")
        new_pages, new_scale = getattr(got, which), getattr(got, f"{which}_scale")
        # row 0, fresh page: the token alone sets the scale, every other slot is zero (write_tokens' result)
        page = pages[0]
        want_scale = fp8_scales(new[0][None, :, None], granularity)[0]  # [] or [Hkv]
        torch.testing.assert_close(new_scale[page], want_scale, atol=0, rtol=0)
        want_token = quantize_fp8(new[0][None, :, None], want_scale[None])[0, :, 0]
        _assert_bytes_equal(new_pages[page, :, 0], want_token, f"{which} fresh token")
        assert not _bytes(new_pages[page, :, 1:]).any(), f"{which}: a fresh page's later slots are zeroed"
        # rows 1 and 2: per KV head, grow (re-quantize the slots below the offset) or keep (bytes unchanged)
        for row, offset in ((1, 3), (2, 5)):
            page = pages[row]
            for h in range(heads):
                s_old = _scale_of(old_scale, page, h)
                s_new = _scale_of(new_scale, page, h)
                amax = new[row].abs().amax() if granularity == "page" else new[row, h].abs().amax()
                grows = factors[row][h] > 1
                if grows:
                    # float64 then float32: the correctly rounded float32 quotient
                    torch.testing.assert_close(s_new, (amax.double() / FP8_MAX).float(), atol=0, rtol=0)
                    kept = dequantize_fp8(old_pages[page : page + 1, h : h + 1, :offset], s_old.reshape(1))
                    want_kept = quantize_fp8(kept, s_new.reshape(1))[0, 0]
                else:
                    assert s_new == s_old, f"{which} row {row} head {h}: the scale must not change"
                    want_kept = old_pages[page, h, :offset]
                _assert_bytes_equal(new_pages[page, h, :offset], want_kept, f"{which} row {row} head {h} kept")
                want_token = quantize_fp8(new[row, h][None, None, None].float(), s_new.reshape(1))[0, 0, 0]
                _assert_bytes_equal(new_pages[page, h, offset], want_token, f"{which} row {row} head {h} token")
                _assert_bytes_equal(new_pages[page, h, offset + 1 :], old_pages[page, h, offset + 1 :],
                                    f"{which} row {row} head {h} after")
        # pages no append touched: unchanged
        others = [p for p in range(8) if p not in pages]
        _assert_bytes_equal(new_pages[others], old_pages[others], f"{which} other pages")
        _assert_bytes_equal(new_scale[others], old_scale[others], f"{which} other scales")

    # the grow and fresh rows equal page_io.write_tokens' write of the token, bit for bit (same scales, same
    # arithmetic); the keep row's token slot too (its scale is recomputed by write_tokens, an ulp away at most)
    oracle = _clone(before)
    for row, start in ((0, page_tokens), (1, 3), (2, 5)):
        write_tokens(oracle, _row_pages(table, row), start, key[row][:, None], value[row][:, None])
    for which in ("k", "v"):
        for row in (0, 1):
            page = pages[row]
            heads_grown = range(heads) if row == 0 or granularity == "page" else [0]
            for h in heads_grown:
                _assert_bytes_equal(getattr(got, which)[page, h], getattr(oracle, which)[page, h], f"{which} {row}")
    # KT, positions and lengths as for float pages (the KT from the unquantized key)
    float_layer = (before.k.float(), before.v.float(), before.kt.clone())
    float_positions, float_lengths = torch.zeros_like(positions), lengths.clone()
    paged_append_token_torch(*float_layer, table, float_positions, float_lengths, seen, key, value, kt_page)
    assert torch.equal(got.kt, float_layer[2])
    assert torch.equal(positions, float_positions) and torch.equal(got_lengths, float_lengths)


def _sequence(backend, layer, table, lengths, steps, kt_page, g, with_kt=True, events=None):
    """``steps`` appends of tokens whose magnitudes jump around (some grow the page scale, most do not); returns
    the float tokens per step. ``events`` (a Counter): what each row's K append did to its page scale (fresh page,
    grown, kept)."""
    batch, heads, dim = table.shape[0], layer.k.shape[1], layer.k.shape[3]
    positions = torch.zeros((batch, heads, table.shape[1] * layer.k.shape[2]), dtype=torch.int32, device=DEVICE)
    seen = torch.tensor(100, device=DEVICE)
    tokens = []
    for _ in range(steps):
        seen += 1
        magnitude = torch.exp(torch.randn((batch, heads, 1), generator=g) * 1.5)
        key = (torch.randn((batch, heads, dim), generator=g) * magnitude).to(DEVICE)
        value = (torch.randn((batch, heads, dim), generator=g) * magnitude.flip(1)).to(DEVICE)
        slots = lengths.tolist()
        before = layer.k_scale.clone()
        _append(backend, layer, table, positions, lengths, seen, key, value, kt_page, with_kt)
        tokens.append((key, value))
        if events is not None:
            page_tokens = layer.k.shape[2]
            for b, slot in enumerate(slots):
                slot = slot if isinstance(slot, int) else slot[0]
                page = int(table[b, slot // page_tokens])
                grown = bool((layer.k_scale[page] != before[page]).any())
                events["fresh" if slot % page_tokens == 0 else ("grown" if grown else "kept")] += 1
    return tokens, positions


def _assert_within_one_step(got: LayerStorage, oracle: LayerStorage, table, count, h=None):
    """Dequantized rows within one e4m3 step (at the oracle's scale) of the oracle's, scales within 1e-5."""
    for b in range(table.shape[0]):
        n = int(count[b]) if h is None else int(count[b, h])
        row = _row_pages(table, b)
        for (a, want), scale in zip(zip(read_tokens(got, row, n), read_tokens(oracle, row, n)),
                                    (oracle.k_scale, oracle.v_scale)):
            per_token = scale[torch.tensor(row, device=DEVICE).repeat_interleave(got.k.shape[2])[:n]]
            s = per_token[None, :, None] if per_token.dim() == 1 else per_token.T[:, :, None]
            assert torch.all((a - want).abs() <= _fp8_step(want, s) * 1.0001), (b, (a - want).abs().max())
        torch.testing.assert_close(got.k_scale[row], oracle.k_scale[row], atol=0, rtol=1e-5)
        torch.testing.assert_close(got.v_scale[row], oracle.v_scale[row], atol=0, rtol=1e-5)


# (granularity, kv_heads, head_dim, page tokens PP, KT page KP)
SEQUENCE_CASES = [
    ("page", 2, 64, 8, 4),
    ("head", 2, 128, 8, 4),
    ("page", 1, 128, 4, 2),
    ("head", 3, 64, 8, 8),
]


@pytest.mark.parametrize("granularity,kv_heads,head_dim,page_tokens,kt_page", SEQUENCE_CASES)
def test_append_sequence_equals_write_tokens_token_by_token(granularity, kv_heads, head_dim, page_tokens, kt_page):
    """Appends through the rule against ``page_io.write_tokens`` of each token at its slot, over rows of different
    lengths (an empty row, one mid page, one at a page boundary) and across page boundaries.

    Tolerance: one e4m3 step of each value at its page's scale (and 1e-5 relative on the scales). Where the scale
    grows, or a page opens, both re-quantize with the same scale and agree bit for bit; where it does not, the rule
    keeps the stored bytes and quantizes the token with the page's scale, while write_tokens re-quantizes the whole
    page with a scale recomputed from the dequantized page (amax = 448 * s in float32, so s again up to an ulp): a
    value at an e4m3 rounding midpoint can then land one step away, and the ulps can add up over the steps.
    The Triton op equals the twin bit for bit; KT, positions and lengths equal the float-page append's.
    """
    g = gen("fp8-sequence", granularity, kv_heads, head_dim, page_tokens, kt_page)
    num_pages = 12
    layer = _pool(num_pages, kv_heads, page_tokens, kt_page, head_dim, granularity, g)
    table = page_table([3, 3, 4], num_pages, g)
    lengths = torch.tensor([0, page_tokens + page_tokens // 2, 2 * page_tokens], device=DEVICE)
    _fill_rows(layer, table, lengths, g)
    steps = page_tokens + 1
    results, events = {}, collections.Counter()
    for backend in ("torch", "triton"):  # (the registered op: test_append_rule_fresh_grow_and_keep)
        state, state_lengths = _clone(layer), lengths.clone()
        tokens, positions = _sequence(backend, state, table, state_lengths, steps, kt_page, gen("tokens", head_dim),
                                      events=events if backend == "torch" else None)
        results[backend] = (state, state_lengths, positions)
    assert events["fresh"] >= 3 and events["grown"] >= 2 and events["kept"] >= 2, events  # every branch ran
    twin, twin_lengths, twin_positions = results["torch"]
    for backend in ("triton",):
        state, state_lengths, positions = results[backend]
        for name in ("k", "v", "kt", "k_scale", "v_scale"):
            _assert_bytes_equal(getattr(state, name), getattr(twin, name), f"{backend} {name}")
        assert torch.equal(state_lengths, twin_lengths) and torch.equal(positions, twin_positions)
    assert twin_lengths.tolist() == (lengths + steps).tolist()
    # the oracle: write_tokens of each token at its slot
    oracle = _clone(layer)
    for step, (key, value) in enumerate(tokens):
        for b in range(3):
            write_tokens(oracle, _row_pages(table, b), int(lengths[b]) + step, key[b][:, None], value[b][:, None])
    _assert_within_one_step(twin, oracle, table, twin_lengths)
    # KT / positions / lengths: as the float-page append of the same tokens
    float_state = [layer.k.float(), layer.v.float(), layer.kt.clone()]
    float_lengths = lengths.clone()
    float_positions = torch.zeros_like(twin_positions)
    seen = torch.tensor(100, device=DEVICE)
    for key, value in tokens:
        seen += 1
        paged_append_token_torch(*float_state, table, float_positions, float_lengths, seen, key, value, kt_page)
    assert torch.equal(twin.kt, float_state[2]) and torch.equal(twin_positions, float_positions)
    assert torch.equal(twin_lengths, float_lengths)


@pytest.mark.parametrize("backend", ["torch", "triton"])
def test_append_kv_and_per_head_lengths_with_head_scales(backend):
    """paged_append_kv (no KT) with per-KV-head lengths ([B, Hkv], heads at different fill levels) and "head" scales:
    each KV head equals write_tokens on that head alone (a one-head view of the pool), within one e4m3 step."""
    heads, page_tokens, dim = 3, 8, 64
    g = gen("fp8-per-head", backend)
    layer = _pool(10, heads, page_tokens, 4, dim, "head", g)
    table = page_table([3, 2], 10, g)
    lengths = torch.tensor([[0, 5, 8], [7, 9, 12]], device=DEVICE)
    for h in range(heads):
        _fill_rows(_head_view(layer, h), table, lengths[:, h], g)
    kt_before = layer.kt.clone()
    state, state_lengths = _clone(layer), lengths.clone()
    steps = 4
    tokens, _ = _sequence(backend, state, table, state_lengths, steps, 4, gen("per-head-tokens"), with_kt=False)
    assert torch.equal(state_lengths, lengths + steps) and torch.equal(state.kt, kt_before)
    oracle = _clone(layer)
    for h in range(heads):
        view = _head_view(oracle, h)
        for step, (key, value) in enumerate(tokens):
            for b in range(2):
                write_tokens(view, _row_pages(table, b), int(lengths[b, h]) + step, key[b, h : h + 1, None],
                             value[b, h : h + 1, None])
    for h in range(heads):
        _assert_within_one_step(_head_view(state, h), _head_view(oracle, h), table, state_lengths[:, h])


@pytest.mark.parametrize("granularity", GRANULARITIES)
def test_triton_append_drops_fp8_writes_without_a_page(granularity):
    """As for float pages: a row whose next slot has no page (-1) or lies past the table gets no write anywhere
    (pages and scales untouched) and its token is still counted; the twin refuses."""
    g = gen("fp8-drop", granularity)
    layer = _pool(4, 2, 8, 4, 16, granularity, g)
    table = page_table([2, 1], 4, g)  # row 0: past its table at 16; row 1: its next slot's page is -1
    lengths = torch.tensor([16, 8], device=DEVICE)
    _fill_rows(layer, table, lengths, g)
    state = _clone(layer)
    _sequence("triton", state, table, lengths, 1, 4, gen("drop-tokens"))
    for name in ("k", "v", "kt", "k_scale", "v_scale"):
        _assert_bytes_equal(getattr(state, name), getattr(layer, name), name)
    assert lengths.tolist() == [17, 9]
    with pytest.raises(IndexError):
        _sequence("torch", _clone(layer), table, torch.tensor([16, 8], device=DEVICE), 1, 4, gen("drop-tokens"))


class _HostReads(TorchDispatchMode):
    """Counts the ops that make the host wait for a tensor's value (as tests/cache/test_host_syncs.py)."""

    READS = {torch.ops.aten._local_scalar_dense.default, torch.ops.aten.nonzero.default,
             torch.ops.aten.equal.default}

    def __init__(self):
        super().__init__()
        self.counts = collections.Counter()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func in self.READS:
            self.counts[str(func)] += 1
        return func(*args, **(kwargs or {}))


@pytest.mark.parametrize("granularity", GRANULARITIES)
def test_append_rule_reads_nothing_back_and_compiles_fullgraph(granularity):
    """The rule never reads a device value on the host (no ``.item()``, no data-dependent branch) and traces into
    one graph (torch.compile(fullgraph=True)) that writes what eager writes."""
    g = gen("fp8-compile", granularity)
    layer = _pool(6, 2, 8, 4, 16, granularity, g)
    table = page_table([2, 2], 6, g)
    lengths = torch.tensor([8, 5], device=DEVICE)
    _fill_rows(layer, table, lengths, g)
    key = torch.randn((2, 2, 16), generator=g).to(DEVICE) * 5
    value = torch.randn((2, 2, 16), generator=g).to(DEVICE) * 0.1
    page = torch.stack([table[0, 1], table[1, 0]]).long()[:, None].expand(2, 2)
    offset = torch.tensor([[0, 0], [5, 5]], device=DEVICE)
    eager = _clone(layer)
    with _HostReads() as reads:
        fp8_append_torch(eager.k, eager.k_scale, page, offset, key)
        fp8_append_torch(eager.v, eager.v_scale, page, offset, value)
    assert reads.counts == {}
    torch._dynamo.reset()
    compiled_state = _clone(layer)
    compiled = torch.compile(paged_append_token_torch, fullgraph=True, backend="aot_eager")
    positions = torch.zeros((2, 2, 16), dtype=torch.int32, device=DEVICE)
    compiled_lengths = lengths.clone()
    compiled(compiled_state.k, compiled_state.v, compiled_state.kt, table, positions, compiled_lengths,
             torch.tensor(9, device=DEVICE), key, value, 4, k_scale=compiled_state.k_scale,
             v_scale=compiled_state.v_scale)
    for name in ("k", "v", "k_scale", "v_scale"):
        _assert_bytes_equal(getattr(compiled_state, name), getattr(eager, name), name)
    assert compiled_lengths.tolist() == [9, 6]


@pytest.mark.skipif(not torch.cuda.is_available(),
                    reason="the interpreter cannot run a triton_op on the fake tensors torch.compile traces with")
def test_registered_append_compiles_fullgraph():
    """The registered op (what RocketKVLayer's compiled decode step traces) with fp8 pages, under
    torch.compile(fullgraph=True): no graph break, the twin's writes."""
    g = gen("fp8-compile-op")
    layer = _pool(6, 2, 8, 4, 16, "head", g)
    table = page_table([2, 2], 6, g)
    lengths = torch.tensor([7, 8], device=DEVICE)
    _fill_rows(layer, table, lengths, g)
    key = torch.randn((2, 2, 16), generator=g).to(DEVICE)
    value = torch.randn((2, 2, 16), generator=g).to(DEVICE)
    want, got = _clone(layer), _clone(layer)
    want_lengths, got_lengths = lengths.clone(), lengths.clone()
    positions = torch.zeros((2, 2, 16), dtype=torch.int32, device=DEVICE)
    seen = torch.tensor(9, device=DEVICE)
    paged_append_token_torch(want.k, want.v, want.kt, table, positions.clone(), want_lengths, seen, key, value, 4,
                             k_scale=want.k_scale, v_scale=want.v_scale)
    torch._dynamo.reset()
    op = ops().paged_append_token

    def step(k, v, kt, ks, vs, lengths):
        op(k, v, kt, table, positions, lengths, seen, key, value, 4, ks, vs)

    torch.compile(step, fullgraph=True, backend="aot_eager")(got.k, got.v, got.kt, got.k_scale, got.v_scale,
                                                              got_lengths)
    for name in ("k", "v", "kt", "k_scale", "v_scale"):
        _assert_bytes_equal(getattr(got, name), getattr(want, name), name)
    assert torch.equal(got_lengths, want_lengths)
