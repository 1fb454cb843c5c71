"""TritonWatch: which Triton kernels a block of code made Triton compile or load (used by first_call and
batching_throughput)."""

from __future__ import annotations

import os
from pathlib import Path


class TritonWatch:
    """Kernels Triton loads (its in-memory cache missed: compiled or read from disk) and entries its disk cache
    gains (compiled) while the block runs."""

    def __init__(self):
        self.loaded: list[str] = []
        self.folder = Path(os.environ.get("TRITON_CACHE_DIR") or Path.home() / ".triton" / "cache")

    def _entries(self) -> set[str]:
        return set(os.listdir(self.folder)) if self.folder.is_dir() else set()

    def __enter__(self):
        self.before = self._entries()
        try:
            from triton import knobs

            knobs.runtime.jit_cache_hook = self._hook
        except (ImportError, AttributeError):
            pass
        return self

    def _hook(self, **kw) -> None:  # returns None: Triton goes on compiling or loading
        self.loaded.append(str(kw.get("repr", kw.get("fn", "")))[:120])

    def __exit__(self, *exc) -> None:
        self.added = len(self._entries() - self.before)
        try:
            from triton import knobs

            knobs.runtime.jit_cache_hook = None
        except (ImportError, AttributeError):
            pass
