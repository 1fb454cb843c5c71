"""Prompts to token ids: plain text (the tokenizer's special tokens added, as generate() users do) and chat messages
(the tokenizer's chat template with the assistant turn opened; the template brings its own special tokens)."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from .errors import InvalidRequest

CHAT_ROLES = ("system", "developer", "user", "assistant")


def encode_text(tokenizer, text: str) -> list[int]:
    if tokenizer is None:
        raise InvalidRequest("this manager has no tokenizer: pass the prompt as token ids", "prompt")
    check_unicode(text, "prompt")
    return list(tokenizer(text, add_special_tokens=True)["input_ids"])


def encode_chat(tokenizer, messages: Sequence[dict[str, Any]], *, chat_template: str | None = None,
                add_generation_prompt: bool = True, add_special_tokens: bool = False) -> list[int]:
    """Token ids of ``messages`` ([{"role": ..., "content": str}]) through the chat template (``chat_template``, else
    the tokenizer's), ready for the reply (``add_generation_prompt``)."""
    if tokenizer is None:
        raise InvalidRequest("this manager has no tokenizer, so it cannot apply a chat template", "messages")
    if chat_template is None and not getattr(tokenizer, "chat_template", None):
        raise InvalidRequest("the model's tokenizer has no chat template; use /v1/completions (or start the server "
                             "with --chat-template)", "messages")
    check_messages(messages)
    from jinja2 import TemplateError

    try:
        text = tokenizer.apply_chat_template(list(messages), tokenize=False,
                                             add_generation_prompt=add_generation_prompt, chat_template=chat_template)
    except TemplateError as err:  # the template's raise_exception (roles that do not alternate, ...): the client's
        raise InvalidRequest(f"the chat template refused these messages: {err}", "messages") from None
    check_unicode(text, "messages")
    return list(tokenizer(text, add_special_tokens=add_special_tokens)["input_ids"])


def tokenize_ids(tokenizer, request, chat_template: str | None = None) -> list[int]:
    """The ids of a /tokenize request (``protocol.TokenizeRequest``): its prompt, or its messages through the chat
    template."""
    if request.messages is not None:
        return encode_chat(tokenizer, request.messages, chat_template=chat_template,
                           add_generation_prompt=request.add_generation_prompt,
                           add_special_tokens=request.add_special_tokens)
    if tokenizer is None:
        raise InvalidRequest("this server has no tokenizer", "prompt")
    check_unicode(request.prompt, "prompt")
    return list(tokenizer(request.prompt, add_special_tokens=request.add_special_tokens)["input_ids"])


def check_messages(messages: Any) -> None:
    """Messages must be a non-empty list of {"role": one of CHAT_ROLES, "content": str}."""
    if not isinstance(messages, list) or not messages:
        raise InvalidRequest("messages must be a non-empty list of {role, content} objects", "messages")
    for i, message in enumerate(messages):
        if not isinstance(message, dict):
            raise InvalidRequest(f"messages[{i}] must be an object with role and content", f"messages[{i}]")
        role = message.get("role")
        if role not in CHAT_ROLES:
            raise InvalidRequest(f"messages[{i}].role must be one of {list(CHAT_ROLES)}, got {role!r}",
                                 f"messages[{i}].role")
        if not isinstance(message.get("content"), str):
            raise InvalidRequest(f"messages[{i}].content must be a string", f"messages[{i}].content")
        extra = sorted(set(message) - {"role", "content", "name"})
        if extra:
            raise InvalidRequest(f"messages[{i}] has unsupported field(s) {extra}; allowed: role, content, name",
                                 f"messages[{i}]")


def check_unicode(text: str, param: str) -> None:
    """Text a tokenizer can encode: JSON's ``"\\ud800"`` escape gives Python a lone surrogate, which is no Unicode
    character (UTF-8 cannot encode it, and the tokenizer raised TypeError: the server answered 500)."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as err:
        raise InvalidRequest(f"{param} is not valid Unicode: a lone surrogate (U+{ord(text[err.start]):04X}) at "
                             f"character {err.start}", param) from None


def chat_template_error(text: str) -> str | None:
    """Why ``text`` is no chat template transformers can render (empty, or a Jinja syntax error with its line), or
    None: checked where a server is built, so a broken template is refused at start-up, not at every chat request."""
    if not isinstance(text, str) or not text.strip():
        return "the template is empty" if isinstance(text, str) else f"must be a string, got {type(text).__name__}"
    import jinja2
    import jinja2.ext
    import jinja2.sandbox

    try:  # the environment transformers renders chat templates in
        jinja2.sandbox.ImmutableSandboxedEnvironment(extensions=[jinja2.ext.loopcontrols]).parse(text)
    except jinja2.TemplateSyntaxError as err:
        return f"not a valid Jinja template (line {err.lineno}: {err.message})"
    return None
