"""Ring (cache/ring.py) against a plain oracle: the list of every token each row has seen, of which a ring of W slots
must hold the last W at slot ``position % W``, in its own storage or in rows of a shared slab."""

from __future__ import annotations

import pytest
import torch

from hf_rocketkv.cache.ring import Ring
from hf_rocketkv.kernels.dispatch import get_ops

HEADS, DIM = 2, 3


def tokens(batch: int, count: int, start: int) -> torch.Tensor:
    """``[B, Hkv, count, D]`` whose values name (row, position): row b's token at position p is 100 * b + p."""
    rows = torch.arange(batch, dtype=torch.float32)[:, None, None, None] * 100
    positions = torch.arange(start, start + count, dtype=torch.float32)[None, None, :, None]
    return (rows + positions).expand(batch, HEADS, count, DIM).clone()


def slot_contents(ring: Ring) -> list[list[float]]:
    """Per row, the position held in each slot (-1 for an empty slot: zeros are position 0 of row 0 only)."""
    keys, _ = ring.row_tensors()
    return [[float(keys[b, 0, s, 0]) for s in range(ring.window)] for b in range(ring.batch_size)]


def expected_slots(batch: int, seen: int, window: int, first_kept: int) -> list[list[float]]:
    """The oracle: positions ``max(first_kept, seen - window) .. seen - 1`` of row b at slot ``p % window``."""
    out = []
    for b in range(batch):
        row = [0.0] * window
        for p in range(max(first_kept, seen - window), seen):
            row[p % window] = 100.0 * b + p
        out.append(row)
    return out


@pytest.mark.parametrize("window,stored,seen,steps", [(4, 3, 3, 6), (5, 4, 9, 7), (3, 2, 2, 1), (6, 0, 0, 8)])
@pytest.mark.parametrize("in_slab", [False, True])
def test_laid_out_then_appended_holds_the_last_window(window, stored, seen, steps, in_slab):
    batch, ops = 3, get_ops("torch", torch.device("cpu"))
    ordered = tokens(batch, stored, seen - stored)
    slab = slots = ids = None
    if in_slab:  # rows 4, 1, 2 of a slab of 6 (not consecutive: reads gather the rows)
        slab = (torch.full((6, HEADS, window, DIM), 7.0), torch.full((6, HEADS, window, DIM), 7.0))
        ids = [4, 1, 2]
        slots = torch.tensor(ids)
    ring = Ring.laid_out(ordered, ordered.clone(), seen, window, slab, slots, ids)
    assert ring.first is None and ring.batch_size == batch and not ring.per_row
    assert slot_contents(ring) == expected_slots(batch, seen, window, seen - stored)
    for step in range(steps):
        token = tokens(batch, 1, seen + step)
        ring.append(ops, token, token.clone())
        assert int(ring.seen) == seen + step + 1
        assert slot_contents(ring) == expected_slots(batch, seen + step + 1, window, seen - stored)
    total = seen + steps
    kept = min(total - (seen - stored), window - 1)
    keys, values = ring.ordered(kept, total)
    assert torch.equal(keys, tokens(batch, kept, total - kept)) and torch.equal(values, keys)
    if in_slab:  # the slab's other rows are untouched
        assert bool((slab[0][[0, 3, 5]] == 7.0).all())


def test_consecutive_slots_are_a_view_of_the_slab():
    window, ops = 4, get_ops("torch", torch.device("cpu"))
    slab = (torch.zeros(5, HEADS, window, DIM), torch.zeros(5, HEADS, window, DIM))
    ordered = tokens(2, 3, 0)
    ring = Ring.laid_out(ordered, ordered.clone(), 3, window, slab, torch.tensor([2, 3]), [2, 3])
    assert ring.first == 2
    keys, _ = ring.returned()
    assert keys.data_ptr() == slab[0][2].data_ptr() and keys.shape[0] == 2
    ring.append(ops, tokens(2, 1, 3), tokens(2, 1, 3))
    assert float(slab[0][3, 0, 3, 0]) == 103.0  # row 1 (slot 3) took position 3 in slot 3 % 4


def test_per_row_counts_write_each_row_at_its_own_slot():
    window, ops = 4, get_ops("torch", torch.device("cpu"))
    slab = (torch.zeros(3, HEADS, window, DIM), torch.zeros(3, HEADS, window, DIM))
    seen = torch.tensor([5, 2])
    ring = Ring(*slab, torch.tensor([2, 0]), seen)
    assert ring.per_row
    token = torch.tensor([1.0, 2.0])[:, None, None, None].expand(2, HEADS, 1, DIM).clone()
    ring.append(ops, token, token.clone())
    assert seen.tolist() == [6, 3]
    assert float(slab[0][2, 1, 5 % window, 0]) == 1.0 and float(slab[0][0, 1, 2, 0]) == 2.0
    assert int((slab[0] != 0).sum()) == 2 * HEADS * DIM


@pytest.mark.parametrize("seen", [1, 3, 4, 6, 11])
def test_mask_reorders_transformers_columns_into_slots(seen):
    window = 4
    ring = Ring(torch.zeros(1, HEADS, window, DIM), torch.zeros(1, HEADS, window, DIM), None, torch.tensor(seen))
    offset = max(0, seen - window)  # column c is position offset + c
    columns = torch.tensor([[True, False, True, True]])[None, None]  # [1, 1, 1, W]: column 1 hidden (padding)
    got = ring.mask(columns)[0, 0, 0].tolist()
    for slot in range(window):
        positions = [p for p in range(offset, seen) if p % window == slot]
        want = bool(positions) and [True, False, True, True][positions[0] - offset]
        assert got[slot] == want or not positions
    causal = ring.mask(None)[0, 0, 0].tolist()
    assert causal == [slot < min(seen, window) for slot in range(window)]


@pytest.mark.parametrize("in_slab", [False, True])
def test_reorder_copies_rings_between_rows(in_slab):
    window = 3
    ordered = tokens(3, 2, 0)
    slab = slots = ids = None
    if in_slab:
        slab = (torch.zeros(4, HEADS, window, DIM), torch.zeros(4, HEADS, window, DIM))
        ids = [3, 0, 1]
        slots = torch.tensor(ids)
    ring = Ring.laid_out(ordered, ordered.clone(), 2, window, slab, slots, ids)
    before = ring.row_tensors()[0].clone()
    ring.reorder(torch.tensor([2, 2, 0]))
    after = ring.row_tensors()[0]
    assert torch.equal(after, before[[2, 2, 0]])
    assert ring.nbytes() == 2 * 3 * HEADS * window * DIM * 4
