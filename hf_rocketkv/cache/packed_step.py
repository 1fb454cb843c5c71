"""PackedStepCache: one forward over the decoding rows of a batch and one chunk of a prompt being prefilled.

The batching engine's decode rows are memory-bound (each step reads the weights for a few tokens) and a prefill chunk
is compute-bound, so putting both into one forward pays the weights once for both. The forward's inputs are one packed
row ``[1, D + C]``: the ``D`` decoding rows' next tokens (each at its own position), then the chunk's ``C`` prompt
tokens. Each layer's keys and values are split here: the first ``D`` go to the ``BatchedDecodeCache`` as one token per
row (``[D, Hkv, 1, d]``), the last ``C`` to the prefilling request's own ``RocketKVCache`` (``[1, Hkv, C, d]``), and the
``rocketkv`` attention function splits the queries the same way (``integration/packed_attention.py``): the decode rows
run stage 2 over their pages, the chunk attends causally over its prompt so far, so every token meets exactly the
attention it would in a forward of its own.

    step = PackedStepCache(batch, rows, cache, start, C)  # batch prepared for ``rows`` rows, no padding rows
    model(ids [1, rows + C], position_ids=[rows' next positions, start .. start + C - 1], past_key_values=step)

transformers builds the forward's masks from this cache (``get_seq_length``, ``get_mask_sizes``). For sliding-window
layers it answers as the prefilling cache would for a forward of ``C`` queries, shifted by ``D`` query columns, so the
mask's last ``C`` rows are exactly the chunk's own sliding mask; its first ``D`` rows are unused (the decode rows'
validity comes from the batch's lengths, as in any decode step). For full-attention layers it answers so that
transformers skips the mask (plain causal), and ``chunk_mask`` gives the chunk its causal mask by position (none for
a chunk that is all its keys: the whole-prompt path, as in a forward of its own); a sliding layer's mask that
transformers skips (fewer keys than the window) is rebuilt lower-right causal.

One object per forward: it holds the split keys of the layer being run and the chunk's mask (sliced once per mask
object, so the attention function's per-forward memos hold across layers).
"""

from __future__ import annotations

import torch
from transformers import Cache

from .seam import tag


class PackedLayer:
    """One model layer of a packed forward: what its ``update`` stored in each of the two caches, read once by the
    attention function (``decode_kv``: the batch layer's returned keys and values; ``chunk_kv``: the prefilling
    cache's)."""

    def __init__(self, step: "PackedStepCache", layer_idx: int):
        self.step = step
        self.layer_idx = layer_idx
        self.decode_kv: tuple[torch.Tensor, torch.Tensor] | None = None
        self.chunk_kv: tuple[torch.Tensor, torch.Tensor] | None = None

    @property
    def rows(self) -> int:
        return self.step.rows

    def stored(self, decode_kv: tuple[torch.Tensor, torch.Tensor], chunk_kv: tuple[torch.Tensor, torch.Tensor]) -> None:
        """What this forward's ``update`` returned from each cache."""
        self.decode_kv, self.chunk_kv = decode_kv, chunk_kv

    def take(self) -> tuple[tuple[torch.Tensor, torch.Tensor], tuple[torch.Tensor, torch.Tensor]]:
        """The two caches' keys and values of this forward, handed once (a second call raises)."""
        if self.decode_kv is None or self.chunk_kv is None:
            raise RuntimeError(f"PackedStepCache layer {self.layer_idx}: attention ran without an update first")
        kv = self.decode_kv, self.chunk_kv
        self.decode_kv = self.chunk_kv = None
        return kv


class PackedStepCache(Cache):
    """The ``past_key_values`` of one packed forward (see the module docstring).

    Args:
        batch: the engine's ``BatchedDecodeCache``, prepared for exactly ``rows`` rows (``prepare(rows, rows)``).
        rows: decoding rows ``D`` (>= 1), the first ``D`` tokens of the forward.
        cache: the prefilling request's ``RocketKVCache`` (batch 1, inside its prefill context).
        start: prompt tokens already in ``cache`` (the chunk's first position).
        tokens: the chunk's prompt tokens ``C``.
    """

    def __init__(self, batch, rows: int, cache, start: int, tokens: int):
        if rows < 1:
            raise ValueError(f"PackedStepCache needs at least one decoding row, got {rows}")
        if len(cache.layers) != len(batch.layers):  # the masks are sized from the prefilling cache's layer kinds
            raise ValueError(f"PackedStepCache: the prefilling cache has {len(cache.layers)} layers and the batch "
                             f"{len(batch.layers)}; build it with the model's config (RocketKVCache(config, pool=pool, "
                             f"model_config=model.config)) so each layer's kind is known before its first chunk")
        super().__init__(layers=[])
        self.batch, self.rows, self.cache, self.start, self.tokens = batch, rows, cache, start, tokens
        self.packed = [PackedLayer(self, i) for i in range(len(batch.layers))]
        self._masks: dict[tuple, tuple[torch.Tensor | None, torch.Tensor | None]] = {}

    # ------------------------------------------------------------------------------------------ Cache interface
    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, layer_idx: int, *args, **kwargs):
        """``[1, Hkv, D + C, d]`` keys and values: the first ``D`` one per decoding row into the batch, the rest into
        the prefilling cache. Returns the packed keys themselves, tagged with this layer's ``PackedLayer`` (the
        attention function finds both halves there)."""
        if key_states.shape[0] != 1 or key_states.shape[2] != self.rows + self.tokens:
            raise ValueError(f"PackedStepCache: the forward must be one packed row of {self.rows} decode tokens and "
                             f"{self.tokens} prompt tokens, got keys of shape {tuple(key_states.shape)}")
        d = self.rows
        layer = self.packed[layer_idx]
        layer.stored(self.batch.update(_one_per_row(key_states[0, :, :d]), _one_per_row(value_states[0, :, :d]),
                                       layer_idx),
                     self.cache.update(key_states[:, :, d:], value_states[:, :, d:], layer_idx))
        marker = key_states[:, :, :0]  # a fresh tensor per call, tagged with this forward's layer
        tag(marker, layer)
        return marker, value_states[:, :, :0]

    def get_seq_length(self, layer_idx: int = 0) -> int:
        """The first query's position as transformers' mask code counts it (``get_query_offset`` asks this): the
        chunk's start, ``D`` columns back."""
        return self.start - self.rows

    def get_mask_sizes(self, query_length, layer_idx: int = 0) -> tuple[int, int]:
        """A sliding-window layer: the prefilling cache's answer for the chunk's ``C = query_length - D`` queries
        (its mask's last ``C`` rows are the chunk's window). A full-attention layer: as many keys as queries, so
        transformers skips that mask (plain causal, nothing materialised: ``[D + C, L]`` booleans for a 16k chunk are
        256 MB, and a sliced mask would send the chunk off cuDNN's whole-prompt path); ``chunk_mask`` builds the
        chunk's own."""
        if self._sliding(layer_idx):
            return self.cache.get_mask_sizes(query_length - self.rows, layer_idx)
        return query_length, 0

    def _sliding(self, layer_idx: int) -> bool:
        sliding = self.cache.is_sliding
        return layer_idx < len(sliding) and bool(sliding[layer_idx])

    @property
    def is_sliding(self) -> list[bool]:
        return list(self.cache.is_sliding)

    # the prefilling cache's other per-layer answers to transformers' mask code (newer releases): the chunk's
    # layers are the ones its masks describe
    @property
    def is_linear(self) -> list[bool]:
        return list(getattr(self.cache, "is_linear", [False] * len(self.cache.layers)))

    @property
    def is_dummy(self) -> list[bool]:
        return list(getattr(self.cache, "is_dummy", [False] * len(self.cache.layers)))

    @property
    def is_compileable(self) -> bool:
        return False

    def __len__(self) -> int:
        return len(self.packed)

    # ------------------------------------------------------------------------------------------ the chunk's mask
    def chunk_mask(self, attention_mask: torch.Tensor | None, kv_length: int, layer_idx: int) -> torch.Tensor | None:
        """The chunk's mask ``[1, 1, C, kv_length]`` at layer ``layer_idx`` from the packed forward's: its last ``C``
        rows where transformers built one (a sliding-window layer), else causal by position. A full-attention
        layer's key column ``k`` is position ``k``, so query ``j`` (position ``start + j``) sees columns up to
        ``start + j``: lower-right causal when the chunk's keys end with it, and the later columns of a prefix hit
        that a chunk replays stay hidden. A sliding layer whose mask transformers skipped (its keys fewer than its
        window) holds the positions just before the chunk's, so lower-right causal. None when the chunk is all the
        keys (square causal, as in a forward of its own). One object per mask, length and kind for the forward."""
        sliding = self._sliding(layer_idx)
        key = (id(attention_mask), kv_length, sliding)
        memo = self._masks.get(key)
        if memo is not None and memo[0] is attention_mask:
            return memo[1]
        first = kv_length - self.tokens if sliding else self.start  # the column of the chunk's first query
        if attention_mask is not None:
            mask = attention_mask[:, :, self.rows:]
        elif first == 0 and self.tokens == kv_length:
            mask = None
        else:
            if kv_length < first + self.tokens:
                raise RuntimeError(f"PackedStepCache: layer {layer_idx} returned {kv_length} keys for a chunk at "
                                   f"positions {self.start}..{self.start + self.tokens - 1}")
            device = self.batch.layers[0].device
            column = torch.arange(kv_length, device=device)
            last_seen = first + torch.arange(self.tokens, device=device)
            mask = (column[None, :] <= last_seen[:, None])[None, None]
        self._masks[key] = (attention_mask, mask)
        return mask


def _one_per_row(states: torch.Tensor) -> torch.Tensor:
    """``[Hkv, D, d]`` (the packed row's first ``D`` columns) as ``[D, Hkv, 1, d]``: one token per decoding row."""
    return states.transpose(0, 1).unsqueeze(2).contiguous()
