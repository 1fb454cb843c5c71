"""A prefix hit on one RocketKV layer: which input columns come from the pool's pages, and, on models with
sliding-window layers, the replay of the hit's last columns that rebuilds those layers' windows.

A hit of ``tokens`` columns means the layer's dense store starts with the hit's K/V ``[0, tokens)`` (gathered from
the pool's pages at the first update, ``PoolPages.prefix_keys``). With a replay from ``start < tokens`` the forwards
feed input columns ``[start, tokens)`` again; this layer stores nothing for them (its hit pages are shared, and the
replayed hidden states are not exact), and its attention reads the hit's K/V plus what was written after them.
"""

from __future__ import annotations


class PrefixHit:
    """One layer's prefix-hit state (module docstring); the layer holds one.

        tokens        input columns the hit provides (0: no hit)
        replay_pos    the next input column while a replay is below ``tokens``, else None
        replayed_now  of the latest dense forward's queries, those that replayed the hit (the attention reads it)
        replay_first  the input column of the latest replaying forward's first query
    """

    def __init__(self) -> None:
        self.tokens = 0
        self.replay_pos: int | None = None
        self.replayed_now = 0
        self.replay_first = 0

    def seed(self, tokens: int, start: int | None = None) -> int:
        """A hit of ``tokens`` columns, replayed from ``start`` (None: no replay); returns the column the layer's
        logical length starts at."""
        start = tokens if start is None else start
        if not 0 <= start <= tokens:
            raise ValueError(f"RocketKVLayer.seed_prefix: start must lie in [0, {tokens}], got {start}")
        self.tokens = tokens
        self.replay_pos = start if start < tokens else None
        return start

    @property
    def next_column(self) -> int:
        """The input column the layer's next forward starts at, before it stored anything."""
        return self.tokens if self.replay_pos is None else self.replay_pos

    def replayed_columns(self, query_length: int) -> int:
        """How many of a forward's first ``query_length`` columns replay the hit (they are not stored)."""
        if self.replay_pos is None:
            return 0
        return max(0, min(query_length, self.tokens - self.replay_pos))

    def consume(self, query_length: int) -> int:
        """A dense forward of ``query_length`` columns: how many of its first columns replay the hit (not to be
        stored); the replay moves past them."""
        skip = self.replayed_now = self.replayed_columns(query_length)
        if skip:
            self.replay_first = self.replay_pos  # the forward's first input column (attention counts)
            self.replay_pos += query_length
            if self.replay_pos >= self.tokens:
                self.replay_pos = None
        return skip
