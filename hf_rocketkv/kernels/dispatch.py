"""The one dispatch point between RocketKV's algorithm and its implementations.

``get_ops(backend, device)`` returns a ``RocketOps`` bundle. Every op has the same signature in every backend:
the PyTorch reference twins live in ``hf_rocketkv/selection`` and beside each Triton kernel, the Triton kernels
in this folder. "auto" picks Triton on CUDA and the reference elsewhere.
"""

from __future__ import annotations

import functools
import os

import torch

from ..selection import stage1_snapkv, stage2_pages
from .fused_decode import paged_fused_decode_torch
from .append_token import append_token_torch, paged_append_kv_torch, paged_append_token_torch
from .ops import RocketOps
from .paged import paged_compact_row_torch, paged_page_scores_torch, paged_top_pages_torch
from .ring_append import ring_append_torch
from .ring_attention import ring_decode_attention_torch
from .sparse_decode_attention import paged_sparse_decode_attention_torch, sparse_decode_attention_torch

__all__ = ["RocketOps", "TORCH_OPS", "get_ops", "triton_usable"]  # RocketOps lives in ops.py, re-exported

TORCH_OPS = RocketOps(
    name="torch",
    window_scores=stage1_snapkv.window_scores,
    build_kt=stage2_pages.build_kt,
    update_kt=stage2_pages.update_kt,
    page_scores=stage2_pages.page_scores,
    select_pages=stage2_pages.select_pages,
    sparse_decode_attention=sparse_decode_attention_torch,
    append_token=append_token_torch,
    top_pages=stage2_pages.top_pages,
    paged_append_token=paged_append_token_torch,
    paged_append_kv=paged_append_kv_torch,
    paged_page_scores=paged_page_scores_torch,
    paged_top_pages=paged_top_pages_torch,
    paged_sparse_decode_attention=paged_sparse_decode_attention_torch,
    paged_fused_decode=paged_fused_decode_torch,
    paged_compact_row=paged_compact_row_torch,
    ring_decode_attention=ring_decode_attention_torch,
    ring_append=ring_append_torch,
)


def triton_usable(device: torch.device) -> bool:
    """Triton runs on CUDA, or anywhere under TRITON_INTERPRET=1 (tests)."""
    if device.type == "cuda":
        return True
    return os.environ.get("TRITON_INTERPRET") == "1"


@functools.lru_cache(maxsize=None)
def _triton_ops() -> RocketOps:
    from . import triton_ops  # imported lazily: triton is optional on CPU-only installs

    return triton_ops.TRITON_OPS


def get_ops(backend: str, device: torch.device) -> RocketOps:
    """Resolve ``RocketKVConfig.backend`` for tensors on ``device``."""
    if backend == "torch":
        return TORCH_OPS
    if backend == "auto":
        return _triton_ops() if device.type == "cuda" else TORCH_OPS
    if backend == "triton":
        if not triton_usable(device):
            raise ValueError(
                f"RocketKVConfig.backend='triton' needs a CUDA device (or TRITON_INTERPRET=1 for tests); the cache "
                f"lives on {device}. Use backend='auto' or 'torch'."
            )
        return _triton_ops()
    raise ValueError(f"RocketKVConfig.backend must be 'auto', 'torch' or 'triton', got {backend!r}")
