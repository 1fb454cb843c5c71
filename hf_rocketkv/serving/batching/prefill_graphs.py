"""cuDNN's prefill attention graphs, built when the batching engine starts instead of at requests' prefills.

cuDNN builds an execution graph for every new attention shape, ~70 ms each on an H100 (~140 ms for a chunk's split),
once per process *and thread*: its graph cache is thread-local. The prefill attention pads queries to buckets
(integration/causal_prefill.py), so prompts of up to N tokens meet a bounded set of shapes (``cudnn_shapes``: 31
at the default 8192-token chunks and N = 16k). Met lazily, each request that brings a new bucket pays its graph in
its prefill, with the running requests waiting. ``BatchingEngine.warm_up(prefill_tokens=N)`` plans
them; the thread that prefills (the engine thread, or the prefill thread with ``concurrent_prefill_tokens``) builds
them before it serves, and ``start()`` returns once they are built.

Shapes that no warm-up planned (an engine without one, as ``generate_batch`` builds; a prompt longer than the
planned length) are built by ``LookaheadGraphs`` on the engine thread right after a prefill chunk's kernels are
queued, for the later chunks of that prompt and for the next prompt to prefill: the device runs the chunk meanwhile
and the host would only wait for it, so those graphs cost nothing (~60-170 ms of host time each otherwise, in the
prefill that meets them).
"""

from __future__ import annotations

import contextlib
import logging
import threading
import time

import torch

from ...integration.causal_prefill import (
    CUDNN_MAX_HEAD_DIM,
    cudnn_shapes,
    cudnn_shapes_of_prompt,
    prefill_attention_kind,
    warm_cudnn_graphs,
)

logger = logging.getLogger(__name__)


class PrefillGraphs:
    """The cuDNN graphs of prompts of up to ``prompt_tokens`` tokens prefilled in chunks of ``chunk_tokens``, for
    ``model``'s attention geometry (its text config's query heads; the KV heads and head dim the engine's ``pool``
    read from it; batch 1, its dtype).

    No shape when no prefill reaches cuDNN: a model without full-attention layers (the pool's ``global_layers``
    empty: every layer slides), whose heads are wider than cuDNN's path takes (Gemma 3's 256), or whose attention
    soft-caps its logits (``prefill_attention_kind``). A model with sinks (gpt-oss) gets the graphs its prefill
    meets: each row's log-sum-exp asked for.

    ``build()`` runs on the prefilling thread (the lock, if given, held: no graph capture meanwhile); ``wait()``
    returns once it ran. A failure is logged and leaves the graphs to be built lazily, as without this."""

    def __init__(self, model, pool, device: torch.device, chunk_tokens: int, prompt_tokens: int):
        self.query_heads, self.kv_heads, self.head_dim = attention_geometry(model, pool)
        self.dtype, self.device = model.dtype, device
        self.prompt_tokens = prompt_tokens
        kind = prefill_attention_kind(model)
        self.shapes = cudnn_shapes(chunk_tokens, prompt_tokens) if reaches_cudnn(kind, pool) else []
        self.sinks = kind == "sinks"
        self.report: dict | None = None
        self._built = threading.Event()

    def build(self, lock: threading.Lock | None = None) -> None:
        started = time.perf_counter()
        try:
            with torch.no_grad(), lock if lock is not None else contextlib.nullcontext():
                built = warm_cudnn_graphs(self.shapes, self.query_heads, self.kv_heads, self.head_dim, self.dtype,
                                          self.device, sinks=self.sinks)
            self.report = {"shapes": built, "seconds": time.perf_counter() - started,
                           "thread": threading.current_thread().name}
            logger.info("hf_rocketkv batching engine: built the prefill attention graphs of %d shapes (prompts up "
                        "to %d tokens) in %.2f s", built, self.prompt_tokens, self.report["seconds"])
        except Exception:  # noqa: BLE001 - an optimisation: serving goes on, the graphs are built when met
            logger.warning("hf_rocketkv batching engine: building the prefill attention graphs failed; they are "
                           "built at the prefills that meet them", exc_info=True)
        finally:
            self._built.set()

    def release(self) -> None:
        """Let ``wait`` return without a build (the thread that was to build them ended first)."""
        self._built.set()

    def wait(self, alive=lambda: True) -> None:
        """Return once ``build`` ran or ``release`` was called, or as soon as ``alive()`` is False (the engine
        thread ended)."""
        while not self._built.wait(0.1):
            if not alive():
                return


def attention_geometry(model, pool) -> tuple[int, int, int]:
    """``(query heads, KV heads, head dim)`` of the model's prefill attention (batch 1)."""
    heads = int(model.config.get_text_config().num_attention_heads)
    return heads, pool.geometry.num_kv_heads, pool.geometry.head_dim


def reaches_cudnn(kind: str | None, pool) -> bool:
    """Whether any prefill of a model whose attention is of ``kind`` (``prefill_attention_kind``) reaches cuDNN
    (``PrefillGraphs``' docstring says when none does)."""
    return bool(pool.hybrid.global_layers) and pool.geometry.head_dim <= CUDNN_MAX_HEAD_DIM and kind is not None



class LookaheadGraphs:
    """The cuDNN graphs of what is prefilled next, built on the engine thread while the device runs the chunk just
    queued (module docstring). ``built``: the shapes built on this thread by the warm-up or by this object, each
    built once (a shape a prefill met lazily may be run once more: a dummy call, its graph already cached). Off
    (``enabled`` False) where no prefill reaches cuDNN, off the GPU, and after a failure (logged once: the graphs
    are then built at the prefills that meet them, as without this).

    ``after_chunk(scheduler, lock, current)`` builds what the later chunks of ``current`` (the request whose chunk
    was just queued) meet, then what the next prompt meets: the first admitted request whose prefill has not
    started, else the head of the waiting queue (read under ``lock``). ``warm`` is ``warm_cudnn_graphs``' signature
    (tests pass a recorder)."""

    def __init__(self, model, pool, device: torch.device, chunk_tokens: int, warm=warm_cudnn_graphs):
        self.query_heads, self.kv_heads, self.head_dim = attention_geometry(model, pool)
        self.dtype, self.device, self.chunk_tokens = model.dtype, device, chunk_tokens
        kind = prefill_attention_kind(model)
        self.enabled = device.type == "cuda" and reaches_cudnn(kind, pool)
        self.sinks = kind == "sinks"
        self.built: set[tuple[int, int]] = set()
        self.shapes_built, self.seconds = 0, 0.0
        self._warm = warm

    def after_chunk(self, scheduler, lock: threading.Lock, current=None) -> None:
        if not self.enabled:
            return
        if current is not None and current.prefill is not None and not current.prefill.done:
            self.build_for(current.request.prompt_len, after=current.prefill.position)
        with lock:
            upcoming = next((r for r in scheduler.prefilling if r.prefill is None), None)
            if upcoming is None and scheduler.waiting:
                upcoming = scheduler.waiting[0]
        if upcoming is not None:
            self.build_for(upcoming.request.prompt_len)

    def build_for(self, prompt_tokens: int, after: int = 0) -> None:
        """Build the graphs that a prompt of ``prompt_tokens`` tokens meets in its chunks from column ``after`` on
        (0: all of them) and that this thread has not built yet."""
        todo = [s for s in cudnn_shapes_of_prompt(prompt_tokens, self.chunk_tokens)
                if s[1] >= after and s not in self.built]
        if not self.enabled or not todo:
            return
        self.built.update(todo)
        started = time.perf_counter()
        try:
            with torch.no_grad():
                self.shapes_built += self._warm(todo, self.query_heads, self.kv_heads, self.head_dim, self.dtype,
                                                self.device, sinks=self.sinks)
        except Exception:  # noqa: BLE001 - an optimisation: the prefills build what they meet
            self.enabled = False
            logger.warning("hf_rocketkv batching engine: building the next prompt's attention graphs failed; they "
                           "are built at the prefills that meet them", exc_info=True)
        self.seconds += time.perf_counter() - started
