"""The batching engine in lockstep on two GPUs (serving/parallel/lockstep.py, NCCL), driven as
benchmarks/tp_serving_throughput.py drives it: rank 0 serves a fixed and a staggered workload, rank 1 follows.

Checked: both ranks emitted exactly the same events (equal SHA-256 digests over every event in order, and equal
counts), every request of both workloads finished with reason ``length`` and its tokens, and every rank's pool has
all its pages free at the end. A random checkpoint with Llama-3.1-8B shapes (4 layers, bf16).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import torch

from .gpu_models import llama_8b_layers, two_gpus

REPO = Path(__file__).resolve().parents[2]
REQUESTS, NEW_TOKENS = 4, 16
WORKLOAD = ["--requests", str(REQUESTS), "--prompt-len", "2048", "--new-tokens", str(NEW_TOKENS),
            "--mixed-requests", str(REQUESTS), "--rate", "20", "--min-prompt", "512", "--max-prompt", "4096",
            "--max-running", "4", "--pool-gib", "4"]


@two_gpus
def test_two_ranks_serve_in_lockstep(tmp_path):
    model = llama_8b_layers(4)
    model.save_pretrained(tmp_path / "model")
    del model
    torch.cuda.empty_cache()
    report_path = tmp_path / "tp.json"
    env = {**os.environ, "PYTHONWARNINGS": "ignore",
           "PYTHONPATH": os.pathsep.join(p for p in (str(REPO), os.environ.get("PYTHONPATH")) if p)}
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2", "-m",
               "benchmarks.tp_serving_throughput", "--dir", str(tmp_path / "model"), "--out", str(report_path),
               *WORKLOAD]
    result = subprocess.run(command, cwd=REPO, env=env, capture_output=True, text=True, timeout=480)
    assert result.returncode == 0 and report_path.exists(), result.stdout[-3000:] + result.stderr[-5000:]
    report = json.loads(report_path.read_text())
    assert report["world_size"] == 2
    ranks = report["ranks"]
    assert report["same_events_on_every_rank"], f"the ranks' event digests differ: {[r['digest'] for r in ranks]}"
    assert ranks[0]["events"] == ranks[1]["events"] > 0
    for workload in ("fixed", "mixed"):
        summary = report["results"][workload]
        assert summary["finished"] == {"length": REQUESTS}, (workload, summary["finished"], summary["errors"])
        assert summary["output_tokens"] == REQUESTS * NEW_TOKENS, workload
    for rank in ranks:
        assert rank["free_pages"] == rank["total_pages"], f"rank {rank['rank']} holds pages after the workloads"
