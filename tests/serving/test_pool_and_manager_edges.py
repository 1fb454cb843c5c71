"""Public surfaces a demanding user reaches: KVBlockPool's methods, GenerationManager's constructor and prompts, and the
OpenAI app's chat template. Each test states what a user should get (a refusal naming the field, a 4xx with an OpenAI
error body, or a pool left exactly as it was).

Oracles are independent of the code under test: the pool's free-page count and page ids before the call, the HTTP
status the documented error table (docs/serving.md "Errors") gives for a client mistake, the transformers chat
template rendered directly.
"""

from __future__ import annotations

import re

import pytest
import torch

import hf_rocketkv.cache  # noqa: F401 - registers RocketKVConfig with the pool's as_budget (tests/memory/conftest.py)
from hf_rocketkv.memory import PrefixFileError
from hf_rocketkv.serving import InvalidRequest, SamplingParams
from tests.memory.helpers import fill_pages, make_pool, rocket_config

CFG = rocket_config(prompt_budget=32, window_size=8)
IDS = list(range(11, 11 + 45))  # 5 full pages of 8 and a partial one


# ------------------------------------------------------------------------------------------------ KVBlockPool
def test_releasing_an_admission_into_another_pool_is_refused_and_changes_neither_pool():
    """Two pools of one model (two engines, a draft model, a test harness): ``a.release(adm_of_b)`` must not drop the
    references of pool a's pages that happen to carry the same ids (a live request of a holds them) nor empty b's
    tables (b could never get those pages back)."""
    a, b = make_pool(24), make_pool(24)
    x = a.admit(40, 8, CFG)  # a live request on pool a
    y = b.admit(40, 8, CFG)  # one on pool b: the same page ids
    held_by_x = set(x.prompt.pages + x.view.pages)
    free_a, free_b, y_pages = a.free_pages(), b.free_pages(), (y.prompt.pages, y.view.pages)
    with pytest.raises(ValueError, match="holds pages of another KVBlockPool"):
        a.release(y)
    assert a.free_pages() == free_a, "pool a freed pages that request x still holds"
    assert (y.prompt.pages, y.view.pages) == y_pages, "y's tables were emptied by the wrong pool"
    z = a.admit(40, 8, CFG)
    assert not set(z.prompt.pages + z.view.pages) & held_by_x, "a new request was handed x's pages"
    b.release(y)
    assert b.free_pages() == b.total_pages() > free_b


@pytest.mark.parametrize("prompt_len", [10.0, torch.tensor(10)])
def test_pages_needed_refuses_a_non_integer_prompt_len_naming_it(prompt_len):
    """``max_new_tokens=4.0`` is refused naming the field; ``prompt_len=10.0`` (or a 0-d tensor) got TypeError
    "'float' object is not iterable" from the row splitter."""
    pool = make_pool(24)
    with pytest.raises(ValueError, match="prompt_len"):
        pool.pages_needed(prompt_len, 4, CFG)
    with pytest.raises(ValueError, match="prompt_len"):
        pool.can_admit(prompt_len, 4, CFG)


def test_the_prefix_reuse_setter_checks_its_value_as_the_constructor_does():
    with pytest.raises(ValueError, match="prefix_reuse"):
        make_pool(24, prefix_reuse="no")  # the constructor refuses it
    pool = make_pool(24)
    with pytest.raises(ValueError, match="prefix_reuse"):
        pool.prefix_reuse = "no"  # a truthy string: reuse silently stays on


def test_a_bad_cache_salt_is_refused_naming_the_argument_not_the_file(tmp_path):
    """The file is sound; the caller's salt is not a string. The error blamed the file ("has malformed contents")
    after reading and digesting all of it."""
    source = make_pool(24)
    adm = source.admit(len(IDS), 0, CFG, token_ids=IDS)
    fill_pages(source, adm.prompt.pages, seed=5)
    source.commit_prompt(adm)
    source.release(adm)
    path = tmp_path / "p.safetensors"
    source.save_prefix(path, IDS)
    target = make_pool(24)
    with pytest.raises(ValueError, match="cache_salt") as err:
        target.load_prefix(path, cache_salt=5)
    assert not isinstance(err.value, PrefixFileError), str(err.value)
    assert target.cached_pages() == 0
    assert target.load_prefix(path, cache_salt="t").pages_loaded == 5  # the same file loads with a string salt


@pytest.mark.parametrize("device", ["gpu", "cuda:x", 1.5])
def test_a_bad_device_is_refused_naming_the_field(device):
    """torch's own message for ``device="gpu"`` lists device types and names no argument; the setter stored any value
    and ``load_prefix`` failed later."""
    with pytest.raises(ValueError, match=r"KVBlockPool\.device must be None, a torch\.device or a device string"):
        make_pool(24, device=device)
    pool = make_pool(24)
    with pytest.raises(ValueError, match=r"KVBlockPool\.device"):
        pool.device = device
    assert pool.device is None
    pool.device = "cpu"
    assert pool.device == torch.device("cpu")


def _saved_prefix():
    source = make_pool(24)
    adm = source.admit(len(IDS), 0, CFG, token_ids=IDS)
    fill_pages(source, adm.prompt.pages, seed=5)
    source.commit_prompt(adm)
    source.release(adm)
    return source


def test_save_and_load_prefix_name_a_directory_as_one(tmp_path):
    """``save_prefix(dir)`` raised a bare IsADirectoryError from the rename after writing a temporary file;
    ``load_prefix(dir)`` said the file "does not exist"."""
    source = _saved_prefix()
    with pytest.raises(ValueError, match="is a directory; give a file path"):
        source.save_prefix(tmp_path, IDS)
    assert sorted(p.name for p in tmp_path.iterdir()) == [], "a temporary file was left behind"
    target = make_pool(24)
    with pytest.raises(PrefixFileError, match="is a directory"):
        target.load_prefix(tmp_path)
    with pytest.raises(ValueError, match="load_prefix: device"):
        target.load_prefix(tmp_path / "missing.safetensors", device="gpu")
    assert target.cached_pages() == 0


# ------------------------------------------------------------------------------------------------ GenerationManager
@pytest.mark.parametrize("max_model_len", [0, -5, True, 2.7, "100"])
def test_a_bad_max_model_len_is_refused_when_the_manager_is_built(make_manager, max_model_len):
    """0 silently became the model's max_position_embeddings; -5, True and 2.7 made every request fail with "the
    model's context is -5 (1, 2) tokens"; "100" was accepted as 100."""
    with pytest.raises(ValueError, match="max_model_len"):
        make_manager(max_model_len=max_model_len)


@pytest.mark.parametrize("prompt", [b"hello", bytearray(b"hello")])
def test_a_bytes_prompt_is_refused_not_read_as_token_ids(make_manager, tokenizer, prompt):
    """bytes is a Sequence of ints, so b"hello" ran as the token ids [104, 101, 108, 108, 111]: neither the text
    "hello" (whose ids the tokenizer gives) nor a refusal."""
    manager = make_manager(tokenizer=tokenizer)
    with pytest.raises(InvalidRequest) as err:
        manager.add_request(prompt, SamplingParams.greedy(2))
    assert err.value.param == "prompt"
    assert manager.metrics().requests_total == 0


# ------------------------------------------------------------------------------------------------ the HTTP app
STRICT_TEMPLATE = (  # as Mistral's and Gemma's templates do: a conversation whose roles do not alternate is refused
    "{% for m in messages %}{% if (m['role'] == 'user') != (loop.index0 % 2 == 0) %}"
    "{{ raise_exception('Conversation roles must alternate user/assistant/user/assistant/...') }}{% endif %}"
    "{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}{% if add_generation_prompt %}assistant:{% endif %}"
)
NOT_ALTERNATING = [{"role": "user", "content": "hi"}, {"role": "user", "content": "again"}]


@pytest.mark.parametrize("path, body", [
    ("/v1/chat/completions", {"model": "tiny", "messages": NOT_ALTERNATING, "max_tokens": 2}),
    ("/tokenize", {"model": "tiny", "messages": NOT_ALTERNATING}),
])
def test_messages_the_chat_template_refuses_are_a_400_naming_messages(serve, tokenizer, path, body):
    """The template's own refusal is the client's mistake: 400 invalid_request_error with param messages and the
    template's message, not 500 internal_error with a server traceback logged."""
    import httpx
    from jinja2.exceptions import TemplateError

    with pytest.raises(TemplateError, match="must alternate"):  # the oracle: transformers itself refuses them
        tokenizer.apply_chat_template(NOT_ALTERNATING, chat_template=STRICT_TEMPLATE, tokenize=False)
    server, manager = serve(tokenizer=tokenizer, app_kwargs={"chat_template": STRICT_TEMPLATE})
    response = httpx.post(server.url + path, json=body, timeout=30)
    error = response.json()["error"]
    assert response.status_code == 400, response.text
    assert (error["type"], error["param"]) == ("invalid_request_error", "messages"), error
    assert "must alternate" in error["message"]
    assert manager.metrics().requests_total == 0
    ok = httpx.post(server.url + path, json={**body, "messages": NOT_ALTERNATING[:1]}, timeout=30)
    assert ok.status_code == 200, ok.text  # the template serves a conversation that alternates


@pytest.mark.parametrize("template, message", [
    ("{% for m in messages %}{{ m['content'] }", "not a valid Jinja template (line 1"),
    ("   ", "the template is empty"),
])
def test_create_app_refuses_a_chat_template_that_cannot_render(make_manager, template, message):
    """A broken template is the server's configuration, refused when the app is built (as ``--chat-template`` is on
    the command line), not a 500 on every chat request."""
    pytest.importorskip("fastapi")
    from hf_rocketkv.serving import create_app

    with pytest.raises(ValueError, match=f"chat_template: {re.escape(message)}"):
        create_app(make_manager(), "tiny", chat_template=template)
