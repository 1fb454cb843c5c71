"""Brute-force oracles for the stage-1 policies, written from each policy's definition (docs/policies.md).

Plain Python loops over rows, KV heads, query heads and queries, float64 arithmetic; nothing here calls the code under
test. Random cases cover GQA ratios 1-8, left padding, rows shorter than the budget, windows longer than a row and
per-row window lengths.
"""

from __future__ import annotations

import math
import random
from dataclasses import dataclass

import torch

from hf_rocketkv.policies import Stage1Inputs


@dataclass
class Case:
    """One random stage-1 problem. ``queries`` [B, Hq, N, D] holds a query for every slot (what H2O accumulates);
    the window queries are its last w slots of each row, i.e. slots ``end[b] - w .. end[b] - 1``."""

    queries: torch.Tensor
    keys: torch.Tensor
    start: list[int]
    end: list[int]
    w: int
    budget: int
    window_len: list[int] | None
    scaling: float

    @property
    def group(self) -> int:
        return self.queries.shape[1] // self.keys.shape[1]

    def q_window(self) -> torch.Tensor:
        """[B, Hq, w, D]: row b's queries of slots end[b]-w .. end[b]-1 (zeros for slots before 0)."""
        batch, heads, _, dim = self.queries.shape
        out = torch.zeros(batch, heads, self.w, dim)
        for b in range(batch):
            for i in range(self.w):
                slot = self.end[b] - self.w + i
                if slot >= 0:
                    out[b, :, i] = self.queries[b, :, slot]
        return out

    def inputs(self, state=None) -> Stage1Inputs:
        window_len = torch.tensor(self.window_len) if self.window_len is not None else None
        return Stage1Inputs(
            self.q_window(), self.keys, torch.tensor(self.start), torch.tensor(self.end), budget=self.budget,
            scaling=self.scaling, window_len=window_len, state=state,
        )

    def window_of(self, b: int) -> int:
        return self.window_len[b] if self.window_len is not None else self.w

    def selects(self, b: int) -> bool:
        """Row b holds more valid tokens than the budget (otherwise it is kept whole)."""
        return self.end[b] - self.start[b] > self.budget


def random_case(
    seed: int,
    *,
    max_batch: int = 3,
    groups=(1, 2, 3, 4, 8),
    max_slots: int = 40,
    dense: bool | None = None,
    with_window_len: bool | None = None,
) -> Case:
    """A random problem. dense=True: every row ends at N (a prefill store); False: per-row ends (a compressed store);
    None: either."""
    rng = random.Random(seed)
    batch = rng.randint(1, max_batch)
    kv_heads = rng.randint(1, 3)
    group = rng.choice(groups)
    dim = rng.choice([4, 8])
    slots = rng.randint(6, max_slots)
    w = rng.randint(1, min(8, slots))
    budget = rng.randint(w, slots + 2)
    dense = rng.random() < 0.5 if dense is None else dense
    start, end = [], []
    for _ in range(batch):
        e = slots if dense else rng.randint(1, slots)
        s = 0 if rng.random() < 0.3 else rng.randint(0, e - 1)
        start.append(s)
        end.append(e)
    with_window_len = rng.random() < 0.5 if with_window_len is None else with_window_len
    window_len = [rng.randint(0 if rng.random() < 0.1 else 1, w) for _ in range(batch)] if with_window_len else None
    g = torch.Generator().manual_seed(seed)
    queries = torch.randn(batch, kv_heads * group, slots, dim, generator=g) * 1.5
    keys = torch.randn(batch, kv_heads, slots, dim, generator=g) * 1.5
    return Case(queries, keys, start, end, w, budget, window_len, dim**-0.5)


# ------------------------------------------------------------------------------------------------ scores


def softmax64(logits: list[float]) -> list[float]:
    top = max(logits)
    exps = [math.exp(x - top) for x in logits]
    total = sum(exps)
    return [x / total for x in exps]


def attention_row(case: Case, b: int, query_head: int, query: torch.Tensor, query_slot: int) -> dict[int, float]:
    """Softmax probabilities (float64) of one query over the valid keys ``start <= j <= query_slot`` of its KV head."""
    kv_head = query_head // case.group
    visible = list(range(case.start[b], query_slot + 1))
    if not visible:
        return {}
    q = query.double()
    logits = [float(q @ case.keys[b, kv_head, j].double()) * case.scaling for j in visible]
    return dict(zip(visible, softmax64(logits)))


def snapkv_raw_scores(case: Case, b: int) -> list[list[float]]:
    """``[Hkv][N]``: attention of the real window queries (the last window_len of the w), summed over them and the
    query heads of each KV head (spec §2)."""
    kv_heads, slots = case.keys.shape[1], case.keys.shape[2]
    out = [[0.0] * slots for _ in range(kv_heads)]
    real = case.window_of(b)
    for query_head in range(case.queries.shape[1]):
        for i in range(case.w - real, case.w):
            slot = case.end[b] - case.w + i
            if slot < 0:
                continue
            for j, p in attention_row(case, b, query_head, case.queries[b, query_head, slot], slot).items():
                out[query_head // case.group][j] += p
    return out


def max_pool(values: list[float], kernel_size: int) -> list[float]:
    """Stride-1 same-length max-pooling; the window is clipped to the sequence."""
    half = kernel_size // 2
    return [max(values[max(0, j - half) : j + half + 1]) for j in range(len(values))]


def snapkv_prefix_scores(case: Case, b: int, kernel_size: int) -> list[list[float]]:
    """``[Hkv][n_prefix]`` pooled scores of the prefix slots ``[start, end - w_b)``."""
    s, e, w = case.start[b], case.end[b], case.window_of(b)
    return [max_pool(row[s : e - w], kernel_size) for row in snapkv_raw_scores(case, b)]


def h2o_scores(case: Case, b: int) -> list[list[float]]:
    """``[Hkv][N]``: attention of EVERY query of the row (slots start..end-1) summed over queries and group."""
    kv_heads, slots = case.keys.shape[1], case.keys.shape[2]
    out = [[0.0] * slots for _ in range(kv_heads)]
    for query_head in range(case.queries.shape[1]):
        for slot in range(case.start[b], case.end[b]):
            for j, p in attention_row(case, b, query_head, case.queries[b, query_head, slot], slot).items():
                out[query_head // case.group][j] += p
    return out


def prefix_of(case: Case, b: int, full: list[list[float]]) -> list[list[float]]:
    s, e, w = case.start[b], case.end[b], case.window_of(b)
    return [row[s : e - w] for row in full]


def knorm_prefix_scores(case: Case, b: int) -> list[list[float]]:
    s, e, w = case.start[b], case.end[b], case.window_of(b)
    return [
        [-math.sqrt(sum(float(x) ** 2 for x in case.keys[b, h, j].double())) for j in range(s, e - w)]
        for h in range(case.keys.shape[1])
    ]


def streaming_slots(case: Case, b: int, sink_tokens: int) -> list[int]:
    """Sinks + recent from the definition: the first min(sinks, budget - w_b) valid slots, then the most recent."""
    s, e, w = case.start[b], case.end[b], case.window_of(b)
    if e - s <= case.budget:
        return list(range(s, e))
    sinks = min(sink_tokens, case.budget - w)
    recent = case.budget - sinks
    return list(range(s, s + sinks)) + list(range(e - recent, e))


# ------------------------------------------------------------------------------------------------ assertions


def assert_top_up_to_ties(chosen: list[int], scores: list[float], k: int, rel_tol: float = 1e-4) -> None:
    """``chosen`` (indices into ``scores``) is a set of k best: nothing dropped beats anything kept, beyond a
    float32-vs-float64 tolerance. Without a tie at the k-th place this is set equality."""
    assert len(chosen) == k == len(set(chosen)), (chosen, k)
    assert all(0 <= c < len(scores) for c in chosen), chosen
    if k == 0:
        return
    kth = sorted(scores, reverse=True)[k - 1]
    tol = rel_tol * max(abs(kth), 1e-6)
    kept = set(chosen)
    for j, score in enumerate(scores):
        if j in kept:
            assert score >= kth - tol, (j, score, kth)
        else:
            assert score <= kth + tol, (j, score, kth)


def assert_uniform_selection(case: Case, kept, prefix_scores_fn) -> None:
    """Every row: kept whole when it fits the budget; else per head its window plus a top-(budget - w_b) prefix set
    of ``prefix_scores_fn(case, b) -> [Hkv][n_prefix]``."""
    assert len(kept) == len(case.start)
    for b, row in enumerate(kept):
        s, e, w = case.start[b], case.end[b], case.window_of(b)
        heads = case.keys.shape[1]
        assert row.counts.tolist() == [min(e - s, case.budget)] * heads
        slots = row.slots.tolist()
        if not case.selects(b):
            assert slots == [list(range(s, e))] * heads
            continue
        reference = prefix_scores_fn(case, b)
        for h in range(heads):
            assert slots[h][case.budget - w :] == list(range(e - w, e)), "window kept"
            prefix = slots[h][: case.budget - w]
            assert prefix == sorted(prefix)
            assert_top_up_to_ties([j - s for j in prefix], reference[h], case.budget - w)
