"""Every validation of the HTTP server at its exact boundary: the last accepted value answers 200, the first refused
one 400 with an OpenAI error naming the field (``param``) and a message saying what is allowed.

The server runs a tiny random Llama (vocabulary 128, character tokenizer) with a context of 64 tokens
(``max_model_len=64``), so the context boundary is a 60-token prompt plus 4 new tokens. Accepted generation requests
ask for one or a few tokens with ``ignore_eos`` (fixed lengths).

The limits themselves are written out here, not read from the code: token ids in ``[0, 128)`` (/detokenize, prompts,
stop_token_ids), prompt + max_tokens <= 64 and prompt < 64, ``max_tokens >= 1`` (as vLLM: "max_tokens must be at
least 1"), ``n == 1``, temperature in ``[0, 2]``, top_p in ``(0, 1]``, top_k >= 0 or vLLM's -1, a 64-bit seed, at
most 16 stop strings.
"""

from __future__ import annotations

import pytest

pytest.importorskip("fastapi")
httpx = pytest.importorskip("httpx")

VOCAB = 128
CONTEXT = 64
NO_EOS = {"ignore_eos": True}
USER = [{"role": "user", "content": "hi"}]


def counting_tokenizer():
    """The character tokenizer, counting its encode calls (``tokenizer.calls``)."""
    from tests.support.tiny_models import char_tokenizer

    tokenizer = char_tokenizer()
    base = type(tokenizer)

    class Counting(base):
        calls = 0

        def __call__(self, *args, **kwargs):
            type(self).calls += 1
            return super().__call__(*args, **kwargs)

    tokenizer.__class__ = Counting
    return tokenizer


@pytest.fixture(scope="module")
def server(tiny_pair):
    from hf_rocketkv.serving import GenerationManager, create_app
    from hf_rocketkv.serving.http.background import ServerThread
    from tests.support.tiny_models import compressing_config

    tokenizer = counting_tokenizer()
    manager = GenerationManager(tiny_pair[0], tokenizer, compressing_config(), max_model_len=CONTEXT)
    assert len(tokenizer) == VOCAB and manager.vocab_size == VOCAB and manager.max_model_len == CONTEXT
    with ServerThread(create_app(manager, "tiny")) as running:
        yield running, tokenizer
    manager.stop(drain=False)


def post(server, path: str, body: dict | None = None, content: bytes | None = None) -> httpx.Response:
    if content is not None:
        return httpx.post(server.url + path, content=content, headers={"content-type": "application/json"},
                          timeout=60)
    return httpx.post(server.url + path, json=body, timeout=60)


def assert_refused(response: httpx.Response, param: str, code: str, *words: str) -> None:
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert (error["param"], error["code"], error["type"]) == (param, code, "invalid_request_error"), error
    for word in words:
        assert word in error["message"], (word, error["message"])


def completion(**fields) -> dict:
    return {"model": "tiny", "prompt": "hi", "max_tokens": 1, **NO_EOS, **fields}


def ids(count: int) -> list[int]:
    return [3 + i % 100 for i in range(count)]


# ------------------------------------------------------------------------------------------------ /detokenize
@pytest.mark.parametrize("tokens", [[0], [VOCAB - 1], [0, VOCAB - 1], []])
def test_detokenize_accepts_every_id_of_the_vocabulary(server, tokens):
    running, tokenizer = server
    response = post(running, "/detokenize", {"tokens": tokens})
    assert response.status_code == 200, response.text
    assert response.json() == {"prompt": tokenizer.decode(tokens)}


@pytest.mark.parametrize("tokens, shown", [([VOCAB], f"[{VOCAB}]"), ([-1], "[-1]"), ([5, VOCAB, -1], f"[{VOCAB}, -1]")])
def test_detokenize_refuses_ids_outside_the_vocabulary(server, tokens, shown):
    running, _ = server
    assert_refused(post(running, "/detokenize", {"tokens": tokens}), "tokens", "invalid_value", shown,
                   f"[0, {VOCAB})")


# ------------------------------------------------------------------------------------------------ the context
@pytest.mark.parametrize("prompt_len, max_tokens", [(CONTEXT - 4, 4), (CONTEXT - 1, 1), (1, CONTEXT - 1)])
def test_a_request_filling_the_context_exactly_is_served(server, prompt_len, max_tokens):
    running, _ = server
    response = post(running, "/v1/completions", completion(prompt=ids(prompt_len), max_tokens=max_tokens))
    assert response.status_code == 200, response.text
    assert response.json()["usage"] == {"prompt_tokens": prompt_len, "completion_tokens": max_tokens,
                                        "total_tokens": CONTEXT}


@pytest.mark.parametrize("prompt_len, max_tokens", [(CONTEXT - 4, 5), (1, CONTEXT), (CONTEXT - 1, 2)])
def test_one_token_over_the_context_is_refused_naming_max_tokens(server, prompt_len, max_tokens):
    running, _ = server
    assert_refused(post(running, "/v1/completions", completion(prompt=ids(prompt_len), max_tokens=max_tokens)),
                   "max_tokens", "context_length_exceeded", f"at most {CONTEXT - prompt_len} tokens")


@pytest.mark.parametrize("prompt_len", [CONTEXT, CONTEXT + 1])
def test_a_prompt_of_the_whole_context_is_refused_naming_prompt(server, prompt_len):
    running, _ = server
    assert_refused(post(running, "/v1/completions", completion(prompt=ids(prompt_len))), "prompt",
                   "context_length_exceeded", f"{prompt_len} tokens", f"context is {CONTEXT} tokens")


@pytest.mark.parametrize("left", [1, 4])
def test_chat_without_max_tokens_takes_what_the_context_leaves(server, left):
    """The chat default (4,096) capped by the rest of the context: a prompt of 64 - left tokens gets exactly
    ``left``."""
    running, tokenizer = server
    content = "x" * 40
    prompt_len = len(tokenizer.apply_chat_template([{"role": "user", "content": content}], tokenize=True,
                                                   add_generation_prompt=True, return_dict=True)["input_ids"])
    content += "x" * (CONTEXT - left - prompt_len)
    response = post(running, "/v1/chat/completions",
                    {"model": "tiny", "messages": [{"role": "user", "content": content}], **NO_EOS})
    assert response.status_code == 200, response.text
    assert response.json()["usage"] == {"prompt_tokens": CONTEXT - left, "completion_tokens": left,
                                        "total_tokens": CONTEXT}


# ------------------------------------------------------------------------------------------------ max_tokens
def test_max_tokens_of_one_is_served(server):
    running, _ = server
    response = post(running, "/v1/completions", completion(max_tokens=1))
    assert response.status_code == 200 and response.json()["usage"]["completion_tokens"] == 1


@pytest.mark.parametrize("endpoint, field", [("completions", "max_tokens"), ("chat/completions", "max_tokens"),
                                             ("chat/completions", "max_completion_tokens")])
@pytest.mark.parametrize("value", [0, -1, 1.0, True, "1"])
def test_max_tokens_below_one_or_not_an_integer_is_refused_before_the_prompt_is_tokenized(server, endpoint, field,
                                                                                         value):
    """The protocol refuses it, naming the field as the client sent it, before any tokenizer work (a long prompt is
    not tokenized only to be refused); SamplingParams' own check would come after the tokenizer and name
    ``max_tokens`` whatever the field."""
    running, tokenizer = server
    body = {"model": "tiny", field: value}
    body.update({"prompt": "hello"} if endpoint == "completions" else {"messages": USER})
    before = type(tokenizer).calls
    assert_refused(post(running, f"/v1/{endpoint}", body), field, "invalid_value",
                   f"{field} must be an integer >= 1, got {value!r}")
    assert type(tokenizer).calls == before


# ------------------------------------------------------------------------------------------------ n
@pytest.mark.parametrize("n", [1, None])
def test_n_of_one_is_served(server, n):
    running, _ = server
    assert post(running, "/v1/completions", completion(n=n)).status_code == 200
    assert post(running, "/v1/chat/completions",
                {"model": "tiny", "messages": USER, "max_tokens": 1, "n": n, **NO_EOS}).status_code == 200


@pytest.mark.parametrize("n", [2, 0, -1, 1.5, True])
def test_n_other_than_one_is_refused(server, n):
    running, _ = server
    assert_refused(post(running, "/v1/completions", completion(n=n)), "n", "unsupported_value", "n must be 1")
    assert_refused(post(running, "/v1/chat/completions", {"model": "tiny", "messages": USER, "n": n}), "n",
                   "unsupported_value", "n must be 1")


# ------------------------------------------------------------------------------------------------ sampling fields
ACCEPTED = [
    ("temperature", 0), ("temperature", 0.0), ("temperature", 2), ("temperature", 2.0), ("temperature", 1e-9),
    ("top_p", 1), ("top_p", 1.0), ("top_p", 1e-9),
    ("top_k", 0), ("top_k", 1), ("top_k", -1), ("top_k", VOCAB), ("top_k", VOCAB + 1),
    ("seed", 2**63 - 1), ("seed", -(2**63)), ("seed", 0),
    ("stop", ["a"] * 16), ("stop", "a"),
    ("stop_token_ids", [0]), ("stop_token_ids", [VOCAB - 1]),
]
REFUSED = [
    ("temperature", -1e-9, "[0, 2]"), ("temperature", 2.000001, "[0, 2]"), ("temperature", "1", "[0, 2]"),
    ("temperature", True, "[0, 2]"),
    ("top_p", 0, "(0, 1]"), ("top_p", 0.0, "(0, 1]"), ("top_p", 1.000001, "(0, 1]"), ("top_p", -0.5, "(0, 1]"),
    ("top_k", -2, ">= 0"), ("top_k", 1.5, ">= 0"),
    ("seed", 2**63, "64-bit"), ("seed", -(2**63) - 1, "64-bit"), ("seed", 1.0, "64-bit"),
    ("stop", ["a"] * 17, "at most 16"), ("stop", [""], "must not be empty"), ("stop", [1], "list of strings"),
    ("stop_token_ids", [VOCAB], f"< the vocabulary size {VOCAB}"), ("stop_token_ids", [-1], "integers >= 0"),
    ("ignore_eos", 1, "true or false"),
]


@pytest.mark.parametrize("field, value", ACCEPTED, ids=[f"{f}={v!r}"[:40] for f, v in ACCEPTED])
def test_sampling_values_at_their_bounds_are_served(server, field, value):
    running, _ = server
    response = post(running, "/v1/completions", completion(**{field: value}))
    assert response.status_code == 200, response.text
    assert response.json()["usage"]["completion_tokens"] <= 1


@pytest.mark.parametrize("field, value, allowed", REFUSED, ids=[f"{f}={v!r}"[:40] for f, v, _ in REFUSED])
def test_sampling_values_past_their_bounds_are_refused_naming_the_field(server, field, value, allowed):
    running, _ = server
    assert_refused(post(running, "/v1/completions", completion(**{field: value})), field, "invalid_value", field,
                   allowed)
    assert_refused(post(running, "/v1/chat/completions",
                        {"model": "tiny", "messages": USER, "max_tokens": 1, field: value}), field, "invalid_value",
                   field, allowed)


@pytest.mark.parametrize("field", ["temperature", "top_p"])
@pytest.mark.parametrize("literal", [b"NaN", b"Infinity", b"-Infinity"])
def test_non_finite_numbers_are_refused(server, field, literal):
    """Python's json reads NaN and Infinity; neither is in any allowed range."""
    running, _ = server
    body = b'{"model": "tiny", "prompt": "hi", "max_tokens": 1, "%s": %s}' % (field.encode(), literal)
    assert_refused(post(running, "/v1/completions", content=body), field, "invalid_value", field)


# ------------------------------------------------------------------------------------------------ prompt token ids
@pytest.mark.parametrize("prompt", [[0], [VOCAB - 1], [0, VOCAB - 1]])
def test_prompt_ids_across_the_vocabulary_are_served(server, prompt):
    running, _ = server
    response = post(running, "/v1/completions", completion(prompt=prompt))
    assert response.status_code == 200, response.text
    assert response.json()["usage"]["prompt_tokens"] == len(prompt)


@pytest.mark.parametrize("prompt", [[VOCAB], [-1], [5, VOCAB]])
def test_prompt_ids_outside_the_vocabulary_are_refused(server, prompt):
    running, _ = server
    assert_refused(post(running, "/v1/completions", completion(prompt=prompt)), "prompt", "invalid_value",
                   f"[0, {VOCAB})")
