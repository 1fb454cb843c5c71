"""A request's decode step as a CUDA graph of the eager forward (``RocketKVConfig.decode_runner="cuda_graphs"``).

generate() compiles decode steps with torch.compile (inductor + CUDA graphs) when a cache is compileable. That costs
a whole-model compile on a process's first call (78-166 s for an 8B model), a recompile whenever a shape changes
(prompt length, batch size, max_new_tokens) and guard checks before every step. RocketKV's decode step has fixed
shapes within one request and no host synchronisation, so it can instead be captured as it runs eagerly:

    step 1   eager, on a side stream (warms up cuBLAS and the Triton kernels; a real step)
    step 2   copy the inputs into static buffers, capture the forward into a torch.cuda.CUDAGraph, replay it
    step 3+  copy the inputs, advance the cache's host bookkeeping, replay

There is no dynamo, so no compile, no recompiles and no guards: a new prompt length, batch size or max_new_tokens is
just another capture (~2 eager steps) on that request's first decode steps. Python runs at capture only, so the
cache layers skip their host bookkeeping while ``cache.hints.in_graph`` is set (``GenerationHints.graph_step``) and
this runner does it instead (``count_decode_step``: capacity check, length mirrors).

The graph lives on the request's cache (``cache.hints``): it is specific to that cache's buffers, and freed with it.
Everything here runs on the thread that calls generate(); nothing is shared between requests or threads.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass, field
from typing import Any, Callable

import torch

from ..cache.cache import RocketKVCache
from .call_state import call_state
from .compiled_decode import count_decode_step


def wants_graphs(cache: RocketKVCache, kwargs: dict) -> bool:
    """A one-token decode step of a cache configured for CUDA graphs, on a device that has them."""
    if cache.config.decode_runner != "cuda_graphs":
        return False
    ids = kwargs.get("input_ids")
    if ids is None or ids.dim() != 2 or ids.shape[1] != 1:
        return False
    return ids.device.type in call_state(cache).graph_devices


def signature_of(kwargs: dict) -> tuple:
    """What a captured graph depends on: every tensor's shape, dtype and device, every other value as is."""
    parts = []
    for name in sorted(kwargs):
        value = kwargs[name]
        if isinstance(value, torch.Tensor):
            parts.append((name, tuple(value.shape), value.dtype, value.device))
        elif isinstance(value, dict):
            parts.append((name, signature_of(value)))
        elif isinstance(value, RocketKVCache):
            parts.append((name, id(value)))
        else:
            parts.append((name, value))
    return tuple(parts)


def static_copy(value):
    """A static buffer for one input (tensors cloned, dicts of tensors recursively, anything else as is)."""
    if isinstance(value, torch.Tensor):
        return value.clone()
    if isinstance(value, dict):
        return {k: static_copy(v) for k, v in value.items()}
    return value


def copy_into(static, value) -> None:
    if isinstance(static, torch.Tensor):
        static.copy_(value)
    elif isinstance(static, dict):
        for key, item in static.items():
            copy_into(item, value[key])


def on_device(device) -> contextlib.AbstractContextManager:
    """Make ``device`` (a GPU) the calling thread's current CUDA device for the block; no-op off CUDA.

    The current device is per host thread, and a thread starts on GPU 0, while side streams, graph captures, events,
    Triton launches and NCCL collectives run on the current device: a model on another GPU (a tensor-parallel rank
    > 0, ``device_map="cuda:1"``) would otherwise have them on the wrong one."""
    device = torch.device(device)
    return torch.cuda.device(device) if device.type == "cuda" else contextlib.nullcontext()


class CudaGraphBackend:
    """torch.cuda.CUDAGraph capture and replay (the real thing; tests substitute a CPU stand-in)."""

    def warm_up(self, run: Callable[[], Any]):
        """Run one real step on a side stream, as torch recommends before a capture."""
        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):
            out = run()
        torch.cuda.current_stream().wait_stream(stream)
        return out

    def capture(self, run: Callable[[], Any]):
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            out = run()
        return graph, out

    def replay(self, graph) -> None:
        graph.replay()


@dataclass
class GraphedStep:
    """The captured decode step of one request (one input signature).

    It never holds the request's cache: the cache holds it (``call_state(cache).graphed_step``), and a cycle through the
    step's inputs or output would keep a pool-backed request's pages out of the pool after the request, until Python's
    cyclic garbage collector happened to run. The cache is left out of ``static_kwargs``, taken out of the static
    output after every step, and put back from the live cache into each step's output (``cache_fields``)."""

    signature: tuple
    static_kwargs: dict
    graph: Any
    static_output: Any
    cache_fields: set = field(default_factory=set)
    replays: int = field(default=0)

    @classmethod
    def captured(cls, signature: tuple, static_kwargs: dict, graph, static_output) -> "GraphedStep":
        return cls(signature, _without_caches(static_kwargs), graph, static_output)

    def replay(self, backend) -> None:
        """Run the captured step once more on ``backend`` (its static inputs already written), counted."""
        backend.replay(self.graph)
        self.replays += 1

    def output(self, cache: RocketKVCache):
        """The step's output: tensors cloned out of the graph's static memory (the next replay overwrites it), the
        live cache where the model's output had it."""
        self.cache_fields |= {k for k, v in self.static_output.items() if isinstance(v, RocketKVCache)}
        fields = {}
        for key, value in self.static_output.items():
            fields[key] = cache if key in self.cache_fields else (
                value.clone() if isinstance(value, torch.Tensor) else value)
        for key in self.cache_fields:
            self.static_output[key] = None  # no reference back to the cache
        return type(self.static_output)(**fields)


def _without_caches(mapping: dict) -> dict:
    return {k: v for k, v in mapping.items() if not isinstance(v, RocketKVCache)}


def run_graphed_step(model, cache: RocketKVCache, kwargs: dict, backend=None):
    """One decode step of ``cache``'s request through its CUDA graph (see the module docstring for the phases),
    on the inputs' GPU as the current device."""
    with on_device(kwargs["input_ids"].device):
        return _run_graphed_step(model, cache, kwargs, backend)


def _run_graphed_step(model, cache: RocketKVCache, kwargs: dict, backend=None):
    state = call_state(cache)
    backend = backend if backend is not None else state.graph_backend or CudaGraphBackend()
    signature = signature_of(kwargs)
    step: GraphedStep | None = state.graphed_step
    if step is not None and step.signature != signature:
        step = None  # new shapes within the request (rare): capture again
        state.keep_step(None)
    if step is None and not state.graph_warmed_up:
        state.warmed_up()
        return backend.warm_up(lambda: model(**kwargs))
    count_decode_step(cache, (), kwargs)  # capacity check and host mirrors, before the device step
    if step is None:
        static_kwargs = {k: static_copy(v) for k, v in kwargs.items()}
        with cache.hints.graph_step():
            graph, static_output = backend.capture(lambda: model(**static_kwargs))
        step = GraphedStep.captured(signature, static_kwargs, graph, static_output)
        state.keep_step(step)
    else:
        for name, static in step.static_kwargs.items():
            copy_into(static, kwargs[name])
    with cache.hints.graph_step():
        step.replay(backend)
    return step.output(cache)
