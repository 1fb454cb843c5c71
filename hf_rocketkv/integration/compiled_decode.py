"""What generate()'s compiled decode step does on the host around the compiled graph, for RocketKV caches only:
a capacity check, decode-time compression when it is due, and the torch.compile guard policy
(``RocketKVConfig.decode_guard_checks``).

Decode-time compression (``RocketKVConfig.decode_budget``): its compaction has fixed shapes and runs in place on
the layers' fixed-address buffers, but the decision *when* is a host counter, which a compiled or captured step
cannot hold. So ``count_decode_step`` runs it eagerly before the step that would exceed the budget; the compiled
graph (or the CUDA graph) only writes each step's query into the layer's ring buffer.

Capacity: a compiled step cannot grow the store (that would change the graph's shapes and addresses) and cannot
raise from the device without a sync, so the host counts the compiled steps itself and raises before the step that
would write past the preallocated slots. generate() sizes the store from its max_length, so it never gets there; a
caller driving generate()'s compiled forward past it gets this error instead of a write out of bounds.

Guards: before each call torch.compile evaluates the graph's guards (~300 weights and ~10 cache attributes per
layer for an 8B model, ~1 ms of CPU per token on an H100 host). ``decode_guard_checks="every_step"`` (the default)
leaves that alone. ``"first_step"`` runs every guard on a request's first compiled step and afterwards only the
guards that tell compiled graphs apart (``torch.compiler.set_stance(skip_guard_eval_unsafe=True)``), which is safe
within one request (same cache object, fixed buffer addresses, same shapes). torch's stance is process-global,
though: while such a step runs, compiled code in *other* threads would skip its guards too. So "first_step" holds a
lock around the step (RocketKV steps of different threads never overlap) and is documented as meant for processes
that run one generate() at a time.
"""

from __future__ import annotations

import threading

import torch

from ..cache.cache import RocketKVCache
from .call_state import call_state

# Serialises "first_step" decode steps: torch.compiler.set_stance saves and restores a process-global stance, and two
# threads interleaving enter/exit would leave guard evaluation switched off for the whole process.
_STANCE_LOCK = threading.Lock()


def run_compiled_step(compiled, cache: RocketKVCache, args: tuple, kwargs: dict):
    """One compiled forward of a RocketKV request: capacity check, then the configured guard policy."""
    count_decode_step(cache, args, kwargs)
    with cache.hints.graph_step():  # counted here: a step dynamo runs eagerly (a frame it skips) must not count again
        if cache.config.decode_guard_checks == "every_step":
            return compiled(*args, **kwargs)
        with _STANCE_LOCK:
            if not call_state(cache).guards_checked:
                outputs = compiled(*args, **kwargs)
                call_state(cache).set_guards_checked()
                return outputs
            with torch.compiler.set_stance("default", skip_guard_eval_unsafe=True):
                return compiled(*args, **kwargs)


def count_decode_step(cache: RocketKVCache, args: tuple, kwargs: dict) -> None:
    """Advance every compressed layer's host mirror of its longest row by one token, or raise if it is full.

    Compiled steps skip the eager bookkeeping of ``cache/decode_append.py``'s ``append_one``; this keeps the mirror exact, so a
    later eager forward on this cache (a next turn) grows the store from the true length.
    """
    ids = kwargs.get("input_ids", args[0] if args else None)
    if ids is not None and ids.shape[-1] != 1:
        return  # not a one-token decode step: the eager path handles (and grows) it
    for layer_idx, layer in enumerate(cache.layers):
        if layer.is_sliding:  # its ring has a fixed size: nothing can fill up
            layer.count_graphed_step()
            continue
        if not layer.compressed:
            continue
        layer.maybe_compress_decode()  # decode-time compression runs here, eagerly, between two device steps
        if layer.decode_room() <= 0:
            raise RuntimeError(
                f"RocketKVCache layer {layer_idx} is full: its slots per row ({layer.capacity} in the widest) hold the "
                f"kept prompt and every generated token, and a compiled decode step cannot grow them. generate() "
                f"sizes them from "
                f"max_length (max_new_tokens); when driving the compiled forward yourself, pass a larger max_length "
                f"or decode eagerly (disable_compile=True), where the store grows."
            )
        layer.note_decode_step(graphed=True)  # the traced/graphed update() skipped its host count
