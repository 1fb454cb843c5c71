"""Fixtures of the serving tests: tiny random models (milliseconds per token) with a character tokenizer, managers
and HTTP servers that are always stopped, and the plain model.generate oracle."""

from __future__ import annotations

import pytest
import torch

from hf_rocketkv import RocketKVCache
from tests.support.tiny_models import compressing_config, greedy, make_models
from tests.serving.helpers import char_tokenizer


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
    from hf_rocketkv.serving.background import ServerThread

    servers = []

    def start(model_name: str = "tiny", app_kwargs: dict | None = None, **kwargs):
        manager = make_manager(**kwargs)
        server = ServerThread(create_app(manager, model_name, **(app_kwargs or {}))).start()
        servers.append(server)
        return server, manager

    yield start
    for server in servers:
        server.stop()


def oracle_tokens(model, prompt_ids, config, max_new_tokens: int, eos_token_id=None) -> list[int]:
    """What model.generate produces alone for one prompt with a fresh RocketKVCache (greedy)."""
    ids = torch.tensor([list(prompt_ids)])
    out = greedy(model, ids, max_new_tokens, past_key_values=RocketKVCache(config), eos_token_id=eos_token_id)
    return out[0, ids.shape[1]:].tolist()
