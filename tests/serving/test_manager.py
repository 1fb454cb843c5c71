"""GenerationManager + SequentialEngine (serving/manager.py, serving/engines/sequential.py) without HTTP, on a tiny
random Llama (CPU, milliseconds per token).

Oracle: model.generate alone on an identical copy of the model with a fresh RocketKVCache of the same config.
"""

from __future__ import annotations

import asyncio
import gc
import threading
import weakref

import pytest
import torch

from hf_rocketkv import KVBlockPool, RocketKVCache
from hf_rocketkv.serving import (
    EngineStopped,
    FinishReason,
    InvalidRequest,
    Overloaded,
    SamplingParams,
    SequentialEngine,
    UnknownRequest,
)
from tests.serving.helpers import ForwardGate, oracle_tokens, prompts, wait_until
from tests.support.tiny_models import EOS


def collect(manager, request_id):
    outputs = list(manager.stream(request_id, timeout=60))
    tokens = [t for out in outputs for t in out.token_ids]
    return outputs, tokens


# ------------------------------------------------------------------------------------------------ correctness
def test_requests_equal_generate_alone_and_run_in_order(make_manager, tiny_pair, cfg):
    manager = make_manager()
    params = SamplingParams.greedy(12, ignore_eos=True)
    batch = prompts(4)
    ids = [manager.add_request(p, params) for p in batch]
    results = [manager.result(i, timeout=60) for i in ids]
    for prompt, result in zip(batch, results):
        assert list(result.token_ids) == oracle_tokens(tiny_pair[1], prompt, cfg, 12)
        assert result.finish_reason is FinishReason.LENGTH
        assert result.prompt_token_ids == tuple(prompt)
    firsts = [r.timings.first_token_at for r in results]
    assert firsts == sorted(firsts)  # FIFO: one request at a time, in submission order
    assert all(r.timings.queued_at <= r.timings.first_token_at <= r.timings.finished_at for r in results)


def test_stream_events_are_incremental_and_end_once(make_manager, tiny_pair, cfg):
    manager = make_manager()
    prompt = prompts(1)[0]
    outputs, tokens = collect(manager, manager.add_request(prompt, SamplingParams.greedy(9, ignore_eos=True)))
    assert tokens == oracle_tokens(tiny_pair[1], prompt, cfg, 9)
    assert [o.finished for o in outputs] == [False] * (len(outputs) - 1) + [True]
    assert [o.completion_tokens for o in outputs if o.token_ids] == list(range(1, 10))
    with pytest.raises(UnknownRequest):  # the record is gone once its final output was read
        list(manager.stream(outputs[0].request_id))


def test_eos_and_stop_token_ids_end_the_request(make_manager, tiny_pair, cfg, tokenizer):
    manager = make_manager(tokenizer)
    prompt = prompts(1)[0]
    free_run = oracle_tokens(tiny_pair[1], prompt, cfg, 16)
    stop_id = free_run[5]
    cut = free_run.index(stop_id)
    result = manager.result(manager.add_request(prompt, SamplingParams.greedy(16, stop_token_ids=[stop_id],
                                                                                ignore_eos=True)))
    assert list(result.token_ids) == free_run[: cut + 1]  # the stop id is the last token...
    assert result.finish_reason is FinishReason.STOP
    assert result.text == tokenizer.decode(free_run[:cut], skip_special_tokens=True)  # ...and not in the text

    with_eos = oracle_tokens(tiny_pair[1], prompt, cfg, 16, eos_token_id=EOS)
    result = manager.result(manager.add_request(prompt, SamplingParams.greedy(16)))  # the model's EOS by default
    assert list(result.token_ids) == with_eos
    assert result.finish_reason is (FinishReason.STOP if with_eos[-1] == EOS else FinishReason.LENGTH)


def test_max_tokens_is_exact(make_manager):
    manager = make_manager()
    for n in (1, 2, 7):
        result = manager.result(manager.add_request(prompts(1)[0], SamplingParams.greedy(n, ignore_eos=True)))
        assert len(result.token_ids) == n and result.finish_reason is FinishReason.LENGTH


def test_stop_string_cuts_text_and_stops_the_engine(make_manager, tiny_pair, cfg, tokenizer):
    manager = make_manager(tokenizer)
    prompt = prompts(1)[0]
    free_run = oracle_tokens(tiny_pair[1], prompt, cfg, 40)
    text = tokenizer.decode(free_run, skip_special_tokens=True)
    stop = text[10:13]  # three characters = three tokens of the character tokenizer
    start = text.index(stop)
    gate = ForwardGate(tiny_pair[0])
    try:
        outputs, tokens = collect(manager, manager.add_request(prompt, SamplingParams.greedy(
            40, stop=[stop, "\x00never"], ignore_eos=True)))
        assert wait_until(lambda: manager.metrics().running == 0)
    finally:
        gate.remove()
    streamed = "".join(o.text for o in outputs)
    assert streamed == text[:start]
    assert outputs[-1].finish_reason is FinishReason.STOP
    assert tokens == free_run[: len(tokens)] and len(tokens) == start + len(stop)
    assert gate.calls <= len(tokens) + 1  # prefill + one forward per fed-back token, at most one step past the stop
    for i, out in enumerate(outputs):  # no streamed piece ever holds the start of the stop string
        assert stop not in "".join(o.text for o in outputs[: i + 1])


# ------------------------------------------------------------------------------------------------ sampling
def test_seeded_sampling_is_reproducible_and_independent_of_other_requests(make_manager):
    manager = make_manager()
    prompt = prompts(1)[0]
    sampled = SamplingParams(max_tokens=12, temperature=1.0, top_k=20, seed=1234, ignore_eos=True)
    alone = manager.result(manager.add_request(prompt, sampled)).token_ids
    torch.manual_seed(0)  # the global RNG plays no part
    ids = [manager.add_request(p, SamplingParams(max_tokens=6, temperature=1.5, ignore_eos=True)) for p in prompts(2)]
    ids.insert(1, manager.add_request(prompt, sampled))
    results = [manager.result(i) for i in ids]
    assert results[1].token_ids == alone
    other = manager.result(manager.add_request(prompt, sampled.replace(seed=4321))).token_ids
    assert other != alone  # 12 draws from top-20 of a random model: a collision is ~impossible


# ------------------------------------------------------------------------------------------------ cancellation
def test_cancel_stops_within_one_step_and_frees_cache_and_pages(make_manager, tiny_pair, cfg):
    pool = KVBlockPool(tiny_pair[0], max_gpu_bytes=1 << 20, page_size=16, kt_page_size=cfg.page_size,
                       kt_dtype=cfg.kt_cache_dtype, dtype=torch.float32)
    caches = []

    def factory(config):
        cache = RocketKVCache(config)
        caches.append(weakref.ref(cache))
        return cache

    engine = SequentialEngine(tiny_pair[0], cfg, pool=pool, cache_factory=factory)
    manager = make_manager(engine=engine, pool=pool)
    gate = ForwardGate(tiny_pair[0], delay=0.01)
    try:
        request_id = manager.add_request(prompts(1)[0], SamplingParams.greedy(300, ignore_eos=True))
        stream = manager.stream(request_id, timeout=60)
        first = [next(stream) for _ in range(3)]
        assert pool.free_pages() < pool.total_pages()  # the running request holds its pages
        calls_at_cancel = gate.calls
        assert manager.cancel(request_id)
        rest = list(stream)
    finally:
        gate.remove()
    assert rest[-1].finish_reason is FinishReason.CANCELLED
    assert gate.calls - calls_at_cancel <= 1  # the engine stopped within one decode step
    assert rest[-1].completion_tokens < 300
    assert pool.free_pages() == pool.total_pages()  # released before the final event
    gc.collect()
    assert [ref() for ref in caches] == [None]
    assert manager.metrics().finished["cancelled"] == 1 and first[0].token_ids


def test_cancel_waiting_request_ends_at_once_without_running(make_manager, tiny_pair):
    manager = make_manager()
    gate = ForwardGate(tiny_pair[0], closed=True)
    try:
        running = manager.add_request(prompts(1)[0], SamplingParams.greedy(3, ignore_eos=True))
        assert gate.entered.wait(10)
        waiting = manager.add_request(prompts(2)[1], SamplingParams.greedy(3, ignore_eos=True))
        assert manager.metrics().waiting == 1
        assert manager.cancel(waiting)
        outputs, tokens = collect(manager, waiting)  # final output already there, while the engine is blocked
        assert outputs[-1].finish_reason is FinishReason.CANCELLED and tokens == []
        assert manager.metrics().waiting == 0
        gate.open()
        assert manager.result(running).finish_reason is FinishReason.LENGTH
        assert not manager.cancel(waiting)  # unknown now
    finally:
        gate.remove()


def test_leaving_a_stream_early_cancels_the_request(make_manager, tiny_pair):
    manager = make_manager()
    gate = ForwardGate(tiny_pair[0], delay=0.01)
    try:
        request_id = manager.add_request(prompts(1)[0], SamplingParams.greedy(300, ignore_eos=True))
        for out in manager.stream(request_id):
            break  # the generator closes here
        assert wait_until(lambda: manager.metrics().finished["cancelled"] == 1, timeout=30)
        assert wait_until(lambda: not manager._records)  # the abandoned record is dropped once it ends
    finally:
        gate.remove()


def test_astream_on_an_event_loop(make_manager, tiny_pair, cfg):
    manager = make_manager()
    batch = prompts(3)

    async def run():
        ids = [manager.add_request(p, SamplingParams.greedy(6, ignore_eos=True)) for p in batch]

        async def tokens(request_id):
            return [t async for out in manager.astream(request_id) for t in out.token_ids]

        return await asyncio.gather(*(tokens(i) for i in ids))

    got = asyncio.run(run())
    assert got == [oracle_tokens(tiny_pair[1], p, cfg, 6) for p in batch]


# ------------------------------------------------------------------------------------------------ errors, overload
def test_error_ends_only_its_request(make_manager, tiny_pair, cfg):
    poison = 77

    def hook(module, args, kwargs):
        ids = kwargs.get("input_ids", args[0] if args else None)
        if ids is not None and ids.shape[-1] > 1 and (ids == poison).any():  # prompts only, never a decode token
            raise RuntimeError("poisoned prompt")

    handle = tiny_pair[0].register_forward_pre_hook(hook, with_kwargs=True)
    manager = make_manager()
    try:
        good = prompts(2)
        bad = [poison] * 30
        ids = [manager.add_request(good[0], SamplingParams.greedy(5, ignore_eos=True)),
               manager.add_request(bad, SamplingParams.greedy(5, ignore_eos=True)),
               manager.add_request(good[1], SamplingParams.greedy(5, ignore_eos=True))]
        results = [manager.result(i, timeout=60) for i in ids]
    finally:
        handle.remove()
    assert results[1].finish_reason is FinishReason.ERROR and "poisoned prompt" in results[1].error
    for prompt, result in ((good[0], results[0]), (good[1], results[2])):
        assert result.finish_reason is FinishReason.LENGTH
        assert list(result.token_ids) == oracle_tokens(tiny_pair[1], prompt, cfg, 5)
    assert manager.healthy() and manager.metrics().finished["error"] == 1


def test_overload_refuses_past_the_queue_and_keeps_admitted(make_manager, tiny_pair, cfg):
    manager = make_manager(max_queue=2)
    gate = ForwardGate(tiny_pair[0], closed=True)
    batch = prompts(4)
    try:
        admitted = [manager.add_request(batch[0], SamplingParams.greedy(4, ignore_eos=True))]
        assert gate.entered.wait(10)  # the first request is inside the engine, holding it
        admitted += [manager.add_request(p, SamplingParams.greedy(4, ignore_eos=True)) for p in batch[1:3]]
        with pytest.raises(Overloaded, match="max_queue=2"):
            manager.add_request(batch[3], SamplingParams.greedy(4))
        metrics = manager.metrics()
        assert (metrics.running, metrics.waiting, metrics.rejected_total) == (1, 2, 1)
        gate.open()
        results = [manager.result(i, timeout=60) for i in admitted]
    finally:
        gate.remove()
    assert [list(r.token_ids) for r in results] == [oracle_tokens(tiny_pair[1], p, cfg, 4) for p in batch[:3]]


def test_stop_drains_or_cancels(make_manager, tiny_pair):
    manager = make_manager()
    gate = ForwardGate(tiny_pair[0], closed=True)
    try:
        ids = [manager.add_request(p, SamplingParams.greedy(3, ignore_eos=True)) for p in prompts(3)]
        assert gate.entered.wait(10)
        threading.Timer(0.2, gate.open).start()
        manager.stop(drain=True, timeout=60)
    finally:
        gate.remove()
    assert [manager.result(i).finish_reason for i in ids] == [FinishReason.LENGTH] * 3
    with pytest.raises(EngineStopped):
        manager.add_request(prompts(1)[0])
    assert not manager.healthy()

    manager = make_manager()
    gate = ForwardGate(tiny_pair[0], closed=True)
    try:
        ids = [manager.add_request(p, SamplingParams.greedy(50, ignore_eos=True)) for p in prompts(3)]
        assert gate.entered.wait(10)
        threading.Timer(0.2, gate.open).start()
        manager.stop(drain=False, timeout=60)
    finally:
        gate.remove()
    reasons = [manager.result(i).finish_reason for i in ids]
    assert reasons == [FinishReason.CANCELLED] * 3


# ------------------------------------------------------------------------------------------------ validation
@pytest.mark.parametrize("prompt, params, param", [
    ([], SamplingParams(), "prompt"),
    ([5, 200], SamplingParams(), "prompt"),  # id beyond the 128-token vocabulary
    (list(range(3, 100)) * 11, SamplingParams(), "prompt"),  # 1067 tokens, the context is 1024
    (list(range(3, 100)) * 10, SamplingParams(max_tokens=60), "max_tokens"),  # 970 + 60 > 1024
    ("text", SamplingParams(), "prompt"),  # no tokenizer
    ([5, 6], SamplingParams(stop=["x"]), "stop"),  # stop strings need a tokenizer
    ([5, 6], SamplingParams(stop_token_ids=[500]), "stop_token_ids"),
])
def test_invalid_requests_name_the_field(make_manager, prompt, params, param):
    manager = make_manager()
    with pytest.raises(InvalidRequest) as err:
        manager.add_request(prompt, params)
    assert err.value.param == param
    assert manager.metrics().requests_total == 0


def test_metrics_count_requests_and_latencies(make_manager):
    manager = make_manager()
    for p in prompts(3):
        manager.result(manager.add_request(p, SamplingParams.greedy(4, ignore_eos=True)))
    m = manager.metrics()
    assert (m.requests_total, m.finished["length"], m.generation_tokens_total) == (3, 3, 12)
    assert m.time_to_first_token.count == 3 and m.tokens_per_second.count == 3
    assert m.prompt_tokens_total == sum(len(p) for p in prompts(3))
    assert (m.free_pages, m.total_pages) == (None, None)


def test_a_request_is_counted_before_its_consumer_sees_its_end(make_manager, tokenizer):
    """Found by the soak test (tests/serving/test_soak.py): the final output reached its consumer before the metrics
    counted the request, so a client reading /metrics right after its response could miss it (and this file's
    metrics test could fail by a hair). Made deterministic here by a slow recorder: the end waits for the count."""
    import time

    manager = make_manager(tokenizer=tokenizer)
    finished = manager._recorder.finished

    def slow_finished(*args):
        time.sleep(0.3)
        finished(*args)

    manager._recorder.finished = slow_finished
    prompt = prompts(1)[0]
    text = manager.result(manager.add_request(prompt, SamplingParams.greedy(30, ignore_eos=True))).text
    assert manager.metrics().finished["length"] == 1  # the engine's final event
    cut = manager.result(manager.add_request(prompt, SamplingParams.greedy(30, ignore_eos=True, stop=[text[9:11]])))
    assert cut.finish_reason is FinishReason.STOP and manager.metrics().finished["stop"] == 1  # a stop string
