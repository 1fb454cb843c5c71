"""generate()/pipeline() glue: one fresh RocketKVCache per call, capacity hints, and guards against misuse.

transformers has no cache registry (``cache_implementation`` is a closed set), so ``import hf_rocketkv`` wraps two
private ``GenerationMixin`` steps, keeping their signatures (checked on transformers 5.17 and 5.23):

* ``_prepare_cache_for_generation``: a model whose attention is ``rocketkv`` gets ``RocketKVCache(config)`` when the
  caller passed no cache; a passed RocketKVCache learns the request's maximum length and whether prefill is chunked;
  a RocketKVCache on a model whose attention is not ``rocketkv`` raises.
* ``_prefill``: a RocketKVCache that already holds tokens only accepts a continuation of the same request
  (``generate`` slices the prompt by the cache's length, so an unrelated prompt would silently give garbage); after
  a chunked prefill it runs the deferred stage 1; with ``prefill_batch_size`` it prefills the batch in row groups
  (``row_groups.py``).
* ``prepare_inputs_for_generation``: records the ids fed so far, which a continuation must start with.
* ``PreTrainedModel.get_compiled_call``: compiled decode steps after a request's first one skip the guards that
  cannot change within a request (``compiled_decode.py``).
* ``DeferredStopCheck.is_supported``: on CUDA, generate() checks for the end of generation one step late, so the host
  never stalls the GPU between decode steps (``deferred_stop_check``).
"""

from __future__ import annotations

import functools

import torch
from transformers import GenerationMixin, PreTrainedModel
from transformers.generation import utils as generation_utils
from transformers.generation.configuration_utils import GenerationMode

from ..cache.cache import RocketKVCache
from ..cache.layer import CROP_UNSUPPORTED
from ..config import RocketKVConfig
from .compiled_decode import wrap_get_compiled_call
from .handoff import ATTN_NAME
from .row_groups import prefill_in_row_groups, wants_row_groups

CONFIG_ATTRIBUTE = "rocketkv"  # model.config.rocketkv: dict of RocketKVConfig fields (saved with the model)


def uses_rocketkv(model) -> bool:
    return getattr(model.config, "_attn_implementation", None) == ATTN_NAME


def get_config(model) -> RocketKVConfig:
    """The RocketKVConfig that generate() uses for ``model`` when no cache is passed (default if never set)."""
    stored = getattr(model.config, CONFIG_ATTRIBUTE, None)
    return RocketKVConfig.from_dict(stored) if stored else RocketKVConfig()


def set_config(model, config: RocketKVConfig) -> None:
    if not isinstance(config, RocketKVConfig):
        raise TypeError(f"config must be a RocketKVConfig, got {type(config).__name__}")
    setattr(model.config, CONFIG_ATTRIBUTE, config.to_dict())


def _wrap_prepare_cache(original):
    @functools.wraps(original)
    def prepare_cache_for_generation(self, generation_config, model_kwargs, *args, **kwargs):
        cache = model_kwargs.get("past_key_values")
        rocket = uses_rocketkv(self)
        if isinstance(cache, RocketKVCache) and not rocket:
            raise ValueError(
                f"past_key_values is a RocketKVCache but the model's attn_implementation is "
                f"'{self.config._attn_implementation}'. Call `hf_rocketkv.enable(model)` or load it with "
                f"`from_pretrained(..., attn_implementation='{ATTN_NAME}')`."
            )
        if rocket and cache is not None and not isinstance(cache, RocketKVCache):
            raise ValueError(
                f"attn_implementation='{ATTN_NAME}' needs a RocketKVCache, got {type(cache).__name__}. Pass "
                f"`past_key_values=RocketKVCache(config)` or no cache (one is made from hf_rocketkv.get_config(model))."
            )
        if rocket and generation_config.use_cache is False:
            raise ValueError(
                f"generate(use_cache=False) keeps no KV cache, so attn_implementation='{ATTN_NAME}' has nothing to "
                f"compress. Leave use_cache on, or switch the model to 'sdpa' for cache-free generation."
            )
        generation_mode = args[0] if args else kwargs.get("generation_mode")
        if (rocket or isinstance(cache, RocketKVCache)) and generation_mode == GenerationMode.ASSISTED_GENERATION:
            raise NotImplementedError(CROP_UNSUPPORTED)
        if rocket and generation_config.cache_implementation is not None:
            raise ValueError(
                f"cache_implementation={generation_config.cache_implementation!r} cannot be combined with "
                f"attn_implementation='{ATTN_NAME}': RocketKV brings its own cache. Leave cache_implementation unset."
            )
        result = original(self, generation_config, model_kwargs, *args, **kwargs)
        if rocket and cache is None:
            cache = RocketKVCache(get_config(self))
            model_kwargs["past_key_values"] = cache
        if isinstance(cache, RocketKVCache):
            max_cache_length = args[2] if len(args) >= 3 else kwargs.get("max_cache_length")
            cache.hints.max_length = max_cache_length
            cache.hints.defer_compression = generation_config.prefill_chunk_size is not None
        return result

    return prepare_cache_for_generation


def _wrap_prefill(original):
    @functools.wraps(original)
    def prefill(self, input_ids, generation_config, model_kwargs, *args, **kwargs):
        cache = model_kwargs.get("past_key_values")
        if not isinstance(cache, RocketKVCache):
            return original(self, input_ids, generation_config, model_kwargs, *args, **kwargs)
        check_continuation(cache, input_ids)
        cache.token_ids = input_ids
        cache.hints.guards_checked = False  # this call's first compiled decode step runs every guard
        cache.hints.prefilling = True
        try:
            if wants_row_groups(cache, input_ids.shape[0]):
                return prefill_in_row_groups(original, self, input_ids, generation_config, model_kwargs, cache, *args,
                                             **kwargs)
            outputs = original(self, input_ids, generation_config, model_kwargs, *args, **kwargs)
            cache.finish_prefill()  # chunked prefill deferred stage 1 until the whole prompt was in
            return outputs
        finally:
            cache.hints.prefilling = False

    return prefill


def _wrap_prepare_inputs(original):
    @functools.wraps(original)
    def prepare_inputs_for_generation(self, input_ids, *args, **kwargs):
        cache = kwargs.get("past_key_values")
        if isinstance(cache, RocketKVCache):
            cache.token_ids = input_ids  # every id fed so far (a reference, no copy): what a continuation must extend
        return original(self, input_ids, *args, **kwargs)

    return prepare_inputs_for_generation


def check_continuation(cache: RocketKVCache, input_ids: torch.Tensor) -> None:
    """A filled cache only continues the request it served: the new ids must start with every id it has seen."""
    seen = cache.get_seq_length()
    if seen == 0:
        return
    previous = cache.token_ids
    hint = (
        "Pass a fresh RocketKVCache to every generate()/pipeline() call (or pass no cache and one is made per "
        "call); to continue a conversation, pass the previous output ids followed by the new tokens."
    )
    if input_ids.shape[1] <= seen:
        raise ValueError(
            f"This RocketKVCache already holds {seen} tokens of an earlier request, but input_ids has only "
            f"{input_ids.shape[1]} tokens, so it cannot be a continuation. {hint}"
        )
    if previous is not None:
        n = min(seen, previous.shape[1])
        same_batch = previous.shape[0] == input_ids.shape[0]
        if not same_batch or not torch.equal(previous[:, :n].to(input_ids.device), input_ids[:, :n]):
            raise ValueError(
                f"This RocketKVCache already holds {seen} tokens of another request: input_ids does not start with "
                f"the tokens it has seen. {hint}"
            )


_INSTALLED = False


def install() -> None:
    """Wrap generate's cache preparation and prefill (idempotent)."""
    global _INSTALLED
    if _INSTALLED:
        return
    GenerationMixin._prepare_cache_for_generation = _wrap_prepare_cache(GenerationMixin._prepare_cache_for_generation)
    GenerationMixin._prefill = _wrap_prefill(GenerationMixin._prefill)
    GenerationMixin.prepare_inputs_for_generation = _wrap_prepare_inputs(GenerationMixin.prepare_inputs_for_generation)
    PreTrainedModel.get_compiled_call = wrap_get_compiled_call(PreTrainedModel.get_compiled_call)
    deferred = getattr(generation_utils, "DeferredStopCheck", None)  # transformers >= 5.17 has it
    if deferred is not None:
        deferred.is_supported = staticmethod(_wrap_deferred_stop_support(deferred.is_supported))
    _INSTALLED = True


def _wrap_deferred_stop_support(original):
    """Let generate() defer its per-token stop check on CUDA for RocketKV caches (``deferred_stop_check``).

    generate() reads ``unfinished_sequences.max() == 0`` on the host after every token, so the GPU idles while the host
    prepares the next step (~2-3 ms per token with an 8B model, a third of a compiled step). transformers' own
    ``DeferredStopCheck`` reads that flag one step late instead, so the next step is queued while the current one
    runs; it costs one extra forward when a sequence stops on EOS, which it undoes with ``cache.crop(-1)``
    (``RocketKVLayer.crop``). transformers enables it on MPS only; the tokens are the same either way.
    """

    @functools.wraps(original)
    def is_supported(device, cache, cache_is_returned, is_assistant):
        if isinstance(cache, RocketKVCache) and cache.config.deferred_stop_check and device.type == "cuda":
            return not is_assistant
        return original(device, cache, cache_is_returned, is_assistant)

    return is_supported
