"""A server that listens while its engine warms up (serving/http/startup.py): /health 503 with the reason, requests 503,
then 200 and requests served once the manager is built; a failed build reported on /health and to on_failure.

Oracle: the text of the tiny model's greedy tokens for the prompt alone (model.generate on the second copy).
"""

from __future__ import annotations

import threading

import pytest

pytest.importorskip("fastapi")
httpx = pytest.importorskip("httpx")

from hf_rocketkv.serving import create_app
from hf_rocketkv.serving.http.background import ServerThread
from hf_rocketkv.serving.http.startup import Starting, start_when_ready
from tests.serving.helpers import oracle_tokens


@pytest.fixture
def started():
    servers = []

    def start(app):
        server = ServerThread(app).start()
        servers.append(server)
        return server

    yield start
    for server in servers:
        server.stop()


def test_health_is_503_with_the_reason_until_the_manager_is_built(started, make_manager, tiny_pair, tokenizer, cfg):
    release = threading.Event()

    def build():
        assert release.wait(60)
        return make_manager(tokenizer=tokenizer, config=cfg)

    app = create_app(Starting(2048, tokenizer, "capturing the decode graphs of buckets (1, 2, 4)"), "tiny")
    server = started(app)
    thread = start_when_ready(app, build)
    health = httpx.get(server.url + "/health")
    assert health.status_code == 503
    assert health.json()["status"] == "starting"
    assert health.json()["reason"] == "capturing the decode graphs of buckets (1, 2, 4)"
    refused = httpx.post(server.url + "/v1/completions", json={"model": "tiny", "prompt": "hi", "max_tokens": 2})
    assert refused.status_code == 503 and refused.json()["error"]["code"] == "starting"
    assert "capturing the decode graphs" in refused.json()["error"]["message"]
    assert refused.headers["retry-after"] == "5"
    assert httpx.get(server.url + "/metrics").status_code == 503
    assert httpx.get(server.url + "/v1/models").status_code == 200  # the model list needs no engine
    release.set()
    thread.join(60)
    assert httpx.get(server.url + "/health").json() == {"status": "ok"}
    body = httpx.post(server.url + "/v1/completions", json={"model": "tiny", "prompt": "Hello", "max_tokens": 4,
                                                             "temperature": 0}, timeout=60).json()
    ids = tokenizer("Hello", add_special_tokens=True)["input_ids"]
    expected = tokenizer.decode(oracle_tokens(tiny_pair[1], ids, cfg, 4), skip_special_tokens=True)
    assert body["choices"][0]["text"] == expected


def test_a_failed_build_is_reported_on_health_and_to_on_failure(started, tokenizer):
    failures = []

    def build():
        raise MemoryError("out of memory capturing bucket 64")

    app = create_app(Starting(2048, tokenizer), "tiny")
    server = started(app)
    start_when_ready(app, build, on_failure=failures.append).join(60)
    health = httpx.get(server.url + "/health")
    assert health.status_code == 503
    assert health.json()["status"] == "failed"
    assert health.json()["reason"] == "MemoryError: out of memory capturing bucket 64"
    assert [type(f) for f in failures] == [MemoryError]


def test_start_when_ready_wants_a_starting_app(make_manager):
    app = create_app(make_manager(), "tiny")
    with pytest.raises(TypeError, match="Starting"):
        start_when_ready(app, lambda: None)
