"""RocketKVLayer: one decoder layer's KV store, in two states.

dense       from the first prompt token until stage 1 runs. Slot s holds column s of the input (left padding
            included), exactly like a DynamicLayer, so prefill attention (chunked or not) is plain causal
            attention with transformers' own mask.
compressed  after stage 1. Per row b and KV head h, slots [0, lengths[b]) hold the kept prompt tokens in
            ascending original position, then every generated token. Padding is never stored. Buffers have a
            fixed capacity (a multiple of page_size) with the KT page summaries beside them; decode writes one
            slot per row in place.

Tensors (B batch, Hkv KV heads, C capacity, P page_size, D head_dim):
    keys, values  [B, Hkv, C, D]     model dtype
    kt            [B, Hkv, C/P, 2, D] KT dtype (min, max of each page)
    positions     [B, Hkv, C]         int32 input column of each stored token (-1 = empty slot)
    lengths       [B]                 int64 tokens stored per row (every KV head holds the same count)

The layer knows nothing of transformers' attention registry; the attention function drives it.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from transformers.cache_utils import CacheLayerMixin

from ..config import RocketKVConfig
from ..kernels.dispatch import RocketOps, get_ops
from ..selection.stage1_snapkv import snapkv_keep_slots


@dataclass
class GenerationHints:
    """What generate() tells the cache before prefill (set by hf_rocketkv's generate integration)."""

    max_length: int | None = None  # logical tokens the cache will have seen at most (prompt + new tokens)
    defer_compression: bool = False  # chunked prefill: run stage 1 at the first decode step, not after each chunk
    prefilling: bool = False  # generate()'s prefill is running (chunks must not be compiled: their shapes change)
    guards_checked: bool = False  # this generate() call's first compiled decode step has run with every guard


CROP_UNSUPPORTED = (
    "RocketKVCache cannot be cropped beyond its last decoded tokens: stage 1 evicts tokens for good, so "
    "assisted/speculative decoding (which rolls the cache back over verified candidates) is not supported. Use "
    "plain greedy, sampling or beam search."
)


def _round_up(n: int, multiple: int) -> int:
    return -(-n // multiple) * multiple


def _pad_dim2(tensor: torch.Tensor, size: int, fill) -> torch.Tensor:
    """``tensor`` with dim 2 extended to ``size`` by ``fill`` (slots or KT pages that hold no token)."""
    missing = size - tensor.shape[2]
    if missing == 0:
        return tensor
    shape = list(tensor.shape)
    shape[2] = missing
    return torch.cat([tensor, tensor.new_full(shape, fill)], dim=2)


class RocketKVLayer(CacheLayerMixin):
    # Decode is static-shape (fixed capacity, state in tensors, no host sync), so generate() may compile it;
    # prefill and stage 1 always run eagerly (generate compiles decode steps only).
    is_compileable = True
    is_sliding = False
    is_croppable = False

    def __init__(self, config: RocketKVConfig, hints: GenerationHints):
        super().__init__()
        self.config = config
        self.hints = hints
        self.keys: torch.Tensor | None = None
        self.values: torch.Tensor | None = None
        self.kt: torch.Tensor | None = None
        self.positions: torch.Tensor | None = None
        self.lengths: torch.Tensor | None = None
        self.compressed = False
        self.seen: torch.Tensor | None = None  # 0-d int64 on the device: logical tokens seen (compile-safe)
        self.host_max_length = 0  # host mirror of lengths.max(), so decode never syncs with the GPU
        self.host_decoded = 0  # one-token decode steps appended since stage 1 last ran (what crop may remove)
        self.ops: RocketOps | None = None
        # dense state only: the padding offset of each row and the latest window of queries
        self.row_start: torch.Tensor | None = None
        self.pending_queries: torch.Tensor | None = None

    # ------------------------------------------------------------------------------------------ lifecycle
    def lazy_initialization(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        """Sizes come from the first K/V seen, so tensor-parallel shards and device maps need nothing special."""
        self.dtype, self.device = key_states.dtype, key_states.device
        self.ops = get_ops(self.config.backend, self.device)
        self.keys = key_states.new_empty((key_states.shape[0], key_states.shape[1], 0, key_states.shape[3]))
        self.values = value_states.new_empty((value_states.shape[0], value_states.shape[1], 0, value_states.shape[3]))
        self.seen = torch.zeros((), dtype=torch.long, device=self.device)
        self.is_initialized = True

    def reset(self) -> None:
        self.__init__(self.config, self.hints)

    @property
    def batch_size(self) -> int:
        if not self.is_initialized:
            raise AttributeError("batch_size")  # Cache.batch_size skips layers without it
        return self.keys.shape[0]

    # ------------------------------------------------------------------------------------------ sizes
    def get_seq_length(self) -> int:
        """Logical tokens seen (positions of new tokens continue from here), not tokens stored."""
        return int(self.seen) if self.is_initialized else 0

    def get_max_length(self) -> int:
        return -1

    def get_mask_sizes(self, query_length: int) -> tuple[int, int]:
        if not self.compressed:
            # dense: the mask covers the stored columns plus the new ones, exactly like a DynamicLayer
            return (self.keys.shape[2] if self.is_initialized else 0) + query_length, 0
        # Compressed: the attention function builds validity from `lengths` and ignores the mask, so its size only
        # has to stay constant across decode steps (a changing mask shape would recompile a compiled decode step).
        if self.hints.max_length is not None:
            return self.hints.max_length + 1, 0
        return self.get_seq_length() + query_length, 0

    def kept_tokens(self) -> torch.Tensor:
        """Tokens physically stored, ``[B, Hkv]`` (padding excluded once compressed)."""
        if not self.is_initialized:
            return torch.zeros(0, 0, dtype=torch.long)
        if not self.compressed:
            stored = self.keys.shape[2] - self.row_start if self.row_start is not None else self.keys.shape[2]
            stored = torch.as_tensor(stored, device=self.device).expand(self.keys.shape[0])
            return stored[:, None].expand(-1, self.keys.shape[1]).clone()
        return self.lengths[:, None].expand(-1, self.keys.shape[1]).clone()

    def memory_bytes(self) -> int:
        tensors = (self.keys, self.values, self.kt, self.positions, self.lengths, self.pending_queries, self.row_start)
        return sum(t.numel() * t.element_size() for t in tensors if t is not None)

    @property
    def capacity(self) -> int:
        return self.keys.shape[2] if self.keys is not None else 0

    # ------------------------------------------------------------------------------------------ update
    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args, **kwargs):
        """Store the new tokens; returns the K/V a dense attention would use (the dense buffers while dense)."""
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)
        query_length = key_states.shape[2]
        self.seen.add_(query_length)
        if not self.compressed:
            first = self.keys.shape[2] == 0
            self.keys = key_states if first else torch.cat([self.keys, key_states], dim=-2)
            self.values = value_states if first else torch.cat([self.values, value_states], dim=-2)
            return self.keys, self.values
        if query_length == 1:
            self._append_one(key_states, value_states)
        else:
            self._append_many(key_states, value_states)
        return self.keys, self.values

    def _append_one(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        """Decode: write slot lengths[b] of every row in place and fold the key into its KT page.

        No host sync and no shape change, so a compiled decode step replays as one CUDA graph. Capacity comes from
        generate()'s max_length; in eager mode the store grows when a caller runs past it.
        """
        if not torch.compiler.is_compiling():  # compiled steps: integration/compiled_decode.py counts on the host
            self._ensure_capacity(1)
            self.note_decode_step()
        self.ops.append_token(
            self.keys, self.values, self.positions, self.kt, self.lengths, self.seen,
            key_states[:, :, 0], value_states[:, :, 0], self.config.page_size,
        )

    def note_decode_step(self) -> None:
        self.host_max_length += 1
        self.host_decoded += 1

    def _append_many(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        """A multi-token forward on a compressed layer (a later turn): append after each row's tokens."""
        n = key_states.shape[2]
        # a sync, but this is a multi-token forward: the mirror may be stale after compiled decode steps driven
        # outside generate() (user-compiled loops), and a stale one would under-size the store
        self.host_max_length = int(self.lengths.max())
        self._ensure_capacity(n)
        offsets = torch.arange(n, device=self.device)
        slots = (self.lengths[:, None] + offsets[None, :])[:, None, :, None]  # [B, 1, n, 1]
        self.keys.scatter_(2, slots.expand_as(key_states), key_states)
        self.values.scatter_(2, slots.expand_as(value_states), value_states)
        columns = (self.seen - n + offsets).to(torch.int32).expand(*self.positions.shape[:2], n)
        self.positions.scatter_(2, slots[..., 0].expand_as(columns), columns)
        self.lengths.add_(n)
        self.host_max_length += n  # every row took n tokens: no second sync
        self.kt = self.ops.build_kt(self.keys, self.lengths, self.config.page_size, self.config.kt_torch_dtype)

    def _ensure_capacity(self, extra: int) -> None:
        """Grow the compressed store (eager mode) so that every row can take ``extra`` more tokens."""
        needed = self.host_max_length + extra
        if needed <= self.capacity:
            return
        new_capacity = _round_up(needed + self._headroom(), self.config.page_size)
        grow = new_capacity - self.capacity
        batch, heads, _, dim = self.keys.shape
        self.keys = torch.cat([self.keys, self.keys.new_zeros(batch, heads, grow, dim)], dim=2)
        self.values = torch.cat([self.values, self.values.new_zeros(batch, heads, grow, dim)], dim=2)
        self.positions = torch.cat([self.positions, self.positions.new_full((batch, heads, grow), -1)], dim=2)
        pages = grow // self.config.page_size
        self.kt = torch.cat([self.kt, self.kt.new_zeros(batch, heads, pages, 2, dim)], dim=2)
        self._mark_static()

    def _headroom(self) -> int:
        """Slots for tokens still to come: from generate()'s max_length when known, else the config's headroom."""
        seen = self.get_seq_length()
        if self.hints.max_length is not None and self.hints.max_length > seen:
            return self.hints.max_length - seen
        return self.config.capacity_headroom

    # ------------------------------------------------------------------------------------------ stage 1
    def observe_prefill(self, query_states: torch.Tensor, row_start: torch.Tensor | None, scaling: float) -> None:
        """Remember the last window_size queries and each row's padding offset.

        With chunked prefill the offset comes from the latest chunk: its mask covers every column so far, while an
        earlier chunk may lie entirely inside a row's left padding (and then under-counts it).
        """
        self.scaling = scaling
        window = self.config.window_size
        if self.pending_queries is not None and query_states.shape[2] < window:
            query_states = torch.cat([self.pending_queries, query_states], dim=2)
        self.pending_queries = query_states[:, :, -window:].detach()
        if row_start is not None or self.row_start is None:
            batch = query_states.shape[0]
            self.row_start = row_start if row_start is not None else torch.zeros(batch, dtype=torch.long, device=self.device)

    def finish_prefill(self) -> None:
        """Run the stage 1 that chunked prefill deferred (no-op when already compressed or never prefilled)."""
        if not self.compressed and self.pending_queries is not None:
            self.compress()

    def compress(self) -> None:
        """Stage 1: keep each row's best ``prompt_budget`` tokens per KV head, release the rest, build the KT."""
        q_window = self.pending_queries
        if self.compressed:
            start = torch.zeros_like(self.lengths)
            end = self.lengths
            columns = self.positions
        else:
            start = self.row_start
            end = torch.full_like(self.row_start, self.keys.shape[2])
            columns = None
        kept = snapkv_keep_slots(
            q_window,
            self.keys,
            start,
            end,
            window_size=q_window.shape[2],
            prompt_budget=self.config.prompt_budget,
            kernel_size=self.config.kernel_size,
            scaling=self.scaling,
            scores_fn=self.ops.window_scores,
        )
        self._compact(kept, columns)
        self.pending_queries = None
        self.row_start = None

    def _compact(self, kept: list[torch.Tensor], columns: torch.Tensor | None) -> None:
        """Gather the kept slots of every row into fresh buffers; the old ones are released."""
        batch, heads, _, dim = self.keys.shape
        counts = [k.shape[1] for k in kept]
        capacity = _round_up(max(max(counts), 1) + self._headroom(), self.config.page_size)
        keys = self.keys.new_zeros(batch, heads, capacity, dim)
        values = self.values.new_zeros(batch, heads, capacity, dim)
        positions = torch.full((batch, heads, capacity), -1, dtype=torch.int32, device=self.device)
        for b, slots in enumerate(kept):
            n = slots.shape[1]
            idx = slots[:, :, None].expand(heads, n, dim)
            keys[b, :, :n] = self.keys[b].gather(1, idx)
            values[b, :, :n] = self.values[b].gather(1, idx)
            positions[b, :, :n] = (columns[b].gather(1, slots) if columns is not None else slots).to(torch.int32)
        self.keys, self.values, self.positions = keys, values, positions
        self.lengths = torch.tensor(counts, dtype=torch.long, device=self.device)
        self.host_max_length = max(counts)
        self.host_decoded = 0
        self.kt = self.ops.build_kt(self.keys, self.lengths, self.config.page_size, self.config.kt_torch_dtype)
        self.compressed = True
        self._mark_static()

    @classmethod
    def stack_rows(cls, parts: list["RocketKVLayer"], hints: GenerationHints) -> "RocketKVLayer":
        """One compressed layer holding the rows of ``parts`` in order (row-group prefill, then batched decode).

        The parts saw the same input columns (one padded batch), so they share ``seen``; capacities may differ
        (rows shorter than the budget keep fewer tokens), so every part is padded with empty slots to the largest.
        """
        first = parts[0]
        if not all(part.compressed for part in parts):
            raise RuntimeError("RocketKVLayer.stack_rows needs compressed layers (stage 1 done on every row group)")
        capacity = max(part.capacity for part in parts)
        pages = capacity // first.config.page_size
        layer = cls(first.config, hints)
        layer.dtype, layer.device, layer.ops, layer.scaling = first.dtype, first.device, first.ops, first.scaling
        layer.keys = torch.cat([_pad_dim2(part.keys, capacity, 0) for part in parts])
        layer.values = torch.cat([_pad_dim2(part.values, capacity, 0) for part in parts])
        layer.positions = torch.cat([_pad_dim2(part.positions, capacity, -1) for part in parts])
        layer.kt = torch.cat([_pad_dim2(part.kt, pages, 0) for part in parts])
        layer.lengths = torch.cat([part.lengths for part in parts])
        layer.seen = first.seen.clone()
        layer.host_max_length = max(part.host_max_length for part in parts)
        layer.compressed = layer.is_initialized = True
        layer._mark_static()
        return layer

    def _mark_static(self) -> None:
        """Fixed addresses for CUDA graphs: decode mutates these tensors in place and never reallocates them."""
        if torch.compiler.is_compiling():
            return
        for tensor in (self.keys, self.values, self.kt, self.positions, self.lengths, self.seen):
            torch._dynamo.mark_static_address(tensor)

    # ------------------------------------------------------------------------------------------ generate hooks
    def _index_batch(self, index: torch.Tensor, in_place: bool = False) -> None:
        for name in ("keys", "values", "kt", "positions", "lengths", "pending_queries", "row_start"):
            tensor = getattr(self, name)
            if tensor is None:
                continue
            selected = tensor.index_select(0, index.to(tensor.device))
            if in_place and self.compressed:
                tensor.copy_(selected)  # beam search reorders every step: keep the buffers' addresses
            else:
                setattr(self, name, selected)

    def reorder_cache(self, beam_idx: torch.LongTensor) -> None:
        if self.is_initialized:
            self._index_batch(beam_idx, in_place=True)

    def batch_repeat_interleave(self, repeats: int) -> None:
        if self.is_initialized:
            self._index_batch(torch.arange(self.keys.shape[0], device=self.device).repeat_interleave(repeats))

    def batch_select_indices(self, indices: torch.Tensor) -> None:
        if self.is_initialized:
            self._index_batch(indices)

    def crop(self, tokens_to_remove: int) -> None:
        """Remove the last ``-tokens_to_remove`` decoded tokens, restoring the state before those decode steps.

        generate()'s deferred stop check (``deferred_stop_check``) runs one decode step past an EOS stop and undoes it
        with ``crop(-1)``; ``crop(0)`` is a no-op. Evicted prompt tokens cannot come back, so a positive value (the
        legacy absolute length), more tokens than were decoded since stage 1, or a dense layer raise.
        """
        if tokens_to_remove > 0:
            raise NotImplementedError(CROP_UNSUPPORTED)
        if tokens_to_remove == 0 or not self.is_initialized:
            return
        count = -tokens_to_remove
        if not self.compressed or count > self.host_decoded:
            raise NotImplementedError(CROP_UNSUPPORTED)
        rows = torch.arange(self.keys.shape[0], device=self.device)
        for _ in range(count):
            self.lengths.sub_(1)
            slot = self.lengths
            self.keys[rows, :, slot] = 0
            self.values[rows, :, slot] = 0
            self.positions[rows, :, slot] = -1
        self.seen.sub_(count)
        self.host_max_length -= count
        self.host_decoded -= count
        # a page's min/max cannot be un-folded: rebuild the summaries of what is left (in place: fixed addresses)
        self.kt.copy_(self.ops.build_kt(self.keys, self.lengths, self.config.page_size, self.config.kt_torch_dtype))

    def offload(self):
        raise NotImplementedError("RocketKVCache does not support offloading=True")

    prefetch = offload
