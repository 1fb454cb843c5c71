"""The one place an engine is built: ``build_engine`` (and what it checks before building).

    engine = build_engine(model, config, pool=KVBlockPool(model), batching=BatchingConfig(max_running=32))
    manager = GenerationManager(model, tokenizer, config, engine=engine, pool=engine.pool)

``GenerationManager`` (``engine=`` a name), ``generate_batch``, ``warm_up_engine`` and ``hf-rocketkv serve`` build
their engines through it, so an engine is configured, refused and warmed up the same way everywhere.
"""

from __future__ import annotations

import logging

from ..cache import pool_policy_refusal
from ..config import RocketKVConfig
from ..integration.compat import attn_implementation
from ..integration.generate import uses_rocketkv
from ..integration.names import ATTN_NAME
from ..memory import PoolExhaustedError
from .batching.scheduler import BatchingConfig
from .engines.interface import Engine
from .engines.sequential import DEFAULT_MAX_QUEUE, SequentialEngine

ENGINE_CHOICES = ("auto", "batching", "sequential")

logger = logging.getLogger(__name__)


def build_engine(model, config: RocketKVConfig | None = None, *, pool=None, engine: Engine | str | None = "auto",
                 batching: BatchingConfig | None = None, max_queue: int = DEFAULT_MAX_QUEUE,
                 warmup_max_tokens: int = 0, max_model_len: int | None = None, lockstep=None) -> Engine:
    """The engine that serves ``model``: ``engine`` itself when it is an Engine instance, else one built by name
    (``ENGINE_CHOICES``; None = auto). ``GenerationManager``, ``generate_batch``, ``warm_up_engine`` and
    ``hf-rocketkv serve`` all build their engine here.

    Args:
        model: a causal LM with ``rocketkv`` attention (else ValueError, before anything is built).
        config: the RocketKVConfig of every request's cache (default ``hf_rocketkv.get_config(model)``).
        pool: the ``KVBlockPool`` the engine draws pages from (required by the batching engine).
        engine: ``"auto"`` (batching with a pool, else sequential), ``"batching"``, ``"sequential"``, or an Engine.
        batching: the batching engine's ``BatchingConfig`` (default ``BatchingConfig(max_queue=max_queue)``).
        max_queue: requests that may wait (the sequential engine's queue; the batching default's ``max_queue``).
        warmup_max_tokens, max_model_len: the batching engine's startup capture (``warm_up_batching``; 0: none).
        lockstep: a ``Lockstep`` for a batching engine under tensor parallelism (serving/parallel/lockstep.py).

    ``auto`` picks the batching engine when there is a pool (it admits by the pool's accounting and decodes every
    running request in one forward), else the sequential one. A built batching engine whose decode runs through
    CUDA graphs is warmed up (``warm_up_batching``) for ``warmup_max_tokens`` (0: not)."""
    if engine is not None and not isinstance(engine, str):
        return engine
    name = engine or "auto"
    if name not in ENGINE_CHOICES:
        raise ValueError(f"engine must be an Engine or one of {list(ENGINE_CHOICES)}, got {name!r}")
    check_rocketkv_attention(model)
    if name == "auto":
        name = "batching" if pool is not None else "sequential"
    if name == "sequential":
        if lockstep is not None:
            raise ValueError("lockstep (tensor parallel serving) needs engine='batching' and a pool")
        return SequentialEngine(model, config, pool=pool, max_queue=max_queue)
    if pool is None:
        raise ValueError("engine='batching' needs pool=KVBlockPool(...): admission is the pool's page accounting")
    from .batching.engine import BatchingEngine

    batching = batching if batching is not None else BatchingConfig(max_queue=max_queue)
    built = BatchingEngine(model, config, pool, batching, lockstep=lockstep)
    warm_up_batching(built, warmup_max_tokens, max_model_len)
    return built


def check_rocketkv_attention(model) -> None:
    """ValueError, before any request runs, when ``model`` does not run ``rocketkv`` attention: both engines keep
    every request's KV in a ``RocketKVCache``, which only that attention fills (otherwise every request would end in
    an error)."""
    if not uses_rocketkv(model):
        raise ValueError(
            f"model: its attn_implementation is {attn_implementation(model)!r}, not {ATTN_NAME!r}; the engines keep "
            f"each request's KV in a RocketKVCache, which only {ATTN_NAME!r} attention fills. Call "
            f"`hf_rocketkv.enable(model)` first, or load it with `from_pretrained(..., attn_implementation="
            f"{ATTN_NAME!r})`")


def batching_refusal(config: RocketKVConfig) -> str | None:
    """Why ``BatchingEngine`` cannot serve ``config``, as one short phrase naming the field (the first such field),
    or None when it can. The engine refuses the same configs when it is built (``NotImplementedError`` or
    ``ValueError`` naming the field); this answers before any model or pool exists (``hf-rocketkv serve`` falls back
    to the sequential engine on it)."""
    if config.multi_turn != "evict":
        return f"multi_turn={config.multi_turn!r} (the batching engine serves one turn per request)"
    if config.decode_budget is not None:
        return (f"decode_budget={config.decode_budget} (the batched decode step does not compress generated "
                f"tokens)")
    if config.token_budget is not None:
        return (f"token_budget={config.token_budget} (it derives page_size per request; the batching engine's pool "
                f"fixes it)")
    return pool_policy_refusal(config)


def warm_up_batching(engine, max_tokens: int, max_model_len: int | None = None) -> dict | None:
    """Capture every decode graph of a not yet started ``BatchingEngine`` now, when its steps run through graphs (on
    CUDA; on the CPU there is nothing to capture), covering requests up to ``max_tokens`` (0: skip), capped by what
    the context leaves after the warm-up prompt (the synthetic request stays within the model's positions). A pool
    too small for the warm-up request is logged and the graphs are then captured lazily: the startup capture is an
    optimisation, never a reason not to serve. Returns ``warm_up``'s report, or None when skipped."""
    if check_warmup_max_tokens(max_tokens) == 0 or not engine.graphs_in_use:
        return None
    if max_model_len is not None:
        max_tokens = min(max_tokens, max_model_len - engine.warm_up_prompt_len)
        if max_tokens < 1:
            logger.warning("hf_rocketkv: no startup capture: the context (%d) leaves no room after the %d-token "
                           "warm-up prompt", max_model_len, engine.warm_up_prompt_len)
            return None
    try:
        return engine.warm_up(max_new_tokens=max_tokens)
    except PoolExhaustedError as err:
        logger.warning("hf_rocketkv: no startup capture (graphs are captured while serving): %s", err)
        return None


def check_warmup_max_tokens(value) -> int:
    """``warmup_max_tokens`` as given, or ValueError naming it (an integer >= 0; 0 turns the startup capture off)."""
    if not isinstance(value, int) or isinstance(value, bool) or value < 0:
        raise ValueError(f"warmup_max_tokens must be an integer >= 0 (0: no startup capture), got {value!r}")
    return value
