"""GenerationHints: what a cache and its layers are told about the prefill or decode step that runs on them.

One object per cache, shared by its layers (they read it; its own methods change it):

    max_length         logical tokens the cache will have seen at most (prompt + new tokens): sizes capacity
    defer_compression  a chunked prefill: stage 1 waits for the last chunk instead of running after each forward
    prefilling         a prefill is running (``RocketKVCache.prefill``): chunks are not compiled, shapes change
    prefill_columns    that prefill's input columns: a chunked prefill's dense store is allocated once at that width
    in_graph           a decode step is being captured or replayed as a CUDA graph, or runs through torch.compile:
                       Python runs once at capture (or trace) and never at replay, so the step's runner does the host
                       bookkeeping, not the traced code (nor a frame dynamo leaves eager)
    op_graph_pool      GPU index -> the memory pool and capture stream every layer's eager-step OpGraphs capture into
                       (cache/op_graphs.py), one per request and GPU

Whoever drives a generate() call (integration/) keeps its own per-call state beside these, in an object of its own
class (``extension``): the cache holds it for the call's duration and never reads it.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import TypeVar

T = TypeVar("T")
KEEP = object()  # ``plan``: leave the field as it is


@dataclass
class GenerationHints:
    """See the module docstring."""

    max_length: int | None = None
    defer_compression: bool = False
    prefill_columns: int | None = None
    prefilling: bool = False
    in_graph: bool = False
    op_graph_pool: dict = field(default_factory=dict)
    _extensions: dict = field(default_factory=dict, repr=False)

    def plan(self, *, max_length=KEEP, defer_compression=KEEP) -> None:
        """What the coming prefill and decode need: ``max_length`` (int or None), whether stage 1 waits for the last
        chunk (bool); a field not given keeps its value."""
        if max_length is not KEEP:
            self.max_length = max_length
        if defer_compression is not KEEP:
            self.defer_compression = bool(defer_compression)

    @contextlib.contextmanager
    def prefill(self, columns: int | None) -> Iterator[None]:
        """``prefilling`` (and ``prefill_columns`` when ``columns`` is given) for the block's duration; nested blocks
        restore the outer block's values."""
        previous = self.prefilling, self.prefill_columns
        self.prefilling = True
        if columns is not None:
            self.prefill_columns = columns
        try:
            yield
        finally:
            self.prefilling, self.prefill_columns = previous

    @contextlib.contextmanager
    def graph_step(self) -> Iterator[None]:
        """``in_graph`` for the block's duration: a decode step captured or replayed as a CUDA graph, or compiled."""
        self.in_graph = True
        try:
            yield
        finally:
            self.in_graph = False

    def extension(self, kind: type[T]) -> T:
        """The ``kind()`` object this cache holds for whoever drives it (made on first use; one per kind)."""
        value = self._extensions.get(kind)
        if value is None:
            value = self._extensions[kind] = kind()
        return value
