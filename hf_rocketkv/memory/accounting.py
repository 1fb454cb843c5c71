"""How many pool pages a request takes, from plain per-row numbers: at its prefill peak and once prefill is over.

A row asks for (``RowDemand``; the numbers come from the caller's policy, e.g. ``cache/page_budget.py`` for a
RocketKVConfig): P = prompt tokens, T = tokens the prompt table holds (P, or more when it is kept and grows),
V = tokens the view table holds, and whether the prompt table is kept after prefill. With p = pool page_size:

    prompt table  ceil(T / p)               the dense prompt, in positional order (reused prefixes live here)
    view table    ceil(V / p)               the request's private working set, allocated whole at admission

    prefix reuse on   prefill_peak = prompt + view   steady_state = view              (prompt pages become cached)
    prompt kept       prefill_peak = prompt + view   steady_state = prompt + view
    prefix reuse off  prefill_peak = max(prompt, view)  (the prompt table is compacted in place, its tail goes back)
                      steady_state = view           view table pages: 0

With token ids, a prefix hit of H pages needs H fewer new prompt pages, but a hit page that sits at ref 0 (cached,
so counted as free) leaves the free count when taken, and a hit page on the host needs a device page to come back
into: ``prefill_peak = prompt - H + view + H_free + H_host`` (vLLM's rule for evictable hits). A batch sums its rows;
hit pages shared by several rows are counted once.

Layer kinds (a model with sliding-window layers, ``layer_kinds.py``): a page spans the full-attention layers only
(``bytes_per_page`` counts K + V + KT of those), so the formulas above count those layers alone; each row also
takes one sliding-window slot (``sliding_slab.py``: ``window`` tokens of K and V in every sliding layer), from
admission to release, whatever its prompt length: ``slots = rows``, and a batch fits when its pages and its slots
both do.
"""

from __future__ import annotations

from dataclasses import dataclass, fields

from .errors import check_int


def ceil_div(a: int, b: int) -> int:
    return -(-a // b)


@dataclass(frozen=True)
class RowPages:
    """Table sizes of one row (before prefix hits)."""

    prompt_pages: int  # pages of the prompt table
    view_pages: int  # pages of the view table (0 with reuse off: the prompt table is compacted in place)
    peak_pages: int  # pages held at the prefill peak, cold
    steady_pages: int  # pages held after prefill


@dataclass(frozen=True)
class RowDemand:
    """What one row asks of the pool, in tokens: the pool's whole view of a request's policy.

    prompt_tokens        P: the prompt (its full pages are hashed and may be prefix hits)
    new_tokens           tokens generated after the prompt (recorded in the ``Admission``)
    view_tokens          V: tokens the view table must hold (survivors of compression + generated tokens)
    hit_cap_tokens       the most prompt tokens a prefix hit may cover (rounded down to whole pages)
    prompt_table_tokens  T: tokens the prompt table must hold (default: P)
    keep_prompt          the prompt table stays held after prefill (a multi-turn history)
    """

    prompt_tokens: int
    new_tokens: int
    view_tokens: int
    hit_cap_tokens: int
    prompt_table_tokens: int | None = None
    keep_prompt: bool = False

    def __post_init__(self) -> None:
        for name in ("prompt_tokens", "new_tokens", "view_tokens", "hit_cap_tokens"):
            check_int(getattr(self, name), f"RowDemand.{name}", 0)
        if self.prompt_table_tokens is None:
            object.__setattr__(self, "prompt_table_tokens", self.prompt_tokens)
        check_int(self.prompt_table_tokens, "RowDemand.prompt_table_tokens", self.prompt_tokens)
        if self.hit_cap_tokens > self.prompt_tokens:
            raise ValueError(f"RowDemand.hit_cap_tokens={self.hit_cap_tokens} exceeds prompt_tokens={self.prompt_tokens}")
        if not isinstance(self.keep_prompt, bool):
            raise ValueError(f"RowDemand.keep_prompt must be True or False, got {self.keep_prompt!r}")

    def prompt_table_pages(self, page_size: int) -> int:
        return ceil_div(self.prompt_table_tokens, page_size)

    def view_pages(self, page_size: int) -> int:
        return ceil_div(self.view_tokens, page_size)

    def pages(self, page_size: int, prefix_reuse: bool = True) -> RowPages:
        """The row's tables in pages of ``page_size`` tokens (module docstring)."""
        prompt, view = self.prompt_table_pages(page_size), self.view_pages(page_size)
        if self.keep_prompt:
            return RowPages(prompt, view, prompt + view, prompt + view)
        if not prefix_reuse:
            in_place = max(prompt, view)
            return RowPages(in_place, 0, in_place, view)
        return RowPages(prompt, view, prompt + view, view)


@dataclass(frozen=True)
class PagesNeeded:
    """What admitting a request (or a batch, summed over rows) takes from the pool.

    prefill_peak    pages taken from ``free_pages()`` at admission: the peak, reached during prefill; decode then
                    allocates nothing. ``can_admit`` is ``prefill_peak <= free_pages()``.
    steady_state    pages the request still holds once prefill is over (the compressed working set)
    prompt_pages    prompt table pages, hits included
    view_pages      view table pages
    hit_pages       prompt pages found in the prefix index (device or host): not recomputed
    hit_pages_free  of the hits, device pages no request holds (taking them lowers ``free_pages()``)
    hit_pages_host  of the hits, host-tier pages (each takes a device page to come back into)
    hit_tokens      prompt tokens covered by hits (``hit_pages * page_size`` per row)
    new_pages       fresh pages allocated (prompt pages not hit + view pages + host onload targets)
    rows            rows counted
    slots           sliding-window slots taken (one per row on a pool of a model with sliding layers, else 0): held
                    from admission to release, the same at the peak and in the steady state
    prefill_peak_bytes, steady_state_bytes
                    device bytes of the two counts: ``pages x bytes_per_page + slots x bytes_per_slot``
    """

    prefill_peak: int
    steady_state: int
    prompt_pages: int
    view_pages: int
    hit_pages: int = 0
    hit_pages_free: int = 0
    hit_pages_host: int = 0
    hit_tokens: int = 0
    new_pages: int = 0
    rows: int = 1
    slots: int = 0
    prefill_peak_bytes: int = 0
    steady_state_bytes: int = 0

    def as_dict(self) -> dict[str, int]:
        return {f.name: getattr(self, f.name) for f in fields(self)}
