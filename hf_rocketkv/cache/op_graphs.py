"""``OpGraph``: one layer's RocketKV launches of an EAGER decode step, replayed as one small CUDA graph
(``RocketKVConfig.eager_layer_graphs``, on by default on CUDA).

Why: without torch.compile or the whole-step graph (``decode_graphs.py``), a batch-1 decode step is bound by the
host: per layer RocketKV's append (1 Triton kernel + the ``seen`` increment) and its stage 2 (page scores, top-k
selection, sparse attention: 5 kernels) cost ~300 us of host time against ~50 us for DynamicCache's update and sdpa
(``benchmarks/probes/eager_layer_time.py``, H200, 2026-11-26). Their shapes and buffers stay the same from one step to the
next, so each group is captured once and replayed: the host then spends one copy per input and one graph launch.

    step with new buffers (first decode step, a grown store, a new batch):  eager, as without graphs (this also
                                                                             compiles the Triton kernels)
    next step, same buffers:       copy the inputs into static tensors, capture on a side stream, replay
    later steps, same buffers:     copy the inputs, replay

``key`` names everything a capture depends on besides the inputs (copied; their shapes and dtypes join the key):
the addresses, shapes, strides and dtypes of the buffers the launches read and write (the layer's pages, KT, block
table, lengths, positions, scales) and any Python values they take. A different key is a new sequence of launches:
the stale graph is dropped and the step runs eagerly. Nothing else changes: the same launches on the same buffers
with the same values, so the results are those of the eager launches bit for bit (``tests/cache/test_op_graphs.py``; on
a GPU, whole generations with and without).

Each graph is captured on a side stream, in ``thread_local`` mode (another thread's CUDA calls during a capture
are not affected). All graphs of one request on one GPU capture into one memory pool, on one side stream
(``GraphPool``, kept in ``GenerationHints.op_graph_pool``): a scratch tensor of one graph (page logits, selection
lists, split partials) is dead once that graph has run, and the graphs replay one after another on one stream, so
the next graph may reuse its memory; only each attention graph's output stays allocated. The pool belongs to the
request's cache and is freed with it (and its graphs); nothing is shared between requests.
"""

from __future__ import annotations

import weakref
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

    def __call__(self, key: tuple, launches: Callable[..., Any], *inputs: torch.Tensor, hints=None) -> Any:
        """``launches(*inputs)`` for this step: eager when ``key`` is new, else through the graph. The result of a
        replay is the graph's static output, overwritten by the next replay (callers use it within the step).
        ``hints``: the request's GenerationHints, whose ``op_graph_pool`` every capture of the request shares."""
        key = (key, tuple((t.shape, t.dtype, t.device) for t in inputs))
        if key != self.key:
            self._drop()
            self.key = key
            return launches(*inputs)
        device = inputs[0].device
        if device.index is not None and device.index != torch.cuda.current_device():
            with torch.cuda.device(device):  # a layer on another GPU (device_map, a tensor-parallel rank)
                return self._through_graph(launches, inputs, hints)
        return self._through_graph(launches, inputs, hints)

    def _through_graph(self, launches: Callable[..., Any], inputs: tuple, hints) -> Any:
        if self.graph is None:
            self.inputs = tuple(t.clone() for t in inputs)
            pool = request_pool(hints)
            handle, stream = pool.handle_and_stream() if pool is not None else (None, None)
            self.graph, self.output = capture(lambda: launches(*self.inputs), handle, stream)
            if pool is not None:
                pool.graphs.add(self.graph)
        else:
            for static, value in zip(self.inputs, inputs):
                static.copy_(value)
        self.graph.replay()
        self.replays += 1
        return self.output

    def __deepcopy__(self, memo: dict) -> "OpGraph":
        """A copied cache's layer captures its own launches (its buffers are new): nothing captured yet."""
        return OpGraph()

    def _drop(self) -> None:
        """Forget the graph (destroying it: its pool has one graph less) and its static tensors."""
        self.graph, self.inputs, self.output = None, (), None


class GraphPool:
    """One request's memory pool and capture stream on one GPU, shared by its OpGraphs.

    torch frees a graph memory pool when the last graph captured into it is destroyed, after which its handle must
    not be used again (an internal assert in the caching allocator). So this keeps weak references to the graphs
    captured into the pool and takes a fresh handle when a capture starts with none of them alive (a grown store
    drops every layer's graphs; a dropped layer takes its graphs with it)."""

    def __init__(self) -> None:
        self.handle: Any = None
        self.stream = torch.cuda.Stream()
        self.graphs: weakref.WeakSet = weakref.WeakSet()

    def __deepcopy__(self, memo: dict) -> "GraphPool":
        """A copied cache's graphs capture into a pool of its own."""
        return GraphPool()

    def handle_and_stream(self) -> tuple[Any, Any]:
        if len(self.graphs) == 0:
            self.handle = torch.cuda.graph_pool_handle()
        return self.handle, self.stream


def request_pool(hints) -> GraphPool | None:
    """The request's GraphPool on the current GPU (made on first use); None without hints (a graph then gets a pool
    and a stream of its own)."""
    if hints is None:
        return None
    device = torch.cuda.current_device()
    if device not in hints.op_graph_pool:
        hints.op_graph_pool[device] = GraphPool()
    return hints.op_graph_pool[device]


def capture(run: Callable[[], Any], pool=None, stream: torch.cuda.Stream | None = None) -> tuple[Any, Any]:
    """Capture ``run()`` (launches only: nothing runs) into a new CUDA graph on the side ``stream`` (None: a new
    one), allocating from ``pool`` (a ``torch.cuda.graph_pool_handle()``; None: a pool of its own); returns (graph,
    output). The caching allocator reuses a freed block only on the stream it was allocated on, so the graphs that
    share a pool are captured on one stream too. Unlike ``torch.cuda.graph`` it neither synchronizes nor empties the
    allocator's cache first: a step captures up to two graphs per layer."""
    graph = torch.cuda.CUDAGraph()
    current = torch.cuda.current_stream()
    stream = stream if stream is not None else torch.cuda.Stream()
    stream.wait_stream(current)
    with torch.cuda.stream(stream):
        graph.capture_begin(pool, capture_error_mode="thread_local")
        try:
            output = run()
        finally:
            graph.capture_end()
    current.wait_stream(stream)
    return graph, output


def buffers_key(*tensors: torch.Tensor | None) -> tuple:
    """Address, shape, strides and dtype of each tensor (None as None): what a captured launch reads them by."""
    return tuple(None if t is None else (t.data_ptr(), t.shape, t.stride(), t.dtype) for t in tensors)
