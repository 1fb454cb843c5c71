"""Fixtures of the serving tests: tiny random models (milliseconds per token) with a character tokenizer, batching
engines, managers and HTTP servers that are always stopped, and the memoised model.generate oracle (the plain
functions they build on are in tests/serving/helpers.py)."""

from __future__ import annotations

import pytest

from hf_rocketkv.serving.batching.engine import BatchingEngine
from hf_rocketkv.serving.batching.scheduler import BatchingConfig
from tests.serving.helpers import CFG, Events, make_pool, oracle_tokens
from tests.support.tiny_models import char_tokenizer, compressing_config, make_models


@pytest.fixture(scope="module")
def tiny_pair():
    """``(served, oracle)``: two identical tiny random Llamas on rocketkv attention (same seed, same weights), so
    the oracle runs model.generate on its own copy while the engine thread uses the other."""
    served, _ = make_models("llama", seed=0)
    oracle, _ = make_models("llama", seed=0)
    return served, oracle


@pytest.fixture(scope="module")
def tokenizer():
    return char_tokenizer()


@pytest.fixture
def cfg():
    """Prompts over 24 tokens are compressed; decode attends 3 pages: the outputs exercise RocketKV, not dense."""
    return compressing_config()


@pytest.fixture
def make_manager(tiny_pair):
    """``make_manager(**kwargs)``: a GenerationManager on the served tiny model; every one is stopped at teardown."""
    from hf_rocketkv.serving import GenerationManager

    managers = []

    def make(tokenizer=None, config=None, **kwargs):
        manager = GenerationManager(tiny_pair[0], tokenizer, config or compressing_config(), **kwargs)
        managers.append(manager)
        return manager

    yield make
    for manager in managers:
        manager.stop(drain=False, timeout=30)


@pytest.fixture
def serve(make_manager):
    """``serve(manager_kwargs...) -> (server, manager)``: the app on 127.0.0.1 (free port), stopped at teardown."""
    pytest.importorskip("fastapi")
    from hf_rocketkv.serving import create_app
    from hf_rocketkv.serving.http.background import ServerThread

    servers = []

    def start(model_name: str = "tiny", app_kwargs: dict | None = None, **kwargs):
        manager = make_manager(**kwargs)
        server = ServerThread(create_app(manager, model_name, **(app_kwargs or {}))).start()
        servers.append(server)
        return server, manager

    yield start
    for server in servers:
        server.stop()


@pytest.fixture(scope="module")
def oracle(tiny_pair):
    """``oracle(prompt, n)``: greedy tokens of the prompt alone (memoised: the random tests reuse prompts)."""
    memo = {}

    def run(prompt, n, config=CFG):
        key = (tuple(prompt), n, config)
        if key not in memo:
            memo[key] = oracle_tokens(tiny_pair[1], prompt, config, n)
        return memo[key]

    return run


@pytest.fixture
def engines(tiny_pair):
    """``make(pool=None, config=CFG, lockstep=None, **batching) -> (engine, events, pool)``: started engines, all
    stopped at teardown."""
    made = []

    def make(pool=None, config=CFG, lockstep=None, **batching):
        pool = pool if pool is not None else make_pool(tiny_pair[0], config=config)
        batching = {"max_running": 8, "buckets": (1, 2, 4, 8), **batching}
        engine = BatchingEngine(tiny_pair[0], config, pool, BatchingConfig(**batching), lockstep=lockstep)
        events = Events()
        engine.start(events)
        made.append(engine)
        return engine, events, pool

    yield make
    for engine in made:
        engine.stop(drain=False, timeout=60)
