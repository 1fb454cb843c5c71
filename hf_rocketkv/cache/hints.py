"""GenerationHints: what generate() tells a RocketKVCache before prefill, shared by the cache and its layers."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class GenerationHints:
    """What generate() tells the cache before prefill (set by hf_rocketkv's generate integration)."""

    max_length: int | None = None  # logical tokens the cache will have seen at most (prompt + new tokens)
    defer_compression: bool = False  # chunked prefill: run stage 1 at the first decode step, not after each chunk
    # input columns of the prefill in progress (``RocketKVCache.prefill``'s ids): a chunked prefill's dense store is
    # allocated once at that width instead of concatenated at every chunk (cache/dense_store.py)
    prefill_columns: int | None = None
    prefilling: bool = False  # generate()'s prefill is running (chunks must not be compiled: their shapes change)
    guards_checked: bool = False  # this generate() call's first compiled decode step has run with every guard
    # device types on which generate() may defer its stop check by a step (deferred_stop_check); CUDA only, as
    # the check needs device events (tests add "cpu" together with a CPU stand-in for torch.Event)
    deferred_stop_devices: tuple[str, ...] = ("cuda",)
    # a decode step is being captured or replayed as a CUDA graph (integration/decode_graphs.py): Python runs once at
    # capture and never at replay, so the step's runner does the host bookkeeping, not the traced code
    in_graph: bool = False
    # this request's captured decode step (integration/decode_graphs.py) and where graphs are used
    graphed_step: object = None
    graph_warmed_up: bool = False
    graph_devices: tuple[str, ...] = ("cuda",)
    graph_backend: object = None  # None: torch.cuda graphs (tests put a CPU stand-in here)
    # GPU index -> GraphPool (memory pool and capture stream) that every layer's eager-step OpGraphs on that GPU
    # capture into (cache/op_graphs.py), made at the first capture: one per request and GPU, so the layers' scratch
    # tensors share memory instead of a pool each
    op_graph_pool: dict = field(default_factory=dict)
    # batch_buckets: generate() padded the caller's rows (real) up to a bucket (padded) with copies of row 0;
    # prefill runs the real rows only and copies row 0's cache (integration/batch_buckets.py)
    batch_padding: tuple[int, int] | None = None
    # the padding offsets of the latest prefill forward's mask (integration/attention.py padding_of_forward):
    # (weak reference to the mask, kv length, offsets on the device, offsets on the host), read once per forward
    padding_memo: tuple | None = None
    # whether that mask is plain lower-right causal (integration/attention.py lower_right_causal): (weak reference to
    # the mask, answer), compared once per forward
    causal_memo: tuple | None = None

    def forget_graph(self) -> None:
        """Drop the captured decode step (its buffers change when a new turn is prefilled)."""
        self.graphed_step = None
        self.graph_warmed_up = False
