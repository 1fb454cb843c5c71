"""The continuous-batching scheduler (serving/batching/scheduler.py) under random request sequences (hypothesis), and
its prefill chunks by token budget (the expected chunks worked out by hand from the documented rule)."""

from __future__ import annotations

import pytest
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from hf_rocketkv.serving.batching.scheduler import BatchingConfig, QueueFull, Scheduler


class Pages:
    """A toy pool: each request needs ``need`` pages to completion."""

    def __init__(self, total):
        self.total, self.used = total, 0

    def admit(self, request):
        if self.used + request["need"] > self.total:
            return False
        self.used += request["need"]
        return True

    def release(self, request):
        self.used -= request["need"]


class SchedulerMachine(RuleBasedStateMachine):
    def __init__(self):
        super().__init__()
        self.pages = Pages(40)
        self.config = BatchingConfig(max_running=6, buckets=(1, 2, 4, 8), prefills_per_step=2, max_queue=5,
                                     prefill_chunk_tokens=8, prefill_token_budget=5)
        self.scheduler = Scheduler(self.config, self.pages.admit, key=lambda r: r["id"],
                                   prompt_left=lambda r: r["left"])
        self.next_id = 0
        self.row_state = []  # the executor's per-row state, moved as the scheduler says
        self.admitted, self.completed, self.order = set(), set(), []

    @rule(need=st.integers(1, 15), prompt=st.integers(1, 30))
    def submit(self, need, prompt):
        request = {"id": self.next_id, "need": need, "left": prompt}
        self.next_id += 1
        try:
            self.scheduler.submit(request)
        except QueueFull:
            assert len(self.scheduler.waiting) == self.config.max_queue

    @rule()
    def step(self):
        step = self.scheduler.next_step()
        for source, target in step.moves:
            self.row_state[target] = self.row_state[source]
        del self.row_state[len(step.decode) :]
        assert [r["id"] for r in step.decode] == self.row_state  # rows stay where the executor put them
        if step.decode:
            assert step.bucket == min(b for b in self.config.buckets if b >= len(step.decode))
        assert sum(tokens for _, tokens in step.prefill) <= self.config.prefill_credit_cap
        for request, tokens in step.prefill:
            assert 1 <= tokens <= min(self.config.prefill_chunk_tokens, request["left"])
            if request["id"] not in self.admitted:
                self.admitted.add(request["id"])
                self.order.append(request["id"])
            request["left"] -= tokens
            if request["left"] == 0:
                row = self.scheduler.prefilled(request)
                assert row == len(self.row_state)
                self.row_state.append(request["id"])

    @precondition(lambda self: self.scheduler.rows)
    @rule(data=st.data())
    def finish(self, data):
        request = data.draw(st.sampled_from(self.scheduler.rows))
        self.scheduler.finish(request)
        self.pages.release(request)
        self.completed.add(request["id"])

    @invariant()
    def accounting(self):
        held = sum(r["need"] for r in self.scheduler.rows + self.scheduler.prefilling)
        assert held == self.pages.used <= self.pages.total
        assert len(self.scheduler.rows) + len(self.scheduler.prefilling) <= self.config.max_running
        assert self.order == sorted(self.order)  # FIFO: nobody overtakes the head of the queue

    def teardown(self):
        # drain: everything admitted or waiting eventually completes, and every page comes back
        for _ in range(200):
            step = self.scheduler.next_step()
            for request, tokens in step.prefill:
                request["left"] -= tokens
                if request["left"] == 0:
                    self.scheduler.prefilled(request)
            for request in list(self.scheduler.rows):
                self.scheduler.finish(request)
                self.pages.release(request)
            if self.scheduler.idle():
                break
        assert self.scheduler.idle() and self.pages.used == 0


SchedulerMachine.TestCase.settings = settings(
    max_examples=40, stateful_step_count=30, deadline=None, derandomize=True,
    suppress_health_check=[HealthCheck.too_slow],
)
TestScheduler = SchedulerMachine.TestCase


def test_config_validation_names_the_field():
    with pytest.raises(ValueError, match="buckets"):
        BatchingConfig(buckets=(4, 2))
    with pytest.raises(ValueError, match="max_running"):
        BatchingConfig(max_running=200)
    assert BatchingConfig().bucket_for(3) == 4 and BatchingConfig().bucket_for(64) == 64


def test_head_of_queue_is_not_overtaken():
    pages = Pages(10)
    scheduler = Scheduler(BatchingConfig(max_running=4, buckets=(1, 2, 4)), pages.admit, key=lambda r: r["id"])
    scheduler.submit({"id": 0, "need": 8})
    scheduler.submit({"id": 1, "need": 8})  # does not fit beside 0
    scheduler.submit({"id": 2, "need": 1})  # would fit, but must not overtake 1
    step = scheduler.next_step()
    assert [r["id"] for r, _ in step.prefill] == [0]
    scheduler.prefilled(step.prefill[0][0])
    assert scheduler.next_step().prefill == []
    scheduler.finish(scheduler.rows[0])
    pages.release({"need": 8})
    assert [r["id"] for r, _ in scheduler.next_step().prefill] == [1]


# ------------------------------------------------------------------------------------------------ prefill chunks
def _chunking(budget: int, chunk: int = 16, per_step: int = 1) -> Scheduler:
    config = BatchingConfig(max_running=4, buckets=(1, 2, 4), prefills_per_step=per_step, prefill_chunk_tokens=chunk,
                            prefill_token_budget=budget)
    return Scheduler(config, Pages(1000).admit, key=lambda r: r["id"], prompt_left=lambda r: r["left"])


def _execute(scheduler: Scheduler, step) -> list[tuple[int, int]]:
    """Run a step's chunks as the engine does; returns them as (request id, tokens)."""
    for request, tokens in step.prefill:
        request["left"] -= tokens
        if request["left"] == 0:
            scheduler.prefilled(request)
    return [(request["id"], tokens) for request, tokens in step.prefill]


def test_without_decoding_rows_one_chunk_runs_per_step():
    scheduler = _chunking(budget=4)
    scheduler.submit({"id": 0, "need": 1, "left": 40})
    assert [_execute(scheduler, scheduler.next_step()) for _ in range(3)] == [[(0, 16)], [(0, 16)], [(0, 8)]]
    assert scheduler.rows and not scheduler.prefilling


def test_while_rows_decode_a_chunk_runs_once_its_tokens_are_earned():
    """Budget 4, chunk 16: the credit starts full (16), each step with decoding rows earns 4 (kept up to 16), a
    chunk runs when the credit pays for it: 16 at the first step, 16 four steps later, the last 8 two steps later."""
    scheduler = _chunking(budget=4)
    scheduler.submit({"id": "row", "need": 1, "left": 1})
    assert _execute(scheduler, scheduler.next_step()) == [("row", 1)]  # now a decoding row
    scheduler.submit({"id": "long", "need": 1, "left": 40})
    ran = {step: _execute(scheduler, scheduler.next_step()) for step in range(1, 9)}
    assert {step: chunks for step, chunks in ran.items() if chunks} == {1: [("long", 16)], 5: [("long", 16)],
                                                                      7: [("long", 8)]}


def test_a_budget_over_the_chunk_runs_several_whole_chunks_per_step_in_admission_order():
    scheduler = _chunking(budget=32, per_step=2)
    scheduler.submit({"id": "row", "need": 1, "left": 1})
    _execute(scheduler, scheduler.next_step())
    scheduler.submit({"id": "a", "need": 1, "left": 20})
    scheduler.submit({"id": "b", "need": 1, "left": 40})
    # credit 32 a step; chunks are whole (a chunk of b's 16 does not fit the 12 left), b waits for the next step
    assert _execute(scheduler, scheduler.next_step()) == [("a", 16), ("a", 4)]
    assert _execute(scheduler, scheduler.next_step()) == [("b", 16), ("b", 16)]
    assert _execute(scheduler, scheduler.next_step()) == [("b", 8)]


def test_prefills_per_step_bounds_the_requests_being_prefilled():
    """One request prefilled at a time (the default): a short prompt behind a long one is admitted once the long one
    has had its last chunk, at the next step."""
    scheduler = _chunking(budget=16)
    scheduler.submit({"id": "long", "need": 1, "left": 32})
    scheduler.submit({"id": "short", "need": 1, "left": 3})
    assert _execute(scheduler, scheduler.next_step()) == [("long", 16)]
    assert _execute(scheduler, scheduler.next_step()) == [("long", 16)]
    assert _execute(scheduler, scheduler.next_step()) == [("short", 3)]


def test_a_request_that_ended_mid_prefill_no_longer_counts():
    scheduler = _chunking(budget=16)
    long = {"id": "long", "need": 1, "left": 64}
    scheduler.submit(long)
    scheduler.submit({"id": "next", "need": 1, "left": 5})
    _execute(scheduler, scheduler.next_step())
    scheduler.prefill_ended(long)  # cancelled after its first chunk
    assert _execute(scheduler, scheduler.next_step()) == [("next", 5)]
    assert scheduler.running == 1 and [r["id"] for r in scheduler.rows] == ["next"]
