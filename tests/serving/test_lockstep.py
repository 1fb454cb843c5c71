"""Lockstep (serving/parallel/lockstep.py): the batching engine under tensor parallelism, rank 0 taking requests and
every rank stepping with it.

In this process: a one-rank gloo group, so the leader's whole path (outbox, inboxes, heartbeats, cancels, stop) runs
against the single-process oracle (each request alone through model.generate). Under ``torchrun --nproc_per_node=2``
(gloo, CPU, tests/serving/lockstep_worker.py): a tiny Llama with ``tp_plan="auto"``; rank 0 serves staggered
requests (greedy, sampled without a seed, one cancelled mid-run, one after an idle gap), rank 1 follows; both ranks
must emit the same events, and the greedy tokens must equal model.generate of each request alone under the same TP.
"""

from __future__ import annotations

import json
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

from hf_rocketkv.serving import EngineStopped, FinishReason, Lockstep, Overloaded, SamplingParams
from hf_rocketkv.serving.batching.engine import BatchingEngine
from hf_rocketkv.serving.batching.scheduler import BatchingConfig
from hf_rocketkv.serving.parallel.lockstep import Inbox, resolve_seed
from tests.serving.helpers import CFG, Events, ForwardGate, make_pool, prompt_of, request, wait_until
from tests.support.repo import ROOT, TORCHRUN, subprocess_env

WORKER = Path(__file__).with_name("lockstep_worker.py")


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


@pytest.fixture
def one_rank_group():
    """torch.distributed with one gloo rank in this process (destroyed afterwards: no state leaks to other tests)."""
    if dist.is_initialized():
        pytest.skip("a process group already exists in this process")
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{_free_port()}", rank=0, world_size=1)
    yield
    dist.destroy_process_group()


@pytest.fixture
def leader(one_rank_group, engines):  # engines stop before the group goes
    """``leader(heartbeat_s, **batching) -> (engine, events, pool)``: a started leader of a one-rank lockstep."""

    def make(heartbeat_s: float = 0.05, **batching):
        return engines(lockstep=Lockstep(heartbeat_s=heartbeat_s), **{"max_running": 4, "buckets": (1, 2, 4),
                                                                      **batching})

    return make


def test_lockstep_needs_torch_distributed():
    if dist.is_initialized():
        pytest.skip("a process group already exists in this process")
    with pytest.raises(RuntimeError, match="torch.distributed"):
        Lockstep()


def test_lockstep_arguments_are_checked(one_rank_group):
    with pytest.raises(ValueError, match="heartbeat_s"):
        Lockstep(heartbeat_s=0)
    with pytest.raises(ValueError, match=r"src must be a rank in \[0, 1\)"):
        Lockstep(src=1)
    with pytest.raises(TypeError, match="leader must send an Inbox"):
        Lockstep().exchange(None)


def test_leader_serves_like_one_process(leader, oracle):
    engine, events, pool = leader()
    free = pool.free_pages()
    prompts = [(prompt_of(30, seed=1), 9), (prompt_of(17, seed=2), 6), (prompt_of(45, seed=3), 12)]
    for i, (prompt, n) in enumerate(prompts):
        engine.submit(request(f"r{i}", prompt, n))
    events.wait_finals(3)
    time.sleep(0.2)  # idle: a few heartbeat inboxes go by, then a request arrives to an idle leader
    late = prompt_of(26, seed=4)
    engine.submit(request("late", late, 5))
    events.wait_finals(4)
    for i, (prompt, n) in enumerate(prompts):
        assert events.tokens(f"r{i}") == oracle(prompt, n), f"request {i}"
    assert events.tokens("late") == oracle(late, 5)
    assert [e.finish_reason for e in events.finals()] == [FinishReason.LENGTH] * 4
    assert wait_until(lambda: pool.free_pages() == free)


def test_leader_cancels_through_the_inbox(leader, tiny_pair):
    engine, events, pool = leader()
    free = pool.free_pages()
    gate = ForwardGate(tiny_pair[0], delay=0.01)
    try:
        engine.submit(request("long", prompt_of(30, seed=5), 200))
        assert wait_until(lambda: len(events.tokens("long")) >= 2)
        engine.cancel("long")
        events.wait_finals(1)
    finally:
        gate.remove()
    assert [e.finish_reason for e in events.finals("long")] == [FinishReason.CANCELLED]
    assert 2 <= len(events.tokens("long")) < 200
    assert wait_until(lambda: pool.free_pages() == free)


def test_a_request_cancelled_before_its_inbox_never_runs(leader, tiny_pair):
    engine, events, _ = leader()
    gate = ForwardGate(tiny_pair[0], closed=True)  # the engine thread sits in the first request's forward
    try:
        engine.submit(request("first", prompt_of(20, seed=6), 3))
        assert gate.entered.wait(10)
        engine.submit(request("second", prompt_of(20, seed=7), 3))
        engine.cancel("second")  # still in the leader's outbox: ends at once, on this thread
        assert [e.finish_reason for e in events.finals("second")] == [FinishReason.CANCELLED]
    finally:
        gate.remove()
    events.wait_finals(2)
    assert events.tokens("second") == [] and len(events.tokens("first")) == 3


def test_leader_queue_counts_requests_not_yet_sent(leader, tiny_pair):
    engine, events, _ = leader(max_queue=2)
    gate = ForwardGate(tiny_pair[0], closed=True)
    try:
        engine.submit(request("a", prompt_of(20, seed=8), 2))
        assert gate.entered.wait(10)
        engine.submit(request("b", prompt_of(20, seed=9), 2))
        engine.submit(request("c", prompt_of(20, seed=10), 2))
        with pytest.raises(Overloaded, match="max_queue=2"):
            engine.submit(request("d", prompt_of(20, seed=11), 2))
        assert engine.load().waiting == 2
    finally:
        gate.remove()
    events.wait_finals(3)
    assert sorted(e.request_id for e in events.finals()) == ["a", "b", "c"]


def test_stop_without_drain_cancels_everything_and_ends_the_thread(leader, tiny_pair):
    engine, events, pool = leader()
    free = pool.free_pages()
    gate = ForwardGate(tiny_pair[0], delay=0.01)
    try:
        for i in range(3):
            engine.submit(request(f"s{i}", prompt_of(20, seed=20 + i), 100))
        assert wait_until(lambda: len(events.tokens("s0")) >= 1)
        engine.stop(drain=False, timeout=60)
    finally:
        gate.remove()
    assert not engine.load().alive
    assert sorted(e.request_id for e in events.finals()) == ["s0", "s1", "s2"]
    assert {e.finish_reason for e in events.finals()} == {FinishReason.CANCELLED}
    assert pool.free_pages() == free
    with pytest.raises(EngineStopped):
        engine.submit(request("after", prompt_of(20, seed=30), 2))


def test_a_follower_takes_no_requests(tiny_pair, one_rank_group):
    lockstep = Lockstep()
    lockstep.rank = 1  # as seen on another rank (a one-rank group has no follower of its own)
    engine = BatchingEngine(tiny_pair[0], CFG, make_pool(tiny_pair[0]), BatchingConfig(max_running=2),
                            lockstep=lockstep)
    with pytest.raises(RuntimeError, match="only the leader takes requests"):
        engine._inboxes.submit(request("x", prompt_of(20, seed=1), 2))
    leader_engine = BatchingEngine(tiny_pair[0], CFG, make_pool(tiny_pair[0]), BatchingConfig(max_running=2),
                                   lockstep=Lockstep())
    with pytest.raises(RuntimeError, match="for the other ranks"):
        leader_engine.follow()


def test_resolve_seed_draws_only_for_unseeded_sampling():
    greedy = SamplingParams.greedy(4)
    seeded = SamplingParams(max_tokens=4, temperature=0.7, seed=5)
    unseeded = SamplingParams(max_tokens=4, temperature=0.7)
    assert resolve_seed(greedy) is greedy and resolve_seed(seeded) is seeded
    drawn = resolve_seed(unseeded)
    assert isinstance(drawn.seed, int) and 0 <= drawn.seed < 2**63 and drawn.temperature == 0.7
    assert not Inbox() and Inbox(exit=True)


# ------------------------------------------------------------------------------------------------ two ranks
@pytest.mark.slow
def test_two_ranks_step_together_and_equal_generate_under_tp(tmp_path):
    from tests.support.tiny_models import make_models

    rocket, _ = make_models("llama", hidden_size=128, num_attention_heads=8, num_key_value_heads=4, head_dim=16)
    model_dir = tmp_path / "model"
    rocket.save_pretrained(model_dir)
    output = tmp_path / "out.json"
    env = subprocess_env(OMP_NUM_THREADS="1", PYTHONWARNINGS="ignore")
    command = [*TORCHRUN, str(WORKER),
               str(model_dir), str(output)]
    result = subprocess.run(command, env=env, capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-5000:]
    report = json.loads(output.read_text())
    leader_events, follower_events = (r["events"] for r in report["ranks"])
    assert leader_events == follower_events, "the ranks emitted different events"
    finals = {e["id"]: e["finish"] for e in leader_events if e["finish"]}
    tokens = {}
    for event in leader_events:
        tokens.setdefault(event["id"], []).extend(event["tokens"])
    for request_id, expected in report["oracle"].items():
        assert tokens[request_id] == expected, f"{request_id}: engine under TP != generate under TP"
        assert finals[request_id] == "length"
    assert finals["sampled"] == "length" and len(tokens["sampled"]) == report["sampled_max_tokens"]
    assert finals["cancelled"] == "cancelled" and 2 <= len(tokens["cancelled"]) < report["cancelled_max_tokens"]
    assert len({rank["total_pages"] for rank in report["ranks"]}) == 1, "the ranks' pools differ in pages"
    for rank in report["ranks"]:
        assert rank["free_pages"] == rank["total_pages"], f"rank {rank['rank']} leaked pages"
        assert rank["kv_heads"] == 2, "each rank holds half of the 4 KV heads"
        assert rank["tp_size"] == 2  # what the engines' guard reads (an engine without lockstep is refused)
    assert report["heartbeats_seen"], "the follower never saw an empty inbox during the idle gap"


@pytest.mark.slow
def test_lockstep_check_script_on_cpu(tmp_path):
    """benchmarks.tp_serving_throughput's logic on a tiny checkpoint: one process, then 2 ranks (gloo), then the table;
    the ranks' event digests must agree and every workload must finish."""
    from tests.support.tiny_models import make_models

    rocket, _ = make_models("llama", hidden_size=128, num_attention_heads=8, num_key_value_heads=4, head_dim=16)
    rocket.save_pretrained(tmp_path / "model")
    env = subprocess_env(OMP_NUM_THREADS="1", PYTHONWARNINGS="ignore")
    script = ["-m", "benchmarks.tp_serving_throughput"]
    small = ["--dir", str(tmp_path / "model"), "--requests", "3", "--prompt-len", "64", "--new-tokens", "5",
             "--mixed-requests", "3", "--rate", "20", "--min-prompt", "30", "--max-prompt", "90", "--max-running", "4",
             "--page-size", "8", "--pool-gib", "0.01", "--rocketkv-json",
             json.dumps(dict(prompt_budget=24, window_size=8, kernel_size=5, topk=3, topr=8, page_size=4,
                             kt_cache_dtype="float32"))]
    runs = {"single": [sys.executable, *script], "tp": [*TORCHRUN, *script]}
    for name, command in runs.items():
        result = subprocess.run([*command, *small, "--out", str(tmp_path / f"{name}.json")], env=env, cwd=ROOT,
                                capture_output=True, text=True, timeout=240)
        assert result.returncode == 0, result.stdout[-2000:] + result.stderr[-4000:]
    tp = json.loads((tmp_path / "tp.json").read_text())
    assert tp["world_size"] == 2 and tp["same_events_on_every_rank"]
    assert tp["ranks"][0]["events"] == tp["ranks"][1]["events"] > 0
    for workload in ("fixed", "mixed"):
        assert tp["results"][workload]["finished"] == {"length": 3}
        assert tp["results"][workload]["output_tokens"] == 15
    table = subprocess.run([sys.executable, *script, "--compare", str(tmp_path / "single.json"),
                            str(tmp_path / "tp.json")], env=env, cwd=ROOT, capture_output=True, text=True, timeout=60)
    assert table.returncode == 0 and "| fixed | tokens_per_s |" in table.stdout
    assert "same events on every rank: True" in table.stdout


def _follower(tiny_pair, inboxes):
    """An engine on 'rank 1' of a one-rank group whose exchange() returns the given inboxes in turn."""
    lockstep = Lockstep()
    lockstep.rank = 1
    feed = iter(inboxes)
    lockstep.exchange = lambda inbox: next(feed)
    pool = make_pool(tiny_pair[0])
    return BatchingEngine(tiny_pair[0], CFG, pool, BatchingConfig(max_running=2), lockstep=lockstep), pool


def test_a_follower_applies_inboxes_and_ends_with_the_leader(tiny_pair, oracle, one_rank_group):
    from hf_rocketkv.serving.parallel.lockstep import Submission, engine_state

    prompt = tuple(prompt_of(30, seed=40))
    submit = Submission("x", prompt, SamplingParams.greedy(3), frozenset())
    # the states a leader would send: before the submit, then with "x" prefilled (iteration 1: its prompt and first
    # token) and decoding (iterations 2-4: a step launched, launched again while the first is read, the last read),
    # then done
    inboxes = [Inbox([submit], state=engine_state(0, [], []))]
    inboxes += [Inbox(state=engine_state(i, ["x"], [])) for i in (1, 2, 3)]
    inboxes += [Inbox(exit=True, state=engine_state(4, [], []))]
    engine, pool = _follower(tiny_pair, inboxes)
    events = Events()
    free = pool.free_pages()
    engine.follow(events)
    assert events.tokens("x") == oracle(list(prompt), 3)
    assert [e.finish_reason for e in events.finals()] == [FinishReason.LENGTH]
    assert pool.free_pages() == free and not engine.load().alive


def test_a_follower_that_diverges_stops_loudly(tiny_pair, one_rank_group):
    from hf_rocketkv.serving.parallel.lockstep import LockstepDiverged, engine_state

    engine, _ = _follower(tiny_pair, [Inbox(state=engine_state(0, ["someone"], []))])
    with pytest.raises(LockstepDiverged, match="rank 1 no longer matches rank 0"):
        engine.follow()
    assert not engine.load().alive


def test_engines_on_a_sharded_model_need_lockstep(tiny_pair, monkeypatch):
    from hf_rocketkv.serving import SequentialEngine

    model = tiny_pair[0]
    assert model.tp_size is None  # not sharded
    # what from_pretrained(tp_plan="auto") shows on each of 2 ranks (transformers' public property)
    monkeypatch.setattr(type(model), "tp_size", property(lambda self: 2))
    with pytest.raises(ValueError, match=r"BatchingEngine: the model is sharded over 2 ranks.*lockstep="):
        BatchingEngine(model, CFG, make_pool(model), BatchingConfig(max_running=2))
    with pytest.raises(ValueError, match="SequentialEngine: the model is sharded over 2 ranks"):
        SequentialEngine(model, CFG)


@pytest.mark.slow
@pytest.mark.parametrize("arch", ["llama", "gemma3", "gpt_oss", "gemma2"])
def test_generate_batch_on_every_rank_under_tp(tmp_path, arch):
    """generate_batch on a sharded model, called on both ranks (torchrun, gloo): every rank gets rank 0's results
    (greedy ones equal model.generate under the same TP), and an invalid prompt raises on every rank. Models with
    sliding-window layers (Gemma 3), sinks (gpt-oss) or soft-capping (Gemma 2) run on the hybrid pool, each rank's
    windows holding its shard of KV heads."""
    from tests.support.hybrid_models import make_hybrid_models
    from tests.support.tiny_models import make_models

    if arch == "llama":
        rocket, _ = make_models("llama", hidden_size=128, num_attention_heads=8, num_key_value_heads=4, head_dim=16)
    else:
        rocket, _ = make_hybrid_models(arch)
    rocket.save_pretrained(tmp_path / "model")
    env = subprocess_env(OMP_NUM_THREADS="1", PYTHONWARNINGS="ignore")
    command = [*TORCHRUN, str(WORKER),
               str(tmp_path / "model"), str(tmp_path / "out.json"), "generate_batch"]
    result = subprocess.run(command, env=env, capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-5000:]
    ranks = json.loads((tmp_path / "out.json").read_text())
    assert ranks[0]["tokens"] == ranks[1]["tokens"] and ranks[0]["reasons"] == ranks[1]["reasons"]
    assert ranks[0]["tokens"][:2] == ranks[0]["oracle"]
    assert [len(t) for t in ranks[0]["tokens"]] == [7, 5, 6] and ranks[0]["reasons"] == ["length"] * 3
    for rank in ranks:
        assert rank["error"] is not None and "prompts[1]" in rank["error"]
