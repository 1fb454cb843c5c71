"""Warm-up of the batching engine: every bucket's decode graph captured before serving (``BatchingEngine.warm_up``).

Captured lazily, each bucket costs an eager step and a capture while real requests wait, and every row whose view
table is wider than any before reallocates the batch's buffers, after which every bucket is captured again. So, as
vLLM and TensorRT-LLM do at start-up, one synthetic request is prefilled exactly as a request is (pool reservation,
its own pool-backed ``RocketKVCache``, stage 1), joins the batch as row 0 and decodes two steps per bucket (padded to
the bucket: warm-up, then capture); then it leaves and its pages go back. It also plans the cuDNN attention graphs
of the prompts to come (prefill_graphs.py), which the thread that prefills builds when the engine starts.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from dataclasses import dataclass

import torch

from ...integration.decode_graphs import on_device
from ...memory import PoolExhaustedError
from ..engines.interface import EngineRequest
from ..sampling import SamplingParams
from .admission import PoolAdmission
from .decode_step import BatchDecoder
from .running import RunningRequest

logger = logging.getLogger(__name__)

DEFAULT_WARMUP_MAX_TOKENS = 512  # max_tokens covered by BatchingEngine.warm_up (and GenerationManager's) default
# the warm-up request's prefix-index salt: its prompt pages (cached once it ends) can never be a real request's hit
WARMUP_CACHE_SALT = "hf_rocketkv.batching.warm_up"
WARMUP_REQUEST_ID = "hf_rocketkv-warm-up"


@dataclass(frozen=True)
class EngineParts:
    """What the warm-up drives of a ``BatchingEngine``, handed over by the engine itself (``BatchingEngine.warm_up``):
    its admission (prefill and release of the synthetic request), its decoder (the steps) and how it resets its batch
    after a failed step."""

    admission: PoolAdmission
    decoder: BatchDecoder
    reset_batch: Callable[[], None]


def warm_up(engine, parts: EngineParts, max_new_tokens: int, buckets: tuple[int, ...] | None,
            prefill_tokens: int | None = None) -> dict:
    """Capture the decode graph of every bucket of ``engine`` (a ``BatchingEngine`` not started yet: the engine
    refuses a warm-up after ``start()``) now.

    The synthetic request has ``engine.warm_up_prompt_len`` random token ids and ``max_tokens = max(max_new_tokens,
    2 * len(buckets) + 1)``. Its view table is as wide as that of any request whose ``max_tokens <= max_new_tokens``,
    whatever its prompt length (a view holds ``min(prompt, prompt_budget) + max_tokens`` tokens, docs/memory.md), so
    such requests never trigger a capture or a table widening afterwards. A request with more ``max_tokens`` widens
    the tables and the buckets are captured again, lazily, as without warm-up. The cost of a wide table is paid from
    the first step: the tables stay as wide as the warm-up's.

    Args:
        max_new_tokens: the largest ``max_tokens`` to cover (an int >= 1).
        buckets: the batch sizes to capture, each one of ``BatchingConfig.buckets``; default: every bucket up to
            ``bucket_for(max_running)``, the largest one a step can use.
        prefill_tokens: prompts of up to this many tokens meet no new cuDNN attention graph while serving
            (prefill_graphs.py: planned here, built by the prefilling thread before ``start()`` returns; 31 shapes,
            2.4-5.2 s on an H100, at the default: two ``prefill_chunk_tokens`` chunks). 0: none. Not under lockstep.

    Runs on the caller's thread, before ``start()``: the engine thread owns the batch once started; graphs captured
    here replay on it. Without graphs (CPU, ``decode_graphs=False``)
    the steps run eagerly (kernels and allocator warmed) and nothing is captured. The synthetic request's
    prompt pages stay in the prefix index as evictable cached pages under a salt of their own (no real request
    can hit them); the pool's free pages are back to what they were. Raises ``ValueError`` for bad arguments
    and ``PoolExhaustedError`` (pages needed and free) when the pool cannot hold the synthetic request.

    Returns ``{"seconds", "buckets", "captures", "table_pages", "max_new_tokens", "prefill_shapes"}``: wall time,
    the buckets stepped, graphs captured, the batch's table width in pool pages, the ``max_tokens`` covered, and
    the prefill attention shapes planned (``engine.prefill_graphs.report`` says what ``start()`` built).
    """
    if not isinstance(max_new_tokens, int) or isinstance(max_new_tokens, bool) or max_new_tokens < 1:
        raise ValueError(f"BatchingEngine.warm_up: max_new_tokens must be an integer >= 1, got {max_new_tokens!r}")
    buckets = _checked_buckets(engine.batching, buckets)
    if prefill_tokens is None:
        prefill_tokens = 2 * engine.batching.prefill_chunk_tokens
    if not isinstance(prefill_tokens, int) or isinstance(prefill_tokens, bool) or prefill_tokens < 0:
        raise ValueError(f"BatchingEngine.warm_up: prefill_tokens must be an integer >= 0 (0: no prefill graphs), "
                         f"got {prefill_tokens!r}")
    graphs = engine.graphs if engine.graphs_in_use else None
    captured_before = graphs.captures if graphs is not None else 0
    started = time.perf_counter()
    running = _synthetic_request(engine, parts.admission, max(max_new_tokens, 2 * len(buckets) + 1),
                                 scratch=buckets[-1] > 1)
    try:
        # not inference_mode: the batch's buffers are updated in place on the engine thread; the model's GPU
        # as the current device, as on the engine thread (the graphs captured here replay there)
        with torch.no_grad(), on_device(engine.device):
            _steps(engine, parts, running, buckets)
    finally:
        parts.admission.release(running)
        engine.batch.release_scratch()
    result = {
        "seconds": time.perf_counter() - started,
        "buckets": buckets,
        "captures": graphs.captures - captured_before if graphs is not None else 0,
        "table_pages": engine.batch.table_width,
        "max_new_tokens": running.request.max_new_tokens,
        "prefill_shapes": 0,
    }
    if prefill_tokens and engine.lockstep is None:  # (a rank's heads are a shard of the config's)
        result["prefill_shapes"] = len(engine.plan_prefill_graphs(prefill_tokens).shapes)
    logger.info("hf_rocketkv batching engine: warmed up buckets %s in %.2f s (%d graphs captured, tables of %d "
                "pages: max_tokens <= %d never captures again)", buckets, result["seconds"], result["captures"],
                result["table_pages"], result["max_new_tokens"])
    return result


def _checked_buckets(config, buckets: tuple[int, ...] | None) -> tuple[int, ...]:
    """The buckets to warm up, checked against ``config`` (a ``BatchingConfig``); default: those a step can use (up
    to the bucket of max_running)."""
    if buckets is None:
        largest = config.bucket_for(config.max_running)
        return tuple(b for b in config.buckets if b <= largest)
    if isinstance(buckets, int) or not all(isinstance(b, int) and not isinstance(b, bool) for b in buckets):
        raise ValueError(f"BatchingEngine.warm_up: buckets must be a tuple of batch sizes, got {buckets!r}")
    unknown = [b for b in buckets if b not in config.buckets]
    if unknown or not buckets:
        raise ValueError(f"BatchingEngine.warm_up: buckets must be among BatchingConfig.buckets "
                         f"{config.buckets}, got {tuple(buckets)!r}")
    return tuple(sorted(set(buckets)))


def _synthetic_request(engine, admission: PoolAdmission, max_new_tokens: int, scratch: bool) -> RunningRequest:
    """The synthetic request, its pages set aside as admission does (PoolExhaustedError when they do not fit):
    its prefill peak, or its view plus the padding rows' scratch page if that is more."""
    vocab = int(engine.model.config.get_text_config().vocab_size)
    generator = torch.Generator().manual_seed(0)  # reproducible; the salt keeps them out of real hits anyway
    ids = torch.randint(0, vocab, (engine.warm_up_prompt_len,), generator=generator).tolist()
    request = EngineRequest(WARMUP_REQUEST_ID, tuple(ids), SamplingParams.greedy(max_new_tokens, ignore_eos=True),
                            frozenset())
    running = RunningRequest(request, cache_salt=WARMUP_CACHE_SALT)
    plan = admission.pages(request)
    paged = bool(engine.pool.hybrid.global_layers)  # (a model whose layers all slide has no pages, no scratch page)
    need = max(plan.peak_pages, plan.steady_pages + int(scratch and paged))
    running.set_aside(engine.pool.reserve(
        need, f"BatchingEngine.warm_up's synthetic request ({request.prompt_len} prompt tokens, max_tokens="
              f"{max_new_tokens}{', plus a scratch page for padding rows' if scratch else ''}; warm up fewer "
              f"max_new_tokens or give the pool more memory)",
        slots=(1 + int(scratch)) if engine.pool.has_sliding_layers else 0))
    return running


def _steps(engine, parts: EngineParts, running: RunningRequest, buckets: tuple[int, ...]) -> None:
    """Prefill the synthetic request, join it as row 0, two decode steps per bucket, leave."""
    token = int(parts.admission.prefill(running).argmax(dim=-1)[0])
    engine.batch.join(0, running.cache)  # the row takes the request's pages
    running.drop_cache()
    try:
        for bucket in buckets:
            if bucket > 1 and not engine.batch.ensure_scratch():
                raise PoolExhaustedError("the padding rows' scratch page (BatchingEngine.warm_up)", 1,
                                         engine.pool.free_pages(), engine.pool.total_pages())
            for _ in range(2):  # a bucket's first step warms up, its second captures (batch_graphs.py)
                token = int(parts.decoder.step_logits(1, bucket, [token]).argmax(dim=-1)[0])
    except BaseException:
        parts.reset_batch()  # a failed step may leave the batch half-updated
        raise
    engine.batch.leave(0)
