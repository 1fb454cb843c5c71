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

fp8 pages (the KV block pool's ``float8_e4m3fn`` storage, arithmetic of ``kernels/fp8.py``): k_pages / v_pages are
e4m3 and every paged op that touches them takes ``k_scale`` / ``v_scale``, float32 ``[N]`` (granularity "page": one
scale per pool page, all KV heads) or ``[N, Hkv]`` (granularity "head"), indexed by pool page id; a value is
``float(q) * scale``. ``check_fp8_scales`` holds the rule (scales given <=> fp8 pages) and its errors;
``gather_pages(..., scale)`` dequantizes while gathering.
"""

from __future__ import annotations

import torch

from .fp8 import FP8_DTYPE, SCALE_DTYPE, quantize_pages
from ..selection.stage2_pages import build_kt, page_scores, top_pages


def check_table(table: torch.Tensor, batch: int, name: str = "table") -> None:
    """A block table must be int32 ``[B, MP]`` (host-side shape check only: no device sync)."""
    if table.dim() != 2 or table.shape[0] != batch or table.dtype != torch.int32:
        raise ValueError(
            f"{name} must be an int32 tensor [B={batch}, max_pages], got {table.dtype} {list(table.shape)}"
        )


def check_fp8_scales(
    k_pages: torch.Tensor, v_pages: torch.Tensor, k_scale: torch.Tensor | None, v_scale: torch.Tensor | None, op: str
) -> bool:
    """Whether the paged K/V are fp8 (True: ``k_scale`` / ``v_scale`` apply), after checking the contract.

    Scales given <=> k_pages and v_pages are ``float8_e4m3fn``; each scale float32 ``[N]`` ("page") or ``[N, Hkv]``
    ("head") for the N pool pages, on the pages' device (K and V may differ in granularity). Shapes, dtypes and
    devices only: no device sync. Anything else raises ValueError naming the argument.
    """
    given = (k_scale is not None, v_scale is not None)
    fp8 = (k_pages.dtype == FP8_DTYPE, v_pages.dtype == FP8_DTYPE)
    if not any(given) and not any(fp8):
        return False
    if given[0] != given[1]:
        missing = "v_scale" if given[0] else "k_scale"
        raise ValueError(f"{op}: k_scale and v_scale go together (fp8 pages need both); {missing} is None")
    if not all(given):
        name = "k_pages" if fp8[0] else "v_pages"
        raise ValueError(
            f"{op}: {name} are {FP8_DTYPE}, so k_scale and v_scale (float32 [N] or [N, Hkv] per pool page) are "
            f"required; got None"
        )
    if not all(fp8):
        name, pages = ("k_pages", k_pages) if not fp8[0] else ("v_pages", v_pages)
        raise ValueError(
            f"{op}: k_scale / v_scale are given, so {name} must be {FP8_DTYPE} (scales only apply to fp8 pages); "
            f"got {pages.dtype}"
        )
    for name, scale, pages in (("k_scale", k_scale, k_pages), ("v_scale", v_scale, v_pages)):
        num_pages, heads = pages.shape[0], pages.shape[1]
        allowed = (f"float32 [N={num_pages}] (one scale per pool page) or [N={num_pages}, Hkv={heads}] (per page and "
                   f"KV head)")
        if not isinstance(scale, torch.Tensor):
            raise ValueError(f"{op}: {name} must be a tensor, {allowed}; got {type(scale).__name__}")
        if scale.dtype != SCALE_DTYPE:
            raise ValueError(f"{op}: {name} must be {allowed}; got dtype {scale.dtype}")
        if tuple(scale.shape) not in ((num_pages,), (num_pages, heads)):
            raise ValueError(f"{op}: {name} must be {allowed}; got shape {list(scale.shape)}")
        if scale.device != pages.device:
            raise ValueError(f"{op}: {name} must be on the pages' device {pages.device}; got {scale.device}")
    return True


def scale_granularity(scale: torch.Tensor) -> str:
    """"page" for a ``[N]`` scale, "head" for ``[N, Hkv]`` (shapes checked by ``check_fp8_scales``)."""
    return "page" if scale.dim() == 1 else "head"


def gather_pages(pages: torch.Tensor, table: torch.Tensor, scale: torch.Tensor | None = None) -> torch.Tensor:
    """Rows of a paged tensor as contiguous per-row tensors.

    ``pages`` ``[N, Hkv, S, *rest]`` (S slots per page: PP tokens for K/V, R KT pages for KT), ``table`` ``[B, MP]``
    -> ``[B, Hkv, MP * S, *rest]``; the slots of a missing page (-1) are zeros.

    ``scale`` (fp8 K/V pages): float32 ``[N]`` or ``[N, Hkv]``; the gathered pages come back dequantized, float32
    ``q.float() * scale[page(, head)]``. Pages are gathered by plain indexing (no ``Tensor.gather``, which has no
    fp8 kernel on the CPU) and dequantized before anything else touches them.
    """
    batch, max_pages = table.shape
    index = table.long()
    present = index >= 0
    gathered = pages[index.clamp(min=0)]  # [B, MP, Hkv, S, *rest]
    if scale is not None:
        page_scale = scale[index.clamp(min=0)].to(SCALE_DTYPE)  # [B, MP] or [B, MP, Hkv]
        page_scale = page_scale.reshape(*page_scale.shape, *([1] * (gathered.dim() - page_scale.dim())))
        gathered = gathered.to(SCALE_DTYPE) * page_scale
    shape = (batch, max_pages) + (1,) * (gathered.dim() - 2)
    gathered = _zero_missing(gathered, present.view(shape))
    gathered = gathered.movedim(2, 1)  # [B, Hkv, MP, S, *rest]
    return gathered.reshape(batch, gathered.shape[1], max_pages * pages.shape[2], *pages.shape[3:])


def _zero_missing(gathered: torch.Tensor, present: torch.Tensor) -> torch.Tensor:
    """``gathered`` with the slots of missing pages set to zero. fp8 (KT pages) is selected on its byte view: the
    same bits (0x00 is +0 in every fp8 format), and inductor's CPU code generator cannot promote a where's bool
    condition with a float8 operand."""
    if gathered.is_floating_point() and gathered.element_size() == 1:  # a float8 format
        raw = gathered.view(torch.uint8)
        return torch.where(present, raw, torch.zeros((), dtype=torch.uint8, device=raw.device)).view(gathered.dtype)
    return torch.where(present, gathered, torch.zeros((), dtype=gathered.dtype, device=gathered.device))


def scatter_pages(pages: torch.Tensor, table: torch.Tensor, rows: torch.Tensor,
                  row_pages: tuple[int, ...] | None = None, scale: torch.Tensor | None = None) -> None:
    """In place: write contiguous rows back into their pages (the inverse of ``gather_pages``).

    ``rows`` ``[B, Hkv, MP * S, *rest]``; the slots of missing pages (-1) are dropped. Every present page of a row is
    written whole, so a row's pages must not be shared with another row.

    ``row_pages`` (host ints, optional): row b's pages are ``table[b, :row_pages[b]]`` and every entry after them is
    -1 (what a ``PagedStore`` table holds). Given, the present pages come from these counts instead of a boolean mask
    over the device table, whose indexing waits for the device (a host sync per call).

    ``scale`` (fp8 K/V pages, float32 ``[N]`` or ``[N, Hkv]``): each written page is quantized over its slots
    (``fp8.quantize_pages``, the granularity from the scale's shape) and its scale written beside it.
    """
    batch, max_pages = table.shape
    per_page = rows.reshape(batch, rows.shape[1], max_pages, pages.shape[2], *pages.shape[3:]).movedim(1, 2)
    if row_pages is None:
        index = table.long()
        present = index >= 0
        index, source = index[present], per_page[present]
    elif len(row_pages) == 1:  # one row (a request's prefill): its slices as they are, no copy through cat
        index, source = table[0, : row_pages[0]].long(), per_page[0, : row_pages[0]]
    else:
        index = torch.cat([table[b, :n] for b, n in enumerate(row_pages)]).long()
        source = torch.cat([per_page[b, :n] for b, n in enumerate(row_pages)])
    store_pages(pages, index, source, scale)


def store_pages(pages: torch.Tensor, index: torch.Tensor, source: torch.Tensor,
                scale: torch.Tensor | None = None) -> None:
    """In place: ``pages[index] = source`` (``source`` ``[n, Hkv, S, *rest]``). fp8 pages (``scale`` float32 ``[N]``
    or ``[N, Hkv]`` given): each page quantized over its slots (``fp8.quantize_pages``, the granularity from the
    scale's shape) and its scale written beside it."""
    if scale is not None:
        source, scale[index] = quantize_pages(source, scale_granularity(scale))
    pages[index] = source.to(pages.dtype)  # index_put_ (index_copy_ has no float8 kernel on CPU)


def identity_table(batch: int, pages_per_row: int, device: torch.device | str) -> torch.Tensor:
    """``[B, MP]`` int32 table where row b owns pages ``b * MP .. b * MP + MP - 1`` (a private store)."""
    return torch.arange(batch * pages_per_row, dtype=torch.int32, device=device).view(batch, pages_per_row)


# ---------------------------------------------------------------------------------------------- twins of the paged
# stage-2 ops (their Triton kernels are page_scores.py / select_pages.py, which import triton at module level)
def paged_page_scores_torch(
    q: torch.Tensor, kt_pages: torch.Tensor, table: torch.Tensor, n_pages: torch.Tensor, topr: int,
    per_head_bound: bool = False,
) -> torch.Tensor:
    """``stage2_pages.page_scores`` over a paged KT: q [B, Hkv, G, D], kt_pages [N, Hkv, R, 2, D], table [B, MP],
    n_pages [B] or [B, Hkv] -> probs [B, Hkv, MP * R] fp32."""
    check_table(table, q.shape[0])
    return page_scores(q, gather_pages(kt_pages, table), n_pages, topr, per_head_bound)


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
    per_head_bound: bool = False,
    softcap: float | None = None,
    scaling: float | None = None,
    counters: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """``stage2_pages.top_pages`` over a paged KT: (page_idx, page_valid) ``[B, Hkv, min(topk, MP * R)]``, page
    indices counted in KT pages of the row (slot // kt_page_size). ``counters``: the Triton twin's arrival counters
    (``arrivals.py``); the reference has one pass and leaves them alone."""
    check_table(table, q.shape[0])
    return top_pages(q, gather_pages(kt_pages, table), lengths, kt_page_size, topr, topk, sink_pages, recent_pages,
                     per_head_bound, softcap, scaling)


def check_counts(counts: torch.Tensor | None, heads: int) -> None:
    """``paged_compact_row``'s per-head ``counts``: None or an integer ``[Hkv]`` tensor (ValueError otherwise)."""
    if counts is None:
        return
    if not isinstance(counts, torch.Tensor) or counts.dtype.is_floating_point or tuple(counts.shape) != (heads,):
        got = f"{counts.dtype} {list(counts.shape)}" if isinstance(counts, torch.Tensor) else type(counts).__name__
        raise ValueError(f"paged_compact_row: counts must be None or an integer tensor [Hkv]=[{heads}], got {got}")


def paged_compact_row_torch(
    keys: torch.Tensor,
    values: torch.Tensor,
    slots: torch.Tensor,
    columns: torch.Tensor | None,
    k_pages: torch.Tensor,
    v_pages: torch.Tensor,
    kt_pages: torch.Tensor | None,
    table: torch.Tensor,
    row_pages: int,
    positions: torch.Tensor,
    kt_page_size: int,
    k_scale: torch.Tensor | None = None,
    v_scale: torch.Tensor | None = None,
    counts: torch.Tensor | None = None,
) -> None:
    """Stage 1's compaction of one row, in place: the kept slots' K/V into the row's pages, their KT summaries and
    their positions (the reference of ``compact.paged_compact_row_triton``).

    keys, values [Hkv, S, D]   the row's dense store (any strides)
    slots        [Hkv, n]      kept slots of each KV head, ascending (int)
    counts       [Hkv] or None kept slots per KV head (per-head budgets, AdaKV): head h keeps ``slots[h, :counts[h]]``
                               (entries after them are ignored, e.g. AdaKV's -1 padding); None: every head keeps n
    columns      [Hkv, S]      positions of the dense slots (int), or None: a slot's position is the slot itself
    k_pages, v_pages [N, Hkv, PP, D]; kt_pages [N, Hkv, PP // KP, 2, D] or None (no KT summaries)
    table        [MP] int32    the row's pages; only its first ``row_pages`` entries are read (host int: no sync)
    positions    [Hkv, MP * PP] int32, written whole: kept slot i's position at i, -1 after the n kept ones

    Slot i < n (or counts[h]) of head h gets dense slot ``slots[h, i]``; the other slots of the row's pages are
    zeroed (whole pages are written, so no byte of an earlier owner of a pool page survives) and their KT covers
    only the kept tokens (``stage2_pages.build_kt``: a page without tokens summarises to zeros).

    fp8 pages (``k_scale`` / ``v_scale`` float32 ``[N]`` or ``[N, Hkv]``, see ``check_fp8_scales``): the row's
    written pages are quantized from the float staging of the row (``kernels/fp8.quantize_pages``: over their valid
    tokens, the slots past the n kept ones being zeros) and their scales written; the KT is built from the
    unquantized keys, as for float pages.
    """
    fp8 = check_fp8_scales(k_pages, v_pages, k_scale, v_scale, "paged_compact_row")
    heads, n = slots.shape
    check_counts(counts, heads)
    dim, page = keys.shape[-1], k_pages.shape[2]
    capacity = table.shape[0] * page
    limit = torch.full((heads,), n, device=keys.device) if counts is None else counts.clamp(max=n)
    kept = torch.arange(n, device=keys.device)[None, :] < limit[:, None]  # [Hkv, n]
    index = slots.long().masked_fill(~kept, 0)  # [Hkv, n]; slots past a head's count are read, then zeroed
    gathered = keys.new_zeros(heads, capacity, dim), values.new_zeros(heads, capacity, dim)
    for source, target in zip((keys, values), gathered):
        target[:, :n] = source.gather(1, index[:, :, None].expand(heads, n, dim)).masked_fill(~kept[:, :, None], 0)
    kept_positions = columns.gather(1, index) if columns is not None else index
    positions.fill_(-1)
    positions[:, :n] = kept_positions.to(positions.dtype).masked_fill(~kept, -1)
    pages = table[:row_pages].long()
    present = row_pages * page
    for source, target, scale in zip(gathered, (k_pages, v_pages), (k_scale, v_scale)):
        block = source[:, :present].reshape(heads, row_pages, page, dim).transpose(0, 1)  # [row_pages, Hkv, PP, D]
        store_pages(target, pages, block, scale if fp8 else None)
    if kt_pages is not None:
        lengths = kept.sum(dim=1)[None]  # [1, Hkv]
        kt = build_kt(gathered[0][None], lengths, kt_page_size, kt_pages.dtype)[0]  # [Hkv, C // KP, 2, D]
        per_page = kt_pages.shape[2]
        kt_pages[pages] = kt[:, : row_pages * per_page].reshape(heads, row_pages, per_page, 2, dim).transpose(0, 1)
