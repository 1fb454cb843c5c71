"""Batch-size buckets (``RocketKVConfig.batch_buckets``): generate() pads a request's rows up to a bucket.

A compiled decode step is specialised to its batch size, so every new batch size would compile the model again.
Like the CUDA-graph capture sizes of serving engines, generate() instead runs a batch of B rows as the smallest
bucket P >= B (1, 2, 4, ..., 128 by default with ``decode_runner="torch_compile"``): a new batch size costs at most
one compile per bucket.

    generate(ids[B])  ──► rows B..P-1 = copies of row 0 (ids, mask, position ids, ...)
      prefill          the real rows only; then the cache copies row 0's compressed rows into rows B..P-1
      decode           P rows: each padded row computes exactly what row 0 does (same tokens, same stop)
    output, cache ◄──  rows B..P-1 stripped (sequences, scores, hidden states; the cache's rows too)

Rows never see each other (attention, stage 1 and page selection are per row), so the real rows' tokens are those
of the unpadded batch. Padding happens only where it is safe to pad: a fresh cache without a pool (a later turn or
a pool's admitted rows keep their batch), the inputs hf_rocketkv knows to be per row, and no generate() feature that
looks at rows by index (streamer, prefix_allowed_tokens_fn, assistant model, negative prompt, custom_generate).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ..cache.cache import RocketKVCache
from . import compat
from .call_state import call_state
from .row_groups import slice_rows

# generate() inputs with one entry per row, padded with copies of row 0 (``inputs`` is generate()'s first argument)
ROW_INPUTS = ("input_ids", "inputs_embeds", "attention_mask", "position_ids", "token_type_ids")
# generate() arguments that see rows by index or stream them: no padding when any is given
ROW_AWARE_ARGUMENTS = ("prefix_allowed_tokens_fn", "assistant_model", "streamer", "negative_prompt_ids",
                       "custom_generate")


@dataclass(frozen=True)
class BatchPadding:
    """One generate() call's padding: ``real`` rows of the caller's, ``padded`` rows run (the bucket)."""

    real: int
    padded: int
    cache: RocketKVCache

    def kept_rows(self, rows: int) -> int:
        """Of a tensor with ``rows`` rows (``padded`` times the beams / return sequences), the caller's rows."""
        return rows // self.padded * self.real if rows % self.padded == 0 else rows


def batch_bucket(config, batch: int) -> int:
    """The padded batch size for ``batch`` rows under ``config`` (a RocketKVConfig): the smallest of its
    ``effective_batch_buckets`` that holds them, else ``batch`` itself (larger batches run unpadded)."""
    return next((size for size in config.effective_batch_buckets if size >= batch), batch)


def plan_padding(call: compat.Call, config, new_cache) -> tuple[BatchPadding, dict] | None:
    """The padding of this generate() call and the arguments to run it with, or None (run as it is).

    ``config`` is the RocketKVConfig the request will use; ``new_cache()`` makes the cache when the caller passed
    none (generate() would make the same one), so the prefill hook can find the padding on it.
    """
    arguments = call.arguments
    kwargs = arguments["kwargs"]
    rows = _row_inputs(arguments)
    if not rows or any(arguments.get(name) is not None for name in ROW_AWARE_ARGUMENTS):
        return None
    batch = next(iter(rows.values())).shape[0]
    padded = batch_bucket(config, batch)
    if padded == batch or not _same_batch(kwargs, rows, batch) or not decode_may_compile(call):
        return None
    cache = compat.cache_from(kwargs)
    if cache is None:
        cache = new_cache()
    if not isinstance(cache, RocketKVCache) or cache.pool is not None or cache.get_seq_length() != 0:
        return None  # a pool admits its rows itself; a later turn keeps the rows its cache holds
    call_state(cache).set_batch_padding((batch, padded))
    changes = {"kwargs": compat.with_cache(kwargs, cache)}
    for name, tensor in rows.items():
        padded_tensor = pad_rows(tensor, padded)
        if name == "inputs":
            changes["inputs"] = padded_tensor
        else:
            changes["kwargs"][name] = padded_tensor
    return BatchPadding(batch, padded, cache), changes


def _row_inputs(arguments: dict) -> dict[str, torch.Tensor]:
    """The per-row tensors among generate()'s inputs, by name (``inputs`` for the first argument)."""
    rows = {name: arguments["kwargs"][name] for name in ROW_INPUTS
            if isinstance(arguments["kwargs"].get(name), torch.Tensor)}
    if isinstance(arguments.get("inputs"), torch.Tensor):
        rows["inputs"] = arguments["inputs"]
    return rows


def _same_batch(kwargs: dict, rows: dict[str, torch.Tensor], batch: int) -> bool:
    """Every per-row input has ``batch`` rows, and no other tensor input does (one we would not know to pad)."""
    if any(tensor.dim() == 0 or tensor.shape[0] != batch for tensor in rows.values()):
        return False
    others = [v for k, v in kwargs.items() if k not in ROW_INPUTS and isinstance(v, torch.Tensor)]
    return not any(tensor.dim() > 0 and tensor.shape[0] == batch for tensor in others)


def decode_may_compile(call: compat.Call) -> bool:
    """Whether generate() will run compiled decode steps, where buckets pay off (elsewhere padding only costs):
    compile not disabled, and a device generate() compiles on (or a compile_config that compiles everywhere)."""
    model = call.arguments["self"]
    if _generation_setting(call, "disable_compile"):
        return False
    if model.device.type in ("cuda", "xpu"):
        return True
    return compat.compiles_on_every_device(_generation_setting(call, "compile_config"))


def _generation_setting(call: compat.Call, name: str):
    """A generation setting as generate() resolves it: a keyword argument, else the generation config passed, else
    the model's."""
    kwargs = call.arguments["kwargs"]
    if name in kwargs:
        return kwargs[name]
    config = call.arguments.get("generation_config") or call.arguments["self"].generation_config
    return getattr(config, name, None)


def pad_rows(tensor: torch.Tensor, rows: int) -> torch.Tensor:
    """``tensor`` with copies of its row 0 appended up to ``rows`` rows."""
    missing = rows - tensor.shape[0]
    return torch.cat([tensor, tensor[:1].expand(missing, *tensor.shape[1:])])


# ------------------------------------------------------------------------------------------------------ prefill
def prefill_real_rows(call: compat.Call, cache: RocketKVCache, run):
    """Prefill only the caller's rows (``run`` is the usual prefill of a call), then let the padding rows copy row
    0's compressed cache and outputs: the padding costs no prefill compute and no stage 1."""
    real, padded = call_state(cache).batch_padding
    input_ids, model_kwargs = call.arguments["input_ids"], call.arguments["model_kwargs"]
    batch = input_ids.shape[0]
    expand = batch // padded  # rows per caller's row (num_beams / num_return_sequences), grouped by row
    kept = real * expand
    outputs = run(call.with_arguments(input_ids=input_ids[:kept],
                                      model_kwargs=slice_rows(model_kwargs, slice(0, kept), batch)))
    index = torch.cat([torch.arange(kept), torch.arange(expand).repeat(padded - real)])
    cache.batch_select_indices(index)
    return _select_output_rows(outputs, index, kept, cache)


def _select_output_rows(outputs, index: torch.Tensor, rows: int, cache: RocketKVCache):
    """Prefill's model output with rows ``index`` of every tensor of ``rows`` rows (tuples of them too)."""
    for key in list(outputs.keys()):
        value = outputs[key]
        if key in compat.CACHE_ARGS:
            outputs[key] = cache
        elif isinstance(value, torch.Tensor) and value.dim() > 0 and value.shape[0] == rows:
            outputs[key] = value.index_select(0, index.to(value.device))
        elif isinstance(value, tuple):
            outputs[key] = tuple(v.index_select(0, index.to(v.device)) if isinstance(v, torch.Tensor) and
                                 v.dim() > 0 and v.shape[0] == rows else v for v in value)
    return outputs


# ------------------------------------------------------------------------------------------------------ output
def strip_padding(output, padding: BatchPadding):
    """generate()'s output and the request's cache with the padding rows removed: the caller sees its batch."""
    cache = padding.cache
    call_state(cache).set_batch_padding(None)
    held = _cache_rows(cache)
    if held is not None and padding.kept_rows(held) != held:
        cache.batch_select_indices(torch.arange(padding.kept_rows(held)))
        call_state(cache).forget_graph()  # a captured decode step points at the padded buffers
    served = call_state(cache).token_ids
    if served is not None:
        call_state(cache).served(served[: padding.kept_rows(served.shape[0])])
    return _strip(output, padding)


def _cache_rows(cache: RocketKVCache) -> int | None:
    """Rows the cache holds (None before its first forward)."""
    return next((layer.batch_size for layer in cache.layers if layer.is_initialized), None)


def _strip(value, padding: BatchPadding):
    if isinstance(value, torch.Tensor):
        return value[: padding.kept_rows(value.shape[0])] if value.dim() > 0 else value
    if isinstance(value, RocketKVCache):
        return value  # stripped above
    if isinstance(value, tuple):
        return tuple(_strip(v, padding) for v in value)
    if hasattr(value, "keys") and hasattr(value, "__setitem__"):  # a ModelOutput (GenerateDecoderOnlyOutput, ...)
        for key in list(value.keys()):
            value[key] = _strip(value[key], padding)
    return value
