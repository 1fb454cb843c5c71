"""generate_batch's batching engine settings (serving/batch.py): ``offline_batching_config`` picks the prefill chunk
by the model's device (16k tokens per forward on a GPU of >= 70 GiB other than an A100, as vLLM's offline LLM
class; 8k elsewhere, the server's default), ``batching=`` replaces it, and a setting that no engine would use is
refused up front.

Oracles: the device rule is written out here as a table of literal cards and chunk sizes (not computed by the
function under test); tokens come from model.generate on each prompt alone (``oracle_tokens``); the chunk sizes that
ran are read from a forward pre-hook on the served model (``ForwardLog``).
"""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from hf_rocketkv.serving import BatchingConfig, SamplingParams, generate_batch, offline_batching_config
from hf_rocketkv.serving import batch as batch_module
from hf_rocketkv.serving import manager as manager_module
from tests.serving.helpers import CFG, make_pool, oracle_tokens, prompts
from tests.serving.test_chunked_prefill import ForwardLog

GIB = 2**30


class OnDevice(torch.nn.Module):
    """A stand-in model whose ``device`` is a CUDA device (no GPU needed: the card's properties are faked)."""

    device = torch.device("cuda", 0)


@pytest.mark.parametrize("name, total_gib, chunk", [
    ("NVIDIA H100 80GB HBM3", 79.2, 16384),
    ("NVIDIA H200", 139.8, 16384),
    ("NVIDIA A100-SXM4-80GB", 79.2, 8192),  # vLLM measured a loss there with its larger default
    ("NVIDIA L40S", 44.4, 8192),
    ("NVIDIA GeForce RTX 4090", 23.6, 8192),
])
def test_offline_chunk_follows_the_card(monkeypatch, name, total_gib, chunk):
    properties = SimpleNamespace(name=name, total_memory=int(total_gib * GIB))
    monkeypatch.setattr(batch_module.torch.cuda, "get_device_properties", lambda device: properties)
    config = offline_batching_config(OnDevice())
    assert (config.prefill_chunk_tokens, config.prefill_token_budget) == (chunk, chunk)
    # everything else is the server's default
    server = BatchingConfig()
    assert (config.max_running, config.buckets, config.prefills_per_step, config.concurrent_prefill_tokens,
            config.overlap_decode) == (server.max_running, server.buckets, server.prefills_per_step,
                                       server.concurrent_prefill_tokens, server.overlap_decode)


def test_offline_chunk_on_the_cpu_is_the_servers(tiny_pair):
    assert offline_batching_config(tiny_pair[0]).prefill_chunk_tokens == 8192 == BatchingConfig().prefill_chunk_tokens


def test_generate_batch_builds_its_engine_with_the_offline_config(tiny_pair, monkeypatch):
    seen = []
    real = manager_module.build_engine

    def spy(model, config=None, **kwargs):
        seen.append(kwargs.get("batching"))
        return real(model, config, **kwargs)

    monkeypatch.setattr(manager_module, "build_engine", spy)
    model = tiny_pair[0]
    generate_batch(model, prompts(3), config=CFG, pool=make_pool(model), sampling=SamplingParams.greedy(2))
    [batching] = seen
    assert batching.prefill_chunk_tokens == offline_batching_config(model).prefill_chunk_tokens
    assert batching.max_queue >= 3


def test_generate_batch_runs_a_given_batching_config(tiny_pair):
    """Chunks of 8 tokens and a waiting queue of 1 for 4 prompts of 28-37 tokens: every prompt is prefilled in
    chunks of at most 8 (so the setting reached the engine), none is refused for the queue (it is raised to the
    batch), and the tokens are each prompt's alone."""
    model, oracle = tiny_pair
    batch = prompts(4)
    log = ForwardLog(model)
    try:
        results = generate_batch(model, batch, config=CFG, pool=make_pool(model),
                                 sampling=SamplingParams.greedy(6, ignore_eos=True),
                                 batching=BatchingConfig(max_queue=1, prefill_chunk_tokens=8, prefill_token_budget=8))
    finally:
        log.remove()
    chunks = [tokens for kind, tokens in log.kinds() if kind == "prefill"]
    assert sum(chunks) == sum(len(p) for p in batch) and max(chunks) == 8
    assert [list(r.token_ids) for r in results] == [oracle_tokens(oracle, p, CFG, 6) for p in batch]


@pytest.mark.parametrize("kwargs, error, match", [
    (dict(engine="sequential", pool=True), ValueError, r"batching=.*pool=KVBlockPool.*engine='sequential'"),
    (dict(engine="auto", pool=False), ValueError, r"batching=.*pool=NoneType"),
    (dict(engine="auto", pool=True, batching={"prefill_chunk_tokens": 16}), TypeError, r"BatchingConfig.*dict"),
])
def test_generate_batch_refuses_a_batching_config_no_engine_uses(tiny_pair, kwargs, error, match):
    model = tiny_pair[0]
    kwargs = dict(kwargs)
    kwargs["pool"] = make_pool(model) if kwargs["pool"] else None
    kwargs.setdefault("batching", BatchingConfig(prefill_chunk_tokens=16))
    with pytest.raises(error, match=match):
        generate_batch(model, prompts(1), config=CFG, sampling=SamplingParams.greedy(2), **kwargs)


class _WarmUpEngine:
    """A stand-in for a not yet started BatchingEngine: whether its steps run through graphs, its warm-up prompt's
    length, and what ``warm_up`` was asked (or an exhausted pool)."""

    def __init__(self, graphs: bool, prompt_len: int = 10, exhausted: bool = False):
        self.graphs_in_use, self.warm_up_prompt_len, self.exhausted, self.asked = graphs, prompt_len, exhausted, []

    def warm_up(self, max_new_tokens: int) -> dict:
        from hf_rocketkv.memory import PoolExhaustedError

        self.asked.append(max_new_tokens)
        if self.exhausted:
            raise PoolExhaustedError("the warm-up request", 9, 3, 12)
        return {"max_new_tokens": max_new_tokens}


@pytest.mark.parametrize("max_tokens, max_model_len, asked", [
    (64, None, 64),   # no context limit: as given
    (64, 100, 64),    # room enough after the 10-token prompt
    (64, 74, 64),     # exactly enough
    (64, 73, 63),     # one short: capped to what the context leaves
    (64, 11, 1),      # one token of room
])
def test_the_startup_capture_covers_what_the_context_leaves_after_the_warm_up_prompt(max_tokens, max_model_len,
                                                                                   asked):
    from hf_rocketkv.serving.builder import warm_up_batching

    engine = _WarmUpEngine(graphs=True)
    assert warm_up_batching(engine, max_tokens, max_model_len) == {"max_new_tokens": asked}
    assert engine.asked == [asked]


def test_the_startup_capture_is_skipped_and_said_when_it_cannot_or_need_not_run(caplog):
    """0 tokens or an engine without graphs (the CPU): skipped, silently; a context with no room after the warm-up
    prompt, or a pool too small for it: skipped with one warning that says why (never a reason not to serve)."""
    from hf_rocketkv.serving.builder import warm_up_batching

    for engine, max_tokens in ((_WarmUpEngine(graphs=True), 0), (_WarmUpEngine(graphs=False), 64)):
        with caplog.at_level("WARNING", logger="hf_rocketkv"):
            caplog.clear()
            assert warm_up_batching(engine, max_tokens, 1000) is None
        assert engine.asked == [] and not caplog.records
    engine = _WarmUpEngine(graphs=True)
    with caplog.at_level("WARNING"):
        caplog.clear()
        assert warm_up_batching(engine, 64, 10) is None
    assert engine.asked == []
    assert [r.getMessage() for r in caplog.records] == [
        "hf_rocketkv: no startup capture: the context (10) leaves no room after the 10-token warm-up prompt"]
    engine = _WarmUpEngine(graphs=True, exhausted=True)
    with caplog.at_level("WARNING"):
        caplog.clear()
        assert warm_up_batching(engine, 64, None) is None
    assert engine.asked == [64]
    assert [r.getMessage() for r in caplog.records] == [
        "hf_rocketkv: no startup capture (graphs are captured while serving): KVBlockPool: the warm-up request needs "
        "9 pages but only 3 of 12 are free (free includes cached prefix pages that can be evicted); nothing was "
        "allocated. Release finished requests, admit fewer rows or shorter requests, or give the pool more "
        "max_gpu_bytes."]
    with pytest.raises(ValueError, match="warmup_max_tokens must be an integer >= 0"):
        warm_up_batching(_WarmUpEngine(graphs=True), -1)


def test_the_batching_refusal_names_a_policy_object_by_its_name():
    """``stage1`` given as a policy object with per-head budgets: the refusal names the policy by its ``name``, as a
    user wrote it, not the object's repr."""
    from hf_rocketkv import RocketKVConfig
    from hf_rocketkv.policies import AdaKVPolicy
    from hf_rocketkv.serving.builder import batching_refusal

    policy = AdaKVPolicy()
    refusal = batching_refusal(RocketKVConfig(stage1=policy))
    assert refusal.startswith("stage1='adakv' (each KV head keeps its own number of tokens")
    assert batching_refusal(RocketKVConfig(stage1="adakv")) == refusal
    assert batching_refusal(RocketKVConfig()) is None


def test_build_engine_picks_checks_and_passes_on_its_arguments(tiny_pair):
    """The one builder: ``auto`` (or None) is the batching engine with a pool and the sequential one without; an Engine
    given is returned as it is; the batching default carries ``max_queue``; the refusals name what is missing."""
    from hf_rocketkv.serving.batching.engine import BatchingEngine
    from hf_rocketkv.serving.builder import build_engine
    from hf_rocketkv.serving.engines.sequential import SequentialEngine

    model = tiny_pair[0]
    pool = make_pool(model)
    assert isinstance(build_engine(model, CFG), SequentialEngine)  # the default: auto
    assert isinstance(build_engine(model, CFG, pool=pool), BatchingEngine)
    for choice in ("auto", None):
        assert isinstance(build_engine(model, CFG, engine=choice), SequentialEngine)
        built = build_engine(model, CFG, pool=pool, engine=choice, max_queue=7)
        assert isinstance(built, BatchingEngine) and built.batching == BatchingConfig(max_queue=7)
    mine = BatchingConfig(max_queue=3, max_running=2, buckets=(1, 2))
    assert build_engine(model, CFG, pool=pool, engine="batching", batching=mine, max_queue=7).batching is mine
    given = build_engine(model, CFG, engine="sequential")
    assert build_engine(model, CFG, engine=given) is given
    with pytest.raises(ValueError) as err:
        build_engine(model, CFG, engine="sequential", lockstep=object())
    assert str(err.value) == "lockstep (tensor parallel serving) needs engine='batching' and a pool"
    with pytest.raises(ValueError) as err:
        build_engine(model, CFG, engine="batching")
    assert str(err.value) == "engine='batching' needs pool=KVBlockPool(...): admission is the pool's page accounting"
    with pytest.raises(ValueError, match=r"engine must be an Engine or one of \['auto', "):
        build_engine(model, CFG, engine="fast")


@pytest.mark.parametrize("value", [True, -1, 1.0, "8"])
def test_warmup_max_tokens_must_be_a_plain_non_negative_integer(value):
    from hf_rocketkv.serving.builder import check_warmup_max_tokens

    with pytest.raises(ValueError) as err:
        check_warmup_max_tokens(value)
    assert str(err.value) == f"warmup_max_tokens must be an integer >= 0 (0: no startup capture), got {value!r}"
    assert check_warmup_max_tokens(0) == 0 and check_warmup_max_tokens(5) == 5


def test_an_engine_for_a_model_without_rocketkv_attention_is_refused_before_anything_is_built():
    from hf_rocketkv.serving.builder import build_engine
    from tests.support.tiny_models import make_models

    _, sdpa = make_models("llama")
    with pytest.raises(ValueError) as err:
        build_engine(sdpa, CFG, engine="sequential")
    assert str(err.value).startswith("model: its attn_implementation is 'sdpa', not 'rocketkv'; the engines keep each "
                                     "request's KV in a RocketKVCache, which only 'rocketkv' attention fills. Call "
                                     "`hf_rocketkv.enable(model)` first")
