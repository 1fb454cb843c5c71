"""Decode-time compression on one layer (``RocketKVConfig.decode_budget``): where its generated tokens start, the ring
buffer of the latest decode queries, and when and how the generated tokens are compressed in place (the scoring is
``policies/decode_compression.py``).

State (B batch, Hq query heads, Hkv KV heads, D head_dim, w = decode_window):
    gen_start       [B] / [B, Hkv] int64  first generated slot of each row (= lengths after stage 1)
    decode_queries  [B, Hq, w, D]         the last w decode queries (post-RoPE), oldest first
    host_generated  generated tokens stored since stage 1 or the last compression (the same in every row)
"""

from __future__ import annotations

import torch

from ..policies.decode_compression import DecodeCompression, move_kept
from ..selection.stage2_pages import per_head
from .row_index import selected_rows


def decode_compression(config) -> DecodeCompression | None:
    """The decode-time compression settings of ``config`` (its ``decode_*`` fields), None when decode_budget is
    None."""
    if config.decode_budget is None:
        return None
    return DecodeCompression(config.decode_budget, config.decode_interval, config.decode_window,
                             config.decode_kernel_size)


class GeneratedTokens:
    """One layer's generated-token state (module docstring). ``settings``: the DecodeCompression, None when off
    (then only ``host_generated`` is kept). Methods take the layer they serve; this object holds no reference to it."""

    ROW_TENSORS = ("gen_start", "decode_queries")

    def __init__(self, settings: DecodeCompression | None) -> None:
        self.settings = settings
        self.gen_start: torch.Tensor | None = None
        self.decode_queries: torch.Tensor | None = None
        self.host_generated = 0

    def start(self, layer, queries: torch.Tensor | None = None) -> None:
        """After a stage 1: generated tokens start at each row's current length; the query ring buffer is allocated
        once (fixed address, written in place by every decode step). Its head count comes from an earlier buffer
        (a later turn), else from ``queries`` ``[B, Hq, *, D]`` (stage 1's window, or a stacked part's buffer)."""
        self.host_generated = 0
        if self.settings is None:
            return
        self.gen_start = layer.lengths.clone()
        held = self.decode_queries if self.decode_queries is not None else queries
        batch = layer.lengths.shape[0]
        shape = (batch, held.shape[1], self.settings.window, layer.head_dim)
        if self.decode_queries is None or tuple(self.decode_queries.shape) != shape:
            self.decode_queries = torch.zeros(shape, dtype=layer.dtype, device=layer.device)
        else:
            self.decode_queries.zero_()

    def record(self, query: torch.Tensor) -> None:
        """Push a decode step's query ``[B, Hq, 1, D]`` into the ring buffer (shift by one, in place; fixed shapes,
        so it runs inside compiled and graphed steps). No-op when decode-time compression is off."""
        if self.decode_queries is None:
            return
        self.decode_queries.copy_(torch.cat([self.decode_queries[:, :, 1:], query.to(self.decode_queries.dtype)],
                                            dim=2))

    def due(self, layer) -> bool:
        """Host side, before a one-token decode step stores its token: whether the generated tokens are to be
        compressed now (``decode_budget + decode_interval`` of them are stored)."""
        if self.settings is None or not layer.compressed or layer.working:
            return False
        return self.settings.due(self.host_generated)

    def note_stored(self, count: int) -> None:
        """``count`` generated tokens were stored (a decode step: 1), or removed (a crop: negative)."""
        self.host_generated += count

    def compress(self, layer) -> int:
        """Keep ``decode_budget`` generated tokens per row and KV head: the newest ``decode_window`` and the
        best-scoring others, moved to slots ``gen_start ..`` in ascending order with their positions; emptied slots
        are cleared and the KT of every page is rebuilt from the kept keys. In place in the layer's pages (fixed
        addresses: captured decode graphs stay valid; a pool's view pages are the request's own, so nothing is
        allocated or freed).

        Shapes: keys/values gathered ``[B, Hkv, C, D]``; kept slots ``[B, Hkv, M]``; positions ``[B, Hkv, C]``.
        Returns how many tokens each row lost (the layer lowers its host mirrors by it).
        """
        settings = self.settings
        keys, values = layer.store.gather()
        slots, lengths = settings.select(self.decode_queries, keys, layer.lengths, self.gen_start, layer.scaling)
        for tensor in (keys, values, layer.positions):
            move_kept(tensor, slots, self.gen_start)
        stored = per_head(lengths, keys.shape[0], keys.shape[1])  # [B, Hkv]
        empty = torch.arange(keys.shape[2], device=layer.device) >= stored[..., None]  # [B, Hkv, C]
        keys.masked_fill_(empty[..., None], 0)
        values.masked_fill_(empty[..., None], 0)
        layer.positions.masked_fill_(empty, -1)
        layer.lengths.copy_(lengths)
        kt = layer.ops.build_kt(keys, layer.lengths, layer.config.page_size, layer.config.kt_torch_dtype)
        layer.store.write(keys, values, kt)
        removed = self.host_generated - settings.budget
        self.host_generated = settings.budget
        return removed

    def select_rows(self, index: torch.Tensor, in_place: bool) -> None:
        """Rows ``index`` of the per-row state (beam reorder, batch select)."""
        tensors = selected_rows([getattr(self, name) for name in self.ROW_TENSORS], index, in_place)
        for name, tensor in zip(self.ROW_TENSORS, tensors):
            setattr(self, name, tensor)

    def tensors(self) -> tuple[torch.Tensor | None, ...]:
        """The device tensors this state holds (memory accounting, static addresses)."""
        return self.gen_start, self.decode_queries
