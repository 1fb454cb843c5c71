"""The one dispatch point between RocketKV's algorithm and its implementations.

``get_ops(backend, device)`` returns a ``RocketOps`` bundle. Every op has the same signature in every backend:
the PyTorch reference twins live in ``hf_rocketkv/selection`` and beside each Triton kernel, the Triton kernels
in this folder. "auto" picks Triton on CUDA and the reference elsewhere.
"""

from __future__ import annotations

import functools
import os
from dataclasses import dataclass
from typing import Callable

import torch

from ..selection import stage1_snapkv, stage2_pages
from .sparse_decode_attention import sparse_decode_attention_torch


@dataclass(frozen=True)
class RocketOps:
    """Every hot op of both stages; see each reference for shapes.

    window_scores(q_window, keys, start, end, scaling) -> [B, Hkv, N] fp32        (stage 1, prefill)
    build_kt(keys, lengths, page_size, kt_dtype) -> kt [B, Hkv, C/P, 2, D]         (after stage 1)
    update_kt(kt, key_new, slot, page_size) -> None (in place)
    page_scores(q, kt, n_pages, topr) -> probs [B, Hkv, NP]
    select_pages(probs, n_pages, topk) -> (page_idx, page_valid)
    sparse_decode_attention(q, keys, values, page_idx, page_valid, lengths, page_size, scaling) -> [B, Hkv, G, D]
    """

    name: str
    window_scores: Callable
    build_kt: Callable
    update_kt: Callable
    page_scores: Callable
    select_pages: Callable
    sparse_decode_attention: Callable


TORCH_OPS = RocketOps(
    name="torch",
    window_scores=stage1_snapkv.window_scores,
    build_kt=stage2_pages.build_kt,
    update_kt=stage2_pages.update_kt,
    page_scores=stage2_pages.page_scores,
    select_pages=stage2_pages.select_pages,
    sparse_decode_attention=sparse_decode_attention_torch,
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
