"""The continuous-batching scheduler (serving/scheduler.py) under random request sequences (hypothesis)."""

from __future__ import annotations

import pytest
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from hf_rocketkv.serving.scheduler import BatchingConfig, QueueFull, Scheduler


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
        self.config = BatchingConfig(max_running=6, buckets=(1, 2, 4, 8), prefills_per_step=2, max_queue=5)
        self.scheduler = Scheduler(self.config, self.pages.admit, key=lambda r: r["id"])
        self.next_id = 0
        self.row_state = []  # the executor's per-row state, moved as the scheduler says
        self.admitted, self.completed, self.order = set(), set(), []

    @rule(need=st.integers(1, 15))
    def submit(self, need):
        request = {"id": self.next_id, "need": need}
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
        for request in step.prefill:
            self.admitted.add(request["id"])
            self.order.append(request["id"])
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
            for request in step.prefill:
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
    assert [r["id"] for r in step.prefill] == [0]
    scheduler.prefilled(step.prefill[0])
    assert scheduler.next_step().prefill == []
    scheduler.finish(scheduler.rows[0])
    pages.release({"need": 8})
    assert [r["id"] for r in scheduler.next_step().prefill] == [1]
