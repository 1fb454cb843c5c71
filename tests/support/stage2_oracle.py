"""Brute-force float64 references of stage 2 (spec §3), written from the definition with plain loops over batch rows,
KV heads, pages, channels and query heads: KT page summaries (``ref_build_kt``), page scores (``ref_page_scores``,
the TensorRT-LLM variant: temperature 1/sqrt(D), top-r channels by |q| summed over the GQA group, max/min picked per
channel by the sign of the group-summed q, softmax over the row's valid pages, mean over the group, q rounded to the
KT dtype), the pages stage 2 must choose (``brute_force_pages``) and exact attention over chosen pages
(``ref_sparse_attention``).

The oracle of the selection tests (tests/selection), of the cache layer's attention paths (tests/cache), of AdaKV's
per-head pages (tests/policies) and of whole generations (tests/integration).
"""

from __future__ import annotations

import math

import torch


def ref_build_kt(keys, lengths, page_size, kt_dtype):
    batch, heads, capacity, dim = keys.shape
    out = torch.zeros(batch, heads, capacity // page_size, 2, dim)
    for b in range(batch):
        for h in range(heads):
            for p in range(capacity // page_size):
                tokens = list(range(p * page_size, min((p + 1) * page_size, int(lengths[b]))))
                if not tokens:
                    continue  # an empty page holds zeros
                for d in range(dim):
                    column = [keys[b, h, t, d].item() for t in tokens]
                    out[b, h, p, 0, d] = min(column)
                    out[b, h, p, 1, d] = max(column)
    return out.to(kt_dtype)


def ref_page_scores(q, kt, n_pages, topr, per_head_bound=False):
    batch, heads, group, dim = q.shape
    out = torch.zeros(batch, heads, kt.shape[2], dtype=torch.float64)
    for b in range(batch):
        n = int(n_pages[b])
        if n == 0:
            continue
        for h in range(heads):
            qq = q[b, h].to(kt.dtype).double()  # [G, D], rounded to the KT dtype like TensorRT-LLM
            magnitude = [sum(abs(qq[g, c].item()) for g in range(group)) for c in range(dim)]
            channels = sorted(range(dim), key=lambda c: -magnitude[c])[: min(topr, dim)]
            use_max = [sum(qq[g, c].item() for g in range(group)) > 0 for c in channels]
            probs = []
            for g in range(group):
                logits = []
                for j in range(n):
                    s = 0.0
                    for c, take_max in zip(channels, use_max):
                        if per_head_bound:  # the larger of the two products, this head's own bound
                            s += max(qq[g, c].item() * kt[b, h, j, m, c].double().item() for m in (0, 1))
                            continue
                        bound = kt[b, h, j, 1 if take_max else 0, c].double().item()
                        s += qq[g, c].item() * bound
                    logits.append(s / math.sqrt(dim))
                probs.append(torch.softmax(torch.tensor(logits, dtype=torch.float64), dim=0))
            out[b, h, :n] = torch.stack(probs).mean(dim=0)
    return out


def ref_sparse_attention(q, keys, values, page_idx, page_valid, lengths, page_size, scaling):
    batch, heads, group, dim = q.shape
    out = torch.zeros(batch, heads, group, dim, dtype=torch.float64)
    for b in range(batch):
        for h in range(heads):
            slots = sorted(
                t
                for p, ok in zip(page_idx[b, h].tolist(), page_valid[b, h].tolist())
                if ok
                for t in range(p * page_size, min((p + 1) * page_size, int(lengths[b])))
            )
            if not slots:
                continue
            k = keys[b, h, slots].double()
            v = values[b, h, slots].double()
            for g in range(group):
                weights = torch.softmax(k @ q[b, h, g].double() * scaling, dim=0)
                out[b, h, g] = weights @ v
    return out


def brute_force_pages(q, kt, lengths, page_size, topr, topk):
    """Independent oracle of stage 2's choice: float64 page scores by loops (``ref_page_scores``), then per (row,
    KV head) the newest page plus the best-scoring others, ``min(topk, pages)`` in all. Returns (page_idx, valid)."""
    batch, heads = q.shape[:2]
    n_pages = [-(-int(n) // page_size) for n in lengths]
    probs = ref_page_scores(q, kt, torch.tensor(n_pages), topr)
    k = min(topk, kt.shape[2])
    page_idx = torch.zeros(batch, heads, k, dtype=torch.long)
    valid = torch.zeros(batch, heads, k, dtype=torch.bool)
    for b in range(batch):
        for h in range(heads):
            newest = n_pages[b] - 1
            others = sorted(range(newest), key=lambda j: (-probs[b, h, j].item(), j))
            chosen = ([newest] + others)[: min(k, n_pages[b])]
            page_idx[b, h, : len(chosen)] = torch.tensor(chosen)
            valid[b, h, : len(chosen)] = True
    return page_idx, valid
