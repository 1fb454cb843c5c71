"""SnapKV (RocketKV's stage 1, TensorRT-LLM semantics): window attention, group sum, max-pooling.

Score of prefix slot j for KV head h: the fp32 softmax attention of the observation-window queries over every valid
key (causal inside the window), summed over the window and over the G query heads of h, then max-pooled over the
row's prefix ``[start, end - w_b)`` with ``kernel_size`` (stride 1, same length). The top ``budget - w_b`` prefix
slots plus the window are kept (spec §2). With ``window_len`` a row scores with its last ``window_len[b]`` queries
only. Cost: O(B Hq w N D) for the scores, one ``[B, Hq, w, N]`` fp32 buffer.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, ClassVar

import torch

from ..selection.stage1_snapkv import pooled_prefix_scores, window_scores
from .base import KeptSlots, Stage1Inputs, select_by_scores


@dataclass(frozen=True)
class SnapKVPolicy:
    """SnapKV with per-KV-head selection (RocketKV / TensorRT-LLM).

    Parameters
    ----------
    kernel_size : int
        Odd width of the max-pooling over the group-summed window scores (63 in RocketKV).
    scores_fn : callable, optional
        ``(q_window, keys, start, end, scaling) -> [B, Hkv, N]`` fp32 window scores; None is the PyTorch reference
        ``selection.stage1_snapkv.window_scores``. The cache passes its backend's twin (the Triton kernel on CUDA).
    """

    kernel_size: int = 63
    scores_fn: Callable | None = None
    name: ClassVar[str] = "snapkv"

    def __post_init__(self) -> None:
        if not isinstance(self.kernel_size, int) or self.kernel_size < 1 or self.kernel_size % 2 == 0:
            raise ValueError(f"SnapKVPolicy.kernel_size must be an odd integer >= 1, got {self.kernel_size!r}")

    def raw_scores(self, inputs: Stage1Inputs) -> torch.Tensor:
        """Window scores before pooling, fp32 ``[B, Hkv, N]``; rows with a shorter ``window_len`` are scored with
        their real queries only (rows sharing a window length share one call)."""
        scores_fn = self.scores_fn if self.scores_fn is not None else window_scores
        q, w = inputs.q_window, inputs.window
        if inputs.window_len is None:
            return scores_fn(q, inputs.keys, inputs.start, inputs.end, inputs.scaling)
        lengths = [n for _, _, n in inputs.rows()]
        if len(set(lengths)) == 1 and lengths[0] > 0:  # one window length: no row gather (the usual prefill)
            n = lengths[0]
            return scores_fn(q[:, :, w - n :], inputs.keys, inputs.start, inputs.end, inputs.scaling)
        out = torch.zeros(inputs.keys.shape[:3], dtype=torch.float32, device=inputs.keys.device)
        for n in sorted(set(lengths)):
            if n == 0:
                continue  # no real query: the row scores 0 everywhere
            rows = torch.tensor([b for b, m in enumerate(lengths) if m == n], device=inputs.keys.device)
            keys, start, end = inputs.keys[rows], inputs.start[rows], inputs.end[rows]
            out[rows] = scores_fn(q[rows][:, :, w - n :], keys, start, end, inputs.scaling)
        return out

    def score(self, inputs: Stage1Inputs) -> torch.Tensor:
        """Max-pooled window scores ``[B, Hkv, N]``: each row's prefix ``[start, end - w_b)`` is pooled on its own
        (pooling never looks across the prefix edges); other slots are -inf, and so is every slot of a row of at most
        ``budget`` tokens (kept whole, never scored)."""
        raw = self.raw_scores(inputs)
        pooled = torch.full_like(raw, float("-inf"))
        for b, (s, e, w) in enumerate(inputs.rows()):
            if e - s > inputs.budget:
                pooled[b, :, s : e - w] = pooled_prefix_scores(raw[b, :, s : e - w], self.kernel_size)
        return pooled

    def select(self, inputs: Stage1Inputs) -> list[KeptSlots]:
        return select_by_scores(inputs, self.score, "SnapKVPolicy.score")
