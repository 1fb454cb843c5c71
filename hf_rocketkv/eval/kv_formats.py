"""Storage formats of the KV cache, simulated for the eval: what a full cache gives back when its pages are stored
in bf16 or in fp8 (e4m3, ``KVBlockPool(dtype=torch.float8_e4m3fn)``) instead of the model's own dtype.

``RoundTripCache(kv_format)`` is a DynamicCache that keeps, instead of the exact keys and values, what the pool's
storage would return: every update re-quantizes the pages of ``page_size`` tokens it touches over their valid tokens
and keeps them dequantized, the rule of ``memory/page_io.write_tokens`` (an earlier token of a partly filled page is
re-quantized from its stored value when the page grows). The fp8 arithmetic is ``memory/fp8.py``'s reference
(``s = amax / 448`` per page, or per page and KV head), so the eval measures the fidelity fp8 pages cost before any
kernel reads them.

    kv_format   stored as                                   eval method
    bf16        bfloat16 (round to nearest)                 full_bf16kv
    fp8_page    e4m3 with one scale per page                full_fp8kv
    fp8_head    e4m3 with one scale per page and KV head    full_fp8kv_head
"""

from __future__ import annotations

import torch
from transformers import DynamicCache

from ..memory import FP8_DTYPE, KVBlockPool, dequantize_fp8, quantize_pages

KV_FORMATS = ("bf16", "fp8_page", "fp8_head")
POOL_PAGE_SIZE = 16  # KVBlockPool's default page size (tokens)


def round_trip_pages(x: torch.Tensor, kv_format: str) -> torch.Tensor:
    """``x`` ``[n, H, p, D]`` (n pages of p tokens) as the storage returns it, in ``x``'s dtype."""
    if kv_format == "bf16":
        return x.to(torch.bfloat16).to(x.dtype)
    granularity = {"fp8_page": "page", "fp8_head": "head"}[kv_format]
    q, scale = quantize_pages(x, granularity)
    return dequantize_fp8(q, scale, x.dtype)


def round_trip_tail(t: torch.Tensor, start: int, page_size: int, kv_format: str) -> None:
    """Re-store, in place, the pages of ``t`` ``[B, H, T, D]`` from the one holding token ``start`` to the end."""
    first = (start // page_size) * page_size
    batch, heads, total, dim = t.shape
    tail = t[:, :, first:]
    tokens = total - first
    pages = -(-tokens // page_size)
    padded = torch.zeros(batch, heads, pages * page_size, dim, dtype=t.dtype, device=t.device)
    padded[:, :, :tokens] = tail  # zeros past the valid tokens change no page's amax
    paged = padded.view(batch, heads, pages, page_size, dim).permute(0, 2, 1, 3, 4).reshape(-1, heads, page_size, dim)
    stored = round_trip_pages(paged, kv_format)
    stored = stored.view(batch, pages, heads, page_size, dim).permute(0, 2, 1, 3, 4).reshape(batch, heads, -1, dim)
    t[:, :, first:] = stored[:, :, :tokens]


class RoundTripCache(DynamicCache):
    """A DynamicCache holding what ``kv_format`` pages of ``page_size`` tokens would give back (module docstring)."""

    def __init__(self, kv_format: str, page_size: int = POOL_PAGE_SIZE):
        if kv_format not in KV_FORMATS:
            raise ValueError(f"RoundTripCache.kv_format must be one of {list(KV_FORMATS)}, got {kv_format!r}")
        super().__init__()
        self.kv_format = kv_format
        self.page_size = page_size

    def update(self, key_states, value_states, layer_idx, *args, **kwargs):
        before = self.get_seq_length(layer_idx)  # 0 for a layer not written yet
        keys, values = super().update(key_states, value_states, layer_idx, *args, **kwargs)
        for stored in (keys, values):
            round_trip_tail(stored, before, self.page_size, self.kv_format)
        return keys, values


def fp8_pool(model, config, kv_format: str, tokens: int) -> KVBlockPool:
    """A KVBlockPool of fp8 pages (``kv_format`` "fp8_page" or "fp8_head") on the model's device with room for one
    request of ``tokens`` tokens: its prompt pages and its compressed view (eval methods ``rocketkv_fp8kv*``)."""
    granularity = {"fp8_page": "page", "fp8_head": "head"}[kv_format]
    device = next(model.parameters()).device
    kwargs = dict(page_size=POOL_PAGE_SIZE, dtype=FP8_DTYPE, scale_granularity=granularity, device=device,
                  kt_page_size=config.page_size, kt_dtype=config.kt_cache_dtype)
    probe = KVBlockPool(model, max_gpu_bytes=1 << 30, **kwargs)  # allocated lazily: only its page bytes are read
    pages = 2 * (-(-tokens // POOL_PAGE_SIZE)) + 8  # the prompt's pages and a view as long, with slack
    return KVBlockPool(model, max_gpu_bytes=pages * probe.bytes_per_page, **kwargs)
