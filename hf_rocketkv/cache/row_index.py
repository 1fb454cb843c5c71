"""Rows of a layer by index (generate()'s beam reorder, batch repeat and select) and crop of its last decoded tokens.

Per-row tensors have the batch on dim 0: dense store / working set ``[B, Hkv, T, D]``, positions ``[B, Hkv, C]``,
lengths ``[B]`` / ``[B, Hkv]``, the stage-1 and decode-compression state (``Stage1.ROW_TENSORS``,
``GeneratedTokens.ROW_TENSORS``), the paged view's rows (gathered ``[B, Hkv, C, D]``, written back).
"""

from __future__ import annotations

import torch

from ..selection.stage2_pages import per_head
from .capacity import private_history, private_view
from .paged_store import write_tokens

CROP_UNSUPPORTED = (
    "RocketKVCache cannot be cropped beyond its last decoded tokens: stage 1 evicts tokens for good, so "
    "assisted/speculative decoding (which rolls the cache back over verified candidates) is not supported. Use "
    "plain greedy, sampling or beam search."
)

def selected_rows(tensors, index: torch.Tensor, in_place: bool) -> list:
    """Rows ``index`` of each tensor (None stays None): copied into the same buffer when ``in_place`` and the shape
    is unchanged (fixed addresses; that buffer is returned), else a new tensor. Their owner holds the results."""
    selected = []
    for tensor in tensors:
        if tensor is None:
            selected.append(None)
            continue
        rows = tensor.index_select(0, index.to(tensor.device))
        if in_place and tensor.shape == rows.shape:
            tensor.copy_(rows)  # keep the buffers' addresses
            rows = tensor
        selected.append(rows)
    return selected


def index_rows(layer, index: torch.Tensor, in_place: bool = False) -> None:
    """Rows ``index`` of every per-row tensor of ``layer``. Dense: plain indexing. Compressed: the view's rows are
    gathered from their pages, indexed and written back (beam search reorders every step: in place, fixed
    addresses); a private view takes a new store when the batch size changes."""
    index = index.to(layer.device)
    in_place_rows = in_place and layer.compressed
    layer.dense.hold(*selected_rows((layer.dense.keys, layer.dense.values), index, in_place_rows))
    layer.stage1.select_rows(index, in_place_rows)
    layer.generated.select_rows(index, in_place_rows)
    if not layer.compressed:  # no view yet: positions and lengths come with stage 1
        layer.tag_keys()
        return
    positions, lengths = selected_rows((layer.positions, layer.lengths), index, in_place_rows)
    keys, values = layer.store.gather()
    kt = layer.store.gather_kt()
    keys, values, kt = keys.index_select(0, index), values.index_select(0, index), kt.index_select(0, index)
    if not (in_place and index.shape[0] == layer.store.batch):
        if layer.pages is not None:
            raise NotImplementedError(
                "RocketKVCache with a pool cannot change its batch size after prefill "
                "(batch_repeat_interleave / batch_select_indices); expand the inputs before prefill"
            )
        layer.resize_view(private_view(layer, index.shape[0], layer.store.capacity), positions, lengths)
    layer.store.write(keys, values, kt)
    if layer.history is not None:
        _index_history(layer, index, in_place)
    layer.mark_static()


def _index_history(layer, index: torch.Tensor, in_place: bool) -> None:
    """keep_all: rows ``index`` of the history. Slots in pages a prefix shares (``fixed``) are never rewritten:
    beams of one prompt hold the same prompt there."""
    history = layer.history
    keys, values = history.store.gather()
    keys, values = keys.index_select(0, index), values.index_select(0, index)
    positions, lengths = history.positions.index_select(0, index), history.lengths.index_select(0, index)
    if in_place and index.shape[0] == history.store.batch:
        history.positions.copy_(positions)
        history.lengths.copy_(lengths)
    else:
        history.move_rows(private_history(layer, index.shape[0], history.store.capacity), positions, lengths)
    counts = history.lengths.tolist()
    write_tokens(history.store, keys, values, [min(f, n) for f, n in zip(history.fixed, counts)], counts)


def crop(layer, tokens_to_remove: int) -> None:
    """``RocketKVLayer.crop``: remove the last ``-tokens_to_remove`` decoded tokens, restoring the state before
    those decode steps.

    generate()'s deferred stop check (``deferred_stop_check``) runs one decode step past an EOS stop and undoes it
    with ``crop(-1)``; ``crop(0)`` is a no-op. Evicted prompt tokens cannot come back, so a positive value (the
    legacy absolute length), more tokens than were decoded since stage 1, or a dense layer raise.
    """
    if tokens_to_remove > 0:
        raise NotImplementedError(CROP_UNSUPPORTED)
    if tokens_to_remove == 0 or not layer.is_initialized:
        return
    count = -tokens_to_remove
    if not layer.compressed or count > layer.host_decoded:
        raise NotImplementedError(CROP_UNSUPPORTED)
    keys, values = layer.store.gather()
    rows = torch.arange(keys.shape[0], device=layer.device)[:, None]
    heads = torch.arange(keys.shape[1], device=layer.device)[None, :]
    for _ in range(count):
        layer.lengths.sub_(1)
        slot = per_head(layer.lengths, keys.shape[0], keys.shape[1])  # [B, Hkv]
        keys[rows, heads, slot] = 0
        values[rows, heads, slot] = 0
        layer.positions[rows, heads, slot] = -1
    # a page's min/max cannot be un-folded: rebuild the summaries of what is left (written into the same pages)
    kt = layer.ops.build_kt(keys, layer.lengths, layer.config.page_size, layer.config.kt_torch_dtype)
    layer.store.write(keys, values, kt)
    layer.forget_decoded(count)
