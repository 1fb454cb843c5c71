"""How many pool pages a RocketKV request takes: at its prefill peak and once compressed.

Notation (one row): p = pool page_size, P = prompt tokens, N = max_new_tokens, B = RocketKVConfig.prompt_budget,
kept = min(P, B) tokens per KV head after stage 1.

    prompt table  ceil(P / p)               the dense, pre-eviction prompt (reused prefixes live here)
                  ceil((P + N) / p)         keep_all (RocketKV-MT): the conversation stays, generated tokens too
    view table    ceil((kept + N) / p)      stage-1 survivors + every decode token, allocated up front so decode
                                            never allocates (fixed shapes for the compiled decode step)

    prefix reuse on   prefill_peak = prompt + view   steady_state = view              (prompt pages become cached)
    keep_all          prefill_peak = prompt + view   steady_state = prompt + view
    prefix reuse off  prefill_peak = max(prompt, view)  (stage 1 compacts in place, the tail pages go back)
                      steady_state = view

With token ids, a prefix hit of H pages needs H fewer new prompt pages, but a hit page that sits at ref 0 (cached,
so counted as free) leaves the free count when taken, and a hit page on the host needs a device page to come back
into: ``prefill_peak = prompt - H + view + H_free + H_host`` (vLLM's rule for evictable hits). A batch sums its rows;
hit pages shared by several rows are counted once.
"""

from __future__ import annotations

from dataclasses import dataclass, fields


def ceil_div(a: int, b: int) -> int:
    return -(-a // b)


@dataclass(frozen=True)
class RowPages:
    """Table sizes of one row (before prefix hits)."""

    prompt_pages: int  # pages of the prompt table (keep_all: prompt + new tokens)
    view_pages: int  # pages of the view table (0 with reuse off: the prompt table is compacted in place)
    peak_pages: int  # pages held at the prefill peak, cold
    steady_pages: int  # pages held after prefill


def row_pages(prompt_len: int, max_new_tokens: int, page_size: int, prompt_budget: int, *,
              prefix_reuse: bool = True, keep_all: bool = False) -> RowPages:
    kept = min(prompt_len, prompt_budget)
    view = ceil_div(kept + max_new_tokens, page_size)
    if keep_all:
        prompt = ceil_div(prompt_len + max_new_tokens, page_size)
        return RowPages(prompt, view, prompt + view, prompt + view)
    prompt = ceil_div(prompt_len, page_size)
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

    def as_dict(self) -> dict[str, int]:
        return {f.name: getattr(self, f.name) for f in fields(self)}
