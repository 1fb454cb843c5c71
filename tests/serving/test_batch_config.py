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
