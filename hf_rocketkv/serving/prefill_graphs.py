"""cuDNN's prefill attention graphs, built when the batching engine starts instead of at requests' prefills.

cuDNN builds an execution graph for every new attention shape, ~70 ms each on an H100 (~140 ms for a chunk's split),
once per process *and thread*: its graph cache is thread-local. The prefill attention pads queries to buckets
(integration/causal_prefill.py), so prompts of up to N tokens meet a bounded set of shapes (``cudnn_shapes``: 31
at the default 8192-token chunks and N = 16k). Met lazily, each request that brings a new bucket pays its graph in
its prefill, with the running requests waiting. ``BatchingEngine.warm_up(prefill_tokens=N)`` plans
them; the thread that prefills (the engine thread, or the prefill thread with ``concurrent_prefill_tokens``) builds
them before it serves, and ``start()`` returns once they are built.
"""

from __future__ import annotations

import contextlib
import logging
import threading
import time

import torch

from ..integration.causal_prefill import CUDNN_MAX_HEAD_DIM, cudnn_shapes, plain_attention, warm_cudnn_graphs

logger = logging.getLogger(__name__)


class PrefillGraphs:
    """The cuDNN graphs of prompts of up to ``prompt_tokens`` tokens prefilled in chunks of ``chunk_tokens``, for
    ``model``'s attention geometry (its text config's query heads; the KV heads and head dim the engine's ``pool``
    read from it; batch 1, its dtype).

    No shape when no prefill reaches cuDNN: a model without full-attention layers (the pool's ``global_layers``
    empty: every layer slides), whose heads are wider than cuDNN's path takes (Gemma 3's 256), or whose attention
    soft-caps its logits or has sinks (``plain_attention``).

    ``build()`` runs on the prefilling thread (the lock, if given, held: no graph capture meanwhile); ``wait()``
    returns once it ran. A failure is logged and leaves the graphs to be built lazily, as without this."""

    def __init__(self, model, pool, device: torch.device, chunk_tokens: int, prompt_tokens: int):
        self.query_heads = int(model.config.get_text_config().num_attention_heads)
        self.kv_heads, self.head_dim = pool.geometry.num_kv_heads, pool.geometry.head_dim
        self.dtype, self.device = model.dtype, device
        self.prompt_tokens = prompt_tokens
        reaches_cudnn = (bool(pool.hybrid.global_layers) and self.head_dim <= CUDNN_MAX_HEAD_DIM
                         and plain_attention(model))
        self.shapes = cudnn_shapes(chunk_tokens, prompt_tokens) if reaches_cudnn else []
        self.report: dict | None = None
        self._built = threading.Event()

    def build(self, lock: threading.Lock | None = None) -> None:
        started = time.perf_counter()
        try:
            with torch.no_grad(), lock if lock is not None else contextlib.nullcontext():
                built = warm_cudnn_graphs(self.shapes, self.query_heads, self.kv_heads, self.head_dim, self.dtype,
                                          self.device)
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
