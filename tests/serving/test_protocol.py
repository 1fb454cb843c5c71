"""The request parser of the HTTP server (serving/http/protocol.py) called directly, against the OpenAI API's rules
written out here: the optional fields' defaults, vLLM's ``top_k=-1``, one prompt per request, and each refusal's
exact words and field."""

from __future__ import annotations

import pytest

from hf_rocketkv.serving import InvalidRequest
from hf_rocketkv.serving.http.protocol import parse_chat_request, parse_completion_request

BASE = {"model": "tiny", "prompt": "hello"}


def refused(body: dict) -> InvalidRequest:
    with pytest.raises(InvalidRequest) as err:
        parse_completion_request(body)
    return err.value


@pytest.mark.parametrize("options, include", [(None, False), ({}, False), ({"include_usage": False}, False),
                                              ({"include_usage": True}, True)])
def test_usage_is_streamed_only_when_asked(options, include):
    """OpenAI: ``stream_options: {"include_usage": true}`` adds the usage chunk; an empty object asks for nothing."""
    body = {**BASE, "stream": True} if options is None else {**BASE, "stream": True, "stream_options": options}
    assert parse_completion_request(body).include_usage is include
    chat = {"model": "tiny", "messages": [{"role": "user", "content": "hi"}], "stream": True}
    if options is not None:
        chat["stream_options"] = options
    assert parse_chat_request(chat).include_usage is include


@pytest.mark.parametrize("options, message", [
    ({"x": 1}, "stream_options must be an object with only include_usage"),
    ([], "stream_options must be an object with only include_usage"),
    ({"include_usage": 1}, "stream_options.include_usage must be true or false"),
])
def test_bad_stream_options_are_refused_word_for_word(options, message):
    err = refused({**BASE, "stream": True, "stream_options": options})
    assert (err.message, err.param) == (message, "stream_options")


@pytest.mark.parametrize("stream", [False, None, "absent"])
@pytest.mark.parametrize("options", [{}, {"include_usage": True}, {"include_usage": False}])
def test_stream_options_without_stream_is_refused(stream, options):
    """OpenAI and vLLM answer 400 to ``stream_options`` on a request that does not stream; ``null`` is no options."""
    body = {**BASE, "stream_options": options} if stream == "absent" else {**BASE, "stream": stream,
                                                                           "stream_options": options}
    err = refused(body)
    assert (err.message, err.param) == ("stream_options is only allowed with stream: true", "stream_options")
    chat = {"model": "tiny", "messages": [{"role": "user", "content": "hi"}], "stream_options": options}
    with pytest.raises(InvalidRequest, match="only allowed with stream: true"):
        parse_chat_request(chat)
    assert parse_completion_request({**BASE, "stream": False, "stream_options": None}).include_usage is False


@pytest.mark.parametrize("top_k, expected", [(-1, 0), (0, 0), (1, 1), (7, 7)])
def test_top_k_minus_one_means_no_limit_as_in_vllm(top_k, expected):
    assert parse_completion_request({**BASE, "top_k": top_k}).sampling["top_k"] == expected


def test_stop_token_ids_become_a_tuple_and_absent_fields_stay_absent():
    parsed = parse_completion_request({**BASE, "stop_token_ids": [5, 6], "temperature": None})
    assert parsed.sampling == {"stop_token_ids": (5, 6)}
    assert parse_completion_request(BASE).sampling == {}


@pytest.mark.parametrize("prompt, expected", [("hello", "hello"), (["hello"], "hello"), ([1, 2], [1, 2]),
                                              ([[1, 2]], [1, 2])])
def test_one_prompt_of_text_or_ids_is_accepted_bare_or_in_a_list_of_one(prompt, expected):
    assert parse_completion_request({**BASE, "prompt": prompt}).prompt == expected


@pytest.mark.parametrize("prompt, message, code", [
    ("", "prompt must not be empty", None),
    ([""], "prompt must not be empty", None),
    (["a", "b"], "one prompt per request is supported; send several requests", "unsupported_value"),
    ([[1], [2]], "one prompt per request is supported; send several requests", "unsupported_value"),
    ([["a"]], "prompt is required: a non-empty string or a non-empty list of token ids", None),
    ([], "prompt is required: a non-empty string or a non-empty list of token ids", None),
    ([True], "prompt is required: a non-empty string or a non-empty list of token ids", None),
])
def test_prompts_the_server_cannot_take_are_refused_word_for_word(prompt, message, code):
    err = refused({**BASE, "prompt": prompt})
    assert (err.message, err.param) == (message, "prompt")
    if code is not None:
        assert err.code == code
