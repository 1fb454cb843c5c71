"""The continuous-batching decode step as one CUDA graph per bucket (``serving/batching/decode_step.py`` runs it).

A ``BatchedDecodeCache`` keeps its per-row buffers (block table, lengths, positions, logical lengths) at fixed
addresses, and a step over ``bucket`` rows reads the first ``bucket`` entries of each: the same tensors every step,
only their contents change (rows join, move, leave, pad). So the eager decode forward of each bucket can be captured
once and replayed, as ``decode_graphs.py`` does for one request:

    first step of a bucket    eager, on a side stream (warms up cuBLAS and the Triton kernels; a real step)
    second step               capture into a graph with static ``input_ids`` / ``position_ids`` buffers, replay
    later steps               copy the inputs into the static buffers, replay

While capturing or replaying, ``batch.hints.in_graph`` is set: the layers skip their host bookkeeping (Python does
not run at replay), and the engine does it instead (``BatchedDecodeCache.prepare`` checks each row's room before the
step, ``stepped`` counts after). Graphs are keyed by the batch object and its ``version``: widening the tables
(a row with more pages than any before) reallocates the buffers, and every bucket is captured again.

Everything runs on the engine thread; the graphs belong to this object and are freed with it.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from ..cache.batch_view import BatchedDecodeCache
from . import compat
from .decode_graphs import CudaGraphBackend


class GraphCaptureFailed(RuntimeError):
    """Capturing a bucket's step failed (nothing ran on the device: the batch is as before); run it eagerly."""


@dataclass
class BucketGraph:
    """The captured step of one bucket: its static inputs and output."""

    input_ids: torch.Tensor  # [bucket, 1]
    position_ids: torch.Tensor  # [bucket, 1]
    graph: Any
    output: Any
    replays: int = 0

    def replay(self, backend) -> None:
        """Run the captured step once more on ``backend`` (its static inputs already written), counted."""
        backend.replay(self.graph)
        self.replays += 1


class BatchedDecodeGraphs:
    """Per-bucket CUDA graphs of a ``BatchedDecodeCache`` decode step.

    Args:
        model: the causal LM (rocketkv attention).
        backend: capture / replay (default ``CudaGraphBackend``; tests use a CPU stand-in).
        devices: device types on which steps are graphed (others run eagerly).
    """

    def __init__(self, model, backend=None, devices: tuple[str, ...] = ("cuda",)):
        self.model = model
        self.backend = backend if backend is not None else CudaGraphBackend()
        self.devices = devices
        self.graphs: dict[int, BucketGraph] = {}
        self.warmed: set[int] = set()
        self.captures = 0
        # the batch (held: an id could be reused by a new object) and its version the graphs were captured for
        self._batch: BatchedDecodeCache | None = None
        self._version = -1

    def wants(self, device: torch.device) -> bool:
        return device.type in self.devices

    def will_capture(self, batch: BatchedDecodeCache) -> bool:
        """Whether ``run`` on the prepared bucket of ``batch`` would warm up or capture (not only replay): no other
        thread may launch CUDA work during a capture."""
        return batch is not self._batch or batch.version != self._version or batch.bucket not in self.graphs

    def run(self, batch: BatchedDecodeCache, input_ids: torch.Tensor, position_ids: torch.Tensor) -> torch.Tensor:
        """One decode step over the prepared bucket (``batch.prepare`` done); returns the logits ``[bucket, V]``
        (a copy: the next replay overwrites the graph's output)."""
        bucket = batch.bucket
        if input_ids.shape != (bucket, 1) or position_ids.shape != (bucket, 1):
            raise ValueError(f"BatchedDecodeGraphs.run: inputs must be [{bucket}, 1] (the prepared bucket), got "
                             f"{tuple(input_ids.shape)} and {tuple(position_ids.shape)}")
        if batch is not self._batch or batch.version != self._version:
            # another batch, or its buffers moved: every graph points at old addresses
            self.graphs.clear()
            self.warmed.clear()
            self._batch, self._version = batch, batch.version
        step = self.graphs.get(bucket)
        if step is None and bucket not in self.warmed:
            self.warmed.add(bucket)
            out = self.backend.warm_up(lambda: self._forward(batch, input_ids, position_ids))
            return out.logits[:, -1]
        if step is None:
            step = self._capture(batch, input_ids, position_ids)
        else:
            step.input_ids.copy_(input_ids)
            step.position_ids.copy_(position_ids)
        with batch.hints.graph_step():
            step.replay(self.backend)
        return step.output.logits[:, -1].clone()

    def _capture(self, batch: BatchedDecodeCache, input_ids: torch.Tensor, position_ids: torch.Tensor) -> BucketGraph:
        static_ids, static_positions = input_ids.clone(), position_ids.clone()
        try:
            with batch.hints.graph_step():
                graph, output = self.backend.capture(lambda: self._forward(batch, static_ids, static_positions))
        except Exception as err:  # noqa: BLE001 - the caller falls back to eager steps
            raise GraphCaptureFailed(f"capturing the decode step of bucket {batch.bucket} failed: "
                                     f"{type(err).__name__}: {err}") from err
        self.captures += 1
        step = BucketGraph(static_ids, static_positions, graph, output)
        self.graphs[batch.bucket] = step
        return step

    def _forward(self, batch: BatchedDecodeCache, input_ids: torch.Tensor, position_ids: torch.Tensor):
        return self.model(input_ids=input_ids, position_ids=position_ids, use_cache=True, **compat.cache_kwargs(batch))
