"""benchmarks.tp_speed on the CPU: ``run`` in one process and under ``torchrun --nproc_per_node=2`` (gloo,
``tp_plan="auto"``) on a tiny Llama, then ``compare``. Checks the JSON each writes and the table, not the speed."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from tests.support.repo import ROOT, TORCHRUN, subprocess_env
from tests.support.tiny_models import make_models

SCRIPT = ["-m", "benchmarks.tp_speed"]  # run from the repository root
# the tiny model's prompt (64 tokens) must exceed prompt_budget, so stage 1 compresses as it would at 100k
ROCKET = dict(prompt_budget=24, window_size=8, kernel_size=5, topk=3, topr=8, page_size=4,
              kt_cache_dtype="float32", backend="torch")
WORKLOAD = ["--batch", "2", "--context", "64", "--new-tokens", "4", "--repeats", "1",
            "--rocketkv-json", json.dumps(ROCKET)]


def _run(command: list[str]) -> subprocess.CompletedProcess:
    env = subprocess_env(OMP_NUM_THREADS="1", PYTHONWARNINGS="ignore",
                         CUDA_VISIBLE_DEVICES="")  # the CPU path even where a GPU is present
    result = subprocess.run(command, env=env, capture_output=True, text=True, timeout=240, cwd=ROOT)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-5000:]
    return result


@pytest.mark.slow
def test_tp_speed_run_and_compare_on_cpu(tmp_path):
    rocket, _ = make_models("llama", hidden_size=128, num_attention_heads=8, num_key_value_heads=4, head_dim=16)
    model_dir = tmp_path / "model"
    rocket.save_pretrained(model_dir)
    single, tp = tmp_path / "single.json", tmp_path / "tp.json"

    _run([sys.executable, *SCRIPT, "run", "--dir", str(model_dir), "--out", str(single), *WORKLOAD])
    _run([*TORCHRUN, *SCRIPT, "run", "--dir", str(model_dir), "--out", str(tp), *WORKLOAD])

    for path, world in ((single, 1), (tp, 2)):
        record = json.loads(path.read_text())
        assert record["world_size"] == world
        assert record["device"] == "cpu"
        assert (record["batch"], record["context"], record["new_tokens"], record["repeats"]) == (2, 64, 4, 1)
        assert record["rocketkv"]["prompt_budget"] == 24 and record["rocketkv"]["backend"] == "torch"
        for key in ("warm_up_s", "ttft_s", "full_s", "decode_ms_per_token_steady"):
            assert record[key] > 0, key
        # the end-to-end decode figure is the difference of two timed calls: on a busy 2-core machine with 4 new
        # tokens it can come out below zero, so its arithmetic is checked rather than its sign
        (ttft,), (full,) = record["ttft_s_all"], record["full_s_all"]
        assert record["decode_ms_per_token"] == pytest.approx((full - ttft) / (4 - 1) * 1e3)
        assert record["tokens_per_s"] == pytest.approx(2 * 1e3 / record["decode_ms_per_token"])
        assert len(record["ttft_s_all"]) == len(record["full_s_all"]) == len(record["decode_ms_per_token_all"]) == 1
        assert record["peak_gib_per_rank"] == [None] * world  # no CUDA allocator on the CPU
        assert record["recompilations_after_warmup"] == 0  # reported; nothing compiles on the CPU
        for key in ("torch", "transformers", "date"):
            assert record[key]

    table = _run([sys.executable, *SCRIPT, "compare", str(single), str(tp)]).stdout
    assert "WARNING" not in table
    assert "| metric | 1 GPU | TP (2 GPUs) | TP / 1 GPU | speed-up |" in table
    for metric in ("TTFT (s)", "decode ms/token", "tokens/s", "peak GiB per GPU"):
        assert f"| {metric} |" in table
    assert "recompilations after warm-up: 0 / 0" in table
