"""What generate()'s compiled decode step does on the host around the CUDA graph: a capacity check, and guards run
once per request instead of once per token (``RocketKVConfig.decode_guard_checks``).

Capacity: a compiled step cannot grow the store (that would change the graph's shapes and addresses) and cannot
raise from the device without a sync, so the host counts the compiled steps itself and raises before the step that
would write past the preallocated slots. generate() sizes the store from its max_length, so it never gets there; a
caller driving generate()'s compiled forward past it gets this error instead of a write out of bounds.

Guards: generate() compiles the decode step (``get_compiled_call``) and calls it once per token. Before each call
torch.compile evaluates the graph's guards: every tensor input and every Python attribute the trace read, ~300
weights and ~10 cache attributes per layer for an 8B model. On the H100 host that is ~1 ms of CPU per token, during
which the GPU waits (generate synchronises every step). Within one request nothing those guards protect can change
between decode steps: the same cache object, buffers at fixed addresses (compiled mode never grows them), the same
shapes and dtypes, grad mode off. So the first decode step of each generate() call runs every guard (a new shape
recompiles as usual), and the later steps run only the guards that tell apart already-compiled graphs
(``torch.compiler.set_stance(skip_guard_eval_unsafe=True)``).

``decode_guard_checks="every_step"`` turns this off.
"""

from __future__ import annotations

import functools

import torch

from ..cache.cache import RocketKVCache


class CompiledDecodeStep:
    """Wraps generate()'s compiled forward for RocketKV caches: capacity check, then guards once per request."""

    def __init__(self, compiled):
        self.compiled = compiled

    def __call__(self, **inputs):
        cache = inputs.get("past_key_values")
        if not isinstance(cache, RocketKVCache):
            return self.compiled(**inputs)
        count_decode_step(cache, inputs)
        if cache.config.decode_guard_checks == "every_step":
            return self.compiled(**inputs)
        if not cache.hints.guards_checked:
            outputs = self.compiled(**inputs)
            cache.hints.guards_checked = True
            return outputs
        with torch.compiler.set_stance("default", skip_guard_eval_unsafe=True):
            return self.compiled(**inputs)


def count_decode_step(cache: RocketKVCache, inputs: dict) -> None:
    """Advance every compressed layer's host mirror of its longest row by one token, or raise if it is full.

    Compiled steps skip the eager bookkeeping in ``RocketKVLayer._append_one``; this keeps the mirror exact, so a
    later eager forward on this cache (a next turn) grows the store from the true length.
    """
    ids = inputs.get("input_ids")
    if ids is not None and ids.shape[-1] != 1:
        return  # not a one-token decode step: the eager path handles (and grows) it
    for layer_idx, layer in enumerate(cache.layers):
        if not layer.compressed:
            continue
        if layer.host_max_length >= layer.capacity:
            raise RuntimeError(
                f"RocketKVCache layer {layer_idx} is full: {layer.capacity} slots per row hold the kept prompt and "
                f"every generated token, and a compiled decode step cannot grow them. generate() sizes them from "
                f"max_length (max_new_tokens); when driving the compiled forward yourself, pass a larger max_length "
                f"or decode eagerly (disable_compile=True), where the store grows."
            )
        layer.note_decode_step()


def wrap_get_compiled_call(original):
    @functools.wraps(original)
    def get_compiled_call(self, compile_config):
        return CompiledDecodeStep(original(self, compile_config))

    return get_compiled_call
