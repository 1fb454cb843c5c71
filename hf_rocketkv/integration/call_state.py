"""CallState: what the generate() integration keeps for one cache between the steps of its generate() calls.

The cache holds it (``GenerationHints.extension``) and never reads it; integration/ is its only reader and writer:

    token_ids              the ids the cache has served ``[B, L]`` (a reference, no copy): a later generate() call on
                           the same cache must extend them (integration/generate.py ``check_continuation``)
    batch_padding          (real, padded): generate() padded the caller's rows up to a batch bucket with copies of
                           row 0 (integration/batch_buckets.py); None otherwise
    graphed_step           the request's captured decode step (integration/decode_graphs.py), ``graph_warmed_up``
                           whether its eager warm-up step ran
    guards_checked         this call's first compiled decode step ran with every guard (integration/compiled_decode.py)
    mask_memos             what the latest forward's mask answered, by question, so that a forward's layers (which
                           all get the same mask object) read the device once: "padding" (its padding offsets),
                           "causal" (plain lower-right causal: integration/attention.py), "band" (exactly a sliding
                           window's band: integration/window_prefill.py); ``answer_of_mask``
    graph_devices,         where the decode step may be captured as a CUDA graph and with what (tests put "cpu" and a
    graph_backend          stand-in backend here: ``use_graphs_on``)
    deferred_stop_devices  device types on which generate() may read its stop flag a step late (CUDA; tests add "cpu"
                           with a CPU stand-in for torch.Event: ``defer_stop_check_on``)
"""

from __future__ import annotations

import copy
import dataclasses
import weakref
from dataclasses import dataclass
from typing import Callable


@dataclass
class CallState:
    """See the module docstring."""

    token_ids: object = None
    batch_padding: tuple[int, int] | None = None
    graphed_step: object = None
    graph_warmed_up: bool = False
    guards_checked: bool = False
    mask_memos: dict = dataclasses.field(default_factory=dict)
    graph_devices: tuple[str, ...] = ("cuda",)
    graph_backend: object = None
    deferred_stop_devices: tuple[str, ...] = ("cuda",)

    def __deepcopy__(self, memo: dict) -> "CallState":
        """A copied cache's state: the ids it served (copied) and its settings; its decode step is captured again and
        its first compiled step checks every guard (its buffers are new), the latest forward's memos forgotten."""
        return dataclasses.replace(self, token_ids=copy.deepcopy(self.token_ids, memo), graphed_step=None,
                                   graph_warmed_up=False, guards_checked=False, mask_memos={})

    def begin_prefill(self) -> None:
        """A new prefill on the cache: its first compiled decode step runs every guard, and a captured decode step
        points at buffers the prefill reallocates."""
        self.guards_checked = False
        self.forget_graph()

    def forget_graph(self) -> None:
        """Drop the captured decode step (its buffers change when a new turn is prefilled or the rows change)."""
        self.graphed_step = None
        self.graph_warmed_up = False

    def served(self, token_ids) -> None:
        """The ids the cache has served so far ``[B, L]`` (a continuation must extend them)."""
        self.token_ids = token_ids

    def set_batch_padding(self, padding: tuple[int, int] | None) -> None:
        self.batch_padding = padding

    def set_guards_checked(self) -> None:
        self.guards_checked = True

    def warmed_up(self) -> None:
        """The request's eager warm-up step before its decode step's capture has run."""
        self.graph_warmed_up = True

    def keep_step(self, step) -> None:
        """The request's captured decode step (None: capture again at the next step)."""
        self.graphed_step = step

    def answer_of_mask(self, question: str, mask, shape: tuple, answer: Callable[[], object]):
        """``answer()``, computed once per forward: remembered under ``question`` with a weak reference to ``mask``
        and the ``shape`` it was asked for (a new forward's mask is a new object, so it is asked again); the
        question's latest entry is ``mask_memos[question] = (weakref to the mask, shape, answer)``."""
        memo = self.mask_memos.get(question)
        if memo is not None and memo[0]() is mask and memo[1] == shape:
            return memo[2]
        value = answer()
        self.mask_memos[question] = (weakref.ref(mask), shape, value)
        return value

    def use_graphs_on(self, devices: tuple[str, ...], backend=None) -> None:
        """Capture decode steps on these device types, with ``backend`` (None: torch.cuda graphs)."""
        self.graph_devices = tuple(devices)
        self.graph_backend = backend

    def defer_stop_check_on(self, devices: tuple[str, ...]) -> None:
        self.deferred_stop_devices = tuple(devices)


def call_state(cache_or_layer) -> CallState:
    """The CallState of a RocketKVCache, BatchedDecodeCache or one of their layers (they share their cache's
    hints)."""
    return cache_or_layer.hints.extension(CallState)
