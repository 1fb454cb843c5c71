"""Row-group prefill: prefill a batch a few rows at a time (``RocketKVConfig.prefill_batch_size``, or rows chosen
from the free memory when it is None).

A prefill forward's activations (above all the MLP's ``[rows, tokens, intermediate_size]`` tensors) and its
full-prompt K/V grow with the rows it holds. RocketKV keeps only ``prompt_budget`` tokens per row after stage 1, so
generate() can prefill the batch in groups of rows, compress each group before the next starts, then stack the
groups' compressed caches and decode the whole batch at once. Each row's attention, padding offset and stage 1 never
look at other rows, so the kept tokens are those of a one-forward prefill; the peak is one group's instead of the
batch's.

With ``prefill_batch_size=None`` (the default) generate() prefills the whole batch in one forward when the estimate
of ``memory/prefill_rows.py`` fits in the free memory, and otherwise in the fewest even groups that fit, saying so in
one INFO line of the ``hf_rocketkv`` logger. Used by the prefill hook in ``generate.py``; the stacking itself is
``RocketKVLayer.stack_rows``.
"""

from __future__ import annotations

import logging

import torch

from ..cache.cache import RocketKVCache
from ..memory.prefill_rows import PrefillRows, PrefillShapes, free_for_prefill, plan_prefill_rows
from . import compat
from .compat import Call

logger = logging.getLogger(__name__)

# model_kwargs entries generate() may pass to prefill: sliced by row, or shared by every row group
ROW_KEYS = ("attention_mask", "position_ids", "token_type_ids", "inputs_embeds")
SHARED_KEYS = ("cache_position", *compat.CACHE_ARGS, "logits_to_keep", "use_cache")


def rows_per_forward(model, cache: RocketKVCache, input_ids: torch.Tensor, model_kwargs: dict) -> int | None:
    """Rows per prefill forward for this generate() call; None: the whole batch in one forward.

    Only a fresh prefill is split (a later turn on a compressed cache is already small): in groups of
    ``config.prefill_batch_size`` rows when it is set and below the batch, else in the groups ``automatic_rows``
    picks from the free memory (logged). A batch with an input that cannot be split by rows stays whole when the
    rows are automatic (a warning says the prefill may not fit); a set ``prefill_batch_size`` refuses it
    (``slice_rows``)."""
    batch = input_ids.shape[0]
    if batch < 2 or cache.get_seq_length() != 0:
        return None
    rows = cache.config.prefill_batch_size
    if rows is not None:
        return rows if batch > rows else None
    plan = automatic_rows(model, cache, batch, input_ids.shape[1], input_ids.device)
    if plan is None or plan.rows is None:
        return None
    unsplittable = [key for key in model_kwargs if cannot_split(key, model_kwargs[key], batch)]
    if unsplittable:
        logger.warning("hf_rocketkv: %s; but the generate() input %r cannot be split by rows, so the whole batch is "
                       "prefilled in one forward", plan.describe(), unsplittable[0])
        return None
    logger.info("hf_rocketkv: %s (RocketKVConfig.prefill_batch_size sets the rows)", plan.describe())
    return plan.rows


def automatic_rows(model, cache: RocketKVCache, batch: int, tokens: int, device: torch.device) -> PrefillRows | None:
    """``plan_prefill_rows`` for this batch on ``device``: the model's shapes and dtype, each row's kept cache (none
    for a pool-backed cache, whose pages exist already), the memory free now. None, with a DEBUG line, where the
    shapes or the free memory cannot be read (a config without the usual sizes; a CPU without /proc/meminfo or
    psutil): the whole batch in one forward, as transformers does."""
    config = model.config.get_text_config() if hasattr(model.config, "get_text_config") else model.config
    dtype_bytes = next((p.element_size() for p in model.parameters() if p.is_floating_point()), 2)
    try:
        shapes = PrefillShapes.of(config, dtype_bytes)
        free = free_for_prefill(device)
    except ValueError as err:
        logger.debug("hf_rocketkv: the whole batch is prefilled in one forward: %s", err)
        return None
    kept = 0 if cache.pool is not None else kept_bytes_per_row(cache, shapes, tokens)
    return plan_prefill_rows(shapes, batch, tokens, kept, free, str(device))


def kept_bytes_per_row(cache: RocketKVCache, shapes: PrefillShapes, tokens: int) -> int:
    """Bytes one row keeps after its prefill, counted high: ``prompt_budget`` prompt tokens (all of them in the
    ``dense_layers``) and the new tokens of ``hints.max_length`` (else ``capacity_headroom``) in every layer, a
    quarter more in RocketKV layers (the KT summaries, positions and capacity's slack)."""
    config = cache.config
    max_length = cache.hints.max_length
    new = max(0, max_length - tokens) if max_length is not None else config.capacity_headroom
    dense = min(config.dense_layers, shapes.layers)
    rocket_tokens = min(tokens, config.prompt_budget) + new
    return shapes.layer_kv_bytes * ((shapes.layers - dense) * rocket_tokens * 5 // 4 + dense * (tokens + new))


def prefill_in_row_groups(prefill: Call, cache: RocketKVCache, rows: int):
    """Run generate's ``prefill`` once per group of ``rows`` rows, each on its own cache, and stack the results into
    ``cache``.

    ``prefill`` is the intercepted ``_prefill`` call (arguments by name). Each group's cache is ``cache.empty_like()``,
    so a cache with another stage-1 policy keeps it. Returns prefill's output for the whole batch: tensors
    concatenated along the batch, the cache field (``compat.CACHE_ARG``) = cache.
    """
    input_ids, model_kwargs = prefill.arguments["input_ids"], prefill.arguments["model_kwargs"]
    batch = input_ids.shape[0]
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


def cannot_split(key: str, value, batch: int) -> bool:
    """A generate() input with a row per batch row that ``slice_rows`` does not know how to split."""
    return (key not in ROW_KEYS and key not in SHARED_KEYS and isinstance(value, torch.Tensor) and value.dim() > 0
            and value.shape[0] == batch)


def slice_rows(model_kwargs: dict, rows: slice, batch: int) -> dict:
    sliced = {}
    for key, value in model_kwargs.items():
        if key in ROW_KEYS and isinstance(value, torch.Tensor):
            sliced[key] = value[rows]
        elif cannot_split(key, value, batch):
            raise ValueError(
                f"RocketKVConfig.prefill_batch_size cannot split the generate() input {key!r} by rows (only "
                f"{', '.join(ROW_KEYS)} are). Set prefill_batch_size to the batch size or more to prefill the whole "
                f"batch in one forward."
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
