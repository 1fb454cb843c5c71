"""The pool's exceptions (each names what was asked, what is available and what is allowed) and its argument check."""

from __future__ import annotations

from typing import Any

import torch

from .layout import SCALE_GRANULARITIES


class PoolExhaustedError(RuntimeError):
    """An allocation does not fit. Raised before anything changes: the pool is exactly as it was."""

    def __init__(self, what: str, pages_needed: int, pages_free: int, pages_total: int, unit: str = "pages"):
        self.pages_needed = pages_needed
        self.pages_free = pages_free
        self.pages_total = pages_total
        self.unit = unit  # "pages", or "sliding-window slots" (one per row of a model with sliding layers)
        note = " (free includes cached prefix pages that can be evicted)" if unit == "pages" else ""
        super().__init__(
            f"KVBlockPool: {what} needs {pages_needed} {unit} but only {pages_free} of {pages_total} are free"
            f"{note}; nothing was allocated. Release finished requests, admit fewer rows or shorter requests, or "
            f"give the pool more max_gpu_bytes."
        )


class PoolStateError(RuntimeError):
    """An operation that the pool's current state does not allow (e.g. reset while requests hold pages)."""


class PrefixFileError(ValueError):
    """A prefix file that cannot be loaded: another model, dtype or page size, truncated, or tampered with."""


def check_int(value: Any, field: str, minimum: int) -> int:
    """``value`` if it is an integer (not a bool) >= ``minimum``, else ValueError naming ``field``."""
    if not isinstance(value, int) or isinstance(value, bool) or value < minimum:
        raise ValueError(f"{field} must be an integer >= {minimum}, got {value!r}")
    return value


def check_device(value: Any, field: str) -> torch.device | None:
    """``value`` as a ``torch.device`` (None stays None), else ValueError naming ``field`` and what is allowed."""
    if value is None or isinstance(value, torch.device):
        return value
    if isinstance(value, str):
        try:
            return torch.device(value)
        except RuntimeError:
            pass
    raise ValueError(f"{field} must be None, a torch.device or a device string such as 'cpu', 'cuda' or 'cuda:1', "
                     f"got {value!r}")


def check_pool_options(page_size, kt_page_size, host_bytes, max_gpu_bytes, scale_granularity, prefix_reuse,
                       transfer_chunk_pages, fingerprint_samples) -> None:
    """KVBlockPool's numeric and mode arguments, each refused with a message naming it."""
    check_int(max_gpu_bytes, "KVBlockPool.max_gpu_bytes", 1)
    check_int(host_bytes, "KVBlockPool.host_bytes", 0)
    check_int(page_size, "KVBlockPool.page_size (tokens per pool page)", 1)
    check_int(kt_page_size, "KVBlockPool.kt_page_size (tokens per KT page)", 1)
    if kt_page_size & (kt_page_size - 1):
        raise ValueError(f"KVBlockPool.kt_page_size (tokens per KT page) must be a power of 2, got {kt_page_size}")
    if page_size % kt_page_size:
        raise ValueError(
            f"KVBlockPool.page_size (tokens per pool page) must be a multiple of KVBlockPool.kt_page_size "
            f"(tokens per KT page): got page_size={page_size}, kt_page_size={kt_page_size}"
        )
    if scale_granularity not in SCALE_GRANULARITIES:
        raise ValueError(
            f"KVBlockPool.scale_granularity must be one of {list(SCALE_GRANULARITIES)}, got {scale_granularity!r}"
        )
    if not isinstance(prefix_reuse, bool):
        raise ValueError(f"KVBlockPool.prefix_reuse must be True or False, got {prefix_reuse!r}")
    check_int(transfer_chunk_pages, "KVBlockPool.transfer_chunk_pages", 1)
    check_int(fingerprint_samples, "KVBlockPool.fingerprint_samples", 0)
