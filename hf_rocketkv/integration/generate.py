"""generate()/pipeline() glue: one fresh RocketKVCache per call, capacity hints, and guards against misuse.

transformers has no cache registry (``cache_implementation`` is a closed set), so hf_rocketkv hooks a few private
generate() steps. The hooking itself (which symbols, checked signatures, binding by name, leaving every other model
alone) lives in ``compat.py`` beside it; this module is what happens when a call involves RocketKV:

* ``generate``: batch-size buckets (``batch_buckets``): a fresh request's rows are padded up to a bucket with
  copies of row 0 and stripped from the output (``batch_buckets.py``); decode steps apply RoPE in one launch
  (``fused_rope``, ``rope.py``) and each RMSNorm in one launch (``fused_norm``, ``norm.py``).
* ``prepare_cache``: a model whose attention is ``rocketkv`` gets ``RocketKVCache(config)`` when the caller passed no
  cache; a passed RocketKVCache learns the request's maximum length and whether prefill is chunked; misuse raises.
* ``prefill``: a RocketKVCache that already holds tokens only accepts a continuation of the same request
  (``generate`` slices the prompt by the cache's length, so an unrelated prompt would silently give garbage); a
  pool-backed cache takes its pages first (admission, prefix hit: ``RocketKVCache.begin_prefill``); after a chunked
  prefill it runs the deferred stage 1; a batch whose one-forward prefill would not fit in the free memory, or one
  above ``prefill_batch_size``, is prefilled in row groups (``row_groups.py``).
* ``prepare_inputs``: records the ids fed so far, which a continuation must start with.
* ``compiled_step``: decode steps generate() would compile are captured as CUDA graphs (``decode_graphs.py``)
  or compiled, counting capacity on the host (``compiled_decode.py``).
* ``deferred_stop_supported``: on CUDA, generate() checks for the end of generation one step late, so the host never
  stalls the GPU between decode steps (``deferred_stop_check``).
"""

from __future__ import annotations

import torch

from ..cache.cache import RocketKVCache
from ..cache.layer import CROP_UNSUPPORTED
from ..config import RocketKVConfig
from . import compat
from .batch_buckets import plan_padding, prefill_real_rows, strip_padding
from .call_state import call_state
from .compiled_decode import run_compiled_step
from .decode_graphs import run_graphed_step, wants_graphs
from .names import ATTN_NAME
from .fused_modeling import fused_modeling
from .row_groups import prefill_in_row_groups, rows_per_forward

CONFIG_ATTRIBUTE = "rocketkv"  # model.config.rocketkv: dict of RocketKVConfig fields (saved with the model)
ASSISTED_GENERATION = "assisted_generation"  # GenerationMode.ASSISTED_GENERATION's value


def uses_rocketkv(model) -> bool:
    return compat.attn_implementation(model) == ATTN_NAME


def get_config(model) -> RocketKVConfig:
    """The RocketKVConfig that generate() uses for ``model`` when no cache is passed (default if never set)."""
    stored = getattr(model.config, CONFIG_ATTRIBUTE, None)
    return RocketKVConfig.from_dict(stored) if stored else RocketKVConfig()


def set_config(model, config: RocketKVConfig) -> None:
    if not isinstance(config, RocketKVConfig):
        raise TypeError(f"config must be a RocketKVConfig, got {type(config).__name__}")
    model.config.update({CONFIG_ATTRIBUTE: config.to_dict()})  # transformers' config keeps it (save_pretrained)


class RocketKVGenerateHooks:
    """What hf_rocketkv does inside generate() (``compat.GenerateHooks``). Stateless: everything a call needs lives
    on its own cache."""

    def involves_model(self, model) -> bool:
        return uses_rocketkv(model)

    def involves_cache(self, cache) -> bool:
        return isinstance(cache, RocketKVCache)

    # ----------------------------------------------------------------------------------------- the whole call
    def generate(self, call: compat.Call):
        """Pad the batch up to its bucket (``RocketKVConfig.batch_buckets``), run generate(), strip the padding."""
        model = call.arguments["self"]
        cache = compat.cache_from(call.arguments["kwargs"])
        config = cache.config if isinstance(cache, RocketKVCache) else get_config(model)
        rocketkv_cache = isinstance(cache, RocketKVCache) or (cache is None and uses_rocketkv(model))
        with fused_modeling(model, config, rocketkv_cache):
            planned = plan_padding(call, config, lambda: RocketKVCache(config)) if uses_rocketkv(model) else None
            if planned is None:
                return call()
            padding, changes = planned
            try:
                output = call(**changes)
            finally:
                call_state(padding.cache).set_batch_padding(None)
            return strip_padding(output, padding)

    # ----------------------------------------------------------------------------------------- cache preparation
    def prepare_cache(self, call: compat.Call):
        model, generation_config = call.arguments["self"], call.arguments["generation_config"]
        model_kwargs = call.arguments["model_kwargs"]
        cache = compat.cache_from(model_kwargs)
        check_generate_request(model, generation_config, cache, call.arguments["generation_mode"])
        result = call()
        if cache is None:
            cache = RocketKVCache(get_config(model))
            model_kwargs[compat.CACHE_ARG] = cache
        configure_layers(cache, model)
        check_layer_plan(cache, model, generation_config)
        cache.hints.plan(max_length=call.arguments["max_cache_length"],
                         defer_compression=generation_config.prefill_chunk_size is not None)
        return result

    # ----------------------------------------------------------------------------------------- prefill
    def prefill(self, call: compat.Call):
        input_ids = call.arguments["input_ids"]
        cache: RocketKVCache = compat.cache_from(call.arguments["model_kwargs"])
        check_continuation(cache, input_ids)
        state = call_state(cache)
        state.served(input_ids)
        state.begin_prefill()  # every guard at the first compiled step; a captured step would read old buffers
        padding = state.batch_padding
        if padding is not None and input_ids.shape[0] > padding[0]:
            return prefill_real_rows(call, cache, lambda rows_call: self._prefill_rows(rows_call, cache))
        return self._prefill_rows(call, cache)

    @staticmethod
    def _prefill_rows(call: compat.Call, cache: RocketKVCache):
        """Prefill every row of ``call`` (in row groups, ``rows_per_forward``) inside the cache's prefill: with a pool,
        every page this forward needs first, or PoolExhaustedError before anything is written; a prefix hit makes
        the cache's length start after it, so _prefill computes only the rest; stage 1 after a chunked prefill."""
        input_ids, model_kwargs = call.arguments["input_ids"], call.arguments["model_kwargs"]
        rows = rows_per_forward(call.arguments["self"], cache, input_ids, model_kwargs)
        with cache.prefill(input_ids, model_kwargs.get("attention_mask"), row_groups=rows):
            return prefill_in_row_groups(call, cache, rows) if rows is not None else call()

    def prepare_inputs(self, call: compat.Call):
        cache: RocketKVCache = call.arguments[compat.CACHE_ARG]
        if not cache.hints.prefilling:  # chunks of a chunked prefill pass partial ids: _prefill recorded the prompt
            call_state(cache).served(call.arguments["input_ids"])  # a reference: what a continuation must extend
        return call()

    # ----------------------------------------------------------------------------------------- decode
    def compiled_step(self, compiled, model, cache: RocketKVCache, args: tuple, kwargs: dict):
        """A decode step generate() would compile: captured as a CUDA graph (``decode_runner="cuda_graphs"``, the
        default on CUDA) or run through torch.compile."""
        if not args and wants_graphs(cache, kwargs):
            return run_graphed_step(model, cache, kwargs)
        return run_compiled_step(compiled, cache, args, kwargs)

    def deferred_stop_supported(self, call: compat.Call) -> bool:
        """Let generate() defer its per-token stop check on CUDA for RocketKV caches (``deferred_stop_check``).

        generate() reads ``unfinished_sequences.max() == 0`` on the host after every token, so the GPU idles while
        the host prepares the next step. transformers' ``DeferredStopCheck`` reads that flag one step late instead;
        it costs one extra forward when a sequence stops on EOS, undone with ``cache.crop(-1)``
        (``RocketKVLayer.crop``; a sliding-window layer's ring keeps the slot that step overwrote once transformers
        calls ``activate_past_recording``, ``SlidingWindowLayer.crop``). transformers enables it on MPS only; the
        tokens are the same either way.
        """
        cache: RocketKVCache = call.arguments["cache"]
        deferring = call_state(cache).deferred_stop_devices
        if cache.config.deferred_stop_check and call.arguments["device"].type in deferring:
            return not call.arguments["is_assistant"]
        return call()


def check_generate_request(model, generation_config, cache, generation_mode) -> None:
    """Every generate() misuse that RocketKV cannot serve, raised before anything is computed."""
    rocket = uses_rocketkv(model)
    if isinstance(cache, RocketKVCache) and not rocket:
        raise ValueError(
            f"{compat.CACHE_ARG} is a RocketKVCache but the model's attn_implementation is "
            f"'{compat.attn_implementation(model)}'. Call `hf_rocketkv.enable(model)` or load it with "
            f"`from_pretrained(..., attn_implementation='{ATTN_NAME}')`."
        )
    if cache is not None and not isinstance(cache, RocketKVCache):
        raise ValueError(
            f"attn_implementation='{ATTN_NAME}' needs a RocketKVCache, got {type(cache).__name__}. Pass "
            f"`{compat.CACHE_ARG}=RocketKVCache(config)` or no cache (one is made from hf_rocketkv.get_config(model))."
        )
    if generation_config.use_cache is False:
        raise ValueError(
            f"generate(use_cache=False) keeps no KV cache, so attn_implementation='{ATTN_NAME}' has nothing to "
            f"compress. Leave use_cache on, or switch the model to 'sdpa' for cache-free generation."
        )
    if getattr(generation_mode, "value", generation_mode) == ASSISTED_GENERATION:
        raise NotImplementedError(CROP_UNSUPPORTED)
    if generation_config.cache_implementation is not None:
        raise ValueError(
            f"cache_implementation={generation_config.cache_implementation!r} cannot be combined with "
            f"attn_implementation='{ATTN_NAME}': RocketKV brings its own cache. Leave cache_implementation unset."
        )
    if rocket or isinstance(cache, RocketKVCache):
        check_whole_counts(generation_config)


# generate() arguments a RocketKV call sizes or splits its cache by: (name, smallest value, what it counts)
WHOLE_COUNTS = (("max_new_tokens", 1, "new tokens"), ("prefill_chunk_size", 1, "prompt tokens per prefill forward"),
                ("num_beams", 1, "beams"))


def check_whole_counts(generation_config) -> None:
    """A ValueError naming the argument when one of ``WHOLE_COUNTS`` is set to something other than a whole number
    at least its smallest value (``max_new_tokens=1.5``, ``prefill_chunk_size=0``, ``num_beams=0``), instead of a
    TypeError or ZeroDivisionError from inside the cache or the model."""
    for name, smallest, what in WHOLE_COUNTS:
        value = getattr(generation_config, name, None)
        if value is None:
            continue
        if isinstance(value, bool) or not isinstance(value, int) or value < smallest:
            raise ValueError(f"generate({name}={value!r}): RocketKV needs a whole number of {what}, an integer >= "
                             f"{smallest}" + (" (or None: the whole prompt in one forward)"
                                              if name == "prefill_chunk_size" else ""))


def compiled_decode_field(config: RocketKVConfig) -> str | None:
    """The setting that makes generate() torch.compile the decode step, as an error message names it
    (``decode_runner='torch_compile'`` or ``batch_buckets``), or None."""
    if config.decode_runner == "torch_compile":
        return "decode_runner='torch_compile'"
    return "batch_buckets" if config.batch_buckets else None


def configure_layers(cache: RocketKVCache, model) -> None:
    """Give the cache the model's layer types (``RocketKVCache.configure_layers``: sliding-window layers keep their
    window) before anything is stored. Their decode steps run under every decode runner: a ring of fixed size,
    laid out on the host before the first captured or compiled step (``SlidingWindowLayer.count_graphed_step``)."""
    if cache.get_seq_length() == 0 and not any(layer.is_initialized for layer in cache.layers):
        cache.configure_layers(model.config)


def check_layer_plan(cache: RocketKVCache, model, generation_config) -> None:
    """Refuse the per-layer fields (``dense_layers``, ``budget_schedule``) where generate() would compile the decode
    step: torch.compile, batch buckets, or CUDA graphs on a graph device (dense layers grow at every step and the
    scheduled layers have capacities of their own, which the compiled and captured steps do not handle yet); their
    decode runs eagerly with ``disable_compile=True``. Names the field instead of falling back silently."""
    config = cache.config
    field = ("dense_layers", config.dense_layers) if config.dense_layers else (
        ("budget_schedule", config.budget_schedule) if config.budget_schedule != "flat" else None)
    if field is None or getattr(generation_config, "disable_compile", False):
        return
    device = next(model.parameters()).device.type
    runner = compiled_decode_field(config)
    if runner is None and device in call_state(cache).graph_devices:
        runner = "decode_runner='cuda_graphs'"
    if runner is not None:
        raise NotImplementedError(
            f"RocketKVConfig.{field[0]}={field[1]!r} does not run under the compiled decode ({runner} on "
            f"{device}) yet: pass generate(..., disable_compile=True) to decode eagerly, or leave {field[0]} at its "
            f"default.")


def check_continuation(cache: RocketKVCache, input_ids: torch.Tensor) -> None:
    """A filled cache only continues the request it served: the new ids must start with every id it has seen."""
    seen = cache.get_seq_length()
    if seen == 0:
        return
    previous = call_state(cache).token_ids
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


HOOKS = RocketKVGenerateHooks()  # stateless: one instance serves every call


def install() -> None:
    """Hook generate()'s private steps through the compat module (idempotent)."""
    compat.install(HOOKS)
