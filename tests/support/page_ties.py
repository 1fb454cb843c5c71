"""Page selection where many pages score the same: tie-heavy inputs and the selection rule written from its
definition with plain loops (the oracle of tests/kernels/test_select_pages_ties.py and
tests/gpu/test_select_pages_ties_gpu.py).

The rule (``stage2_pages.select_pages``' docstring): with n pages in use, the forced pages {j < sink_pages} and
{j >= n - recent_pages} (inside [0, n)) come first in ascending order, then the other pages in use by descending
score with the LOWER page id first on a tie (NaN and values <= 0 score 0), cut at K = min(topk, NP); slots past
min(K, n) are invalid and hold n, n + 1, ...
"""

from __future__ import annotations

import math

import torch

PATTERNS = ("equal", "two_levels", "zeros_nan", "tied_blocks")


def tied_probs(batch: int, heads: int, num_pages: int, pattern: str) -> torch.Tensor:
    """fp32 ``[B, Hkv, NP]`` page probabilities (CPU) where ties decide the selection.

    equal        every page 0.5
    two_levels   0.5 on pages j % 3 == 0, 0.25 on the others: ties on both sides of the top-k boundary
    zeros_nan    0 everywhere, NaN on pages j % 5 == 1, -1 on j % 5 == 2 (all rank as 0), one page 0.75 per head
    tied_blocks  pages in runs of 37 share a score that rises with the run: the best run is the LAST, and the runs
                 cross every power-of-two chunk boundary of the kernels' multi-stage sort
    """
    page = torch.arange(num_pages, dtype=torch.float32)
    if pattern == "equal":
        row = torch.full((num_pages,), 0.5)
    elif pattern == "two_levels":
        row = torch.where(page % 3 == 0, 0.5, 0.25)
    elif pattern == "zeros_nan":
        row = torch.zeros(num_pages)
        row[page % 5 == 1] = float("nan")
        row[page % 5 == 2] = -1.0
    elif pattern == "tied_blocks":
        row = (torch.div(page, 37, rounding_mode="floor") + 1) / 4096
    else:
        raise ValueError(f"unknown pattern {pattern!r}; one of {PATTERNS}")
    probs = row.expand(batch, heads, num_pages).clone()
    if pattern == "zeros_nan":
        for h in range(heads):
            probs[:, h, (7 * h + 3) % num_pages] = 0.75
    return probs


def rule_selection(probs: torch.Tensor, n_pages: torch.Tensor, topk: int, sink_pages: int = 0,
                   recent_pages: int = 1) -> tuple[torch.Tensor, torch.Tensor]:
    """(page_idx ``[B, Hkv, K]`` int64, page_valid bool) by the rule in the module docstring, in its canonical order
    (CPU). ``n_pages`` [B] or [B, Hkv]."""
    probs = probs.detach().double().cpu()
    batch, heads, num_pages = probs.shape
    counts = n_pages.detach().cpu()
    k = min(topk, num_pages)
    page_idx = torch.zeros(batch, heads, k, dtype=torch.long)
    valid = torch.zeros(batch, heads, k, dtype=torch.bool)
    for b in range(batch):
        for h in range(heads):
            count = int(counts[b] if counts.dim() == 1 else counts[b, h])
            n = max(0, min(count, num_pages))
            score = [v if (not math.isnan(v) and v > 0) else 0.0 for v in probs[b, h].tolist()]
            forced = [j for j in range(n) if j < sink_pages or j >= n - recent_pages]
            forced_set = set(forced)
            others = sorted((j for j in range(n) if j not in forced_set), key=lambda j: (-score[j], j))
            chosen = (forced + others)[:k]
            unused = list(range(n, n + k - len(chosen)))
            page_idx[b, h] = torch.tensor(chosen + unused, dtype=torch.long)
            valid[b, h, : len(chosen)] = True
    return page_idx, valid


def constant_kt(batch: int, heads: int, num_pages: int, dim: int, dtype: torch.dtype, g: torch.Generator,
                device) -> torch.Tensor:
    """KT summaries ``[B, Hkv, NP, 2, D]`` that are the same for every page of a (row, KV head) (the KT of constant
    keys): every page's logit, and so its probability, is the same, so the choice among them is the tie rule alone.
    min = c - |e| and max = c + |e| with c, e drawn per (row, KV head), both exactly representable in ``dtype``."""
    center = (torch.randn(batch, heads, 1, dim, generator=g) * 2).round() / 4
    spread = (torch.randn(batch, heads, 1, dim, generator=g).abs() * 2).round() / 4
    kt = torch.stack([center - spread, center + spread], dim=3)  # [B, Hkv, 1, 2, D]
    return kt.expand(batch, heads, num_pages, 2, dim).contiguous().to(dtype).to(device)


def pages_in_use(lengths: torch.Tensor, page_size: int) -> torch.Tensor:
    """ceil(length / page_size), from the definition."""
    return torch.tensor([-(-int(n) // page_size) for n in lengths.cpu().flatten()]).view(lengths.shape)
