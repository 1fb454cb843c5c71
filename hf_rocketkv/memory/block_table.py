"""BlockTable: one request's pool pages for one purpose, in order.

Two kinds per request (docs/memory.md):

    prompt  the pre-eviction K/V of the prompt in positional order: token t lies in page ``pages[t // page_size]``,
            slot ``t % page_size``. Full pages get a prefix hash once written and become shareable.
    view    RocketKV's private working set (stage-1 survivors, then generated tokens, with KT summaries). Never hashed.

The pool alone changes a table (under its lock); callers read ``pages`` (a tuple) or :meth:`as_tensor`, an int32
device tensor ``[max_pages]`` padded with -1 for kernels. The tensor is created once and updated in place whenever
the table changes, so its address stays fixed (CUDA graphs).
"""

from __future__ import annotations

import itertools

import torch

TABLE_KINDS = ("prompt", "view")
_table_ids = itertools.count()  # only names tables in messages; never used for identity checks


class BlockTable:
    def __init__(self, kind: str, max_pages: int | None = None):
        if kind not in TABLE_KINDS:
            raise ValueError(f"BlockTable.kind must be one of {list(TABLE_KINDS)}, got {kind!r}")
        if max_pages is not None and (not isinstance(max_pages, int) or isinstance(max_pages, bool) or max_pages < 0):
            raise ValueError(f"BlockTable.max_pages must be None or an integer >= 0, got {max_pages!r}")
        self.kind = kind
        self.max_pages = max_pages
        self.name = f"{kind}-table-{next(_table_ids)}"
        self._pages: list[int] = []
        self._tensor: torch.Tensor | None = None
        self._owner: object | None = None  # the token of the pool whose pages the table holds (None while empty)

    @property
    def pages(self) -> tuple[int, ...]:
        """Physical page ids in order (a copy)."""
        return tuple(self._pages)

    def __len__(self) -> int:
        return len(self._pages)

    def __repr__(self) -> str:
        return f"BlockTable({self.name}, pages={self._pages})"

    def as_tensor(self, device: torch.device | str | None = None, max_pages: int | None = None) -> torch.Tensor:
        """The page ids as int32 ``[max_pages]`` on ``device``, padded with -1; the same tensor on every call.

        ``max_pages`` (first call only): the table's ``max_pages`` when set, else its current length.
        """
        if self._tensor is None:
            size = max_pages if max_pages is not None else (self.max_pages if self.max_pages is not None else len(self))
            if size < len(self._pages):
                raise ValueError(f"{self.name}: max_pages={size} is smaller than the table ({len(self._pages)} pages)")
            self._tensor = torch.full((size,), -1, dtype=torch.int32, device=device or "cpu")
            self._sync_tensor()
        elif device is not None and torch.device(device) != self._tensor.device:
            raise ValueError(f"{self.name}: its tensor lives on {self._tensor.device}, asked for {device}")
        return self._tensor

    # ------------------------------------------------------------------------------------------ pool only
    # The pool's page core (memory/core.py) and planner change a table, under the pool's lock; nothing else does.
    def check_room(self, extra: int) -> None:
        """Raise unless ``extra`` more pages fit in the table (its tensor's width, else ``max_pages``)."""
        limit = self._tensor.shape[0] if self._tensor is not None else self.max_pages
        if limit is not None and len(self._pages) + extra > limit:
            raise ValueError(
                f"{self.name}: {len(self._pages)} + {extra} pages exceed its max_pages={limit}"
            )

    def check_owner(self, owner: object) -> None:
        """Raise unless the table is empty or holds pages of the pool whose token is ``owner``: a page id means
        nothing in another pool (releasing it there would free a page some other request holds)."""
        if self._pages and self._owner is not owner:
            raise ValueError(f"{self.name} holds pages of another KVBlockPool: release, truncate or grow it through "
                             f"the pool it came from")

    def extend(self, pages: list[int], owner: object) -> None:
        """Append page ids ``pages`` of the pool whose token is ``owner`` (the tensor follows in place)."""
        self.check_owner(owner)
        self._pages.extend(pages)
        if self._pages:
            self._owner = owner
        self._sync_tensor()

    def truncate(self, length: int) -> list[int]:
        """Drop pages from ``length`` on; returns them in table order."""
        dropped = self._pages[length:]
        del self._pages[length:]
        if not self._pages:
            self._owner = None
        self._sync_tensor()
        return dropped

    def _sync_tensor(self) -> None:
        if self._tensor is None:
            return
        padded = self._pages + [-1] * (self._tensor.shape[0] - len(self._pages))
        self._tensor.copy_(torch.tensor(padded, dtype=torch.int32))
