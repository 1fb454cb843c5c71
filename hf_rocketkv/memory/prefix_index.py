"""PrefixIndex: which page holds which prefix content, so that a later request can reuse it.

It maps a page's chained hash (``hashing.py``; the root ties it to the pool's model fingerprint) to the one device
page or host slot holding that content. Pages join it when written (``register``, ``commit_prompt``: only held
pages, whose K/V the caller has written); they leave it when evicted (offload) or when the index is reset. The same
content computed twice stays private on the second page (vLLM does not de-duplicate either: block tables stay
append-only); a device copy replaces a host copy. Lookups walk a chain of hashes from page 0 to the first miss.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from .admission import Admission
from .block_table import BlockTable
from .core import PageCore
from .errors import PoolStateError, check_int
from .free_list import UNCACHED
from .hashing import PrefixKeys, as_token_list, page_hashes
from .page_meta import PageInfo, PageMeta, Tier, check_priority


class PrefixIndex:
    """Prefix hash -> page (device) or slot (host), for the pages of one pool's core."""

    def __init__(self, core: PageCore, root: bytes, page_size: int, default_priority: int):
        self.core = core
        self.root = root
        self.page_size = page_size
        self.default_priority = default_priority  # of pages registered without a priority
        self.entries: dict[bytes, PageMeta] = {}

    # ============================================================================================ lookups

    def use_default_priority(self, priority: int) -> None:
        """The retention priority of pages registered without one."""
        self.default_priority = priority
    def hash_ids(self, token_ids: list[int], keys: PrefixKeys | None = None) -> list[bytes]:
        """Chained hashes of the full pages of ``token_ids`` (a validated list)."""
        return page_hashes(self.root, token_ids, self.page_size, keys)

    def hash_pages(self, token_ids: Any, keys: PrefixKeys | None = None) -> list[bytes]:
        """Chained prefix hashes of the full pages of ``token_ids`` under the pool's model fingerprint."""
        return self.hash_ids(as_token_list(token_ids), keys)

    def chain(self, hashes: Sequence[bytes]) -> list[PageMeta]:
        """The pages (device or host) of the longest indexed prefix of ``hashes``."""
        pages = []
        for page_hash in hashes:
            meta = self.entries.get(page_hash)
            if meta is None:
                break
            pages.append(meta)
        return pages

    def resident_prefix(self, token_ids: Any, keys: PrefixKeys | None = None) -> list[PageInfo]:
        """The longest chain of full pages of ``token_ids`` in the index (device or host), no hit cap; read-only."""
        with self.core.lock:
            return [PageInfo.of(meta, meta.index in self.core.free_of(meta))
                    for meta in self.chain(self.hash_pages(token_ids, keys))]

    # ============================================================================================ registration
    def register(self, table: BlockTable, hashes: Sequence[bytes], start_page: int = 0,
                 priority: int | None = None) -> int:
        """Give pages ``start_page, start_page+1, ...`` of ``table`` the prefix hashes ``hashes`` (their K/V must be
        written). A hash already indexed on another page leaves this page private. Returns pages newly indexed."""
        core = self.core
        with core.lock:
            priority = self.default_priority if priority is None else check_priority(priority, "priority")
            check_int(start_page, "start_page", 0)
            table.check_owner(core.token)
            pages = table.pages
            if start_page + len(hashes) > len(pages):
                raise ValueError(f"{table.name} has {len(pages)} pages; cannot register pages "
                                 f"[{start_page}, {start_page + len(hashes)})")
            core.tick()
            return sum(self.register_page(core.device_pages[pages[start_page + i]], h, start_page + i, priority)
                       for i, h in enumerate(hashes))

    def commit_prompt(self, admission: Admission, num_tokens: int | None = None, priority: int | None = None) -> int:
        """Index the admission's full prompt pages among its first ``num_tokens`` tokens (default: the whole
        prompt), once their K/V are written in every layer. Returns pages newly indexed."""
        with self.core.lock:
            admission.prompt.check_owner(self.core.token)
            num_tokens = admission.prompt_len if num_tokens is None else num_tokens
            check_int(num_tokens, "num_tokens", 0)
            if num_tokens > admission.prompt_len:
                raise ValueError(f"num_tokens={num_tokens} exceeds the prompt ({admission.prompt_len} tokens)")
            full = min(num_tokens // self.page_size, len(admission.page_hashes))
            start = admission.committed_pages
            if full <= start:
                return 0
            if len(admission.prompt) < full:
                raise PoolStateError(f"{admission.prompt.name} was released; commit_prompt must come before release")
            added = self.register(admission.prompt, admission.page_hashes[start:full], start, priority)
            admission.committed(full)
            return added

    def register_page(self, meta: PageMeta, page_hash: bytes, depth: int, priority: int) -> int:
        """Index one held device page under ``page_hash``; returns 1 if it was indexed, 0 if it stays private."""
        if meta.hash == page_hash:
            return 0
        if meta.hash is not None:
            raise PoolStateError(f"page {meta.index} already holds another prefix page; refusing to re-key it")
        if meta.ref < 1:
            raise PoolStateError(f"page {meta.index} is not held by any table; only held pages can be registered")
        existing = self.entries.get(page_hash)
        if existing is not None:
            host_free = self.core.host_free
            if existing.tier is Tier.DEVICE or existing.index not in host_free:
                return 0  # the same content is already indexed on the device (computed twice): keep this private
            host_free.remove(existing.index)  # a device copy replaces the host copy
            existing.forget()
            host_free.push_back(UNCACHED, existing.index)
        meta.name(page_hash, depth, priority, self.core.clock)
        self.entries[page_hash] = meta
        return 1

    # ============================================================================================ forgetting
    def reset(self) -> None:
        """Forget every cached prefix (device and host). Refused while any table holds a page."""
        core = self.core
        with core.lock:
            held = sum(meta.ref > 0 for meta in core.device_pages)
            if held:
                raise PoolStateError(f"KVBlockPool.reset: {held} pages are still held by requests; release them first")
            core.events.synchronize()
            self.entries.clear()
            for pages, free in ((core.device_pages, core.free), (core.host_pages, core.host_free)):
                for meta in pages:
                    if meta.index in free:
                        free.remove(meta.index)
                    meta.forget()
                    meta.clear_events()
                    free.push_back(UNCACHED, meta.index)
