"""The batching engine's admission (serving/batching/admission.py): a request is admitted when the pool can set its
pages aside, waits while it cannot, and ends with an error when it never could. Oracle: each request alone through
model.generate."""

from __future__ import annotations

import re

import pytest

from hf_rocketkv.serving import FinishReason
from tests.serving.helpers import make_pool, prompt_of, request


def test_prompt_that_never_fits_the_pool_ends_with_an_error(engines, oracle, tiny_pair):
    pool = make_pool(tiny_pair[0], page_size=8, mib=0.05)  # a few dozen pages
    engine, events, _ = engines(pool=pool)
    free = pool.free_pages()
    huge = prompt_of(pool.total_pages() * 8, seed=3)
    small = prompt_of(20, seed=4)
    engine.submit(request("huge", huge, 4))
    engine.submit(request("small", small, 4))
    events.wait_finals(2)
    final = events.finals("huge")[0]
    assert final.finish_reason is FinishReason.ERROR
    assert "can never be admitted" in final.error and "pages" in final.error
    assert events.tokens("small") == oracle(small, 4)
    assert pool.free_pages() == free


def test_requests_wait_for_pages_then_run(engines, oracle, tiny_pair):
    """A pool that holds about two requests at once: the rest wait at the head of the queue, none is refused."""
    pool = make_pool(tiny_pair[0], page_size=8, mib=0.06)
    engine, events, _ = engines(pool=pool)
    prompts = [prompt_of(40, seed=20 + i) for i in range(5)]
    for i, prompt in enumerate(prompts):
        engine.submit(request(f"w{i}", prompt, 6))
    events.wait_finals(5)
    for i, prompt in enumerate(prompts):
        assert events.tokens(f"w{i}") == oracle(prompt, 6)


@pytest.mark.parametrize("engine", ["batching", "sequential"])
def test_the_manager_refuses_what_never_fits_the_pool(make_manager, oracle, tiny_pair, engine):
    """Found by fuzzing the server (tests/serving/test_fuzz.py): a request that fits the context but never the pool
    was admitted to end with ``error``, and the server answered 500 (a server error for a client's request). Now
    ``add_request`` refuses it (400 over HTTP), naming the prompt, or max_tokens and the most that fits."""
    from hf_rocketkv.serving import InvalidRequest, SamplingParams
    from tests.serving.helpers import CFG

    pool = make_pool(tiny_pair[0], page_size=8, mib=0.05)
    manager = make_manager(config=CFG, pool=pool, engine=engine)
    total = pool.total_pages()
    with pytest.raises(InvalidRequest) as err:
        manager.add_request(prompt_of(total * 8, seed=3), SamplingParams.greedy(1))
    assert (err.value.param, err.value.code) == ("prompt", "context_length_exceeded")
    assert f"pool's {total} pages" in err.value.message
    prompt = prompt_of(20, seed=4)
    with pytest.raises(InvalidRequest) as err:
        manager.add_request(prompt, SamplingParams.greedy(total * 8))
    assert (err.value.param, err.value.code) == ("max_tokens", "context_length_exceeded")
    most = int(re.search(r"at most (\d+) tokens", err.value.message).group(1))
    with pytest.raises(InvalidRequest):
        manager.add_request(prompt, SamplingParams.greedy(most + 1))
    result = manager.result(manager.add_request(prompt, SamplingParams.greedy(most, ignore_eos=True)))
    assert list(result.token_ids) == oracle(prompt, most)
    metrics = manager.metrics()
    assert metrics.requests_total == 1 and metrics.free_pages == total


@pytest.mark.parametrize("config", [
    dict(prompt_budget=32, window_size=8, kernel_size=3, topk=4, page_size=4),
    dict(prompt_budget=32, window_size=8, kernel_size=3, topk=4, page_size=4, multi_turn="keep_all"),
    dict(prompt_budget=16, window_size=8, kernel_size=3, topk=2, page_size=4, decode_budget=8, decode_interval=4,
         decode_window=4),
], ids=["evict", "keep_all", "decode_budget"])
@pytest.mark.parametrize("page_size, prefix_reuse", [(4, False), (8, True)])
def test_pool_fit_refusals_at_every_boundary_against_a_linear_scan(config, page_size, prefix_reuse):
    """``check_pool_fits`` over every prompt length and max_tokens around a pool's size: silent when the request's
    peak fits; else "prompt" when even one token does not fit, else "max_tokens" naming the most that fits. The oracle
    scans ``request_pages`` token by token (no bisection), so an off-by-one in the search or a boundary shows."""
    from types import SimpleNamespace

    from hf_rocketkv import RocketKVConfig
    from hf_rocketkv.cache.page_budget import request_pages
    from hf_rocketkv.serving import InvalidRequest
    from hf_rocketkv.serving.batching.admission import check_pool_fits

    cfg = RocketKVConfig(**config)
    spec = SimpleNamespace(page_size=page_size, prefix_reuse=prefix_reuse)
    total = request_pages(cfg, spec, 40, 1).peak_pages + 2  # a pool a little larger than a 40-token prompt's peak
    pool = SimpleNamespace(page_size=page_size, prefix_reuse=prefix_reuse, total_pages=lambda: total)

    def need(prompt_len, tokens):
        return request_pages(cfg, spec, prompt_len, tokens).peak_pages

    boundary_hits = 0
    for prompt_len in range(1, 90):
        for max_tokens in (1, 2, 3, 5, 8, 13, 40, 100):
            fits = [t for t in range(1, max_tokens + 1) if need(prompt_len, t) <= total]
            if need(prompt_len, max_tokens) <= total:
                check_pool_fits(cfg, pool, prompt_len, max_tokens)
                boundary_hits += need(prompt_len, max_tokens) == total
                continue
            with pytest.raises(InvalidRequest) as err:
                check_pool_fits(cfg, pool, prompt_len, max_tokens)
            assert err.value.code == "context_length_exceeded"
            if not fits:
                assert err.value.param == "prompt"
                assert f"needs {need(prompt_len, 1)} KV pool pages" in err.value.message
                assert f"pool's {total} pages (of {page_size} tokens)" in err.value.message
            else:
                assert err.value.param == "max_tokens"
                assert err.value.message.endswith(f"ask for at most {max(fits)} tokens"), err.value.message
                assert f"needs {need(prompt_len, max_tokens)} KV pool pages" in err.value.message
    assert boundary_hits  # some request needed exactly the whole pool (and was let through)
