"""``hf-rocketkv serve`` with its defaults on a GPU: the batching engine over a pool sized from the CUDA memory free
once the model has loaded (0.9 of it, memory/sizing.py), and ``KVBlockPool(model)`` sized by the same rule.

Checked: the start line names the batching engine and a pool of 0.9 of the free memory (within what the weights and
the engine's warm-up take); 8 concurrent streams, one of them a 16k-token prompt, each get their ``max_tokens``
tokens with the pool that large (the prefill's activations fit beside it); every page is free again afterwards.
Llama-3.1-8B layer shapes (2 layers, random bf16 weights) with a 128-token character vocabulary, so the test's
tokenizer can spell every id the model emits.
"""

from __future__ import annotations

import re
import signal
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor

import pytest
import torch

from tests.cli.test_serve import server_address, wait_for_health
from tests.support.repo import ROOT, subprocess_env
from tests.support.tiny_models import char_tokenizer

from .gpu_models import llama_8b_layers

STREAMS, MAX_TOKENS, LONG_PROMPT = 8, 16, 16_000


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    from hf_rocketkv.bench.decode import LLAMA_31_8B, build_model

    path = tmp_path_factory.mktemp("serve") / "model"
    model = build_model({**LLAMA_31_8B, "vocab_size": 128}, 2, torch.bfloat16, torch.device("cuda"), 0)
    model.save_pretrained(path)
    char_tokenizer().save_pretrained(path)
    del model
    torch.cuda.empty_cache()
    return path


def _stream(httpx, url: str, prompt: str) -> tuple[int, int]:
    body = {"model": "tiny", "prompt": prompt, "max_tokens": MAX_TOKENS, "ignore_eos": True, "temperature": 0,
            "stream": True, "stream_options": {"include_usage": True}}
    import json

    with httpx.Client(timeout=300) as client, client.stream("POST", url + "/v1/completions", json=body) as response:
        chunks = [json.loads(line[6:]) for line in response.iter_lines() if line.startswith("data: {")]
        usage = next((c["usage"] for c in chunks if c.get("usage")), None)
        return response.status_code, (usage or {}).get("completion_tokens", -1)


def test_serve_batches_by_default_over_an_automatically_sized_pool(model_dir):
    httpx = pytest.importorskip("httpx")
    pytest.importorskip("fastapi")
    total = torch.cuda.mem_get_info()[1]
    command = [sys.executable, "-m", "hf_rocketkv.cli", "serve", "--model", str(model_dir), "--device", "cuda",
               "--port", "0", "--served-model-name", "tiny", "--log-level", "warning", "--max-running", "8"]
    process = subprocess.Popen(command, cwd=ROOT, stderr=subprocess.PIPE, text=True, env=subprocess_env(),
                               start_new_session=True)
    lines = []
    try:
        url = server_address(_Recorder(process, lines), timeout=600)
        assert wait_for_health(httpx, url, timeout=120)
        pool_line = next(line for line in lines if "KV pool" in line)
        assert "batching engine" in pool_line, pool_line
        found = re.search(r"KV pool ([\d.]+) GiB \(0\.9 of \(([\d.]+) GiB free on cuda:\d+ - ([\d.]+) GiB kept for "
                          r"prefill\)", pool_line)
        gib = float(found.group(1))
        assert 1.0 < float(found.group(3)) < 2.0, pool_line  # 2 layers: 0.25 GiB of 32k dense K/V + 1.375 of a chunk
        assert gib > 0.8 * total / 2**30 * 0.9, pool_line  # 2 layers of weights leave almost the whole card free

        prompts = ["x" * LONG_PROMPT] + [f"request {i}: " + "abc " * (50 * i) for i in range(1, STREAMS)]
        with ThreadPoolExecutor(STREAMS) as workers:
            results = list(workers.map(lambda p: _stream(httpx, url, p), prompts))
        assert results == [(200, MAX_TOKENS)] * STREAMS, results
        metrics = httpx.get(url + "/metrics", timeout=30).text
        free = float(re.search(r"^hf_rocketkv_pool_free_pages (\S+)$", metrics, re.M).group(1))
        total_pages = float(re.search(r"^hf_rocketkv_pool_total_pages (\S+)$", metrics, re.M).group(1))
        assert free == total_pages, metrics
    finally:
        process.send_signal(signal.SIGINT)
        try:
            process.wait(60)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait()
        process.stderr.close()


class _Recorder:
    """The server process as ``server_address`` reads it, keeping every stderr line it read."""

    def __init__(self, process: subprocess.Popen, lines: list[str]):
        self.process, self.lines = process, lines
        self.stderr = self

    def readline(self) -> str:
        line = self.process.stderr.readline()
        self.lines.append(line)
        return line

    def poll(self):
        return self.process.poll()


def test_kv_block_pool_of_a_model_takes_0_9_of_the_free_cuda_memory():
    from hf_rocketkv import KVBlockPool

    model = llama_8b_layers(2)
    free = torch.cuda.mem_get_info()[0]
    pool = KVBlockPool(model)
    assert pool.sizing is not None and pool.sizing.device.startswith("cuda") and pool.sizing.fraction == 0.9
    assert abs(pool.sizing.free - free) < 64 * 2**20  # read now, on the model's device
    pool.bind_all("cuda")  # pages are allocated on first use: allocate every layer's now
    taken = free - torch.cuda.mem_get_info()[0]
    reserve = 2 * 2 * 8 * 128 * 32768 * 2 + 8192 * (8 * 4096 + 4 * 14336) * 2  # 32k dense K/V of 2 layers + a chunk
    assert pool.sizing.reserve == reserve
    assert 0.85 * (free - reserve) <= taken <= 0.9 * (free - reserve) + 64 * 2**20, (taken / 2**30, free / 2**30)
    assert pool.num_pages * pool.bytes_per_page <= 0.9 * (free - reserve)
