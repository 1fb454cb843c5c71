"""Row-group prefill (``RocketKVConfig.prefill_batch_size``): prefill a batch a few rows at a time.

A prefill forward's activations (above all the MLP's ``[rows, tokens, intermediate_size]`` tensors) and its
full-prompt K/V grow with the rows it holds. RocketKV keeps only ``prompt_budget`` tokens per row after stage 1, so
generate() can prefill the batch in groups of rows, compress each group before the next starts, then stack the
groups' compressed caches and decode the whole batch at once. Each row's attention, padding offset and stage 1 never
look at other rows, so the kept tokens are those of a one-forward prefill; the peak is one group's instead of the
batch's.

Used by the prefill hook in ``generate.py``; the stacking itself is ``RocketKVLayer.stack_rows``.
"""

from __future__ import annotations

import torch

from ..cache.cache import RocketKVCache
from . import compat
from .compat import Call

# model_kwargs entries generate() may pass to prefill: sliced by row, or shared by every row group
ROW_KEYS = ("attention_mask", "position_ids", "token_type_ids", "inputs_embeds")
SHARED_KEYS = ("cache_position", *compat.CACHE_ARGS, "logits_to_keep", "use_cache")


def wants_row_groups(cache: RocketKVCache, batch: int) -> bool:
    """Split only a fresh prefill (a later turn on a compressed cache is already small) of a batch above the limit."""
    rows = cache.config.prefill_batch_size
    return rows is not None and batch > rows and cache.get_seq_length() == 0


def prefill_in_row_groups(prefill: Call, cache: RocketKVCache):
    """Run generate's ``prefill`` once per group of rows, each on its own cache, and stack the results into ``cache``.

    ``prefill`` is the intercepted ``_prefill`` call (arguments by name). Each group's cache is ``cache.empty_like()``,
    so a cache with another stage-1 policy keeps it. Returns prefill's output for the whole batch: tensors
    concatenated along the batch, the cache field (``compat.CACHE_ARG``) = cache.
    """
    input_ids, model_kwargs = prefill.arguments["input_ids"], prefill.arguments["model_kwargs"]
    batch = input_ids.shape[0]
    rows = cache.config.prefill_batch_size
    outputs, parts = [], []
    for start in range(0, batch, rows):
        group = slice(start, min(start + rows, batch))
        part = cache.empty_like()
        cache.share_rows(part, group)  # a pool-backed cache: the group's admitted rows, in the same pool
        part.setup_prefix()  # and their prefix hit
        part.hints.plan(defer_compression=cache.hints.defer_compression)
        group_kwargs = compat.with_cache(slice_rows(model_kwargs, group, batch), part)
        # admitted by the whole batch's cache already (share_rows): no ids, so no admission of its own
        with part.prefill(max_length=cache.hints.max_length, columns=input_ids.shape[1]):
            outputs.append(prefill(input_ids=input_ids[group], model_kwargs=group_kwargs))
        parts.append(part)
    cache.adopt_row_groups(parts)
    return stack_outputs(outputs, cache)


def slice_rows(model_kwargs: dict, rows: slice, batch: int) -> dict:
    sliced = {}
    for key, value in model_kwargs.items():
        if key in ROW_KEYS and isinstance(value, torch.Tensor):
            sliced[key] = value[rows]
        elif isinstance(value, torch.Tensor) and value.dim() > 0 and value.shape[0] == batch and key not in SHARED_KEYS:
            raise ValueError(
                f"RocketKVConfig.prefill_batch_size cannot split the generate() input {key!r} by rows (only "
                f"{', '.join(ROW_KEYS)} are). Set prefill_batch_size=None to prefill the whole batch in one forward."
            )
        else:
            sliced[key] = value
    return sliced


def stack_outputs(outputs: list, cache: RocketKVCache):
    """One model output for the batch: tensor fields (and tuples of tensors) concatenated along dim 0."""
    merged = outputs[0]
    for key in list(merged.keys()):
        values = [out[key] for out in outputs]
        if key in compat.CACHE_ARGS:
            merged[key] = cache
        elif isinstance(values[0], torch.Tensor):
            merged[key] = torch.cat(values)
        elif isinstance(values[0], tuple) and all(isinstance(v, torch.Tensor) for v in values[0]):
            merged[key] = tuple(torch.cat(parts) for parts in zip(*values))
    return merged
