"""The engines' threads run with the model's GPU as their current CUDA device (a thread starts on GPU 0, while
Triton launches, graph captures, events and NCCL collectives use the current device): checked on the CPU by
recording what each engine thread enters, and on a machine with two GPUs with a model on the second one."""

from __future__ import annotations

import contextlib
import threading

import pytest
import torch

from hf_rocketkv.serving import SequentialEngine
from hf_rocketkv.serving.batching.engine import BatchingEngine
from hf_rocketkv.serving.batching.scheduler import BatchingConfig
from tests.serving.helpers import CFG, Events, make_pool, prompt_of, request


@pytest.fixture
def entered(monkeypatch):
    """(thread name, device) of every on_device scope the serving engines enter."""
    from hf_rocketkv.serving.batching import warm_up
    from hf_rocketkv.serving.engines import threaded

    seen = []

    def recording(device):
        seen.append((threading.current_thread().name, torch.device(device)))
        return contextlib.nullcontext()

    monkeypatch.setattr(warm_up, "on_device", recording)  # BatchingEngine.warm_up, on the caller's thread
    monkeypatch.setattr(threaded, "on_device", recording)  # every engine thread
    return seen


def _serve_one(engine):
    events = Events()
    engine.start(events)
    try:
        engine.submit(request("r", prompt_of(30, seed=1), 3))
        events.wait_finals(1)
    finally:
        engine.stop(timeout=60)
    return events


def test_batching_engine_thread_and_warm_up_enter_the_model_device(tiny_pair, entered):
    engine = BatchingEngine(tiny_pair[0], CFG, make_pool(tiny_pair[0]), BatchingConfig(max_running=2, buckets=(1, 2)))
    engine.warm_up(max_new_tokens=4, buckets=(1,))
    _serve_one(engine)
    assert entered == [(threading.current_thread().name, torch.device("cpu")),
                       ("hf-rocketkv-batching", torch.device("cpu"))]


def test_sequential_engine_thread_enters_the_model_device(tiny_pair, entered):
    _serve_one(SequentialEngine(tiny_pair[0], CFG))
    assert entered == [("hf-rocketkv-engine", torch.device("cpu"))]


@pytest.mark.gpu
@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two GPUs")
def test_engines_serve_a_model_on_the_second_gpu():
    """A model on cuda:1 with the Triton kernels and CUDA graphs: the batching engine's tokens equal generate()'s on
    the same GPU (greedy, float32)."""
    from hf_rocketkv import KVBlockPool, RocketKVCache
    from tests.support.tiny_models import greedy, make_models

    model, _ = make_models("llama", hidden_size=128, num_attention_heads=8, num_key_value_heads=4, head_dim=16)
    model = model.to("cuda:1")
    config = CFG.replace(backend="triton")
    pool = KVBlockPool(model, max_gpu_bytes=2**24, page_size=8, dtype=torch.float32, device="cuda:1",
                       kt_page_size=config.page_size, kt_dtype=config.kt_cache_dtype)
    prompt = prompt_of(40, seed=2)
    ids = torch.tensor([prompt], device="cuda:1")
    expected = greedy(model, ids, 6, cache=RocketKVCache(config))[0, ids.shape[1]:].tolist()
    engine = BatchingEngine(model, config, pool, BatchingConfig(max_running=2, buckets=(1, 2)))
    engine.warm_up(max_new_tokens=8, buckets=(1,))
    events = Events()
    engine.start(events)
    try:
        engine.submit(request("gpu1", prompt, 6))
        events.wait_finals(1)
    finally:
        engine.stop(timeout=60)
    assert events.tokens("gpu1") == expected
