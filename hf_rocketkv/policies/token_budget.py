"""The paper's token-budget mode (RocketKV, arXiv 2502.14051 §3.6; spec §1): one knob ``t`` -> every budget.

``t`` is the K/V traffic per attention op per decode step, in K+V token pairs per KV head, *including* the page
scoring of stage 2; half goes to scoring pages, half to exact attention. With ``S = prompt_len + max_new_tokens``:

    c        = max(1, S / t)                          total compression
    a        = min(0.2 + 0.06 log2 c, 0.8)            share of log c taken by stage 1 (the paper's split r)
    capacity = max(floor(S / c^a), min(2 max_new, S)) tokens kept after stage 1, generated ones included
    prompt_budget = capacity - max_new_tokens         stage-1 budget for the prompt, per KV head
    topk_tokens   = t // 2                            tokens read by exact attention per step
    c2       = max(1, capacity / t)                   stage-2 compression (= c^(1-a))
    page     = ceil(sqrt(c2)), or 1 if that exceeds c2
    topr     = int(D page / c2)                       query channels that score a page

Scoring reads ``topr`` of D channels of min/max for ``capacity / page`` pages, about ``capacity / c2 = t`` key
vectors = ``t / 2`` K+V pairs, and exact attention reads ``t / 2`` pairs: ``t`` in all.

Differences from the paper, because our stage 2 selects whole pages and our kernels need power-of-two pages:
- ``page_size`` is the paper's page rounded DOWN to a power of two (3 -> 2; 5..7 -> 4). Down, so the page never
  exceeds c2 and topr stays <= D; topr is recomputed for the rounded page, so the scoring traffic is still about t/2.
- ``topk`` is in pages: ``max(1, topk_tokens // page_size)``, so the exact-attention read stays <= t/2 tokens
  (our stage 2 also always attends the page of the newest token; it is one of the topk).
The paper's values are kept as ``paper_page_size`` and ``paper_topr`` for reference.
"""

from __future__ import annotations

import math
from dataclasses import dataclass


@dataclass(frozen=True)
class DerivedBudgets:
    """Every budget that ``derive_budgets`` derives (see the module docstring for the formulas)."""

    total_length: int  # S = prompt_len + max_new_tokens
    compression: float  # c
    split: float  # a
    capacity: int  # tokens kept after stage 1, generated ones included
    prompt_budget: int  # stage 1: prompt tokens kept per KV head
    topk_tokens: int  # stage 2: tokens read by exact attention per step (the paper's topk)
    paper_page_size: int  # the paper's page (any integer >= 1)
    paper_topr: int  # the paper's top-r for paper_page_size
    page_size: int  # ours: paper_page_size rounded down to a power of two
    topk: int  # ours: pages per KV head = max(1, topk_tokens // page_size)
    topr: int  # ours: top-r recomputed for page_size


def _check_int(name: str, value, minimum: int) -> None:
    if not isinstance(value, int) or isinstance(value, bool) or value < minimum:
        raise ValueError(f"derive_budgets: {name} must be an integer >= {minimum}, got {value!r}")


def _topr(head_dim: int, page: int, stage2_compression: float) -> int:
    """Channels that keep the scoring traffic at about t/2: ``int(D page / c2)`` clamped to [1, D]."""
    return min(max(int(head_dim * page / stage2_compression), 1), head_dim)


def derive_budgets(prompt_len: int, max_new_tokens: int, token_budget: int, head_dim: int) -> DerivedBudgets:
    """Stage-1 and stage-2 budgets for one request from the token budget ``t`` (paper §3.6, spec §1).

    ``prompt_len``: valid prompt tokens (per row); ``max_new_tokens``: tokens still to generate (0 when unknown);
    ``token_budget``: t, K+V pairs read per KV head per decode step; ``head_dim``: D.
    """
    _check_int("prompt_len", prompt_len, 1)
    _check_int("max_new_tokens", max_new_tokens, 0)
    _check_int("token_budget", token_budget, 2)
    _check_int("head_dim", head_dim, 1)
    total = prompt_len + max_new_tokens
    compression = max(1.0, total / token_budget)
    split = min(0.2 + 0.06 * math.log2(compression), 0.8)
    capacity = max(math.floor(total / compression**split), min(2 * max_new_tokens, total))
    stage2_compression = max(1.0, capacity / token_budget)
    paper_page = math.ceil(math.sqrt(stage2_compression))
    if paper_page > stage2_compression:
        paper_page = 1
    page = 1 << (paper_page.bit_length() - 1)  # largest power of two <= paper_page
    topk_tokens = token_budget // 2
    return DerivedBudgets(
        total_length=total,
        compression=compression,
        split=split,
        capacity=capacity,
        prompt_budget=capacity - max_new_tokens,
        topk_tokens=topk_tokens,
        paper_page_size=paper_page,
        paper_topr=_topr(head_dim, paper_page, stage2_compression),
        page_size=page,
        topk=max(1, topk_tokens // page),
        topr=_topr(head_dim, page, stage2_compression),
    )
