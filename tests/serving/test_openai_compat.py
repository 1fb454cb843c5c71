"""What an OpenAI (or vLLM) client relies on, each checked with the real ``openai`` client against the server on
127.0.0.1: 404 ``model_not_found`` for an unknown model, one error shape ``{"error": {...}}`` on every route (unknown
routes and wrong methods too), streams that never split a UTF-8 character (an incomplete one at max_tokens is held
back and dropped), the Bearer API key, a chat template given to the server, and vLLM's /tokenize and /detokenize.

The UTF-8 tests run a tiny random Llama over a byte-level tokenizer (one token per byte) whose output is forced, by
hooks on the embedding and the LM head, to spell 🚀 (4 bytes) over and over: max_tokens then cuts it wherever asked.
"""

from __future__ import annotations

import itertools

import pytest

pytest.importorskip("fastapi")
openai = pytest.importorskip("openai")
httpx = pytest.importorskip("httpx")

ROCKET = "🚀"
KEY = "sk-test-0123"
TEMPLATE = "{% for m in messages %}<{{ m['role'] }}>{{ m['content'] }}{% endfor %}{% if add_generation_prompt %}<bot>{% endif %}"


def client(server, api_key: str = "none"):
    return openai.OpenAI(base_url=server.url + "/v1", api_key=api_key, max_retries=0, timeout=60)


def assert_openai_error(body: dict, code: str) -> None:
    assert set(body) == {"error"}, body
    error = body["error"]
    assert set(error) == {"message", "type", "param", "code"} and error["message"] and error["code"] == code, error


# ------------------------------------------------------------------------------------------------ unknown model
def test_an_unknown_model_is_404_model_not_found(serve, tokenizer):
    server, manager = serve(tokenizer=tokenizer)
    api = client(server)
    with pytest.raises(openai.NotFoundError) as completion:
        api.completions.create(model="gpt-4", prompt="hi", max_tokens=2)
    with pytest.raises(openai.NotFoundError) as chat:
        api.chat.completions.create(model="gpt-4", messages=[{"role": "user", "content": "hi"}], max_tokens=2)
    with pytest.raises(openai.NotFoundError) as chat_stream:
        list(api.chat.completions.create(model="gpt-4", messages=[{"role": "user", "content": "hi"}], max_tokens=2,
                                         stream=True))
    for raised in (completion, chat, chat_stream):
        assert raised.value.status_code == 404 and raised.value.code == "model_not_found"
        assert raised.value.param == "model" and "'gpt-4' does not exist" in raised.value.message
    with pytest.raises(openai.NotFoundError) as tokenize:
        api.post(server.url + "/tokenize", body={"model": "gpt-4", "prompt": "hi"}, cast_to=object)
    assert tokenize.value.code == "model_not_found"
    assert manager.metrics().requests_total == 0  # nothing was admitted


# ------------------------------------------------------------------------------------------------ one error shape
def test_every_route_answers_errors_in_one_shape(serve, tokenizer):
    server, _ = serve(tokenizer=tokenizer)
    api = client(server)
    with pytest.raises(openai.NotFoundError) as embeddings:  # a route this server does not have
        api.embeddings.create(model="tiny", input="hello")
    assert embeddings.value.code == "not_found" and "/v1/embeddings" in embeddings.value.message
    with pytest.raises(openai.BadRequestError) as bad:
        api.completions.create(model="tiny", prompt="hi", max_tokens=0)
    assert bad.value.code == "invalid_value" and bad.value.param == "max_tokens"
    with pytest.raises(openai.BadRequestError) as detok:
        api.post(server.url + "/detokenize", body={"tokens": [1, 10**9]}, cast_to=object)
    assert detok.value.param == "tokens" and "outside the vocabulary" in detok.value.message

    cases = [("get", "/v1/nothing", None, 404, "not_found"), ("post", "/v1/embeddings", {}, 404, "not_found"),
             ("get", "/v1/completions", None, 405, "method_not_allowed"),
             ("delete", "/v1/models", None, 405, "method_not_allowed"),
             ("post", "/tokenize", {"prompt": 5}, 400, "invalid_value"),
             ("post", "/tokenize", {"prompt": "a", "messages": []}, 400, "invalid_value"),
             ("post", "/tokenize", {"prompt": "a", "frobnicate": 1}, 400, "unsupported_field"),
             ("post", "/detokenize", {"tokens": "abc"}, 400, "invalid_value"),
             ("get", "/v1/models/other", None, 404, "model_not_found")]
    for method, path, body, status, code in cases:
        response = httpx.request(method, server.url + path, json=body, timeout=30)
        assert response.status_code == status, (path, response.text)
        assert_openai_error(response.json(), code)
    raw = httpx.post(server.url + "/tokenize", content=b"{not json", headers={"content-type": "application/json"})
    assert raw.status_code == 400 and raw.json()["error"]["code"] == "invalid_json"


# ------------------------------------------------------------------------------------------------ API key
def test_the_api_key_guards_every_route_but_health_and_metrics(serve, tokenizer):
    server, _ = serve(tokenizer=tokenizer, app_kwargs={"api_key": KEY})
    out = client(server, KEY).completions.create(model="tiny", prompt="hello", max_tokens=3, temperature=0,
                                                 extra_body={"ignore_eos": True})
    assert out.usage.completion_tokens == 3
    assert client(server, KEY).models.list().data[0].id == "tiny"
    for api in (client(server, "wrong-key"), client(server, KEY + "x")):
        with pytest.raises(openai.AuthenticationError) as denied:
            api.completions.create(model="tiny", prompt="hello", max_tokens=3)
        assert denied.value.status_code == 401 and denied.value.code == "invalid_api_key"
        with pytest.raises(openai.AuthenticationError):
            api.models.list()
    for path in ("/v1/models", "/tokenize", "/v1/nothing"):  # unknown routes too: nothing is told without the key
        response = httpx.post(server.url + path, json={"prompt": "x"}, timeout=30)
        assert response.status_code == 401 and response.headers["www-authenticate"] == "Bearer"
        assert_openai_error(response.json(), "invalid_api_key")
    assert httpx.get(server.url + "/health", timeout=30).status_code == 200  # probes and Prometheus: no key
    assert httpx.get(server.url + "/metrics", timeout=30).status_code == 200


def test_create_app_refuses_an_empty_key(make_manager, tokenizer):
    from hf_rocketkv.serving import create_app

    with pytest.raises(ValueError, match="api_key"):
        create_app(make_manager(tokenizer=tokenizer), "tiny", api_key="")


# ------------------------------------------------------------------------------------------------ chat template
def test_a_chat_template_given_to_the_server_is_used(serve, tokenizer, oracle):
    server, _ = serve(tokenizer=tokenizer, app_kwargs={"chat_template": TEMPLATE})
    api = client(server)
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Name a fox."}]
    text = "<system>Be brief.<user>Name a fox.<bot>"
    ids = tokenizer(text, add_special_tokens=False).input_ids
    assert ids != tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True,
                                                return_dict=True)["input_ids"]  # not the tokenizer's own template
    reply = api.chat.completions.create(model="tiny", messages=messages, max_tokens=4, temperature=0,
                                        extra_body={"ignore_eos": True})
    assert reply.usage.prompt_tokens == len(ids)
    assert reply.choices[0].message.content == tokenizer.decode(oracle(ids, 4), skip_special_tokens=True)
    tokens = api.post(server.url + "/tokenize", body={"model": "tiny", "messages": messages}, cast_to=object)
    assert tokens["tokens"] == ids and tokens["count"] == len(ids)


# ------------------------------------------------------------------------------------------------ /tokenize, /detokenize
def test_tokenize_and_detokenize_as_vllm_has_them(serve, tokenizer):
    server, manager = serve(tokenizer=tokenizer)
    api = client(server)
    text = "Hello, world"
    tokens = api.post(server.url + "/tokenize", body={"model": "tiny", "prompt": text, "return_token_strs": True},
                      cast_to=object)
    expected = tokenizer(text, add_special_tokens=True).input_ids
    assert tokens == {"count": len(expected), "max_model_len": manager.max_model_len, "tokens": expected,
                      "token_strs": tokenizer.convert_ids_to_tokens(expected)}
    plain = api.post(server.url + "/tokenize", body={"prompt": text, "add_special_tokens": False}, cast_to=object)
    assert plain["tokens"] == tokenizer(text, add_special_tokens=False).input_ids and plain["token_strs"] is None
    messages = [{"role": "user", "content": "hi"}]
    chat = api.post(server.url + "/tokenize", body={"messages": messages, "add_generation_prompt": False},
                    cast_to=object)
    template = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=False)
    assert chat["tokens"] == tokenizer(template, add_special_tokens=False).input_ids
    back = api.post(server.url + "/detokenize", body={"model": "tiny", "tokens": expected}, cast_to=object)
    assert back == {"prompt": tokenizer.decode(expected)}
    assert manager.metrics().requests_total == 0  # neither one is a generation request


# ------------------------------------------------------------------------------------------------ UTF-8
def byte_tokenizer():
    """One token per byte (GPT-2's byte-to-character table), <pad>=0, <s>=1, </s>=2: any multi-byte character is
    several tokens, and decoding a part of it gives U+FFFD."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {"<pad>": 0, "<s>": 1, "</s>": 2}
    for char in sorted(pre_tokenizers.ByteLevel.alphabet()):
        vocab[char] = len(vocab)
    backend = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    backend.decoder = decoders.ByteLevel()
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=backend, bos_token="<s>", eos_token="</s>",
                                        pad_token="<pad>")
    tokenizer.chat_template = "{% for m in messages %}{{ m['content'] }}{% endfor %}"
    return tokenizer


@pytest.fixture(scope="module")
def rocket_server():
    """``(server, tokenizer)``: a tiny Llama over the byte tokenizer whose every next token is forced so that it
    writes 🚀🚀🚀... after any prompt ending in "!" (the hooks map the last input byte to the next one)."""
    import torch

    from hf_rocketkv.serving import GenerationManager, create_app
    from hf_rocketkv.serving.http.background import ServerThread
    from tests.support.tiny_models import compressing_config, make_models

    tokenizer = byte_tokenizer()
    model, _ = make_models("llama", vocab_size=len(tokenizer))
    cycle = tokenizer("!" + ROCKET, add_special_tokens=False).input_ids  # "!" then the emoji's 4 bytes
    assert len(cycle) == 5 and tokenizer.decode(cycle[1:3]).endswith("\ufffd")
    following = dict(itertools.pairwise(cycle)) | {cycle[-1]: cycle[1]}
    seen = {}

    def record(_module, args, _output):
        seen["ids"] = args[0]

    def force(_module, _args, logits):
        last = seen["ids"][:, -1].tolist()
        forced = torch.full_like(logits, -1e4)
        for row, token in enumerate(last):
            forced[row, :, following.get(token, cycle[1])] = 1e4
        return forced

    hooks = [model.model.embed_tokens.register_forward_hook(record), model.lm_head.register_forward_hook(force)]
    manager = GenerationManager(model, tokenizer, compressing_config())
    server = ServerThread(create_app(manager, "tiny")).start()
    yield server, tokenizer
    server.stop()
    manager.stop(drain=False, timeout=30)
    for hook in hooks:
        hook.remove()


@pytest.mark.parametrize("max_tokens, text", [(4, ROCKET), (6, ROCKET), (7, ROCKET), (8, ROCKET * 2), (3, "")])
def test_streams_never_split_a_character(rocket_server, max_tokens, text):
    server, _ = rocket_server
    api = client(server)
    chunks = list(api.completions.create(model="tiny", prompt="Launch!", max_tokens=max_tokens, temperature=0,
                                         stream=True))
    pieces = [c.choices[0].text for c in chunks if c.choices]
    assert "".join(pieces) == text and not any("\ufffd" in piece for piece in pieces), pieces
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "length"
    whole = api.completions.create(model="tiny", prompt="Launch!", max_tokens=max_tokens, temperature=0)
    assert whole.choices[0].text == text and whole.usage.completion_tokens == max_tokens
    chat = list(api.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "Go!"}],
                                            max_tokens=max_tokens, temperature=0, stream=True))
    deltas = [c.choices[0].delta.content or "" for c in chat if c.choices]
    assert "".join(deltas) == text and not any("\ufffd" in delta for delta in deltas), deltas
