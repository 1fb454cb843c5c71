"""How many rows one prefill forward may hold: generate()'s automatic row groups.

A prefill forward of ``rows x tokens`` holds one layer's activations (above all the MLP's ``[rows, tokens,
intermediate]`` tensors) and that layer's dense K/V until stage 1 compresses it; these grow with the rows the forward
holds. What stays after a row's prefill is its compressed cache (``prompt_budget`` tokens per layer, plus the room
for the new tokens), and stacking the groups' caches into the batch's holds it twice for a moment. So a batch whose
one-forward prefill would not fit in the free memory is prefilled in groups of rows (``RocketKVConfig.
prefill_batch_size``, the same tokens as one forward: each row's attention and stage 1 never look at other rows).

The rule (:func:`plan_prefill_rows`), all in bytes:

    forward(r) = r x tokens x ((8 x hidden + 4 x intermediate x experts per token) x dtype + 2 x layer K/V per token)
    kept       = batch x kept_per_row (the rows' compressed caches, all held by the time the last group runs)
    rows       = the largest r with forward(r) + kept <= fraction x free; the whole batch when that is all of it

then spread evenly: ``ceil(batch / groups)`` rows per forward for the fewest groups. Stacking the groups' caches
holds ``kept`` twice for a moment; when even that exceeds ``fraction x free``, or one row's forward does not fit
beside ``kept``, one row per forward is attempted anyway (the estimate is deliberately high) and the plan says so.
The activation count is the same generous one as the pool's prefill reserve (``sizing.prefill_reserve_bytes``);
``fraction`` (0.8) leaves the rest for the allocator's fragmentation, the decode step's workspace and CUDA graphs.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import torch

from .sizing import GIB, host_available

PREFILL_FRACTION = 0.8  # of the free memory, for the prefill's peak and the kept caches


@dataclass(frozen=True)
class PrefillShapes:
    """What one token of a prefill costs, per row, read from a model's (text) config and dtype."""

    activation_bytes: int  # one token's activations in one layer's forward: (8 x hidden + 4 x intermediate) x dtype
    layer_kv_bytes: int  # one token's dense K and V in one layer: 2 x kv_heads x head_dim x dtype
    layers: int

    @classmethod
    def of(cls, config: Any, dtype_bytes: int) -> PrefillShapes:
        """From a transformers (text) config: ``hidden_size``, ``intermediate_size`` (4 x hidden when absent; times
        ``num_experts_per_tok`` for a mixture of experts), heads, ``head_dim`` and ``num_hidden_layers``."""
        missing = [name for name in ("hidden_size", "num_attention_heads", "num_hidden_layers")
                   if not isinstance(getattr(config, name, None), int)]
        if missing:
            raise ValueError(f"the model config {type(config).__name__} names no integer {', '.join(missing)}: the "
                             f"prefill's memory cannot be estimated")
        hidden, heads = config.hidden_size, config.num_attention_heads
        kv_heads = int(getattr(config, "num_key_value_heads", None) or heads)
        head_dim = int(getattr(config, "head_dim", None) or hidden // heads)
        intermediate = int(getattr(config, "intermediate_size", None) or 4 * hidden)
        experts = int(getattr(config, "num_experts_per_tok", None) or 1)
        return cls(activation_bytes=(8 * hidden + 4 * intermediate * experts) * dtype_bytes,
                   layer_kv_bytes=2 * kv_heads * head_dim * dtype_bytes, layers=config.num_hidden_layers)

    def forward_bytes(self, rows: int, tokens: int) -> int:
        """Peak of one prefill forward of ``rows x tokens`` outside the kept caches: its activations in one layer and
        the dense K/V of two layers (the one being compressed and the next)."""
        return rows * tokens * (self.activation_bytes + 2 * self.layer_kv_bytes)


@dataclass(frozen=True)
class PrefillRows:
    """The rows per prefill forward chosen for a batch, and why (:meth:`describe`)."""

    rows: int | None  # rows per forward; None: the whole batch in one forward
    batch: int
    tokens: int
    need: int  # bytes a one-forward prefill of the whole batch needs (its forward and the kept caches)
    free: int  # free bytes the rule read
    device: str
    fits_one_row: bool = True  # False: one row per forward, or stacking the kept caches, exceeds the estimate

    @property
    def groups(self) -> int:
        return 1 if self.rows is None else math.ceil(self.batch / self.rows)

    def describe(self) -> str:
        """E.g. ``prefill of 64 rows x 32768 tokens in 6 forwards of 11 rows: one forward of the whole batch needs
        ~390.5 GiB, 0.8 of the 121.0 GiB free on cuda:0 allows 11``."""
        if self.rows is None:
            return (f"prefill of {self.batch} rows x {self.tokens} tokens in one forward (~{self.need / GIB:.1f} GiB "
                    f"of the {self.free / GIB:.1f} GiB free on {self.device})")
        allows = (f"{PREFILL_FRACTION:g} of the {self.free / GIB:.1f} GiB free on {self.device} allows "
                  f"{self.rows}" if self.fits_one_row else
                  f"not even one row fits the estimate in {PREFILL_FRACTION:g} of the {self.free / GIB:.1f} GiB free "
                  f"on {self.device} (beside the kept caches, or them twice while stacking): one row per forward is "
                  f"attempted")
        return (f"prefill of {self.batch} rows x {self.tokens} tokens in {self.groups} forwards of {self.rows} rows: "
                f"one forward of the whole batch needs ~{self.need / GIB:.1f} GiB, {allows}")


def plan_prefill_rows(shapes: PrefillShapes, batch: int, tokens: int, kept_per_row: int, free: int,
                      device: str = "cuda") -> PrefillRows:
    """The rows per prefill forward of the rule (module docstring) for ``batch`` rows of ``tokens`` tokens, each
    keeping ``kept_per_row`` bytes after its prefill (0 for a pool-backed cache: its pages are already allocated),
    with ``free`` bytes free on ``device``."""
    for name, value in (("batch", batch), ("tokens", tokens)):
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ValueError(f"plan_prefill_rows: {name} must be an integer >= 1, got {value!r}")
    for name, value in (("kept_per_row", kept_per_row), ("free", free)):
        if isinstance(value, bool) or not isinstance(value, int) or value < 0:
            raise ValueError(f"plan_prefill_rows: {name} must be an integer number of bytes >= 0, got {value!r}")
    kept = batch * kept_per_row
    need = shapes.forward_bytes(batch, tokens) + kept
    allowed = int(PREFILL_FRACTION * free)
    if need <= allowed:
        return PrefillRows(None, batch, tokens, need, free, device)
    per_row = shapes.forward_bytes(1, tokens)
    rows = (allowed - kept) // per_row if allowed > kept else 0
    fits = rows >= 1 and 2 * kept <= allowed
    rows = max(1, min(int(rows), batch - 1))
    rows = math.ceil(batch / math.ceil(batch / rows))  # the fewest forwards, as even as they go
    return PrefillRows(rows, batch, tokens, need, free, device, fits_one_row=fits)


def free_for_prefill(device: torch.device) -> int:
    """Bytes a prefill on ``device`` can allocate now: CUDA's free device memory plus what torch's allocator holds
    unused (reserved, not allocated); the available host RAM elsewhere."""
    if device.type == "cuda":
        free, _total = torch.cuda.mem_get_info(device)
        return int(free + torch.cuda.memory_reserved(device) - torch.cuda.memory_allocated(device))
    return host_available()


__all__ = ["PREFILL_FRACTION", "PrefillRows", "PrefillShapes", "free_for_prefill", "plan_prefill_rows"]
