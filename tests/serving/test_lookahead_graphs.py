"""The next prompt's prefill attention graphs, built while the device runs a chunk (serving/batching/prefill_graphs.py,
``LookaheadGraphs``): on the engine thread, after a chunk's kernels are queued and before the next prompt's first
forward; each shape once (the warm-up's included); a failing build is logged, switches the lookahead off and the
requests are served as without it.

On the CPU cuDNN never runs, so the lookahead is switched on by hand and its builder replaced by a recorder, and
each prompt length is given a shape of its own (``(length, 0)``) so that the builds say which prompt they were for.
The order of builds and forwards comes from one list written by the recorder and a forward pre-hook; the tokens
come from model.generate on each prompt alone (``oracle``).
"""

from __future__ import annotations

import threading

import pytest
import torch

from hf_rocketkv.integration.causal_prefill import cudnn_shapes_of_prompt
from hf_rocketkv.serving.batching import prefill_graphs
from tests.serving.helpers import Events, make_pool, prompt_of, request
from tests.serving.test_chunked_prefill import ForwardLog
from tests.serving.test_prefill_graphs import CHUNK, engines  # noqa: F401 - engines: the fixture

LENGTHS = (40, 21, 33)  # chunks of 16: 16 16 8 | 16 5 | 16 16 1


class Timeline:
    """One ordered list of what happened: ("prefill", tokens) per prefill forward, ("build", shapes) per build
    (with the builder's thread), written by the forward hook and by the stand-in builder."""

    def __init__(self, fail: bool = False):
        self.entries: list[tuple] = []
        self.threads: set[str] = set()
        self.lock = threading.Lock()
        self.fail = fail

    def forward(self, kind, tokens):
        if kind == "prefill":
            with self.lock:
                self.entries.append(("prefill", tokens))

    def warm(self, shapes, query_heads, kv_heads, head_dim, dtype, device, sinks=False):
        with self.lock:
            self.entries.append(("build", list(shapes)))
            self.threads.add(threading.current_thread().name)
        if self.fail:
            raise RuntimeError("no cuDNN here")
        return len(shapes)


def serve_held(engine, tiny_pair, timeline):
    """The first prompt's first forward waits until the other two are submitted (so they are waiting while its
    chunks run); returns each request's tokens."""
    release = threading.Event()
    first = []

    def on_forward(kind, tokens):
        timeline.forward(kind, tokens)
        if not first:
            first.append(1)
            assert release.wait(30)

    log = ForwardLog(tiny_pair[0], on_forward)
    events = Events()
    engine.start(events)
    try:
        for i, n in enumerate(LENGTHS):
            engine.submit(request(f"r{i}", prompt_of(n, seed=60 + i), 4))
        release.set()
        events.wait_finals(len(LENGTHS))
    finally:
        release.set()
        log.remove()
        engine.stop(timeout=60)
    return {f"r{i}": events.tokens(f"r{i}") for i in range(len(LENGTHS))}


def switch_on(engine, timeline, monkeypatch):
    monkeypatch.setattr(prefill_graphs, "cudnn_shapes_of_prompt", lambda n, chunk: [(n, 0)])
    engine._lookahead.enabled = True
    engine._lookahead._warm = timeline.warm


@pytest.mark.parametrize("batching", [{}, {"prefills_per_step": 2, "prefill_token_budget": 64}],
                         ids=["one_at_a_time", "two_admitted_at_once"])
def test_the_next_prompt_s_graphs_are_built_while_a_chunk_runs(engines, tiny_pair, oracle,  # noqa: F811
                                                               monkeypatch, batching):
    """One prefill at a time: the next prompt is the head of the queue. Two admitted at once (a budget for both):
    the third prompt is admitted with the second, and is the next one while the second's chunks run."""
    timeline = Timeline()
    engine = engines(**batching)
    switch_on(engine, timeline, monkeypatch)
    tokens = serve_held(engine, tiny_pair, timeline)
    entries = timeline.entries
    builds = [e[1] for e in entries if e[0] == "build"]
    assert builds == [[(21, 0)], [(33, 0)]]  # the first prompt started before anything waited: built lazily
    prefills = [i for i, e in enumerate(entries) if e[0] == "prefill"]
    assert [entries[i][1] for i in prefills] == [16, 16, 8, 16, 5, 16, 16, 1]
    at = entries.index(("build", [(21, 0)]))
    assert prefills[0] < at < prefills[3]  # after the first prompt's first chunk, before the second prompt's
    at = entries.index(("build", [(33, 0)]))
    assert prefills[3] < at < prefills[5]  # after the second prompt's first chunk, before the third prompt's
    assert timeline.threads == {"hf-rocketkv-batching"}  # cuDNN's graph cache belongs to the prefilling thread
    assert engine._lookahead.shapes_built == 2
    assert tokens == {f"r{i}": oracle(prompt_of(n, seed=60 + i), 4) for i, n in enumerate(LENGTHS)}


def test_a_prompt_s_later_chunks_are_built_while_its_first_runs(engines, tiny_pair, oracle,  # noqa: F811
                                                               monkeypatch):
    """Each chunk its own shape ``(length, start)``: after the 40-token prompt's first chunk, the shapes of its
    chunks at 16 and 32, then the next prompt's; nothing after its later chunks (all built); then the third's."""
    timeline = Timeline()
    engine = engines()
    switch_on(engine, timeline, monkeypatch)
    monkeypatch.setattr(prefill_graphs, "cudnn_shapes_of_prompt",
                        lambda n, chunk: [(n, start) for start in range(0, n, chunk)])
    tokens = serve_held(engine, tiny_pair, timeline)
    builds = [e[1] for e in timeline.entries if e[0] == "build"]
    assert builds == [[(40, 16), (40, 32)], [(21, 0), (21, 16)], [(33, 0), (33, 16), (33, 32)]]
    prefills = [i for i, e in enumerate(timeline.entries) if e[0] == "prefill"]
    assert prefills[0] < timeline.entries.index(("build", [(40, 16), (40, 32)])) < prefills[1]
    assert tokens == {f"r{i}": oracle(prompt_of(n, seed=60 + i), 4) for i, n in enumerate(LENGTHS)}


def test_shapes_the_warm_up_built_are_not_built_again(engines, tiny_pair, monkeypatch):  # noqa: F811
    timeline = Timeline()
    monkeypatch.setattr(prefill_graphs, "warm_cudnn_graphs", timeline.warm)  # the warm-up's builder
    engine = engines()
    engine.warm_up(max_new_tokens=5, prefill_tokens=2 * CHUNK)
    switch_on(engine, timeline, monkeypatch)
    engine._lookahead.built.update([(21, 0)])  # as if the warm-up had planned the second prompt's shape
    serve_held(engine, tiny_pair, timeline)
    builds = [e[1] for e in timeline.entries if e[0] == "build"]
    assert builds == [engine.prefill_graphs.shapes, [(33, 0)]]
    assert set(engine.prefill_graphs.shapes) <= engine._lookahead.built


def test_a_failing_lookahead_is_logged_switched_off_and_the_requests_served(engines, tiny_pair, oracle,  # noqa: F811
                                                                           monkeypatch, caplog):
    timeline = Timeline(fail=True)
    engine = engines()
    switch_on(engine, timeline, monkeypatch)
    tokens = serve_held(engine, tiny_pair, timeline)
    assert [e[1] for e in timeline.entries if e[0] == "build"] == [[(21, 0)]]  # tried once, then off
    assert not engine._lookahead.enabled
    assert "building the next prompt's attention graphs failed" in caplog.text
    assert tokens == {f"r{i}": oracle(prompt_of(n, seed=60 + i), 4) for i, n in enumerate(LENGTHS)}


def test_off_on_the_cpu_with_concurrent_prefill_and_where_cudnn_never_runs(engines, tiny_pair):  # noqa: F811
    assert not engines()._lookahead.enabled  # CPU
    assert engines(concurrent_prefill_tokens=4)._lookahead is None  # the prefill thread builds nothing ahead
    lookahead = prefill_graphs.LookaheadGraphs(tiny_pair[0], make_pool(tiny_pair[0]), torch.device("cuda"), CHUNK)
    assert lookahead.enabled  # (a model and pool whose prefill reaches cuDNN, on a CUDA device)
    assert lookahead.chunk_tokens == CHUNK and cudnn_shapes_of_prompt(3 * CHUNK, CHUNK) == [(512, 0)]
