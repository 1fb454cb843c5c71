"""generate_batch: many prompts through a GenerationManager, results in input order.

    results = hf_rocketkv.generate_batch(model, ["first prompt", "second"], tokenizer=tok,
                                         sampling=SamplingParams.greedy(64))
    results[0].text, results[0].token_ids, results[0].finish_reason
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

import torch

from ..config import RocketKVConfig
from .batching.scheduler import DEFAULT_PREFILL_CHUNK_TOKENS, BatchingConfig
from .builder import build_engine, check_rocketkv_attention
from .errors import InvalidRequest
from .manager import GenerationManager
from .outputs import GenerationResult
from .parallel.lockstep import Lockstep, tensor_parallel_size
from .sampling import SamplingParams

# A batch handed over at once is judged by its end-to-end throughput, so on a large GPU a prompt of up to 16k tokens
# runs in one forward (one host overhead, no deferred stage 1); a server keeps 8k chunks (its decoding rows wait for
# each chunk's forward). vLLM's offline LLM class makes the same choice (16384 batched tokens against its server's
# 8192 on GPUs of >= 70 GiB other than the A100).
OFFLINE_PREFILL_CHUNK_TOKENS = 16384
OFFLINE_LARGE_DEVICE_BYTES = 70 * 2**30


def _prompt_list(prompts) -> list:
    """``prompts`` as a list, or TypeError naming the field when it is one prompt rather than a list of them (a string
    would otherwise run as one prompt per character, a 1-D tensor as one per id)."""
    if isinstance(prompts, (str, bytes)):
        raise TypeError(f"prompts must be a list of prompts (strings or lists of token ids), got a single "
                        f"{type(prompts).__name__}: pass [prompt] for one prompt")
    if isinstance(prompts, torch.Tensor) and prompts.dim() < 2:
        raise TypeError(f"prompts must be a list of prompts (strings or lists of token ids), got a "
                        f"{prompts.dim()}-D tensor: pass [ids] for one prompt, or a 2-D tensor with one prompt per row")
    if not isinstance(prompts, Sequence) and not isinstance(prompts, torch.Tensor):
        try:
            return list(prompts)
        except TypeError:
            raise TypeError(f"prompts must be a list of prompts (strings or lists of token ids), got "
                            f"{type(prompts).__name__}") from None
    return list(prompts)


def _described(value) -> str:
    """A wrong-typed argument as an error message names it: its type, and its entries' types for a list."""
    if isinstance(value, (list, tuple)):
        kinds = sorted({type(entry).__name__ for entry in value})
        return f"a {type(value).__name__} of {', '.join(kinds) or 'nothing'}"
    return type(value).__name__


def sampling_from_generation_config(generation_config) -> SamplingParams:
    """SamplingParams equivalent to a transformers GenerationConfig's length, sampling and EOS settings."""
    max_tokens = generation_config.max_new_tokens or 16
    eos = generation_config.eos_token_id
    stop = generation_config.stop_strings
    extra = {"stop_token_ids": tuple(eos if isinstance(eos, (list, tuple)) else [eos]) if eos is not None else (),
             "stop": tuple([stop] if isinstance(stop, str) else stop or ())}
    if not generation_config.do_sample:
        return SamplingParams.greedy(max_tokens, **extra)
    return SamplingParams(
        max_tokens=max_tokens, **extra,
        temperature=generation_config.temperature if generation_config.temperature is not None else 1.0,
        top_p=generation_config.top_p if generation_config.top_p is not None else 1.0,
        top_k=generation_config.top_k or 0,
    )


def generate_batch(model, prompts: Sequence[str | Sequence[int]], generation_config=None,
                   config: RocketKVConfig | None = None, pool=None,
                   sampling: SamplingParams | Sequence[SamplingParams] | None = None, *, tokenizer=None,
                   engine="auto", batching: BatchingConfig | None = None) -> list[GenerationResult]:
    """Generate for every prompt and return one ``GenerationResult`` per prompt, in input order.

    Args:
        model: a causal LM with ``rocketkv`` attention.
        prompts: strings (need ``tokenizer``) or lists of token ids.
        generation_config: used only when ``sampling`` is None: its max_new_tokens / do_sample / temperature /
            top_p / top_k (default: the model's generation config).
        config: RocketKVConfig of every request's cache (default ``hf_rocketkv.get_config(model)``).
        pool: a ``KVBlockPool``: with one, the prompts run through the continuous-batching engine (``BatchingEngine``:
            every running prompt decodes in one forward), pages drawn from it.
        sampling: one SamplingParams for all prompts, or one per prompt.
        tokenizer: to encode string prompts and decode outputs (``result.text``); without it texts are empty.
        engine: an Engine to use, or ``"auto"`` (default: batching with a pool, else sequential), ``"batching"``,
            ``"sequential"`` (see ``GenerationManager``).
        batching: the batching engine's ``BatchingConfig`` (only with a pool and ``engine`` ``"auto"`` or
            ``"batching"``; its ``max_queue`` is raised to the number of prompts). Default:
            ``offline_batching_config(model)``: prompts of up to 16k tokens in one prefill forward on a GPU of
            >= 70 GiB (not an A100), 8k elsewhere, as the server's default.

    A model whose attention is not ``rocketkv`` raises ``ValueError`` before any prompt runs (``hf_rocketkv.enable(
    model)`` first). An invalid prompt raises ``InvalidRequest`` naming its index (requests added before it are
    cancelled).

    Tensor parallel (a model loaded with ``tp_plan="auto"`` under torchrun): call it on every rank with the same
    arguments, as ``model.generate``; it needs ``pool`` (a pool per rank). Rank 0's engine takes the requests and the
    other ranks step with it in lockstep (serving/parallel/lockstep.py); every rank returns rank 0's results (and raises
    its error, if any).
    """
    check_rocketkv_attention(model)
    prompts = _prompt_list(prompts)
    if isinstance(sampling, SamplingParams) or sampling is None:
        params = sampling or sampling_from_generation_config(generation_config or model.generation_config)
        per_prompt = [params] * len(prompts)
    else:
        if not isinstance(sampling, (list, tuple)) or not all(isinstance(p, SamplingParams) for p in sampling):
            raise TypeError(f"sampling must be a SamplingParams or a list with one SamplingParams per prompt, got "
                            f"{_described(sampling)}")
        per_prompt = list(sampling)
        if len(per_prompt) != len(prompts):
            raise ValueError(f"sampling has {len(per_prompt)} entries for {len(prompts)} prompts")
    _check_batching(batching, engine, pool)
    if not prompts:
        return []
    if tensor_parallel_size(model) > 1:
        return _generate_in_lockstep(model, prompts, per_prompt, config, pool, tokenizer, engine, batching)
    if pool is not None and engine in ("auto", "batching"):
        batching = _queue_for(batching or offline_batching_config(model), len(prompts))
    # no startup capture: one workload, whose buckets are captured as it reaches them (capturing every bucket up
    # front would only add the ones it never uses)
    manager = GenerationManager(model, tokenizer, config, engine=engine, pool=pool,
                                max_queue=max(1, len(prompts)), batching=batching, warmup_max_tokens=0)
    return _run_all(manager, prompts, per_prompt)


def offline_batching_config(model) -> BatchingConfig:
    """The batching engine's settings for a batch handed over at once (``generate_batch``): the server's defaults,
    but prompts of up to ``OFFLINE_PREFILL_CHUNK_TOKENS`` (16k) tokens in one prefill forward when the model is on a
    GPU of at least 70 GiB other than an A100 (see the constant's comment)."""
    chunk = OFFLINE_PREFILL_CHUNK_TOKENS if _large_gpu(_model_device(model)) else DEFAULT_PREFILL_CHUNK_TOKENS
    return BatchingConfig(prefill_chunk_tokens=chunk, prefill_token_budget=chunk)


def _large_gpu(device: torch.device) -> bool:
    if device.type != "cuda":
        return False
    properties = torch.cuda.get_device_properties(device)
    return properties.total_memory >= OFFLINE_LARGE_DEVICE_BYTES and "a100" not in properties.name.lower()


def _model_device(model) -> torch.device:
    device = getattr(model, "device", None)
    if isinstance(device, torch.device):
        return device
    parameter = next(model.parameters(), None)
    return parameter.device if parameter is not None else torch.device("cpu")


def _check_batching(batching, engine, pool) -> None:
    """``batching`` configures the batching engine that generate_batch builds: refused where none is built."""
    if batching is None:
        return
    if not isinstance(batching, BatchingConfig):
        raise TypeError(f"generate_batch(batching=...) must be a hf_rocketkv.serving.BatchingConfig, got "
                        f"{type(batching).__name__}")
    if pool is None or engine not in ("auto", "batching"):
        raise ValueError(
            f"generate_batch(batching=...) configures the batching engine it builds: it needs pool=KVBlockPool(...) "
            f"and engine='auto' or 'batching', got pool={type(pool).__name__}, "
            f"engine={engine if isinstance(engine, str) else type(engine).__name__!r}")


def _queue_for(batching: BatchingConfig, prompts: int) -> BatchingConfig:
    """Every prompt is submitted at once: the waiting queue holds them all (never a batch refused half-way)."""
    return dataclasses.replace(batching, max_queue=max(batching.max_queue, prompts))


def _run_all(manager: GenerationManager, prompts: list, per_prompt: list[SamplingParams]) -> list[GenerationResult]:
    try:
        ids = [_add(manager, i, prompt, params) for i, (prompt, params) in enumerate(zip(prompts, per_prompt))]
        return [manager.result(request_id) for request_id in ids]
    finally:
        manager.stop(drain=False)


def _generate_in_lockstep(model, prompts: list, per_prompt: list[SamplingParams], config, pool, tokenizer,
                          engine, batching: BatchingConfig | None) -> list[GenerationResult]:
    """Every rank: a lockstep batching engine; rank 0 runs the batch through a manager, the others follow; then
    rank 0's results (or its exception) go to every rank. ``batching``: as given (the same on every rank), else the
    server's defaults (a choice by each rank's device could differ between ranks)."""
    import torch.distributed as dist

    if pool is None or engine not in ("auto", "batching"):
        raise ValueError(
            f"generate_batch on a model sharded over {tensor_parallel_size(model)} ranks runs the batching engine in "
            f"lockstep: pass pool=KVBlockPool(...) (one per rank) and engine='auto' or 'batching', got "
            f"pool={type(pool).__name__}, engine={engine!r}")
    lockstep = Lockstep()
    batching = _queue_for(batching or BatchingConfig(), len(prompts))
    built = build_engine(model, config, pool=pool, engine="batching", batching=batching,
                         max_queue=max(1, len(prompts)), lockstep=lockstep)  # no warm-up
    outcome: list | BaseException | None = None
    if lockstep.is_leader:
        try:
            manager = GenerationManager(model, tokenizer, config, engine=built, pool=pool,
                                        max_queue=max(1, len(prompts)), warmup_max_tokens=0)
            outcome = _run_all(manager, prompts, per_prompt)
        except Exception as err:  # noqa: BLE001 - raised on every rank below
            outcome = err
            _end_followers(built)
    else:
        built.follow()  # returns once rank 0's manager has stopped its engine (the last inbox)
    box = [outcome]
    dist.broadcast_object_list(box, src=lockstep.src, group=lockstep.group)
    if isinstance(box[0], BaseException):
        raise box[0]
    return box[0]


def _add(manager: GenerationManager, index: int, prompt, params: SamplingParams) -> str:
    try:
        return manager.add_request(prompt, params)
    except InvalidRequest as err:
        raise InvalidRequest(f"prompts[{index}]: {err.message}", err.param, err.code) from err


def _end_followers(engine) -> None:
    """Rank 0 failed: its engine still sends the last inbox, so the other ranks' ``follow()`` returns."""
    try:
        engine.start(lambda event: None)  # the manager failed before starting it
    except RuntimeError:
        pass  # started already
    engine.stop(drain=False)
