"""Paged KV storage as the decode ops see it, and the PyTorch helpers the paged twins use.

A paged store (the KV block pool's layout, docs/memory.md) holds fixed-size pages shared by many rows:

    k_pages, v_pages  [N, Hkv, PP, D]        PP tokens per page (the pool's page_size)
    kt_pages          [N, Hkv, R, 2, D]      R = PP // KP KT pages per page (KP = RocketKVConfig.page_size)
    table             [B, MP] int32          row b's slot s lives in page table[b, s // PP] at offset s % PP;
                                             -1 = no page (a row with fewer pages than the widest row)

so row b's KT page j is ``kt_pages[table[b, j // R], :, j % R]``, and a row holds C = MP * PP slots. A contiguous
store ``[B, Hkv, C, D]`` is the special case N = B, PP = C, table = [[0], [1], ..., [B - 1]]: the Triton kernels
serve both with one body (a constexpr chooses whether the page id is read from the table or is the row itself).

The twins of the paged ops gather the pages into contiguous tensors (``gather_pages``) and call the contiguous
reference, so a paged kernel is checked against exactly the math of the contiguous one.
"""

from __future__ import annotations

import torch

from ..selection.stage2_pages import page_scores, top_pages


def check_table(table: torch.Tensor, batch: int, name: str = "table") -> None:
    """A block table must be int32 ``[B, MP]`` (host-side shape check only: no device sync)."""
    if table.dim() != 2 or table.shape[0] != batch or table.dtype != torch.int32:
        raise ValueError(
            f"{name} must be an int32 tensor [B={batch}, max_pages], got {table.dtype} {list(table.shape)}"
        )


def gather_pages(pages: torch.Tensor, table: torch.Tensor) -> torch.Tensor:
    """Rows of a paged tensor as contiguous per-row tensors.

    ``pages`` ``[N, Hkv, S, *rest]`` (S slots per page: PP tokens for K/V, R KT pages for KT), ``table`` ``[B, MP]``
    -> ``[B, Hkv, MP * S, *rest]``; the slots of a missing page (-1) are zeros.
    """
    batch, max_pages = table.shape
    index = table.long()
    present = index >= 0
    gathered = pages[index.clamp(min=0)]  # [B, MP, Hkv, S, *rest]
    shape = (batch, max_pages) + (1,) * (gathered.dim() - 2)
    gathered = torch.where(present.view(shape), gathered, torch.zeros((), dtype=pages.dtype, device=pages.device))
    gathered = gathered.movedim(2, 1)  # [B, Hkv, MP, S, *rest]
    return gathered.reshape(batch, gathered.shape[1], max_pages * pages.shape[2], *pages.shape[3:])


def scatter_pages(pages: torch.Tensor, table: torch.Tensor, rows: torch.Tensor,
                  row_pages: tuple[int, ...] | None = None) -> None:
    """In place: write contiguous rows back into their pages (the inverse of ``gather_pages``).

    ``rows`` ``[B, Hkv, MP * S, *rest]``; the slots of missing pages (-1) are dropped. Every present page of a row is
    written whole, so a row's pages must not be shared with another row.

    ``row_pages`` (host ints, optional): row b's pages are ``table[b, :row_pages[b]]`` and every entry after them is
    -1 (what a ``PagedStore`` table holds). Given, the present pages come from these counts instead of a boolean mask
    over the device table, whose indexing waits for the device (a host sync per call).
    """
    batch, max_pages = table.shape
    per_page = rows.reshape(batch, rows.shape[1], max_pages, pages.shape[2], *pages.shape[3:]).movedim(1, 2)
    if row_pages is None:
        index = table.long()
        present = index >= 0
        pages[index[present]] = per_page[present].to(pages.dtype)
        return
    if len(row_pages) == 1:  # one row (a request's prefill): its slices as they are, no copy through cat
        index, source = table[0, : row_pages[0]].long(), per_page[0, : row_pages[0]]
    else:
        index = torch.cat([table[b, :n] for b, n in enumerate(row_pages)]).long()
        source = torch.cat([per_page[b, :n] for b, n in enumerate(row_pages)])
    pages[index] = source.to(pages.dtype)  # index_put_ (index_copy_ has no float8 kernel on CPU)


def identity_table(batch: int, pages_per_row: int, device: torch.device | str) -> torch.Tensor:
    """``[B, MP]`` int32 table where row b owns pages ``b * MP .. b * MP + MP - 1`` (a private store)."""
    return torch.arange(batch * pages_per_row, dtype=torch.int32, device=device).view(batch, pages_per_row)


# ---------------------------------------------------------------------------------------------- twins of the paged
# stage-2 ops (their Triton kernels are page_scores.py / select_pages.py, which import triton at module level)
def paged_page_scores_torch(
    q: torch.Tensor, kt_pages: torch.Tensor, table: torch.Tensor, n_pages: torch.Tensor, topr: int
) -> torch.Tensor:
    """``stage2_pages.page_scores`` over a paged KT: q [B, Hkv, G, D], kt_pages [N, Hkv, R, 2, D], table [B, MP],
    n_pages [B] or [B, Hkv] -> probs [B, Hkv, MP * R] fp32."""
    check_table(table, q.shape[0])
    return page_scores(q, gather_pages(kt_pages, table), n_pages, topr)


def paged_top_pages_torch(
    q: torch.Tensor,
    kt_pages: torch.Tensor,
    table: torch.Tensor,
    lengths: torch.Tensor,
    kt_page_size: int,
    topr: int,
    topk: int,
    sink_pages: int = 0,
    recent_pages: int = 1,
) -> tuple[torch.Tensor, torch.Tensor]:
    """``stage2_pages.top_pages`` over a paged KT: (page_idx, page_valid) ``[B, Hkv, min(topk, MP * R)]``, page
    indices counted in KT pages of the row (slot // kt_page_size)."""
    check_table(table, q.shape[0])
    return top_pages(q, gather_pages(kt_pages, table), lengths, kt_page_size, topr, topk, sink_pages, recent_pages)
