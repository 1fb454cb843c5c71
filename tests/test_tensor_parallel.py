"""Tensor parallelism (integration notes §5): ``torchrun --nproc_per_node=2`` (gloo, CPU) runs tests/tp_worker.py on
a tiny Llama loaded with ``tp_plan="auto"`` and ``attn_implementation="rocketkv"``; each rank's RocketKVCache holds
its shard of KV heads and compresses independently. Tokens must equal a single-process run."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from hf_rocketkv import RocketKVCache, RocketKVConfig

from .helpers import PAD, greedy, left_pad, make_models, random_ids

WORKER = Path(__file__).with_name("tp_worker.py")
ROCKET = dict(prompt_budget=24, window_size=8, kernel_size=5, topk=3, topr=8, page_size=4,
              kt_cache_dtype="float32", backend="torch")
NEW_TOKENS = 12


@pytest.mark.slow
def test_tensor_parallel_generate_matches_single_process(tmp_path):
    rocket, _ = make_models("llama", hidden_size=128, num_attention_heads=8, num_key_value_heads=4, head_dim=16)
    model_dir = tmp_path / "model"
    rocket.save_pretrained(model_dir)
    ids, mask = left_pad([random_ids(1, 48, seed=1)[0], random_ids(1, 40, seed=2)[0]])
    spec = dict(input_ids=ids.tolist(), attention_mask=mask.tolist(), max_new_tokens=NEW_TOKENS, pad_token_id=PAD,
                rocketkv=ROCKET)
    (tmp_path / "in.json").write_text(json.dumps(spec))
    output = tmp_path / "out.json"

    repo = str(Path(__file__).resolve().parents[1])  # the worker imports hf_rocketkv from this checkout
    python_path = os.pathsep.join(p for p in (repo, os.environ.get("PYTHONPATH")) if p)
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONWARNINGS": "ignore", "PYTHONPATH": python_path}
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2", str(WORKER),
               str(model_dir), str(tmp_path / "in.json"), str(output)]
    result = subprocess.run(command, env=env, capture_output=True, text=True, timeout=240)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-5000:]
    report = json.loads(output.read_text())
    assert report["world_size"] == 2

    # single process, same checkpoint, same cache config
    from transformers import AutoModelForCausalLM

    import hf_rocketkv

    single = AutoModelForCausalLM.from_pretrained(model_dir, attn_implementation=hf_rocketkv.ATTN_NAME).eval()
    cache = RocketKVCache(RocketKVConfig(**ROCKET))
    expected = greedy(single, ids, attention_mask=mask, past_key_values=cache, max_new_tokens=NEW_TOKENS)
    assert [layer.keys.shape[1] for layer in cache.layers] == [4, 4]

    for rank in report["ranks"]:
        assert rank["tokens"] == expected.tolist(), f"rank {rank['rank']} generated different tokens"
        assert rank["kv_heads"] == [2, 2], "each rank must hold half of the 4 KV heads"
        assert rank["compressed"]
        assert rank["kept_tokens"] == [[[24 + NEW_TOKENS - 1] * 2] * 2] * 2
        assert rank["seq_length"] == ids.shape[1] + NEW_TOKENS - 1
