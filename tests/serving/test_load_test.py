"""benchmarks.load_test, bounded, against the tiny model's server on 127.0.0.1."""

from __future__ import annotations

import json
import time

import pytest

pytest.importorskip("fastapi")
pytest.importorskip("openai")


@pytest.fixture(scope="module")
def load_test():
    from benchmarks import load_test

    return load_test


def test_load_test_reports_ttft_and_throughput(serve, tokenizer, load_test, tmp_path, capsys):
    server, manager = serve(tokenizer=tokenizer)
    output = tmp_path / "load.json"
    argv = ["--url", server.url + "/v1", "--requests", "6", "--concurrency", "3", "--prompt-tokens", "20",
            "--max-tokens", "5", "--time-limit", "60", "--output", str(output)]
    assert load_test.main(argv) == 0
    result = json.loads(output.read_text())
    assert (result["sent"], result["completed"], result["errors"]["count"]) == (6, 6, 0)
    # tokens/s is the tokens over the run's wall time, and no first token comes after the run ended
    assert result["output_tokens"] == 30
    assert result["output_tokens_per_s"] == pytest.approx(30 / result["wall_s"])
    assert result["ttft_s"]["count"] == 6 and 0 < result["ttft_s"]["p50"] <= result["ttft_s"]["p99"] <= result["wall_s"]
    assert result["tokens_per_s_per_user"]["count"] == 6
    assert sorted(r["index"] for r in result["requests"]) == list(range(6))
    assert "TTFT" in capsys.readouterr().out
    # the server records a request as finished after its last chunk is on the wire, so the client may see the
    # end first: wait (bounded) for the manager's count
    deadline = time.monotonic() + 10
    while manager.metrics().finished.get("length", 0) < 6 and time.monotonic() < deadline:
        time.sleep(0.02)
    assert manager.metrics().finished["length"] == 6


def test_load_test_refuses_non_loopback_and_bad_bounds(load_test, capsys):
    assert load_test.main(["--url", "http://10.1.2.3:8000/v1"]) == 2
    assert "loopback" in capsys.readouterr().err
    assert load_test.main(["--url", "http://127.0.0.1:1/v1", "--requests", "2", "--concurrency", "5"]) == 2
    assert load_test.main(["--url", "http://127.0.0.1:1/v1", "--requests", "100000"]) == 2


def test_percentile_is_linear_interpolation(load_test):
    assert load_test.percentile([], 50) is None
    assert load_test.percentile([3.0], 99) == 3.0
    assert load_test.percentile([1.0, 2.0, 3.0, 4.0], 50) == 2.5
    assert load_test.percentile(list(map(float, range(101))), 99) == pytest.approx(99.0)
