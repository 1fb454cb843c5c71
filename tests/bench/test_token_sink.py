"""benchmarks.token_sink.TokenRecorder, the serving benchmarks' event sink, on hand-made events and times: what it
records, when it wakes waiters (every event, or only finished requests), and the per-user rates
benchmarks.decode_under_arrivals computes from it, checked against values worked out by hand."""

from __future__ import annotations

import threading
from types import SimpleNamespace

import pytest

from benchmarks import batching_throughput, decode_under_arrivals
from benchmarks.token_sink import TokenRecorder


def event(rid: str, tokens: int, finish: str | None = None):
    return SimpleNamespace(request_id=rid, token_ids=tuple(range(tokens)), finish_reason=finish)


class Clock:
    """Hands out the given times, one per call."""

    def __init__(self, *times: float):
        self.times = list(times)

    def __call__(self) -> float:
        return self.times.pop(0)


class CountingCondition(threading.Condition):
    def __init__(self):
        super().__init__()
        self.notified = 0

    def notify_all(self) -> None:
        self.notified += 1
        super().notify_all()


def test_records_submits_tokens_and_finals():
    """An event of n tokens gives n equal arrival times; an event without tokens adds none; the final event is
    kept; ``window`` keeps the times within [start, end], both ends included."""
    engine = SimpleNamespace(submitted=[])
    engine.submit = engine.submitted.append
    recorder = TokenRecorder(clock=Clock(0.5, 1.0, 2.0, 3.0, 4.0))
    recorder.submit(engine, SimpleNamespace(request_id="a"))
    assert recorder.submitted == {"a": 0.5} and len(engine.submitted) == 1
    recorder(event("a", 1))  # 1.0
    recorder(event("a", 2))  # 2.0, 2.0
    recorder(event("b", 0))  # 3.0: no token
    recorder(event("a", 1, finish="length"))  # 4.0
    assert recorder.token_times == {"a": [1.0, 2.0, 2.0, 4.0]}
    assert list(recorder.finals) == ["a"] and recorder.finals["a"].finish_reason == "length"
    assert recorder.window("a", 2.0, 4.0) == [2.0, 2.0, 4.0]
    assert recorder.window("a", 1.5, 3.9) == [2.0, 2.0]
    assert recorder.window("b", 0.0, 9.0) == []


@pytest.mark.parametrize("wake_on_tokens, wakes", [(True, 3), (False, 1)])
def test_waiters_wake_on_every_event_or_only_on_finals(wake_on_tokens, wakes):
    """Three events, one of them final: three wake-ups for a recorder waited on for tokens
    (decode_under_arrivals), one for a recorder waited on for finished requests (batching_throughput)."""
    recorder = TokenRecorder(wake_on_tokens=wake_on_tokens, clock=Clock(1.0, 2.0, 3.0))
    recorder.cond = CountingCondition()
    recorder(event("a", 1))
    recorder(event("a", 1))
    recorder(event("a", 1, finish="stop"))
    assert recorder.cond.notified == wakes


def test_the_benchmarks_keep_their_wake_up_rule():
    assert batching_throughput.Recorder().wake_on_tokens is False
    assert isinstance(batching_throughput.Recorder(), TokenRecorder)


def test_wait_returns_when_the_requests_finish():
    recorder = TokenRecorder()
    assert recorder.wait(1, 0.01) is False  # nothing finished: times out
    feeder = threading.Thread(target=lambda: (recorder(event("a", 2)), recorder(event("b", 1, finish="length")),
                                              recorder(event("a", 0, finish="stop"))))
    feeder.start()
    assert recorder.wait(2, 30)
    feeder.join()
    assert sorted(recorder.finals) == ["a", "b"] and len(recorder.token_times["a"]) == 2


def test_wait_for_tokens_wakes_on_a_token_event():
    """A waiter for tokens is woken by the token event itself (not only by a final one, which never comes here)."""
    recorder = TokenRecorder(wake_on_tokens=True)
    feeder = threading.Timer(0.05, lambda: recorder(event("a", 3)))
    feeder.start()
    assert recorder.wait_for(lambda r: len(r.token_times.get("a", [])) >= 3, 30)
    feeder.join()


def test_decode_rates_on_synthetic_token_times():
    """Window [10, 14] (4 s). Request x: tokens at 9 (outside), 10, 11, 11.5, 14 -> 4 in the window, 1 token/s,
    longest gap 14 - 11.5 = 2.5 s. Request y: 10.5, 12.5 -> 2 tokens, 0.5 token/s, gap 2 s. Request z: one token
    at 13 -> 0.25 token/s, no gap. Median of (1, 0.5, 0.25) = 0.5, lowest 0.25, longest gap 2.5."""
    recorder = TokenRecorder()
    recorder.token_times = {"x": [9.0, 10.0, 11.0, 11.5, 14.0], "y": [10.5, 12.5], "z": [13.0]}
    got = decode_under_arrivals.rates(recorder, ["x", "y", "z"], 10.0, 14.0)
    assert got == {"per_user_tokens_per_s_p50": 0.5, "per_user_tokens_per_s_min": 0.25, "max_gap_s": 2.5,
                   "window_s": 4.0}
    empty = decode_under_arrivals.rates(recorder, [], 10.0, 14.0)
    assert empty["per_user_tokens_per_s_p50"] is None and empty["max_gap_s"] is None


def test_the_gap_that_spans_a_window_counts_in_its_longest_gap():
    """Window [10.0, 10.2], shorter than one decode step. Request a: tokens at 9.5 and 10.5 (none inside) -> rate 0,
    its gap of 1.0 s spans the window. Request b: 9.0, 10.1, 10.6 -> one token inside (5 tokens/s), gaps 1.1 (spans
    the start) and 0.5 (spans the end). Request c: 9.9 only -> no gap. Longest gap 1.1; tokens before the window or
    after it that border no gap of it (a: 8.0 -> 9.5 added below) change nothing."""
    recorder = TokenRecorder()
    recorder.token_times = {"a": [9.5, 10.5], "b": [9.0, 10.1, 10.6], "c": [9.9]}
    got = decode_under_arrivals.rates(recorder, ["a", "b", "c"], 10.0, 10.2)
    assert got["max_gap_s"] == pytest.approx(1.1)
    assert got["per_user_tokens_per_s_min"] == 0.0 and got["per_user_tokens_per_s_p50"] == 0.0
    recorder.token_times["a"] = [8.0, 9.5, 10.5]
    assert decode_under_arrivals.rates(recorder, ["a", "b", "c"], 10.0, 10.2)["max_gap_s"] == pytest.approx(1.1)
    assert recorder.gaps_overlapping("a", 10.0, 10.2) == [1.0]
