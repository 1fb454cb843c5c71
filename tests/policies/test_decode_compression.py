"""Decode-time compression's selection against a brute-force float64 oracle written from its definition
(hf_rocketkv/policies/decode_compression.py): plain loops over rows, KV heads, query heads and window queries; the
kept slots do not depend on the store's capacity (slots past every length are never selectable, even where
max-pooled scores tie)."""

from __future__ import annotations

import math
import random

import pytest
import torch
import torch.nn.functional as F

from hf_rocketkv.policies.decode_compression import (
    DecodeCompression,
    decode_keep_slots,
    move_kept,
)
from tests.policies.oracle import assert_top_up_to_ties, max_pool, softmax64


def oracle_scores(queries, keys, length: int, b: int, scaling: float) -> list[list[float]]:
    """``[Hkv][C]`` summed window attention of row b (query i at slot length - w + i, causal)."""
    num_q, w = queries.shape[1], queries.shape[2]
    num_kv, capacity = keys.shape[1], keys.shape[2]
    group = num_q // num_kv
    out = [[0.0] * capacity for _ in range(num_kv)]
    for qh in range(num_q):
        h = qh // group
        for i in range(w):
            own = length - w + i
            q = queries[b, qh, i].double()
            probs = softmax64([float(q @ keys[b, h, j].double()) * scaling for j in range(own + 1)])
            for j, p in enumerate(probs):
                out[h][j] += p
    return out


def random_problem(seed: int):
    rng = random.Random(seed)
    batch, num_kv, group, dim = rng.randint(1, 3), rng.randint(1, 3), rng.choice([1, 2, 4]), rng.choice([4, 8])
    w = rng.randint(1, 5)
    budget = rng.randint(w, w + 8)
    capacity = rng.randint(budget + 12, budget + 30)
    gen_start = [rng.randint(0, 8) for _ in range(batch)]
    lengths = [rng.randint(g + w, capacity) for g in gen_start]  # some rows under the budget, some over
    g = torch.Generator().manual_seed(seed)
    queries = torch.randn(batch, num_kv * group, w, dim, generator=g) * 1.5
    keys = torch.randn(batch, num_kv, capacity, dim, generator=g) * 1.5
    return queries, keys, lengths, gen_start, budget, rng.choice([1, 3, 5])


@pytest.mark.parametrize("seed", range(12))
def test_decode_keep_slots_matches_oracle(seed):
    queries, keys, lengths, gen_start, budget, kernel = random_problem(seed)
    w, scaling = queries.shape[2], queries.shape[3] ** -0.5
    slots, new_lengths = decode_keep_slots(
        queries, keys, torch.tensor(lengths), torch.tensor(gen_start), budget, scaling, kernel
    )
    assert slots.shape == (keys.shape[0], keys.shape[1], budget)
    for b, (length, g0) in enumerate(zip(lengths, gen_start)):
        if length - g0 <= budget:
            assert new_lengths[b] == length
            assert slots[b, :, : length - g0].tolist() == [list(range(g0, length))] * keys.shape[1]
            continue
        assert new_lengths[b] == g0 + budget
        scores = oracle_scores(queries, keys, length, b, scaling)
        for h in range(keys.shape[1]):
            kept = slots[b, h].tolist()
            assert kept == sorted(kept) and len(set(kept)) == budget
            assert kept[budget - w :] == list(range(length - w, length))  # the newest window
            pooled = max_pool(scores[h][g0 : length - w], kernel)
            assert_top_up_to_ties([j - g0 for j in kept[: budget - w]], pooled, budget - w)


def test_move_kept_compacts_in_place():
    store = torch.arange(2 * 1 * 12, dtype=torch.float32).view(2, 1, 12, 1).repeat(1, 1, 1, 3)
    positions = torch.arange(24, dtype=torch.int32).view(2, 1, 12)
    slots = torch.tensor([[[4, 7, 9]], [[2, 3, 4]]])  # row 1 unchanged (identity)
    gen_start = torch.tensor([3, 2])
    before = store.clone()
    move_kept(store, slots, gen_start)
    move_kept(positions, slots, gen_start)
    assert store[0, 0, :6, 0].tolist() == [0, 1, 2, 4, 7, 9] and torch.equal(store[1], before[1])
    assert positions[0, 0, :6].tolist() == [0, 1, 2, 4, 7, 9]


def test_a_decode_loop_stays_bounded():
    """Generated tokens never exceed budget + interval, and the newest window always survives."""
    policy = DecodeCompression(budget=8, interval=4, window=3, kernel_size=3)
    g = torch.Generator().manual_seed(0)
    capacity, prompt = 5 + policy.max_generated, 5
    keys = torch.zeros(1, 1, capacity, 4)
    positions = torch.full((1, 1, capacity), -1, dtype=torch.long)
    queries = torch.zeros(1, 2, 3, 4)
    length = prompt
    positions[0, 0, :prompt] = torch.arange(prompt)
    for step in range(40):
        keys[0, 0, length] = torch.randn(4, generator=g)
        positions[0, 0, length] = prompt + step
        queries = torch.cat([queries[:, :, 1:], torch.randn(1, 2, 1, 4, generator=g)], dim=2)
        length += 1
        if policy.due(length - prompt):
            slots, lengths = policy.select(queries, keys, torch.tensor([length]), torch.tensor([prompt]), 0.5)
            move_kept(keys, slots, torch.tensor([prompt]))
            move_kept(positions, slots, torch.tensor([prompt]))
            length = int(lengths[0])
            assert length == prompt + policy.budget
        assert length - prompt <= policy.max_generated
        newest = prompt + step
        assert positions[0, 0, length - 3 : length].tolist() == [newest - 2, newest - 1, newest]
    assert positions[0, 0, :prompt].tolist() == list(range(prompt))


def test_decode_compression_validates():
    with pytest.raises(ValueError, match="DecodeCompression.window \\(9\\) must be <= budget \\(8\\)"):
        DecodeCompression(budget=8, window=9)
    with pytest.raises(ValueError, match="DecodeCompression.interval must be an integer >= 1, got 0"):
        DecodeCompression(budget=64, interval=0)
    with pytest.raises(ValueError, match="kernel_size must be odd"):
        DecodeCompression(budget=64, kernel_size=4)
    small = DecodeCompression(budget=8, interval=4, window=2)
    assert small.due(12) and not small.due(11)
    assert math.isclose(DecodeCompression(budget=64).max_generated, 128)


@pytest.mark.parametrize("per_head", [False, True])
def test_decode_keep_slots_do_not_depend_on_the_capacity(per_head):
    """Slots past every length are never selectable, so padding the store must not change the kept slots. With the
    max-pooling (kernel 7) neighbouring slots tie and ``topk`` picks among ties by the tensor's size."""
    torch.manual_seed(0)
    queries, keys = torch.randn(1, 2, 4, 16), torch.randn(1, 1, 40, 16)
    lengths, gen_start = torch.tensor([40]), torch.tensor([24])
    if per_head:
        queries, keys = torch.randn(1, 4, 4, 16), torch.randn(1, 2, 40, 16)
        lengths, gen_start = torch.tensor([[40, 33]]), torch.tensor([[24, 17]])
    exact, _ = decode_keep_slots(queries, keys, lengths, gen_start, 12, 0.25, 7)
    padded, _ = decode_keep_slots(queries, F.pad(keys, (0, 0, 0, 216)), lengths, gen_start, 12, 0.25, 7)
    assert torch.equal(exact, padded), (exact.tolist(), padded.tolist())


@pytest.mark.parametrize("seed", range(4))
def test_select_uses_its_kernel_and_the_callers_scaling(seed):
    """DecodeCompression.select is decode_keep_slots with the settings' budget and kernel (3 here, not the default 7)
    and the scaling it is given (0.3, not 1 / sqrt(D)), checked against the oracle."""
    queries, keys, lengths, gen_start, budget, _ = random_problem(seed)
    w, scaling, kernel = queries.shape[2], 0.3, 3
    lengths = [max(length, g0 + budget + 1) for length, g0 in zip(lengths, gen_start)]  # every row over the budget
    policy = DecodeCompression(budget=budget, window=w, kernel_size=kernel)
    slots, _ = policy.select(queries, keys, torch.tensor(lengths), torch.tensor(gen_start), scaling)
    for b, (length, g0) in enumerate(zip(lengths, gen_start)):
        scores = oracle_scores(queries, keys, length, b, scaling)
        for h in range(keys.shape[1]):
            pooled = max_pool(scores[h][g0 : length - w], kernel)
            assert_top_up_to_ties([j - g0 for j in slots[b, h].tolist()[: budget - w]], pooled, budget - w)


def test_smallest_settings_and_refusals():
    assert DecodeCompression(budget=1, interval=1, window=1, kernel_size=1).max_generated == 2
    assert DecodeCompression(budget=4, window=4).window == 4  # the window may be the whole budget
    for field, bad in (("budget", 2.5), ("budget", True), ("window", 0), ("kernel_size", 0)):
        with pytest.raises(ValueError, match=rf"^DecodeCompression\.{field} must be an integer >= 1, got {bad!r}$"):
            DecodeCompression(**{"budget": 8, field: bad})
    queries, keys = torch.zeros(2, 2, 1, 4), torch.zeros(2, 2, 8, 4)
    with pytest.raises(ValueError, match=r"^gen_start must have shape \[B\]=\[2\]"):
        decode_keep_slots(queries, keys, torch.tensor([5, 5]), torch.tensor([1, 1, 1]), 2, 0.5)
    with pytest.raises(ValueError, match=r"^gen_start must have shape \[B\]=\[2\]"):
        move_kept(keys, torch.zeros(2, 2, 2, dtype=torch.long), torch.tensor([1]))


def test_default_kernel_is_seven():
    queries, keys, lengths, gen_start, budget, _ = random_problem(3)
    args = (queries, keys, torch.tensor(lengths), torch.tensor(gen_start), budget, 0.5)
    for got, want in zip(decode_keep_slots(*args), decode_keep_slots(*args, 7)):
        assert torch.equal(got, want)
