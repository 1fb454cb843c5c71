"""The batching engine's admission (serving/admission.py): a request is admitted when the pool can set its pages
aside, waits while it cannot, and ends with an error when it never could. Oracle: each request alone through
model.generate."""

from __future__ import annotations

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
