"""Warm start of the batching engine across processes: compile its kernels once into a folder, reuse them after.

    # process 1, once per machine type (same torch, Triton, GPU and model shapes as the server)
    hf_rocketkv.use_compile_cache(DIR)                  # before anything compiles
    hf_rocketkv.warm_up_engine(model, pool=KVBlockPool(model, ...), batch_sizes=(32,), prompt_tokens=8192)
    # process 2 (and every later one)
    hf_rocketkv.use_compile_cache(DIR)                  # before the model is built
    generate_batch(model, prompts, pool=pool, ...)      # or hf-rocketkv serve --compile-cache DIR

What ``generate_batch`` or a server pays on its first call beyond a warm call is mostly Triton's JIT of RocketKV's
kernels (the pool's paged copies, chunked prefill, stage 1, stage 2's page selection, every decode bucket's kernels)
and the C launchers Triton builds for them. Triton keeps both in ``TRITON_CACHE_DIR`` keyed by the kernel's source,
its constants and its arguments' specialisation (dtype, alignment, an integer's divisibility by 16): a later
process that meets the same specialisations loads them from there instead of compiling. ``warm_up_engine`` runs the
engine through everything a request meets: the startup capture of every decode bucket (``BatchingEngine.warm_up``,
tables as wide as requests of up to ``max_tokens``), then one batch of ``b`` random prompts of ``prompt_tokens`` for
each ``b`` in ``batch_sizes`` (chunked prefill, stage 1, joins, batched decode at that size).

CUDA graphs and the caching allocator's segments belong to a process and cannot be saved: a later process still
captures each bucket's graph when it first reaches it (without compiling anything, that is a few milliseconds per
bucket), or at start-up with ``GenerationManager(warmup_max_tokens=...)`` (``hf-rocketkv serve`` does that).
"""

from __future__ import annotations

import time

import torch

from .batching.scheduler import BatchingConfig
from .batching.warm_up import DEFAULT_WARMUP_MAX_TOKENS
from .builder import build_engine, check_rocketkv_attention
from .manager import GenerationManager
from .sampling import SamplingParams


def warm_up_engine(model, config=None, *, pool, batch_sizes=(1,), prompt_tokens: int = 4096, new_tokens: int = 4,
                   max_tokens: int = DEFAULT_WARMUP_MAX_TOKENS, batching: BatchingConfig | None = None) -> dict:
    """Run the batching engine over ``pool`` through every kernel a request meets, so that they are compiled (into
    ``TRITON_CACHE_DIR``: call ``hf_rocketkv.use_compile_cache(DIR)`` first to keep them for later processes).

    Args:
        model: a causal LM with ``rocketkv`` attention. config: its RocketKVConfig (default ``get_config(model)``).
        pool: the ``KVBlockPool`` to draw pages from (build it as the serving process does: the pool's size is
            part of some kernels' arguments).
        batch_sizes: for each ``b``, one batch of ``b`` random prompts runs to completion (an int or a sequence of
            ints >= 1, each <= ``batching.max_running``).
        prompt_tokens: the prompts' length (an int >= 1; prompt_tokens + new_tokens within the model's positions).
        new_tokens: tokens each prompt of those batches generates (an int >= 2: at least one batched decode step).
        max_tokens: ``BatchingEngine.warm_up`` covers requests of up to this many tokens: every bucket up to
            ``max_running`` decodes two steps (captured on CUDA), tables as wide as such requests'; 0 skips it.
        batching: the engine's ``BatchingConfig`` (default ``BatchingConfig()``): the same as the server's, so the
            same buckets and prefill chunks are compiled.

    Returns ``{"seconds", "startup_capture", "batches": [{"batch", "seconds"}]}``. Raises ``ValueError`` naming the
    argument for bad input, before anything runs.
    """
    check_rocketkv_attention(model)
    batching = batching if batching is not None else BatchingConfig()
    sizes = _checked(model, batch_sizes, prompt_tokens, new_tokens, max_tokens, batching)
    if pool is None:
        raise ValueError("warm_up_engine: pool must be a KVBlockPool (the batching engine draws its pages from it)")
    vocab = int(model.config.get_text_config().vocab_size)
    started = time.perf_counter()
    engine = build_engine(model, config, pool=pool, engine="batching", batching=batching)  # no capture yet
    capture = None
    if max_tokens:  # also without graphs (eager decode, the CPU): the buckets' kernels run once each
        limit = getattr(model.config.get_text_config(), "max_position_embeddings", None)
        covered = max_tokens if limit is None else min(max_tokens, limit - engine.warm_up_prompt_len)
        if covered >= 1:
            capture = engine.warm_up(max_new_tokens=covered)
    manager = GenerationManager(model, None, config, engine=engine, pool=pool, max_queue=batching.max_queue)
    batches = []
    try:
        for size in sizes:
            generator = torch.Generator().manual_seed(size)
            prompts = torch.randint(0, vocab, (size, prompt_tokens), generator=generator).tolist()
            params = SamplingParams.greedy(new_tokens, ignore_eos=True)
            begun = time.perf_counter()
            ids = [manager.add_request(prompt, params) for prompt in prompts]
            results = [manager.result(request_id) for request_id in ids]
            failed = [(i, r.finish_reason, r.error) for i, r in enumerate(results) if len(r.token_ids) != new_tokens]
            if failed:
                raise RuntimeError(f"warm_up_engine: batch of {size}: requests ended early (index, reason, error): "
                                   f"{failed[:3]}")
            batches.append({"batch": size, "seconds": round(time.perf_counter() - begun, 3)})
    finally:
        manager.stop(drain=False)
    return {"seconds": round(time.perf_counter() - started, 3), "startup_capture": capture, "batches": batches}


def _checked(model, batch_sizes, prompt_tokens, new_tokens, max_tokens, batching: BatchingConfig) -> tuple[int, ...]:
    """The batch sizes as a sorted tuple; ValueError naming the argument for anything that cannot run."""
    if isinstance(batch_sizes, int) and not isinstance(batch_sizes, bool):
        batch_sizes = (batch_sizes,)
    try:
        sizes = tuple(batch_sizes)
    except TypeError:
        sizes = ()
    if not sizes or any(not isinstance(b, int) or isinstance(b, bool) or b < 1 for b in sizes):
        raise ValueError(f"warm_up_engine: batch_sizes must be an integer >= 1 or a sequence of them, got "
                         f"{batch_sizes!r}")
    if max(sizes) > batching.max_running:
        raise ValueError(f"warm_up_engine: batch_sizes {sizes} exceed the engine's max_running "
                         f"({batching.max_running}): a larger batch runs as several")
    for name, value, low in (("prompt_tokens", prompt_tokens, 1), ("new_tokens", new_tokens, 2),
                             ("max_tokens", max_tokens, 0)):
        if not isinstance(value, int) or isinstance(value, bool) or value < low:
            raise ValueError(f"warm_up_engine: {name} must be an integer >= {low}, got {value!r}")
    limit = getattr(model.config.get_text_config(), "max_position_embeddings", None)
    if limit is not None and prompt_tokens + new_tokens > limit:
        raise ValueError(f"warm_up_engine: prompt_tokens ({prompt_tokens}) + new_tokens ({new_tokens}) exceeds the "
                         f"model's max_position_embeddings ({limit})")
    return tuple(sorted(set(sizes)))
