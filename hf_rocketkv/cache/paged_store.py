"""PagedStore: one layer's compressed K/V (and KT) for a batch of rows, in pages.

Layout (kernels/paged.py; the KV block pool's, docs/memory.md):

    k, v    [N, Hkv, PP, D]     PP tokens per page, model dtype
    kt      [N, Hkv, R, 2, D]   R = PP // KP KT pages per page (KP = RocketKVConfig.page_size); None for a store
                                without KT summaries (keep_all's full history)
    table   [B, MP] int32       row b's slot s is in page table[b, s // PP] at offset s % PP; -1 = no page

fp8 pages (a pool built with ``dtype=torch.float8_e4m3fn``): ``k``/``v`` are e4m3 with float32 scales ``k_scale`` /
``v_scale`` ``[N]`` (one per page) or ``[N, Hkv]`` (per page and KV head), and ``read_dtype`` is the model's dtype.
Reads dequantize (``gather``); writes follow ``memory/page_io.write_tokens``' rule: every page a write touches is
re-quantized over what it holds, and slots past the write are zeros, so a page's scale covers exactly its tokens.

``row_pages[b]`` pages belong to row b (the first entries of its table row), so row b holds
``row_pages[b] * PP`` slots and the store ``C = MP * PP``. A private store (no pool) owns its tensors and gives every
row MP pages (an identity table); a pool-backed store's tensors are the pool's per-layer tensors and its table comes
from the request's block tables.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import torch

from ..kernels.paged import gather_pages, identity_table, scale_granularity, scatter_pages
from ..memory.fp8 import dequantize_fp8, quantize_pages


def ceil_div(a: int, b: int) -> int:
    return -(-a // b)


@dataclass
class PagedStore:
    k: torch.Tensor
    v: torch.Tensor
    kt: torch.Tensor | None
    table: torch.Tensor
    row_pages: tuple[int, ...]
    private: bool  # True: the tensors belong to this store alone (no pool)
    k_scale: torch.Tensor | None = None  # fp8 pages: float32 [N] or [N, Hkv]; None: pages in the model dtype
    v_scale: torch.Tensor | None = None
    read_dtype: torch.dtype | None = None  # fp8 pages: the dtype reads dequantize to (the model's)

    @classmethod
    def over(cls, storage, table: torch.Tensor, row_pages: tuple[int, ...], read_dtype: torch.dtype,
             kt: bool = True) -> "PagedStore":
        """A store over a pool layer's tensors (``memory.storage.LayerStorage``): its pages, KT unless ``kt`` is
        False, and for fp8 pages their scales, read back in ``read_dtype`` (the model's)."""
        fp8 = storage.k_scale is not None
        return cls(storage.k, storage.v, storage.kt if kt else None, table, row_pages, False, k_scale=storage.k_scale,
                   v_scale=storage.v_scale, read_dtype=read_dtype if fp8 else None)

    @property
    def fp8(self) -> bool:
        return self.k_scale is not None

    @property
    def page_tokens(self) -> int:
        return self.k.shape[2]

    @property
    def batch(self) -> int:
        return self.table.shape[0]

    @property
    def max_pages(self) -> int:
        return self.table.shape[1]

    @property
    def capacity(self) -> int:
        """Slots of the widest row (C = MP * PP)."""
        return self.max_pages * self.page_tokens

    def row_capacity(self) -> list[int]:
        return [pages * self.page_tokens for pages in self.row_pages]

    def gather(self) -> tuple[torch.Tensor, torch.Tensor]:
        """Every row's slots as contiguous ``(keys, values)`` ``[B, Hkv, C, D]`` (zeros where a row has no page);
        fp8 pages are dequantized to ``read_dtype``."""
        if self.fp8:
            return (gather_pages(self.k, self.table, self.k_scale).to(self.read_dtype),
                    gather_pages(self.v, self.table, self.v_scale).to(self.read_dtype))
        return gather_pages(self.k, self.table), gather_pages(self.v, self.table)

    def gather_kt(self) -> torch.Tensor:
        """KT summaries as ``[B, Hkv, C // KP, 2, D]``."""
        return gather_pages(self.kt, self.table)

    def write(self, keys: torch.Tensor, values: torch.Tensor, kt: torch.Tensor | None = None) -> None:
        """Write contiguous rows ``[B, Hkv, W, D]`` (W <= C; the rest of each page is zeroed) into the rows' pages,
        and ``kt`` ``[B, Hkv, W // KP, 2, D]`` when given. Whole pages are written, so stale bytes of an earlier
        owner of a pool page never survive."""
        counts = self.row_pages  # host page counts: no device-side mask of the table (a sync per write)
        # fp8 pages: each written whole, quantized over its slots (the rows' zeros past their tokens included)
        scatter_pages(self.k, self.table, _pad_slots(keys, self.capacity, 0), counts, self.k_scale)
        scatter_pages(self.v, self.table, _pad_slots(values, self.capacity, 0), counts, self.v_scale)
        if kt is not None:
            scatter_pages(self.kt, self.table, _pad_slots(kt, self.max_pages * self.kt.shape[2], 0), counts)

    def widened(self, capacity: int) -> "PagedStore":
        """The same pages, the table padded with -1 (no page) up to ``capacity`` slots per row (never narrowed).

        A compiled decode step sees one table shape for every request of a capacity bucket
        (``RocketKVConfig.capacity_buckets``), while a pool reserves no page for the padding: ``row_pages`` still
        says how many slots each row really holds."""
        pages = ceil_div(capacity, self.page_tokens)
        if pages <= self.max_pages:
            return self
        padding = self.table.new_full((self.batch, pages - self.max_pages), -1)
        return dataclasses.replace(self, table=torch.cat([self.table, padding], dim=1))

    def nbytes(self) -> int:
        """Bytes of the pages this store's rows hold (all of a private store's tensors, the table included)."""
        tensors = (self.k, self.v, self.kt, self.k_scale, self.v_scale)
        per_page = sum(t[0].numel() * t.element_size() for t in tensors if t is not None)
        if self.private:
            return per_page * self.k.shape[0] + self.table.numel() * self.table.element_size()
        return per_page * sum(self.row_pages) + self.table.numel() * self.table.element_size()


def _pad_slots(tensor: torch.Tensor, size: int, fill) -> torch.Tensor:
    """``tensor`` with dim 2 extended to ``size`` by ``fill``."""
    missing = size - tensor.shape[2]
    if missing == 0:
        return tensor
    if missing < 0:
        raise ValueError(f"{tensor.shape[2]} slots do not fit a store of {size}")
    shape = list(tensor.shape)
    shape[2] = missing
    return torch.cat([tensor, tensor.new_full(shape, fill)], dim=2)


def private_store(
    batch: int,
    pages_per_row: int,
    num_kv_heads: int,
    page_tokens: int,
    head_dim: int,
    dtype: torch.dtype,
    device: torch.device,
    kt_page_size: int | None = None,
    kt_dtype: torch.dtype | None = None,
) -> PagedStore:
    """A zeroed store owned by one layer: ``batch * pages_per_row`` pages, row b owning pages
    ``b * MP .. b * MP + MP - 1``. Without ``kt_page_size`` it keeps no KT summaries."""
    num_pages = batch * pages_per_row
    k = torch.zeros(num_pages, num_kv_heads, page_tokens, head_dim, dtype=dtype, device=device)
    v = torch.zeros_like(k)
    kt = None
    if kt_page_size is not None:
        kt = torch.zeros(num_pages, num_kv_heads, page_tokens // kt_page_size, 2, head_dim, dtype=kt_dtype,
                         device=device)
    return PagedStore(k, v, kt, identity_table(batch, pages_per_row, device), (pages_per_row,) * batch, True)


def write_tokens(store: PagedStore, keys: torch.Tensor, values: torch.Tensor, start: list[int], end: list[int]) -> None:
    """Write slots ``[start[b], end[b])`` of each row from contiguous rows ``[B, Hkv, W, D]`` (slot-aligned: the
    row's slot s comes from ``keys[b, :, s]``) into the row's pages, and nothing else. Pages before ``start`` may be
    shared (prefix pages another request also reads): they are never touched."""
    # checked on the host (a row's pages are table[b, :row_pages[b]]), and the index tensors are built on the
    # device: no host-device sync on the prefill path
    for b, (first, last) in enumerate(zip(start, end)):
        if last > first and (b >= len(store.row_pages) or last > store.row_pages[b] * store.page_tokens):
            raise IndexError("write_tokens: a row has no page for a slot it writes (table entry -1)")
    if store.fp8:
        _write_tokens_fp8(store, keys, values, start, end)
        return
    device, page = store.k.device, store.page_tokens
    rows, slots = [], []
    for b, (first, last) in enumerate(zip(start, end)):
        whole_from, whole_to = ceil_div(first, page) * page, last // page * page
        if whole_to > whole_from:  # the row's whole pages in one copy each for K and V (a prompt: all but its tail)
            _write_whole_pages(store, keys, values, b, whole_from, whole_to)
            pieces = ((first, whole_from), (whole_to, last))
        else:
            pieces = ((first, last),)
        for lo, hi in pieces:  # partial pages at either end: slot by slot, the rest of those pages untouched
            if hi > lo:
                rows.append(torch.full((hi - lo,), b, dtype=torch.long, device=device))
                slots.append(torch.arange(lo, hi, dtype=torch.long, device=device))
    if not rows:
        return
    rows, slots = torch.cat(rows), torch.cat(slots)
    pages = store.table.long()[rows, slots // store.page_tokens]
    offsets = slots % store.page_tokens
    store.k[pages, :, offsets] = keys[rows, :, slots].to(store.k.dtype)
    store.v[pages, :, offsets] = values[rows, :, slots].to(store.v.dtype)


def _write_whole_pages(store: PagedStore, keys: torch.Tensor, values: torch.Tensor, row: int, first: int,
                       last: int) -> None:
    """Slots ``[first, last)`` of ``row`` (page aligned at both ends) into the row's pages, one indexed copy per
    tensor: the slot-by-slot path gathers and scatters every token through an index tensor of its own."""
    page = store.page_tokens
    pages = store.table[row, first // page : last // page].long()
    heads, dim = keys.shape[1], keys.shape[3]
    for source, target in ((keys, store.k), (values, store.v)):
        # [Hkv, n * P, D] -> [n, Hkv, P, D]: page-major like the pool's pages (a view; index_put_ reads the strides)
        per_page = source[row, :, first:last].reshape(heads, -1, page, dim).transpose(0, 1)
        target[pages] = per_page.to(target.dtype)


def _write_tokens_fp8(store: PagedStore, keys: torch.Tensor, values: torch.Tensor, start: list[int],
                      end: list[int]) -> None:
    """``write_tokens`` into fp8 pages by ``memory/page_io.write_tokens``' rule: the pages that slots
    ``[start[b], end[b])`` touch are dequantized, take the new tokens, have every slot at or past ``end[b]`` zeroed,
    and are re-quantized with fresh scales (earlier tokens of a touched page keep their values up to rounding).
    Pages before the first touched one are never read or written (shared prefix pages)."""
    page, granularity = store.page_tokens, scale_granularity(store.k_scale)
    for b, (first, last) in enumerate(zip(start, end)):
        if last <= first:
            continue
        first_page, end_page = first // page, ceil_div(last, page)
        index = store.table[b, first_page:end_page].long()
        base = first_page * page  # slot of the first touched page's slot 0
        for source, pages, scale in ((keys, store.k, store.k_scale), (values, store.v, store.v_scale)):
            dense = dequantize_fp8(pages[index], scale[index])  # [m, Hkv, PP, D] float32
            heads, dim = dense.shape[1], dense.shape[3]
            flat = dense.transpose(0, 1).reshape(heads, -1, dim)  # [Hkv, m * PP, D] (a copy)
            flat[:, first - base : last - base] = source[b, :, first:last].to(flat.dtype)
            flat[:, last - base :] = 0
            quantized, scales = quantize_pages(flat.reshape(heads, -1, page, dim).transpose(0, 1), granularity)
            pages[index] = quantized
            scale[index] = scales
