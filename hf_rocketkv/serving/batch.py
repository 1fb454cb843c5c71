"""generate_batch: many prompts through a GenerationManager, results in input order.

    results = hf_rocketkv.generate_batch(model, ["first prompt", "second"], tokenizer=tok,
                                         sampling=SamplingParams.greedy(64))
    results[0].text, results[0].token_ids, results[0].finish_reason
"""

from __future__ import annotations

from collections.abc import Sequence

from ..config import RocketKVConfig
from .errors import InvalidRequest
from .lockstep import Lockstep, tensor_parallel_size
from .manager import GenerationManager, build_engine, check_rocketkv_attention
from .outputs import GenerationResult
from .sampling import SamplingParams


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
                   engine="auto") -> list[GenerationResult]:
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

    A model whose attention is not ``rocketkv`` raises ``ValueError`` before any prompt runs (``hf_rocketkv.enable(
    model)`` first). An invalid prompt raises ``InvalidRequest`` naming its index (requests added before it are cancelled).

    Tensor parallel (a model loaded with ``tp_plan="auto"`` under torchrun): call it on every rank with the same
    arguments, as ``model.generate``; it needs ``pool`` (a pool per rank). Rank 0's engine takes the requests and the
    other ranks step with it in lockstep (serving/lockstep.py); every rank returns rank 0's results (and raises its
    error, if any).
    """
    check_rocketkv_attention(model)
    prompts = list(prompts)
    if isinstance(sampling, SamplingParams) or sampling is None:
        params = sampling or sampling_from_generation_config(generation_config or model.generation_config)
        per_prompt = [params] * len(prompts)
    else:
        per_prompt = list(sampling)
        if len(per_prompt) != len(prompts):
            raise ValueError(f"sampling has {len(per_prompt)} entries for {len(prompts)} prompts")
    if not prompts:
        return []
    if tensor_parallel_size(model) > 1:
        return _generate_in_lockstep(model, prompts, per_prompt, config, pool, tokenizer, engine)
    # no startup capture: one workload, whose buckets are captured as it reaches them (capturing every bucket up
    # front would only add the ones it never uses)
    manager = GenerationManager(model, tokenizer, config, engine=engine, pool=pool,
                                max_queue=max(1, len(prompts)), warmup_max_tokens=0)
    return _run_all(manager, prompts, per_prompt)


def _run_all(manager: GenerationManager, prompts: list, per_prompt: list[SamplingParams]) -> list[GenerationResult]:
    try:
        ids = [_add(manager, i, prompt, params) for i, (prompt, params) in enumerate(zip(prompts, per_prompt))]
        return [manager.result(request_id) for request_id in ids]
    finally:
        manager.stop(drain=False)


def _generate_in_lockstep(model, prompts: list, per_prompt: list[SamplingParams], config, pool, tokenizer,
                          engine) -> list[GenerationResult]:
    """Every rank: a lockstep batching engine; rank 0 runs the batch through a manager, the others follow; then
    rank 0's results (or its exception) go to every rank."""
    import torch.distributed as dist

    if pool is None or engine not in ("auto", "batching"):
        raise ValueError(
            f"generate_batch on a model sharded over {tensor_parallel_size(model)} ranks runs the batching engine in "
            f"lockstep: pass pool=KVBlockPool(...) (one per rank) and engine='auto' or 'batching', got "
            f"pool={type(pool).__name__}, engine={engine!r}")
    lockstep = Lockstep()
    built = build_engine("batching", model, config, pool, max(1, len(prompts)), lockstep=lockstep)  # no warm-up
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
