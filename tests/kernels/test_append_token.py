"""append_token: one decode token into the compressed cache (K/V row, position, KT page, length), in place.

Oracle: the multi-op body RocketKVLayer._append_one had before the fused op (kept verbatim below as
``old_append``); the reference ``append_token_torch`` must equal it exactly, and the Triton kernel must equal the
reference bit for bit (KT rounding included) for every dtype, KT dtype, page size and head dim.
"""

import pytest
import torch

from hf_rocketkv import RocketKVConfig, RocketKVLayer
from hf_rocketkv.cache.layer import GenerationHints
from hf_rocketkv.kernels.append_token import append_token_torch
from hf_rocketkv.selection import stage2_pages as ref
from tests.kernels.kernel_utils import DEVICE, gen, ops, randn

pytestmark = pytest.mark.gpu  # compiled for the GPU where one is present (pytest -m gpu); interpreted on CPU


def old_append(keys, values, positions, kt, lengths, seen, key_new, value_new, page_size):
    """A decode append written op by op, the reference of the fused append_token ([B] lengths only)."""
    rows = torch.arange(keys.shape[0], device=keys.device)
    slot = lengths
    keys[rows, :, slot] = key_new
    values[rows, :, slot] = value_new
    positions[rows, :, slot] = (seen - 1).to(torch.int32)
    ref.update_kt(kt, key_new, slot, page_size)
    lengths.add_(1)


def _state(batch, kv_heads, capacity, head_dim, dtype, kt_dtype, page_size, lengths, g):
    keys = randn((batch, kv_heads, capacity, head_dim), dtype, g, scale=3.0)
    values = randn((batch, kv_heads, capacity, head_dim), dtype, g)
    positions = torch.randint(0, 100, (batch, kv_heads, capacity), generator=g, dtype=torch.int32).to(DEVICE)
    kt = ref.build_kt(keys, lengths, page_size, kt_dtype)
    return [keys, values, positions, kt, lengths.clone(), torch.tensor(40, device=DEVICE)]


def _run(fn, state, steps, g_new, dtype, page_size=4, strided=False):
    keys = state[0]
    batch, kv_heads, _, head_dim = keys.shape
    for _ in range(steps):
        state[5] += 1  # update() advances `seen` before the write
        k = randn((batch, kv_heads, 2, head_dim), dtype, g_new, scale=3.0)[:, :, 1]  # strided, like key_states[:, :, 0]
        v = randn((batch, kv_heads, head_dim), dtype, g_new)
        if strided:
            v = v.transpose(0, 1).contiguous().transpose(0, 1)
        assert fn(*state, k, v, page_size) is None
    return state


# (dtype, KT dtype, page_size, head_dim)
CASES = [
    (torch.bfloat16, torch.float8_e5m2, 4, 128),
    (torch.bfloat16, torch.bfloat16, 1, 64),
    (torch.float16, torch.float16, 2, 32),
    (torch.float32, torch.float32, 8, 16),
    (torch.float32, torch.float8_e5m2, 16, 256),
    (torch.float16, torch.bfloat16, 4, 48),  # head_dim that is not a power of two
]


@pytest.mark.parametrize("dtype,kt_dtype,page_size,head_dim", CASES)
def test_append_token_equals_old_path_and_reference(dtype, kt_dtype, page_size, head_dim):
    g = gen("append", dtype, kt_dtype, page_size, head_dim)
    capacity = 6 * page_size
    # a row with no token, a fresh page next, mid page
    lengths = torch.tensor([0, page_size, 2 * page_size + page_size // 2 + 1 if page_size > 1 else 3], device=DEVICE)
    steps = min(5, capacity - int(lengths.max()))
    base = _state(3, 3, capacity, head_dim, dtype, kt_dtype, page_size, lengths, g)
    results = {}
    for name, fn in (("old", old_append), ("ref", append_token_torch), ("triton", ops().append_token)):
        state = [t.clone() for t in base]
        results[name] = _run(fn, state, steps, gen("append-new", head_dim), dtype, page_size, name == "triton")
    for name in ("ref", "triton"):
        for got, want in zip(results[name], results["old"]):
            assert got.dtype == want.dtype and torch.equal(got.float(), want.float()), name
    # the incremental KT equals a rebuild over the stored keys
    keys, _, _, kt, lengths, _ = results["triton"]
    assert torch.equal(kt.float(), ref.build_kt(keys, lengths, page_size, kt_dtype).float())


@pytest.mark.parametrize("kv_heads,head_dim", [(1, 16), (8, 128), (5, 64)])
def test_append_token_per_head_lengths(kv_heads, head_dim):
    """lengths [B, Hkv]: each head writes its own slot; [B] equals its [B, Hkv] expansion exactly."""
    g = gen("append-per-head", kv_heads, head_dim)
    page_size, capacity = 4, 24
    lengths = torch.randint(0, 18, (2, kv_heads), generator=g).to(DEVICE)
    base = _state(2, kv_heads, capacity, head_dim, torch.bfloat16, torch.float8_e5m2, page_size, lengths, g)
    want = _run(append_token_torch, [t.clone() for t in base], 3, gen("new", kv_heads), torch.bfloat16)
    got = _run(ops().append_token, [t.clone() for t in base], 3, gen("new", kv_heads), torch.bfloat16)
    for a, b in zip(got, want):
        assert torch.equal(a.float(), b.float())
    assert torch.equal(got[4], lengths + 3)
    # the slot each (row, head) wrote holds that step's column
    for b in range(2):
        for h in range(kv_heads):
            assert got[2][b, h, int(lengths[b, h]):int(lengths[b, h]) + 3].tolist() == [40, 41, 42]

    rows = torch.tensor([3, 17], device=DEVICE)
    base = _state(2, kv_heads, capacity, head_dim, torch.float16, torch.bfloat16, page_size, rows, g)
    by_row = _run(ops().append_token, [t.clone() for t in base], 2, gen("rows"), torch.float16)
    expanded = [t.clone() for t in base]
    expanded[4] = rows[:, None].expand(2, kv_heads).clone()
    by_head = _run(ops().append_token, expanded, 2, gen("rows"), torch.float16)
    for a, b in zip(by_row[:4], by_head[:4]):
        assert torch.equal(a.float(), b.float())
    assert torch.equal(by_head[4], (rows + 2)[:, None].expand(2, kv_heads))


def test_append_token_drops_writes_past_capacity():
    """The caller guarantees capacity; past it the kernel writes nothing out of bounds and still counts."""
    g = gen("append-full")
    lengths = torch.tensor([8, 3], device=DEVICE)
    state = _state(2, 2, 8, 16, torch.float32, torch.float32, 4, lengths, g)
    before = [t.clone() for t in state]
    _run(ops().append_token, state, 1, gen("full-new"), torch.float32)
    assert torch.equal(state[0][0], before[0][0]) and torch.equal(state[3][0], before[3][0])
    assert state[4].tolist() == [9, 4]


@pytest.mark.parametrize("backend", ["torch", "triton"])
def test_layer_decode_state_equals_old_path(backend):
    """RocketKVLayer.update (one ops.append_token call) leaves the state the op-by-op append leaves."""
    cfg = RocketKVConfig(prompt_budget=10, window_size=4, kernel_size=3, topk=2, topr=16, page_size=4,
                         kt_cache_dtype="float8_e5m2", backend=backend)
    layer = RocketKVLayer(cfg, GenerationHints(max_length=30 + 6))
    g = torch.Generator().manual_seed(0)
    layer.update(torch.randn(2, 2, 30, 16, generator=g).to(DEVICE), torch.randn(2, 2, 30, 16, generator=g).to(DEVICE))
    layer.observe_prefill(torch.randn(2, 6, 30, 16, generator=g).to(DEVICE), torch.tensor([0, 25], device=DEVICE),
                          0.25)
    layer.compress()
    assert layer.ops.name == backend
    oracle = [t.clone() for t in (layer.keys, layer.values, layer.positions, layer.kt, layer.lengths, layer.seen)]
    for _ in range(6):
        k, v = torch.randn(2, 2, 1, 16, generator=g).to(DEVICE), torch.randn(2, 2, 1, 16, generator=g).to(DEVICE)
        layer.update(k, v)
        oracle[5] += 1
        old_append(*oracle, k[:, :, 0], v[:, :, 0], 4)
    state = (layer.keys, layer.values, layer.positions, layer.kt, layer.lengths, layer.seen)
    for got, want in zip(state, oracle):
        assert torch.equal(got.float(), want.float())
    assert layer.lengths.tolist() == [16, 11]
