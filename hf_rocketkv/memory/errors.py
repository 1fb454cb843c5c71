"""The pool's exceptions: each names what was asked, what is available and what is allowed."""

from __future__ import annotations


class PoolExhaustedError(RuntimeError):
    """An allocation does not fit. Raised before anything changes: the pool is exactly as it was."""

    def __init__(self, what: str, pages_needed: int, pages_free: int, pages_total: int):
        self.pages_needed = pages_needed
        self.pages_free = pages_free
        self.pages_total = pages_total
        super().__init__(
            f"KVBlockPool: {what} needs {pages_needed} pages but only {pages_free} of {pages_total} are free "
            f"(free includes cached prefix pages that can be evicted); nothing was allocated. Release finished "
            f"requests, admit fewer rows or shorter requests, or give the pool more max_gpu_bytes."
        )


class PoolStateError(RuntimeError):
    """An operation that the pool's current state does not allow (e.g. reset while requests hold pages)."""


class PrefixFileError(ValueError):
    """A prefix file that cannot be loaded: another model, dtype or page size, truncated, or tampered with."""
