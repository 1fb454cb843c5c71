"""Lockstep worker for tests/serving/test_lockstep.py (``torchrun --nproc_per_node=2``, gloo, CPU).

    torchrun --nproc_per_node=2 tests/serving/lockstep_worker.py MODEL_DIR OUTPUT_JSON

Every rank loads the tiny checkpoint with ``tp_plan="auto"`` and builds a pool and a BatchingEngine with a
``Lockstep``. Rank 0 submits staggered requests (greedy ones, a sampled one without a seed, one cancelled after two
tokens, one after an idle gap of several heartbeats) and stops; rank 1 follows. Then every rank runs the oracle
(model.generate of each greedy request alone, under the same TP), and rank 0 writes every rank's events, pages and
the oracle's tokens to OUTPUT_JSON.
"""

from __future__ import annotations

import json
import os
import sys
import threading
import time
import warnings
from pathlib import Path

import torch
import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

GREEDY = {"g1": (40, 8, 1), "g2": (56, 10, 2), "late": (48, 6, 3)}  # id: (prompt length, max_tokens, seed)
SAMPLED_MAX, CANCELLED_MAX = 8, 200
HEARTBEAT_S = 0.1


def main() -> None:
    model_dir, output_path = sys.argv[1:3]
    if sys.argv[3:] == ["generate_batch"]:
        return batch_main(model_dir, output_path)
    torch.set_num_threads(1)
    warnings.filterwarnings("ignore")
    from transformers import AutoModelForCausalLM
    from transformers.distributed import DistributedConfig

    import hf_rocketkv
    from hf_rocketkv import KVBlockPool, RocketKVCache
    from hf_rocketkv.serving import Lockstep, SamplingParams
    from hf_rocketkv.serving.batching.engine import BatchingEngine
    from hf_rocketkv.serving.batching.scheduler import BatchingConfig
    from hf_rocketkv.serving.engines.interface import EngineRequest
    from tests.support.tiny_models import compressing_config, greedy, random_ids

    model = AutoModelForCausalLM.from_pretrained(model_dir, distributed_config=DistributedConfig(tp_plan="auto"),
                                                 attn_implementation=hf_rocketkv.ATTN_NAME, dtype=torch.float32).eval()
    rank = dist.get_rank()
    config = compressing_config(kt_cache_dtype="float32")
    pool = KVBlockPool(model, max_gpu_bytes=2**20, page_size=8, dtype=torch.float32, device="cpu",
                       kt_page_size=config.page_size, kt_dtype=config.kt_cache_dtype)
    lockstep = Lockstep(heartbeat_s=HEARTBEAT_S)
    engine = BatchingEngine(model, config, pool, BatchingConfig(max_running=4, buckets=(1, 2, 4)), lockstep=lockstep)

    events, lock, heartbeats = [], threading.Condition(), []
    if not lockstep.is_leader:  # count the empty inboxes this follower receives
        exchange = lockstep.exchange
        lockstep.exchange = lambda inbox: _counted(exchange(inbox), heartbeats)

    def sink(event) -> None:
        with lock:
            events.append({"id": event.request_id, "tokens": list(event.token_ids),
                           "finish": event.finish_reason.value if event.finish_reason else None})
            lock.notify_all()

    def prompt(length, seed):
        return tuple(random_ids(1, length, seed=seed)[0].tolist())

    if lockstep.is_leader:
        def finished(request_id):
            return any(e["id"] == request_id and e["finish"] for e in events)

        def tokens_of(request_id):
            return sum(len(e["tokens"]) for e in events if e["id"] == request_id)

        def submit(request_id, ids, params):
            engine.submit(EngineRequest(request_id, ids, params, frozenset()))

        # 5 ms per forward on the leader (the follower waits for it in every collective): the cancelled request's
        # 200 tokens take seconds, so the cancel lands mid-run even on a loaded machine
        model.register_forward_pre_hook(lambda module, args: time.sleep(0.005))
        engine.start(sink)
        submit("g1", prompt(*GREEDY["g1"][::2]), SamplingParams.greedy(GREEDY["g1"][1]))
        submit("cancelled", prompt(30, 4), SamplingParams.greedy(CANCELLED_MAX))
        time.sleep(0.05)  # a later arrival joins a running batch
        submit("sampled", prompt(30, 5), SamplingParams(max_tokens=SAMPLED_MAX, temperature=0.8))  # seed: None
        submit("g2", prompt(*GREEDY["g2"][::2]), SamplingParams.greedy(GREEDY["g2"][1]))
        with lock:
            assert lock.wait_for(lambda: tokens_of("cancelled") >= 2, 120)
        engine.cancel("cancelled")
        with lock:
            assert lock.wait_for(lambda: all(finished(r) for r in ("g1", "g2", "sampled", "cancelled")), 120)
        time.sleep(5 * HEARTBEAT_S)  # idle: heartbeats only
        submit("late", prompt(*GREEDY["late"][::2]), SamplingParams.greedy(GREEDY["late"][1]))
        with lock:
            assert lock.wait_for(lambda: finished("late"), 120)
        engine.stop(drain=True, timeout=120)
    else:
        engine.follow(sink)
    assert not engine.load().alive

    oracle = {}
    for request_id, (length, max_tokens, seed) in GREEDY.items():  # every rank: generate's forwards are collective
        ids = torch.tensor([prompt(length, seed)])
        out = greedy(model, ids, max_tokens, cache=RocketKVCache(config))
        oracle[request_id] = out[0, ids.shape[1]:].tolist()

    report = dict(rank=rank, events=events, free_pages=pool.free_pages(), total_pages=pool.total_pages(),
                  kv_heads=int(pool.layer(0).k.shape[1]), heartbeats=len(heartbeats), tp_size=model.tp_size)
    gathered = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, report)
    if rank == 0:
        Path(output_path).write_text(json.dumps({
            "ranks": gathered, "oracle": oracle, "sampled_max_tokens": SAMPLED_MAX,
            "cancelled_max_tokens": CANCELLED_MAX, "heartbeats_seen": gathered[1]["heartbeats"] > 0,
        }))
    _leave()


def batch_main(model_dir: str, output_path: str) -> None:
    """generate_batch called on every rank with the same arguments: results on every rank, and an invalid prompt's
    error raised on every rank (none left waiting)."""
    torch.set_num_threads(1)
    warnings.filterwarnings("ignore")
    from transformers import AutoModelForCausalLM
    from transformers.distributed import DistributedConfig

    import hf_rocketkv
    from hf_rocketkv import KVBlockPool, RocketKVCache, generate_batch
    from hf_rocketkv.serving import InvalidRequest, SamplingParams
    from tests.support.tiny_models import compressing_config, greedy, random_ids

    model = AutoModelForCausalLM.from_pretrained(model_dir, distributed_config=DistributedConfig(tp_plan="auto"),
                                                 attn_implementation=hf_rocketkv.ATTN_NAME, dtype=torch.float32).eval()
    config = compressing_config(kt_cache_dtype="float32")

    def pool():
        return KVBlockPool(model, max_gpu_bytes=2**20, page_size=8, dtype=torch.float32, device="cpu",
                           kt_page_size=config.page_size, kt_dtype=config.kt_cache_dtype)

    prompts = [random_ids(1, n, seed=n)[0].tolist() for n in (40, 56, 30)]
    sampling = [SamplingParams.greedy(7, ignore_eos=True), SamplingParams.greedy(5, ignore_eos=True),
                SamplingParams(max_tokens=6, temperature=0.9, ignore_eos=True)]  # seed None: drawn on rank 0
    results = generate_batch(model, prompts, config=config, pool=pool(), sampling=sampling)
    try:
        generate_batch(model, [prompts[0], [10**6]], config=config, pool=pool(), sampling=SamplingParams.greedy(3))
        error = None
    except InvalidRequest as err:
        error = str(err)
    oracle = []
    for prompt, params in zip(prompts[:2], sampling[:2]):
        ids = torch.tensor([prompt])
        oracle.append(greedy(model, ids, params.max_tokens, cache=RocketKVCache(config))[0, ids.shape[1]:]
                      .tolist())
    report = dict(rank=dist.get_rank(), tokens=[list(r.token_ids) for r in results],
                  reasons=[r.finish_reason.value for r in results], error=error, oracle=oracle)
    gathered = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, report)
    if dist.get_rank() == 0:
        Path(output_path).write_text(json.dumps(gathered))
    _leave()


def _leave() -> None:
    """Every rank leaves without interpreter finalization, as tests/integration/tp_worker.py does: the model's DTensor
    shards keep the gloo group alive past destroy_process_group(), and gloo's threads meeting a half torn-down
    interpreter abort now and then ("terminate called without an active exception", SIGABRT, pytorch/pytorch#179291)
    after all the work is done and the report written. os._exit after flushing makes the exit status report the run."""
    dist.barrier()
    dist.destroy_process_group()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


def _counted(inbox, heartbeats):
    if not inbox:
        heartbeats.append(1)
    return inbox


if __name__ == "__main__":
    main()
