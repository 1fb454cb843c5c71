"""A later turn on a compressed layer: its real new tokens stored after each row's kept tokens (or keep_all's whole
history) in a contiguous working set, and the exact attention of its queries over that set.

Working set (B batch, Hkv KV heads, W slots, D head_dim): ``layer.dense.keys`` / ``dense.values`` ``[B, Hkv, W, D]``,
``layer.positions`` ``[B, Hkv, W]`` int32 (input columns, -1 empty), ``layer.lengths`` ``[B]``: row b's stored tokens
then its ``m_b`` real new ones. Stage 1 then compacts it into a fresh view (``cache/compaction.py``).
"""

from __future__ import annotations

import torch

from ..host_copy import device_tensor
from ..selection.logit_features import masked_attention
from .capacity import headroom, pad_slots, round_up
from .history import grow_history
from .paged_store import write_tokens

# refused by ``RocketKVLayer.update`` before any state changes, so the cache stays usable for decode steps
PER_HEAD_LATER_TURN = (
    "RocketKVCache: stage-1 policy {name!r} gives each KV head its own number of kept tokens, so a later turn (several "
    "new tokens on a compressed cache) with RocketKVConfig.multi_turn='evict' would re-run stage 1 over KV heads of "
    "different lengths, which is not implemented. Use multi_turn='keep_all' (each later turn re-runs stage 1 over "
    "the whole conversation, stored per row) or a uniform policy (snapkv, streaming, knorm, h2o, random)."
)


def store_new_tokens(layer, valid: torch.Tensor | None) -> None:
    """``RocketKVLayer.store_new_tokens``: the later turn's tokens staged by ``update`` (``pending_keys`` /
    ``pending_values`` ``[B, Hkv, n, D]``), padding skipped, into a contiguous working set.

    ``valid`` bool ``[B, n]`` marks the real new tokens (None = all real). The working set starts from the stored
    tokens (the view; with ``multi_turn="keep_all"``, every token of the conversation so far); row b then takes its
    ``m_b`` real tokens, in order, at slots ``lengths[b] .. lengths[b] + m_b - 1``, so attention and stage 1 see
    exactly what a run of that row alone sees.
    """
    key_states, value_states = layer.take_pending()
    batch, _, n, _ = key_states.shape
    columns = [torch.arange(n, device=layer.device)] * batch if valid is None else [
        row.nonzero()[:, 0] for row in valid
    ]
    keys, values, positions, lengths = _working_source(layer)
    # a sync, but this is a multi-token forward: the mirror may be stale after compiled decode steps driven
    # outside generate() (user-compiled loops), and a stale one would under-size the store
    stored = lengths.tolist()
    counts = [len(c) for c in columns]
    totals = [s + m for s, m in zip(stored, counts)]  # each row's tokens after this turn
    width = _working_width(layer, max(totals), keys.shape[2])
    keys, values = pad_slots(keys, width, 0), pad_slots(values, width, 0)
    positions = pad_slots(positions, width, -1)
    first_column = int(layer.seen) - n
    for b, (length, taken) in enumerate(zip(stored, columns)):
        m = len(taken)
        keys[b, :, length : length + m] = key_states[b, :, taken]
        values[b, :, length : length + m] = value_states[b, :, taken]
        positions[b, :, length : length + m] = (first_column + taken).to(torch.int32)
    lengths = lengths + device_tensor(counts, lengths.dtype, layer.device)
    layer.hold_working_set(keys, values, positions, lengths, max(totals))
    if layer.history is not None:
        _extend_history(layer, keys, values, positions, lengths, stored, totals)


def attend_working_set(layer, query: torch.Tensor, scaling: float, valid: torch.Tensor | None = None) -> torch.Tensor:
    """``RocketKVLayer.attend_later_turn``: ``query`` ``[B, Hq, n, D]`` of n new tokens (stored already) ->
    ``[B, n, Hq, D]``: each real one sees every kept token and the real new tokens up to itself. ``valid`` bool
    ``[B, n]`` marks the real tokens (None: all)."""
    n = query.shape[2]
    keys, values = layer.keys, layer.values  # the later turn's contiguous working set (store_new_tokens)
    slot = torch.arange(keys.shape[2], device=query.device)
    # Row b stored its m_b real new tokens last, in order; the r-th real one (r = 0, 1, ...) sits at slot
    # lengths - m_b + r and sees every slot up to it. A padding query sees the real tokens before it: its output is
    # never used, and it always has at least one visible slot, so it is not NaN.
    real = torch.ones(query.shape[0], n, dtype=torch.long, device=query.device) if valid is None else valid.long()
    seen_real = real.cumsum(dim=1)  # [B, n] real new tokens up to and including each query
    limit = ((layer.lengths - real.sum(dim=1))[:, None] + seen_real - 1).clamp(min=0)  # [B, n]
    mask = slot[None, None, :] <= limit[:, :, None]
    return masked_attention(query, keys, values, mask[:, None], scaling, layer.features)


def _working_source(layer) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """What a later turn starts from: (keys, values [B, Hkv, W, D], positions [B, Hkv, W], lengths [B]), as
    fresh contiguous tensors. The view, trimmed to its capacity; keep_all: the whole history."""
    if layer.history is not None:
        keys, values = layer.history.store.gather()
        return keys, values, layer.history.positions.clone(), layer.history.lengths.clone()
    keys, values = layer.store.gather()
    return keys, values, layer.positions.clone(), layer.lengths.clone()


def _working_width(layer, needed: int, current: int) -> int:
    """Slots of a later turn's working set: the current width when the new tokens fit, else grown to the
    tokens to come (the same widths an in-place store had, so width-dependent policies see the same shapes)."""
    if needed <= current:
        return current
    return round_up(needed + headroom(layer), layer.config.page_size)


def _extend_history(layer, keys: torch.Tensor, values: torch.Tensor, positions: torch.Tensor, lengths: torch.Tensor,
                    stored: list[int], totals: list[int]) -> None:
    """keep_all: a later turn's real tokens, just placed in the working set (``keys`` / ``values`` ``[B, Hkv, W, D]``,
    ``positions`` ``[B, Hkv, W]``, ``lengths`` ``[B]``) after each row's history, join the history pages too (the
    working set's slots are the history's slots). Row b's new tokens fill slots ``[stored[b], totals[b])``."""
    history = layer.history
    grow_history(layer, max(totals) - history.host_max_length)
    write_tokens(history.store, keys, values, stored, totals)
    history.hold_rows(positions, lengths)
