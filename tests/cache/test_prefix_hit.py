"""PrefixHit (cache/prefix_hit.py): a hit's replay bookkeeping against a column-by-column oracle."""

from __future__ import annotations

import random

import pytest

from hf_rocketkv.cache.prefix_hit import PrefixHit


def oracle(tokens: int, start: int, chunks: list[int]) -> list[tuple[int, int]]:
    """(replayed columns, first column) of each forward, walking the input columns one by one: a forward starting at
    column c replays its columns below ``tokens``; columns at or past ``tokens`` are new."""
    column, out = start, []
    for n in chunks:
        replayed = sum(1 for c in range(column, column + n) if c < tokens)
        out.append((replayed, column))
        column += n
    return out


@pytest.mark.parametrize("seed", range(40))
def test_replay_of_random_chunks_matches_a_column_walk(seed):
    rng = random.Random(seed)
    tokens = rng.randint(1, 64)
    start = rng.randint(0, tokens)
    chunks = [rng.randint(1, 24) for _ in range(rng.randint(1, 8))]
    hit = PrefixHit()
    assert hit.seed(tokens, start) == start
    assert hit.next_column == start
    for (replayed, first), n in zip(oracle(tokens, start, chunks), chunks):
        assert hit.replayed_columns(n) == replayed
        assert hit.consume(n) == replayed
        assert hit.replayed_now == replayed
        if replayed:
            assert hit.replay_first == first
    walked = start + sum(chunks)
    assert hit.replay_pos == (walked if walked < tokens else None)


def test_a_hit_without_replay_starts_after_its_columns_and_replays_nothing():
    hit = PrefixHit()
    assert hit.seed(12) == 12 and hit.next_column == 12 and hit.replay_pos is None
    assert hit.consume(5) == 0 and hit.replayed_now == 0


@pytest.mark.parametrize("start", [-1, 13])
def test_a_replay_start_outside_the_hit_is_refused_with_its_bounds(start):
    with pytest.raises(ValueError, match=r"start must lie in \[0, 12\]"):
        PrefixHit().seed(12, start)
