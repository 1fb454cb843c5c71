"""``OpGraph``: one layer's RocketKV launches of an EAGER decode step, replayed as one small CUDA graph
(``RocketKVConfig.eager_layer_graphs``, on by default on CUDA).

Why: without torch.compile or the whole-step graph (``decode_graphs.py``), a batch-1 decode step is bound by the
host: per layer RocketKV's append (1 Triton kernel + the ``seen`` increment) and its stage 2 (page scores, top-k
selection, sparse attention: 5 kernels) cost ~300 us of host time against ~50 us for DynamicCache's update and sdpa
(``benchmarks/eager_layer_time.py``, H200, 2026-11-26). Their shapes and buffers stay the same from one step to the
next, so each group is captured once and replayed: the host then spends one copy per input and one graph launch.

    step with new buffers (first decode step, a grown store, a new batch):  eager, as without graphs (this also
                                                                             compiles the Triton kernels)
    next step, same buffers:       copy the inputs into static tensors, capture on a side stream, replay
    later steps, same buffers:     copy the inputs, replay

``key`` names everything a capture depends on besides the inputs (copied; their shapes and dtypes join the key):
the addresses, shapes, strides and dtypes of the buffers the launches read and write (the layer's pages, KT, block table, lengths, positions, scales) and any Python
values they take. A different key is a new sequence of launches: the stale graph is dropped and the step runs
eagerly. Nothing else changes: the same launches on the same buffers with the same values, so the results are those
of the eager launches bit for bit (``tests/test_op_graphs.py``; on a GPU, whole generations with and without).

Each graph is captured on a side stream, in ``thread_local`` mode (another thread's CUDA calls during a capture
are not affected), into its own memory pool (its scratch tensors: ~0.2 MiB per layer at 8B shapes, batch 1). The
graph belongs to one layer of one request's cache and is freed with it; nothing is shared between requests.
"""

from __future__ import annotations

from typing import Any, Callable

import torch


class OpGraph:
    """The captured launches of one group (``"append"`` or ``"attention"``) of one layer."""

    __slots__ = ("key", "graph", "inputs", "output", "replays")

    def __init__(self) -> None:
        self.key: tuple | None = None
        self.graph: Any = None
        self.inputs: tuple[torch.Tensor, ...] = ()
        self.output: Any = None
        self.replays = 0

    def __call__(self, key: tuple, launches: Callable[..., Any], *inputs: torch.Tensor) -> Any:
        """``launches(*inputs)`` for this step: eager when ``key`` is new, else through the graph. The result of a
        replay is the graph's static output, overwritten by the next replay (callers use it within the step)."""
        key = (key, tuple((t.shape, t.dtype, t.device) for t in inputs))
        if key != self.key:
            self.key, self.graph, self.inputs, self.output = key, None, (), None
            return launches(*inputs)
        if self.graph is None:
            self.inputs = tuple(t.clone() for t in inputs)
            self.graph, self.output = capture(lambda: launches(*self.inputs))
        else:
            for static, value in zip(self.inputs, inputs):
                static.copy_(value)
        self.graph.replay()
        self.replays += 1
        return self.output


def capture(run: Callable[[], Any]) -> tuple[Any, Any]:
    """Capture ``run()`` (launches only: nothing runs) into a new CUDA graph on a side stream; returns (graph,
    output). Unlike ``torch.cuda.graph`` it neither synchronizes nor empties the allocator's cache first: a step
    captures up to two graphs per layer."""
    graph = torch.cuda.CUDAGraph()
    current = torch.cuda.current_stream()
    stream = torch.cuda.Stream()
    stream.wait_stream(current)
    with torch.cuda.stream(stream):
        graph.capture_begin(capture_error_mode="thread_local")
        try:
            output = run()
        finally:
            graph.capture_end()
    current.wait_stream(stream)
    return graph, output


def buffers_key(*tensors: torch.Tensor | None) -> tuple:
    """Address, shape, strides and dtype of each tensor (None as None): what a captured launch reads them by."""
    return tuple(None if t is None else (t.data_ptr(), t.shape, t.stride(), t.dtype) for t in tensors)
