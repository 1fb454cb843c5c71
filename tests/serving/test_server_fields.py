"""Every request field the HTTP server parses, accepted or refused by value, and the exact shape of every response
body, on a tiny random Llama with a character tokenizer (the server of tests/serving/test_server_boundaries.py).

The accepted values are OpenAI's own where the server cannot honour another (``n`` 1, ``echo`` false, ``best_of``
1, ``suffix`` "", ``logprobs`` null or false, ``tools`` empty, ``tool_choice`` "none", ``response_format`` text);
the others are refused with 400 ``unsupported_value`` naming the field, each written out here with the words of its
message. The bodies are compared whole with OpenAI's shapes (ids, objects, choices, usage), as written in its API
reference, not as the server builds them.
"""

from __future__ import annotations

import json

import pytest

pytest.importorskip("fastapi")
httpx = pytest.importorskip("httpx")

from tests.serving.test_server_boundaries import NO_EOS, USER, assert_refused, post  # noqa: E402
from tests.serving.test_server_boundaries import server  # noqa: E402, F401 - the module's server fixture

COMPLETION = {"model": "tiny", "prompt": "hi", "max_tokens": 2, **NO_EOS}
CHAT = {"model": "tiny", "messages": USER, "max_tokens": 2, **NO_EOS}

ACCEPTED = [
    ("completions", {"echo": False}), ("completions", {"echo": None}), ("completions", {"best_of": 1}),
    ("completions", {"suffix": ""}), ("completions", {"logprobs": None}), ("completions", {"user": "u1"}),
    ("completions", {"presence_penalty": 0}), ("completions", {"frequency_penalty": 0.0}),
    ("completions", {"logit_bias": {}}), ("completions", {"stream": None}), ("completions", {"prompt": ["hi"]}),
    ("completions", {"prompt": [[40, 41]]}), ("completions", {"stop_token_ids": [5, 6], "temperature": 0}),
    ("chat/completions", {"logprobs": False}), ("chat/completions", {"logprobs": None}),
    ("chat/completions", {"tools": []}), ("chat/completions", {"tool_choice": "none"}),
    ("chat/completions", {"tools": None, "tool_choice": None}), ("chat/completions", {"parallel_tool_calls": True}),
    ("chat/completions", {"response_format": {"type": "text"}}), ("chat/completions", {"response_format": None}),
    ("chat/completions", {"top_logprobs": None}),
]
REFUSED = [
    # (endpoint, fields, param, code, words of the message)
    ("completions", {"echo": True}, "echo", "unsupported_value", "echo=True is not supported (allowed: null or False)"),
    ("completions", {"best_of": 2}, "best_of", "unsupported_value", "best_of=2 is not supported (allowed: null or 1)"),
    ("completions", {"suffix": "x"}, "suffix", "unsupported_value", "suffix='x' is not supported (allowed: null or '')"),
    ("completions", {"logprobs": 0}, "logprobs", "unsupported_value", "logprobs is not supported (allowed: null)"),
    ("completions", {"logprobs": False}, "logprobs", "unsupported_value", "logprobs is not supported"),
    ("completions", {"presence_penalty": 1}, "presence_penalty", "unsupported_value",
     "presence_penalty is not supported (allowed: 0 or null), got 1"),
    ("completions", {"frequency_penalty": -0.5}, "frequency_penalty", "unsupported_value",
     "frequency_penalty is not supported (allowed: 0 or null), got -0.5"),
    ("completions", {"logit_bias": {"5": 1}}, "logit_bias", "unsupported_value",
     "logit_bias is not supported (allowed: null or {})"),
    ("completions", {"prompt": ""}, "prompt", "invalid_value", "prompt must not be empty"),
    ("completions", {"prompt": []}, "prompt", "invalid_value", "prompt is required: a non-empty string or"),
    ("completions", {"prompt": [True, 5]}, "prompt", "invalid_value", "prompt is required"),
    ("completions", {"prompt": 5}, "prompt", "invalid_value", "prompt is required"),
    ("completions", {"prompt": ["a", "b"]}, "prompt", "unsupported_value", "one prompt per request is supported"),
    ("completions", {"prompt": [[1, 2], [3]]}, "prompt", "unsupported_value", "one prompt per request"),
    ("completions", {"stream": "yes"}, "stream", "invalid_value", "stream must be true or false, got 'yes'"),
    ("completions", {"stream": 1}, "stream", "invalid_value", "stream must be true or false, got 1"),
    ("completions", {"stream_options": {"x": 1}}, "stream_options", "invalid_value",
     "stream_options must be an object with only include_usage"),
    ("completions", {"stream_options": []}, "stream_options", "invalid_value", "an object with only include_usage"),
    ("completions", {"stream_options": {"include_usage": 1}}, "stream_options", "invalid_value",
     "stream_options.include_usage must be true or false"),
    ("completions", {"model": ""}, "model", "invalid_value", "model is required (a string: see GET /v1/models)"),
    ("completions", {"model": 5}, "model", "invalid_value", "model is required"),
    ("completions", {"frobnicate": 1}, "frobnicate", "unsupported_field", "unsupported field(s) ['frobnicate']"),
    ("completions", {"messages": USER}, "messages", "unsupported_field", "allowed: ["),
    ("chat/completions", {"logprobs": True}, "logprobs", "unsupported_value",
     "=logprobs / top_logprobs are not supported"),
    ("chat/completions", {"top_logprobs": 0}, "logprobs", "unsupported_value", "top_logprobs are not supported"),
    ("chat/completions", {"tools": [{"type": "function"}]}, "tools", "unsupported_value",
     "=tools and tool_choice are not supported"),
    ("chat/completions", {"tool_choice": "auto"}, "tools", "unsupported_value", "tools and tool_choice"),
    ("chat/completions", {"tool_choice": None, "tools": {}}, "tools", "unsupported_value", "tools and tool_choice"),
    ("chat/completions", {"response_format": {"type": "json_object"}}, "response_format", "unsupported_value",
     '=response_format: only {"type": "text"} is supported'),
    ("chat/completions", {"messages": []}, "messages", "invalid_value",
     "=messages is required: a non-empty list of {role, content} objects"),
    ("chat/completions", {"messages": "hi"}, "messages", "invalid_value", "messages is required"),
    ("chat/completions", {"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": "x"}]}]},
     "messages[0].content", "unsupported_value", "messages[0].content: only text parts are supported"),
    ("chat/completions", {"messages": [USER[0], {"role": "user", "content": [{"type": "text", "text": 5}]}]},
     "messages[1].content", "unsupported_value", "messages[1].content: only text parts"),
    ("chat/completions", {"messages": [{"role": "user", "content": ["hi"]}]}, "messages[0].content",
     "unsupported_value", "only text parts"),
    ("chat/completions", {"prompt": "hi"}, "prompt", "unsupported_field", "unsupported field(s) ['prompt']"),
]


@pytest.mark.parametrize("endpoint, fields", ACCEPTED, ids=[f"{e}-{json.dumps(f)}"[:60] for e, f in ACCEPTED])
def test_fields_at_their_allowed_values_are_served(server, endpoint, fields):
    running, _ = server
    base = COMPLETION if endpoint == "completions" else CHAT
    response = post(running, f"/v1/{endpoint}", {**base, **fields})
    assert response.status_code == 200, response.text
    assert response.json()["usage"]["completion_tokens"] == 2


@pytest.mark.parametrize("endpoint, fields, param, code, words", REFUSED,
                         ids=[f"{e}-{json.dumps(f)}"[:60] for e, f, *_ in REFUSED])
def test_fields_at_other_values_are_refused_naming_them(server, endpoint, fields, param, code, words):
    """``words``: part of the message, or, after ``=``, the whole of it."""
    running, _ = server
    base = COMPLETION if endpoint == "completions" else CHAT
    response = post(running, f"/v1/{endpoint}", {**base, **fields})
    assert_refused(response, param, code, words.removeprefix("="))
    if words.startswith("="):
        assert response.json()["error"]["message"] == words[1:]


@pytest.mark.parametrize("content", [b"[1, 2]", b'"text"', b"null"])
def test_a_body_that_is_no_object_is_refused(server, content):
    running, _ = server
    for path in ("/v1/completions", "/v1/chat/completions", "/tokenize", "/detokenize"):
        response = post(running, path, content=content)
        assert response.status_code == 400, (path, response.text)
        assert response.json()["error"]["code"] == "invalid_json", path
        assert response.json()["error"]["message"] == "the request body must be a JSON object", path


def test_a_prompt_given_as_one_list_of_ids_or_one_string_is_unwrapped(server):
    running, tokenizer = server
    ids = tokenizer("hello", add_special_tokens=True).input_ids
    plain = post(running, "/v1/completions", {**COMPLETION, "prompt": "hello", "temperature": 0}).json()
    for prompt in (["hello"], [ids], ids):
        got = post(running, "/v1/completions", {**COMPLETION, "prompt": prompt, "temperature": 0}).json()
        assert got["choices"][0]["text"] == plain["choices"][0]["text"], prompt
        assert got["usage"]["prompt_tokens"] == len(ids), prompt


def test_chat_content_parts_are_joined(server):
    running, _ = server
    whole = post(running, "/v1/chat/completions", {**CHAT, "temperature": 0,
                                                    "messages": [{"role": "user", "content": "hello there"}]}).json()
    parts = [{"type": "text", "text": "hello "}, {"type": "text", "text": "there"}]
    joined = post(running, "/v1/chat/completions", {**CHAT, "temperature": 0,
                                                     "messages": [{"role": "user", "content": parts}]}).json()
    assert joined["choices"] == whole["choices"] and joined["usage"] == whole["usage"]


# ------------------------------------------------------------------------------------------------ response bodies
def test_whole_response_bodies_have_openais_shape(server):
    running, tokenizer = server
    hi = len(tokenizer("hi").input_ids)
    completion = post(running, "/v1/completions", {**COMPLETION, "model": "tiny"}).json()
    assert set(completion) == {"id", "object", "created", "model", "choices", "usage"}
    assert completion["id"].startswith("cmpl-") and completion["object"] == "text_completion"
    assert completion["model"] == "tiny" and isinstance(completion["created"], int)
    (choice,) = completion["choices"]
    assert choice == {"index": 0, "text": choice["text"], "logprobs": None, "finish_reason": "length"}
    assert completion["usage"] == {"prompt_tokens": hi, "completion_tokens": 2, "total_tokens": hi + 2}
    chat = post(running, "/v1/chat/completions", CHAT).json()
    assert set(chat) == {"id", "object", "created", "model", "choices", "usage"}
    assert chat["id"].startswith("chatcmpl-") and chat["object"] == "chat.completion" and chat["model"] == "tiny"
    (choice,) = chat["choices"]
    assert choice == {"index": 0, "message": {"role": "assistant", "content": choice["message"]["content"]},
                      "logprobs": None, "finish_reason": "length"}
    usage = chat["usage"]
    assert usage["completion_tokens"] == 2 and usage["total_tokens"] == usage["prompt_tokens"] + 2


def events(response: httpx.Response) -> list:
    lines = [line for line in response.text.splitlines() if line]
    assert lines[-1] == "data: [DONE]" and all(line.startswith("data: ") for line in lines)
    return [json.loads(line[len("data: "):]) for line in lines[:-1]]


@pytest.mark.parametrize("usage", [False, True])
def test_streamed_chunks_have_openais_shape(server, usage):
    running, tokenizer = server
    hi = len(tokenizer("hi").input_ids)
    options = {"stream_options": {"include_usage": True}} if usage else {}
    chunks = events(post(running, "/v1/completions", {**COMPLETION, "stream": True, **options}))
    *text, last = chunks if usage else (*chunks, None)
    for chunk in text:
        assert set(chunk) == {"id", "object", "created", "model", "choices"}, chunk  # no usage key on the way
        assert chunk["object"] == "text_completion" and chunk["id"].startswith("cmpl-")
        (choice,) = chunk["choices"]
        assert set(choice) == {"index", "text", "logprobs", "finish_reason"} and choice["index"] == 0
    assert [c["choices"][0]["finish_reason"] for c in text] == [None] * (len(text) - 1) + ["length"]
    assert len({c["id"] for c in chunks}) == 1
    if usage:
        assert last == {"id": text[0]["id"], "object": "text_completion", "created": text[0]["created"],
                        "model": "tiny", "choices": [],
                        "usage": {"prompt_tokens": hi, "completion_tokens": 2, "total_tokens": hi + 2}}

    chunks = events(post(running, "/v1/chat/completions", {**CHAT, "stream": True, **options}))
    *deltas, last = chunks if usage else (*chunks, None)
    assert deltas[0]["choices"][0]["delta"]["role"] == "assistant"  # the first chunk carries the role
    for chunk in deltas:
        assert set(chunk) == {"id", "object", "created", "model", "choices"}, chunk
        assert chunk["object"] == "chat.completion.chunk" and chunk["id"].startswith("chatcmpl-")
        (choice,) = chunk["choices"]
        assert set(choice) == {"index", "delta", "logprobs", "finish_reason"} and choice["logprobs"] is None
        assert choice["index"] == 0
    assert all("role" not in c["choices"][0]["delta"] for c in deltas[1:])
    assert deltas[-1]["choices"][0]["finish_reason"] == "length"
    if usage:
        assert last["choices"] == [] and last["object"] == "chat.completion.chunk"
        assert last["usage"]["completion_tokens"] == 2 and last["id"] == deltas[0]["id"]


def test_a_body_over_the_size_limit_is_refused_unread(server):
    """64 bytes per token of the context plus 64 KiB: 64 x 64 + 65,536 = 69,632 bytes for this server. A body of
    exactly that many bytes is read (and refused for its prompt, over the context); one byte more is 413."""
    running, _ = server
    limit = 64 * 64 + (64 << 10)

    def body(size: int) -> bytes:
        head, tail = b'{"model": "tiny", "max_tokens": 1, "prompt": "', b'"}'
        return head + b"x" * (size - len(head) - len(tail)) + tail

    read = post(running, "/v1/completions", content=body(limit))
    assert read.status_code == 400 and read.json()["error"]["code"] == "context_length_exceeded", read.text
    refused = post(running, "/v1/completions", content=body(limit + 1))
    assert refused.status_code == 413 and refused.json()["error"]["code"] == "request_too_large"
    assert refused.json()["error"]["message"] == (f"the request body has more than {limit} bytes, more than any "
                                                  f"prompt this server's context holds")



def test_a_streamed_body_without_a_length_is_held_to_the_same_byte(server):
    """Sent in chunks with no Content-Length (chunked transfer encoding), the body is counted as it arrives: exactly
    69,632 bytes are read (and refused for the prompt), one byte more is 413."""
    running, _ = server
    limit = 64 * 64 + (64 << 10)

    def chunks(size: int):
        head, tail = b'{"model": "tiny", "max_tokens": 1, "prompt": "', b'"}'
        body = head + b"x" * (size - len(head) - len(tail)) + tail
        for start in range(0, len(body), 4096):
            yield body[start:start + 4096]

    read = post(running, "/v1/completions", content=chunks(limit))
    assert read.status_code == 400 and read.json()["error"]["code"] == "context_length_exceeded", read.text
    refused = post(running, "/v1/completions", content=chunks(limit + 1))
    assert refused.status_code == 413 and refused.json()["error"]["code"] == "request_too_large", refused.text


# ------------------------------------------------------------------------------------------------ /tokenize
@pytest.mark.parametrize("body, param, words", [
    ({"prompt": "a", "messages": USER}, "messages",
     "=give either prompt (a string) or messages (a list of {role, content}), not both"),
    ({}, "prompt", "give either prompt"),
    ({"prompt": None, "messages": None}, "prompt", "give either prompt"),
    ({"prompt": 5}, "prompt", "=prompt must be a string"),
    ({"prompt": "a", "add_special_tokens": "yes"}, "add_special_tokens",
     "add_special_tokens must be true or false, got 'yes'"),
    ({"prompt": "a", "return_token_strs": 1}, "return_token_strs", "return_token_strs must be true or false, got 1"),
    ({"messages": USER, "add_generation_prompt": 0}, "add_generation_prompt", "add_generation_prompt must be true"),
    ({"prompt": "a", "model": ""}, "model", "=model must be a string (see GET /v1/models) or left out"),
    ({"prompt": "a", "model": 3}, "model", "model must be a string"),
    ({"messages": []}, "messages", "messages is required"),
])
def test_tokenize_refuses_each_field_naming_it(server, body, param, words):
    """``words``: part of the message, or, after ``=``, the whole of it."""
    running, _ = server
    response = post(running, "/tokenize", body)
    assert_refused(response, param, "invalid_value", words.removeprefix("="))
    if words.startswith("="):
        assert response.json()["error"]["message"] == words[1:]


def test_tokenize_defaults_and_flags(server):
    running, tokenizer = server
    got = post(running, "/tokenize", {"prompt": "hi"}).json()
    ids = tokenizer("hi", add_special_tokens=True).input_ids
    assert got == {"count": len(ids), "max_model_len": 64, "tokens": ids, "token_strs": None}
    strs = post(running, "/tokenize", {"prompt": "hi", "return_token_strs": True, "add_special_tokens": False}).json()
    assert strs["tokens"] == [ord("h"), ord("i")] and strs["token_strs"] == ["h", "i"]
    chat = post(running, "/tokenize", {"messages": USER, "model": "tiny"}).json()
    text = tokenizer.apply_chat_template(USER, tokenize=False, add_generation_prompt=True)
    assert chat["tokens"] == tokenizer(text, add_special_tokens=False).input_ids
    bare = post(running, "/tokenize", {"messages": USER, "add_generation_prompt": False}).json()
    assert bare["count"] == chat["count"] - len("assistant:")
    unknown = post(running, "/tokenize", {"prompt": "hi", "model": "gpt-4"})
    assert unknown.status_code == 404 and unknown.json()["error"] == {
        "message": "model 'gpt-4' does not exist; this server serves 'tiny'", "type": "invalid_request_error",
        "param": "model", "code": "model_not_found"}


# ------------------------------------------------------------------------------------------------ /detokenize
def test_detokenize_refuses_a_missing_list_and_an_unknown_model(server):
    running, _ = server
    for body in ({}, {"tokens": "abc"}, {"tokens": [1, True]}, {"tokens": [1.0]}, {"tokens": None}):
        response = post(running, "/detokenize", body)
        assert_refused(response, "tokens", "invalid_value", "")
        assert response.json()["error"]["message"] == "tokens is required: a list of token ids"
    unknown = post(running, "/detokenize", {"tokens": [5], "model": "gpt-4"})
    assert unknown.status_code == 404 and unknown.json()["error"] == {
        "message": "model 'gpt-4' does not exist; this server serves 'tiny'", "type": "invalid_request_error",
        "param": "model", "code": "model_not_found"}
    assert post(running, "/detokenize", {"tokens": [70], "model": "tiny"}).json() == {"prompt": "F"}
    assert_refused(post(running, "/detokenize", {"tokens": [5], "model": ""}), "model", "invalid_value",
                   "model must be a string")


def test_detokenize_names_at_most_five_bad_ids(server):
    running, _ = server
    bad = [-1, 128, 129, 130, 131, 132, 133]
    assert_refused(post(running, "/detokenize", {"tokens": [5, *bad]}), "tokens", "invalid_value",
                   "token id(s) [-1, 128, 129, 130, 131] outside the vocabulary [0, 128)")


def test_a_server_without_a_tokenizer_refuses_text_routes_naming_the_field(tiny_pair):
    from hf_rocketkv.serving import GenerationManager, create_app
    from hf_rocketkv.serving.http.background import ServerThread
    from tests.support.tiny_models import compressing_config

    manager = GenerationManager(tiny_pair[0], None, compressing_config(), max_model_len=64)
    try:
        with ServerThread(create_app(manager, "tiny")) as running:
            refused = post(running, "/detokenize", {"tokens": [5]})
            assert_refused(refused, "tokens", "invalid_value", "")
            assert refused.json()["error"]["message"] == "this server has no tokenizer"
            ids = post(running, "/v1/completions", {**COMPLETION, "prompt": [5, 6]})
            assert ids.status_code == 200 and ids.json()["usage"]["prompt_tokens"] == 2
            assert_refused(post(running, "/v1/completions", COMPLETION), "prompt", "invalid_value",
                           "this manager has no tokenizer: pass the prompt as token ids")
    finally:
        manager.stop(drain=False)
