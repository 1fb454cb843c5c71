"""Stage-2 options: which pages a decode step must attend besides the top-k by score, or every kept page.

RocketKV's stage 2 reads ``topk`` pages per KV head per decode step: the page holding the newest token plus the
best pages by KT score. Recent tokens and the first tokens (attention sinks) carry much of next-token fidelity on
text, and under plain top-k they must win their pages by score. The options here force them in, inside the same
read budget (the forced pages are part of the ``topk``):

    stage2_sink_tokens = s    the first ceil(s / P) pages of the compacted store (stage 1 keeps the prompt's first s
                              tokens: ``Stage1Inputs.keep_first``)
    stage2_recent_tokens = r  the newest 1 + ceil(r / P) pages: the newest page (partly filled) and enough full pages
                              before it to hold at least the r newest tokens
    stage2 = "none"           no page selection: attend every kept token (stage 1 only)

P is ``page_size``. The counts (``forced_page_counts``, ``fit_forced_pages``) are plain Python ints (static under
torch.compile); the kernels' ``select_pages`` / ``top_pages`` take them as ``sink_pages`` / ``recent_pages``
(docs/kernels.md, "Page selection"). They and the option names live in config.py, which validates with them.
"""

from __future__ import annotations

import torch

from ..config import STAGE2_NAMES, STAGE2_SCORES, fit_forced_pages, forced_page_counts

__all__ = ["STAGE2_NAMES", "STAGE2_SCORES", "every_page", "fit_forced_pages", "forced_page_counts"]


def every_page(lengths: torch.Tensor, num_kv_heads: int, num_pages: int, page_size: int):
    """``stage2="none"``: every page in use, as ``(page_idx, page_valid)`` ``[B, Hkv, NP]`` for
    ``sparse_decode_attention``. ``lengths`` [B] or [B, Hkv] tokens stored; ``num_pages`` = capacity / P (a fixed
    shape: compile-friendly, no host sync)."""
    batch = lengths.shape[0]
    page = torch.arange(num_pages, device=lengths.device)
    n_pages = (lengths + page_size - 1) // page_size
    n_pages = n_pages[:, None] if n_pages.dim() == 1 else n_pages  # [B, 1] or [B, Hkv]
    page_valid = (page < n_pages[..., None]).expand(batch, num_kv_heads, num_pages)
    return page.expand(batch, num_kv_heads, num_pages), page_valid
