"""The OpenAI-compatible server (serving/http/server.py) on 127.0.0.1 (a free port), driven by the real ``openai``
client and raw httpx, on a tiny random Llama with a character tokenizer: completions and chat, model ids and aliases,
disconnects, errors, overload, metrics. Oracle: model.generate alone with the same cache config (greedy)."""

from __future__ import annotations

import threading
from concurrent.futures import ThreadPoolExecutor

import pytest

pytest.importorskip("fastapi")
openai = pytest.importorskip("openai")
httpx = pytest.importorskip("httpx")

from tests.serving.helpers import ForwardGate, make_pool, oracle_tokens, wait_until  # noqa: E402

PROMPTS = [
    "The quick brown fox jumps over the lazy dog.",
    "A journey of a thousand miles begins with a single step",
    "To be, or not to be, that is the question: whether",
    "All happy families are alike; each unhappy family is unhappy",
]
NO_EOS = {"ignore_eos": True}  # the random model emits EOS early; fixed lengths make the comparison meaningful


def client(server):
    return openai.OpenAI(base_url=server.url + "/v1", api_key="none", max_retries=0, timeout=60)


def expected_text(tiny_pair, tokenizer, cfg, prompt_ids, n):
    return tokenizer.decode(oracle_tokens(tiny_pair[1], prompt_ids, cfg, n), skip_special_tokens=True)


def chat_ids(tokenizer, content):
    text = tokenizer.apply_chat_template([{"role": "user", "content": content}], tokenize=False,
                                         add_generation_prompt=True)
    return tokenizer(text, add_special_tokens=False).input_ids


# ------------------------------------------------------------------------------------------------ happy paths
def test_completions_streaming_and_not(serve, tiny_pair, tokenizer, cfg):
    server, _ = serve(tokenizer=tokenizer)
    api = client(server)
    prompt = PROMPTS[0]
    expected = expected_text(tiny_pair, tokenizer, cfg, tokenizer(prompt).input_ids, 10)

    whole = api.completions.create(model="tiny", prompt=prompt, max_tokens=10, temperature=0, extra_body=NO_EOS)
    assert whole.choices[0].text == expected and whole.choices[0].finish_reason == "length"
    assert (whole.usage.prompt_tokens, whole.usage.completion_tokens) == (len(prompt), 10)
    assert whole.object == "text_completion" and whole.model == "tiny" and whole.id.startswith("cmpl-")

    chunks = list(api.completions.create(model="tiny", prompt=prompt, max_tokens=10, temperature=0, stream=True,
                                         stream_options={"include_usage": True}, extra_body=NO_EOS))
    assert "".join(c.choices[0].text for c in chunks if c.choices) == expected
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "length"
    assert len([c for c in chunks if c.choices]) > 2  # really streamed
    assert chunks[-1].usage.completion_tokens == 10 and not chunks[-1].choices

    ids = tokenizer(prompt).input_ids  # token ids as the prompt
    by_ids = api.completions.create(model="tiny", prompt=ids, max_tokens=10, temperature=0, extra_body=NO_EOS)
    assert by_ids.choices[0].text == expected


def test_chat_streaming_and_not(serve, tiny_pair, tokenizer, cfg):
    server, _ = serve(tokenizer=tokenizer)
    api = client(server)
    content = "Tell me about the lazy dog and the quick fox."
    expected = expected_text(tiny_pair, tokenizer, cfg, chat_ids(tokenizer, content), 8)
    messages = [{"role": "user", "content": content}]

    whole = api.chat.completions.create(model="tiny", messages=messages, max_tokens=8, temperature=0,
                                        extra_body=NO_EOS)
    assert whole.choices[0].message.content == expected and whole.choices[0].message.role == "assistant"
    assert whole.usage.prompt_tokens == len(chat_ids(tokenizer, content))

    chunks = list(api.chat.completions.create(model="tiny", messages=messages, max_completion_tokens=8,
                                              temperature=0, stream=True, extra_body=NO_EOS))
    assert chunks[0].choices[0].delta.role == "assistant"
    assert "".join(c.choices[0].delta.content or "" for c in chunks) == expected
    assert chunks[-1].choices[0].finish_reason == "length" and chunks[-1].object == "chat.completion.chunk"

    parts = [{"type": "text", "text": content[:10]}, {"type": "text", "text": content[10:]}]
    joined = api.chat.completions.create(model="tiny", messages=[{"role": "user", "content": parts}], max_tokens=8,
                                         temperature=0, extra_body=NO_EOS)
    assert joined.choices[0].message.content == expected


def test_default_max_tokens(serve, tokenizer):
    server, _ = serve(tokenizer=tokenizer, app_kwargs={"default_max_tokens": 5})
    api = client(server)
    short = api.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "hi"}],
                                        extra_body=NO_EOS)
    assert short.usage.completion_tokens == 5  # the server's default for chat
    near_limit = [{"role": "user", "content": "y" * 1005}]  # chat template + 1005 characters: 1021 of 1024 tokens
    tail = api.chat.completions.create(model="tiny", messages=near_limit, extra_body=NO_EOS)
    assert tail.usage.prompt_tokens + tail.usage.completion_tokens == 1024  # capped by the rest of the context
    assert api.completions.create(model="tiny", prompt="hi", extra_body=NO_EOS).usage.completion_tokens == 16


def test_concurrent_requests_equal_each_alone(serve, tiny_pair, tokenizer, cfg):
    server, _ = serve(tokenizer=tokenizer)
    api = client(server)
    lengths = [6, 9, 4, 7]

    def one(i):
        stream = api.completions.create(model="tiny", prompt=PROMPTS[i], max_tokens=lengths[i], temperature=0,
                                        stream=True, extra_body=NO_EOS)
        return "".join(c.choices[0].text for c in stream if c.choices)

    with ThreadPoolExecutor(4) as pool:
        got = list(pool.map(one, range(4)))
    assert got == [expected_text(tiny_pair, tokenizer, cfg, tokenizer(p).input_ids, n)
                   for p, n in zip(PROMPTS, lengths)]


def test_seeded_sampling_is_reproducible_over_http(serve, tokenizer):
    server, _ = serve(tokenizer=tokenizer)
    api = client(server)

    def sample(seed):
        return api.completions.create(model="tiny", prompt=PROMPTS[1], max_tokens=12, temperature=1.0, top_p=0.95,
                                      seed=seed, extra_body={"top_k": 30, **NO_EOS}).choices[0].text

    assert sample(11) == sample(11) != sample(12)


def test_stop_strings_over_http(serve, tiny_pair, tokenizer, cfg):
    server, _ = serve(tokenizer=tokenizer)
    full = expected_text(tiny_pair, tokenizer, cfg, tokenizer(PROMPTS[2]).input_ids, 30)
    stop = full[8:10]
    out = client(server).completions.create(model="tiny", prompt=PROMPTS[2], max_tokens=30, temperature=0,
                                            stop=[stop], extra_body=NO_EOS)
    assert out.choices[0].text == full[: full.index(stop)] and out.choices[0].finish_reason == "stop"


def test_models_health_and_stopped_server(serve, tokenizer):
    server, manager = serve(tokenizer=tokenizer)
    api = client(server)
    assert [m.id for m in api.models.list().data] == ["tiny"]
    assert httpx.get(server.url + "/health").json() == {"status": "ok"}
    manager.stop()
    assert httpx.get(server.url + "/health").status_code == 503
    response = httpx.post(server.url + "/v1/completions", json={"model": "tiny", "prompt": "hi"})
    assert response.status_code == 503 and response.json()["error"]["code"] == "engine_stopped"


# ------------------------------------------------------------------------------------------------ disconnects
def test_client_disconnect_mid_stream_cancels_and_frees_pages(serve, tiny_pair, tokenizer, cfg):
    pool = make_pool(tiny_pair[0], page_size=16, config=cfg)
    server, manager = serve(tokenizer=tokenizer, pool=pool)
    gate = ForwardGate(tiny_pair[0], delay=0.01)
    try:
        body = {"model": "tiny", "prompt": PROMPTS[0], "max_tokens": 400, "temperature": 0, "stream": True,
                **NO_EOS}
        with httpx.Client(timeout=30) as http, http.stream("POST", server.url + "/v1/completions", json=body) as r:
            lines = r.iter_lines()
            received = [line for line, _ in zip(lines, range(6)) if line.startswith("data:")]
            assert received and manager.metrics().running == 1
            assert pool.free_pages() < pool.total_pages()
        # the connection is closed here, mid-stream
        assert wait_until(lambda: manager.metrics().finished["cancelled"] == 1, timeout=30)
        metrics = manager.metrics()
        assert metrics.running == 0 and metrics.generation_tokens_total < 400
        assert pool.free_pages() == pool.total_pages()
        assert wait_until(lambda: not manager._records)  # nothing kept for the gone client
    finally:
        gate.remove()


def test_client_disconnect_while_waiting_for_a_whole_completion(serve, tiny_pair, tokenizer):
    server, manager = serve(tokenizer=tokenizer)
    gate = ForwardGate(tiny_pair[0], delay=0.01)
    try:
        body = {"model": "tiny", "prompt": PROMPTS[1], "max_tokens": 400, "temperature": 0, **NO_EOS}
        with pytest.raises(httpx.ReadTimeout):
            httpx.post(server.url + "/v1/completions", json=body, timeout=0.5)
        assert wait_until(lambda: manager.metrics().finished["cancelled"] == 1, timeout=30)
        assert manager.metrics().generation_tokens_total < 400
    finally:
        gate.remove()


# ------------------------------------------------------------------------------------------------ bad requests
LONG = "x" * 1100  # the tiny model's context is 1024 tokens (one per character)

BAD_REQUESTS = [
    ("completions", {"prompt": "hi"}, "model", "invalid_value"),
    ("completions", {"model": "tiny", "prompt": LONG}, "prompt", "context_length_exceeded"),
    ("completions", {"model": "tiny", "prompt": "x" * 1000, "max_tokens": 100}, "max_tokens",
     "context_length_exceeded"),
    ("completions", {"model": "tiny", "prompt": "hi", "max_tokens": -1}, "max_tokens", "invalid_value"),
    ("completions", {"model": "tiny", "prompt": "hi", "temperature": 3}, "temperature", "invalid_value"),
    ("completions", {"model": "tiny", "prompt": "hi", "top_p": 0}, "top_p", "invalid_value"),
    ("completions", {"model": "tiny", "prompt": "hi", "n": 2}, "n", "unsupported_value"),
    ("completions", {"model": "tiny", "prompt": "hi", "logprobs": 2}, "logprobs", "unsupported_value"),
    ("completions", {"model": "tiny", "prompt": "hi", "echo": True}, "echo", "unsupported_value"),
    ("completions", {"model": "tiny", "prompt": "hi", "best_of": 3}, "best_of", "unsupported_value"),
    ("completions", {"model": "tiny", "prompt": "hi", "presence_penalty": 0.5}, "presence_penalty",
     "unsupported_value"),
    # JSON booleans are no numbers (Python's False == 0 and True == 1 must not let them through)
    ("completions", {"model": "tiny", "prompt": "hi", "presence_penalty": False}, "presence_penalty",
     "unsupported_value"),
    ("completions", {"model": "tiny", "prompt": "hi", "frequency_penalty": False}, "frequency_penalty",
     "unsupported_value"),
    ("completions", {"model": "tiny", "prompt": "hi", "n": True}, "n", "unsupported_value"),
    ("completions", {"model": "tiny", "prompt": "hi", "best_of": True}, "best_of", "unsupported_value"),
    ("completions", {"model": "tiny", "prompt": "hi", "echo": 0}, "echo", "unsupported_value"),
    ("completions", {"model": "tiny", "prompt": "hi", "logit_bias": 0}, "logit_bias", "unsupported_value"),
    ("completions", {"model": "tiny", "prompt": "hi", "stop": [1]}, "stop", "invalid_value"),
    ("completions", {"model": "tiny", "prompt": "hi", "frobnicate": 1}, "frobnicate", "unsupported_field"),
    ("completions", {"model": "tiny", "prompt": ["a", "b"]}, "prompt", "unsupported_value"),
    ("completions", {"model": "tiny", "prompt": [5, 999]}, "prompt", "invalid_value"),
    ("completions", {"model": "tiny"}, "prompt", "invalid_value"),
    ("chat/completions", {"model": "tiny", "messages": []}, "messages", "invalid_value"),
    ("chat/completions", {"model": "tiny", "messages": [{"role": "robot", "content": "x"}]}, "messages[0].role",
     "invalid_value"),
    ("chat/completions", {"model": "tiny", "messages": [{"role": "user", "content": "x"}], "n": 3}, "n",
     "unsupported_value"),
    ("chat/completions", {"model": "tiny", "messages": [{"role": "user", "content": "x"}],
                          "tools": [{"type": "function"}]}, "tools", "unsupported_value"),
    ("chat/completions", {"model": "tiny", "messages": [{"role": "user", "content": "x"}], "logprobs": 0},
     "logprobs", "unsupported_value"),
    ("chat/completions", {"model": "tiny", "messages": [{"role": "user", "content": "x"}], "tools": 0}, "tools",
     "unsupported_value"),
    ("chat/completions", {"model": "tiny", "messages": [{"role": "user", "content": LONG}]}, "prompt",
     "context_length_exceeded"),
]


@pytest.fixture(scope="module")
def bad_request_server(tiny_pair, tokenizer):
    from hf_rocketkv.serving import GenerationManager, create_app
    from hf_rocketkv.serving.http.background import ServerThread
    from tests.support.tiny_models import compressing_config

    manager = GenerationManager(tiny_pair[0], tokenizer, compressing_config())
    with ServerThread(create_app(manager, "tiny")) as server:
        yield server, manager
    manager.stop(drain=False)


@pytest.mark.parametrize("endpoint, body, param, code", BAD_REQUESTS,
                         ids=[f"{e}-{p}-{i}" for i, (e, _, p, _) in enumerate(BAD_REQUESTS)])
def test_bad_requests_get_400_with_openai_error(bad_request_server, endpoint, body, param, code):
    server, manager = bad_request_server
    response = httpx.post(f"{server.url}/v1/{endpoint}", json=body)
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert set(error) == {"message", "type", "param", "code"}
    assert (error["param"], error["code"], error["type"]) == (param, code, "invalid_request_error")
    assert error["message"]
    assert manager.metrics().running == 0 and manager.metrics().requests_total == 0  # nothing was admitted


@pytest.mark.parametrize("content", [b"{not json", b"[1, 2]", b"\xff\xfe"])
def test_malformed_bodies_get_400(bad_request_server, content):
    server, _ = bad_request_server
    response = httpx.post(server.url + "/v1/completions", content=content,
                          headers={"content-type": "application/json"})
    assert response.status_code == 400 and response.json()["error"]["type"] == "invalid_request_error"


def test_openai_client_sees_the_error_fields(bad_request_server):
    server, _ = bad_request_server
    with pytest.raises(openai.BadRequestError) as err:
        client(server).completions.create(model="tiny", prompt="hi", max_tokens=-5)
    assert err.value.status_code == 400 and err.value.param == "max_tokens" and "max_tokens" in err.value.message


# ------------------------------------------------------------------------------------------------ overload, failures
def test_overload_gets_429_and_admitted_requests_complete(serve, tiny_pair, tokenizer, cfg):
    server, manager = serve(tokenizer=tokenizer, max_queue=1)
    api = client(server)
    gate = ForwardGate(tiny_pair[0], closed=True)
    results = {}

    def run(i):
        results[i] = api.completions.create(model="tiny", prompt=PROMPTS[i], max_tokens=5, temperature=0,
                                            extra_body=NO_EOS).choices[0].text

    threads = [threading.Thread(target=run, args=(i,)) for i in range(2)]
    try:
        threads[0].start()
        assert gate.entered.wait(10)  # request 0 holds the engine
        threads[1].start()
        assert wait_until(lambda: manager.metrics().waiting == 1)  # request 1 fills the queue
        with pytest.raises(openai.RateLimitError) as err:
            api.completions.create(model="tiny", prompt=PROMPTS[2], max_tokens=5)
        assert err.value.status_code == 429 and err.value.code == "overloaded"
        assert err.value.response.headers["retry-after"] == "1"
    finally:
        gate.open()
        for thread in threads:
            thread.join(60)
        gate.remove()
    assert [results[i] for i in range(2)] == [expected_text(tiny_pair, tokenizer, cfg, tokenizer(PROMPTS[i]).input_ids,
                                                            5) for i in range(2)]
    assert manager.metrics().rejected_total == 1 and manager.healthy()


def test_a_failing_request_gets_500_and_the_server_goes_on(serve, tiny_pair, tokenizer):
    server, _ = serve(tokenizer=tokenizer)
    poison = ord("#")

    def hook(module, args, kwargs):
        ids = kwargs.get("input_ids")
        # prompts only (prefill forwards): a sampled decode token may be '#' by chance
        if ids is not None and ids.shape[-1] > 1 and (ids == poison).any():
            raise RuntimeError("boom")

    handle = tiny_pair[0].register_forward_pre_hook(hook, with_kwargs=True)
    try:
        response = httpx.post(server.url + "/v1/completions", json={"model": "tiny", "prompt": "a#b", "max_tokens": 3})
        assert response.status_code == 500 and "boom" in response.json()["error"]["message"]
        with pytest.raises(openai.APIError, match="boom"):
            list(client(server).completions.create(model="tiny", prompt="a#b", max_tokens=3, stream=True))
        ok = client(server).completions.create(model="tiny", prompt="fine", max_tokens=3, temperature=0,
                                             extra_body=NO_EOS)
        assert ok.usage.completion_tokens == 3
    finally:
        handle.remove()


# ------------------------------------------------------------------------------------------------ metrics
def test_metrics_endpoint(serve, tiny_pair, tokenizer, cfg):
    from prometheus_client.parser import text_string_to_metric_families

    pool = make_pool(tiny_pair[0], page_size=16, config=cfg)
    server, _ = serve(tokenizer=tokenizer, pool=pool)
    api = client(server)
    for prompt in PROMPTS[:3]:
        api.completions.create(model="tiny", prompt=prompt, max_tokens=4, temperature=0, extra_body=NO_EOS)
    response = httpx.get(server.url + "/metrics")
    assert response.status_code == 200 and response.headers["content-type"].startswith("text/plain")
    samples = {(s.name, tuple(sorted(s.labels.items()))): s.value
               for family in text_string_to_metric_families(response.text) for s in family.samples}
    get = lambda name, **labels: samples[(name, tuple(sorted(labels.items())))]  # noqa: E731
    assert get("hf_rocketkv_requests_running") == 0 and get("hf_rocketkv_requests_waiting") == 0
    assert get("hf_rocketkv_requests_total") == 3
    assert get("hf_rocketkv_requests_finished_total", reason="length") == 3
    assert get("hf_rocketkv_generation_tokens_total") == 12
    assert get("hf_rocketkv_pool_free_pages") == get("hf_rocketkv_pool_total_pages") == pool.total_pages()
    assert get("hf_rocketkv_time_to_first_token_seconds_count") == 3
    assert get("hf_rocketkv_time_to_first_token_seconds_bucket", le="+Inf") == 3
    assert get("hf_rocketkv_tokens_per_second_count") == 3


def test_model_alias_and_models_by_id(make_manager, tokenizer):
    pytest.importorskip("fastapi")
    openai = pytest.importorskip("openai")
    httpx = pytest.importorskip("httpx")
    from hf_rocketkv.serving import create_app
    from hf_rocketkv.serving.http.background import ServerThread

    manager = make_manager(tokenizer=tokenizer)
    alias = "/data/models/org/tiny-llama"  # what --model was: a folder path, slashes included
    with ServerThread(create_app(manager, "tiny", aliases=(alias,))) as server:
        api = openai.OpenAI(base_url=server.url + "/v1", api_key="none", max_retries=0, timeout=60)
        texts = []
        for model in ("tiny", alias):
            out = api.completions.create(model=model, prompt="hello there", max_tokens=3, temperature=0,
                                         extra_body={"ignore_eos": True})
            assert out.model == "tiny" and out.usage.completion_tokens == 3
            texts.append(out.choices[0].text)
            assert api.models.retrieve(model).id == "tiny"
            raw = httpx.get(server.url + "/v1/models/" + model, timeout=30)
            assert raw.status_code == 200 and raw.json()["id"] == "tiny" and raw.json()["object"] == "model"
        assert texts[0] == texts[1]  # the same model behind both ids
        with pytest.raises(openai.NotFoundError) as missing:  # 404, as OpenAI and vLLM answer an unknown model
            api.completions.create(model="tiny-other", prompt="hi", max_tokens=2)
        assert missing.value.status_code == 404 and missing.value.body["code"] == "model_not_found"
        with pytest.raises(openai.NotFoundError):
            api.models.retrieve("org/other")
        for unknown in ("other", "org/other", alias + "x"):
            missing = httpx.get(server.url + "/v1/models/" + unknown, timeout=30)
            assert missing.status_code == 404
            error = missing.json()["error"]
            assert set(error) >= {"message", "type", "param", "code"} and error["code"] == "model_not_found"
