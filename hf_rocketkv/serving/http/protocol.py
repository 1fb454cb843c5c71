"""The OpenAI wire format: request bodies parsed and validated, response bodies built. No web framework here.

Parsing is strict: a field we do not know, or a known one used in a way we cannot honour (n != 1, logprobs,
penalties, tools, echo, ...), raises ``InvalidRequest`` naming it (the server answers 400), rather than being
silently ignored. Extensions beside OpenAI's fields (vLLM names): ``top_k``, ``stop_token_ids``, ``ignore_eos``.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from ..errors import InvalidRequest
from ..sampling import SamplingParams

COMPLETION_DEFAULT_MAX_TOKENS = 16  # OpenAI's default for /v1/completions
# Chat without max_tokens: this cap or the rest of the context, whichever is smaller. A cap, because a RocketKV cache
# preallocates decode slots for max_tokens: "the rest of a 128k context" would reserve 128k slots per request.
CHAT_DEFAULT_MAX_TOKENS = 4096

SAMPLING_FIELDS = ("temperature", "top_p", "top_k", "stop", "stop_token_ids", "seed", "ignore_eos")
COMMON_FIELDS = frozenset({
    "model", "max_tokens", "n", "stream", "stream_options", "user", "logprobs", "presence_penalty",
    "frequency_penalty", "logit_bias", *SAMPLING_FIELDS,
})
COMPLETION_FIELDS = COMMON_FIELDS | {"prompt", "echo", "best_of", "suffix"}
CHAT_FIELDS = COMMON_FIELDS | {
    "messages", "max_completion_tokens", "top_logprobs", "response_format", "tools", "tool_choice",
    "parallel_tool_calls",
}
# vLLM's /tokenize (a prompt, or chat messages through the template) and /detokenize
TOKENIZE_FIELDS = frozenset({"model", "prompt", "messages", "add_special_tokens", "add_generation_prompt",
                             "return_token_strs"})
DETOKENIZE_FIELDS = frozenset({"model", "tokens"})


@dataclass(frozen=True)
class ParsedRequest:
    """A validated /v1/completions or /v1/chat/completions body.

    prompt            completions: a string or a list of token ids; chat: None
    messages          chat: the messages (text content); completions: None
    max_tokens        None: the endpoint's default (completions 16; chat min(chat_default, the rest of the context))
    sampling          SamplingParams fields other than max_tokens
    """

    model: str
    stream: bool
    include_usage: bool
    max_tokens: int | None
    sampling: dict[str, Any]
    prompt: str | list[int] | None = None
    messages: list[dict[str, str]] | None = None

    def sampling_params(self, prompt_len: int, max_model_len: int,
                        chat_default: int = CHAT_DEFAULT_MAX_TOKENS) -> SamplingParams:
        """SamplingParams once the prompt is tokenized (the endpoint's default max_tokens filled in)."""
        max_tokens = self.max_tokens
        if max_tokens is None and self.messages is None:
            max_tokens = COMPLETION_DEFAULT_MAX_TOKENS
        elif max_tokens is None:
            max_tokens = max(1, min(chat_default, max_model_len - prompt_len))
        return SamplingParams(max_tokens=max_tokens, **self.sampling)


# ------------------------------------------------------------------------------------------------ parsing
def parse_completion_request(body: Any) -> ParsedRequest:
    body = _check_body(body, COMPLETION_FIELDS)
    for name, allowed in (("echo", (None, False)), ("best_of", (None, 1)), ("suffix", (None, ""))):
        if not _one_of(body.get(name), allowed):
            raise InvalidRequest(f"{name}={body[name]!r} is not supported (allowed: {_show(allowed)})", name,
                                 "unsupported_value")
    if body.get("logprobs") is not None:
        raise InvalidRequest("logprobs is not supported (allowed: null)", "logprobs", "unsupported_value")
    return ParsedRequest(prompt=_completion_prompt(body.get("prompt")), max_tokens=_max_tokens(body, "max_tokens"),
                         **_common(body))


def parse_chat_request(body: Any) -> ParsedRequest:
    body = _check_body(body, CHAT_FIELDS)
    if not _one_of(body.get("logprobs"), (None, False)) or body.get("top_logprobs") is not None:
        raise InvalidRequest("logprobs / top_logprobs are not supported", "logprobs", "unsupported_value")
    if not _one_of(body.get("tools"), (None, [])) or not _one_of(body.get("tool_choice"), (None, "none")):
        raise InvalidRequest("tools and tool_choice are not supported", "tools", "unsupported_value")
    response_format = body.get("response_format")
    if response_format is not None and response_format != {"type": "text"}:
        raise InvalidRequest("response_format: only {\"type\": \"text\"} is supported", "response_format",
                             "unsupported_value")
    max_tokens = _max_tokens(body, "max_completion_tokens")
    if max_tokens is None:
        max_tokens = _max_tokens(body, "max_tokens")
    return ParsedRequest(messages=_chat_messages(body.get("messages")), max_tokens=max_tokens, **_common(body))


def _check_body(body: Any, allowed: frozenset[str]) -> dict[str, Any]:
    if not isinstance(body, dict):
        raise InvalidRequest("the request body must be a JSON object", None, "invalid_json")
    unknown = sorted(set(body) - allowed)
    if unknown:
        raise InvalidRequest(f"unsupported field(s) {unknown}; allowed: {sorted(allowed)}", unknown[0],
                             "unsupported_field")
    return body


def _one_of(value: Any, allowed: tuple) -> bool:
    """``value in allowed`` with JSON's types kept apart: Python counts ``False == 0`` and ``True == 1``, JSON does
    not (``"n": true`` or ``"presence_penalty": false`` is a wrong type, not the number 1 or 0)."""
    return any(value is option or (type(value) is type(option) and value == option) for option in allowed)


def _common(body: dict[str, Any]) -> dict[str, Any]:
    model = body.get("model")
    if not isinstance(model, str) or not model:
        raise InvalidRequest("model is required (a string: see GET /v1/models)", "model")
    if not _one_of(body.get("n"), (None, 1)):
        raise InvalidRequest(f"n must be 1 (one choice per request), got {body['n']!r}", "n", "unsupported_value")
    for name in ("presence_penalty", "frequency_penalty"):
        if not _one_of(body.get(name), (None, 0, 0.0)):
            raise InvalidRequest(f"{name} is not supported (allowed: 0 or null), got {body[name]!r}", name,
                                 "unsupported_value")
    if not _one_of(body.get("logit_bias"), (None, {})):
        raise InvalidRequest("logit_bias is not supported (allowed: null or {})", "logit_bias", "unsupported_value")
    stream = body.get("stream", False)
    if stream is None:
        stream = False
    if not isinstance(stream, bool):
        raise InvalidRequest(f"stream must be true or false, got {stream!r}", "stream")
    include_usage = _include_usage(body.get("stream_options"))
    if body.get("stream_options") is not None and not stream:  # OpenAI and vLLM answer 400 too
        raise InvalidRequest("stream_options is only allowed with stream: true", "stream_options")
    return dict(model=model, stream=stream, include_usage=include_usage, sampling=_sampling_fields(body))


def _sampling_fields(body: dict[str, Any]) -> dict[str, Any]:
    """The SamplingParams fields present (None means "the default"); SamplingParams validates the values."""
    fields = {name: body[name] for name in SAMPLING_FIELDS if body.get(name) is not None}
    if fields.get("top_k") == -1:  # vLLM's spelling of "no limit"
        fields["top_k"] = 0
    if "stop_token_ids" in fields and isinstance(fields["stop_token_ids"], list):
        fields["stop_token_ids"] = tuple(fields["stop_token_ids"])
    SamplingParams(**fields)  # validate now, with a placeholder max_tokens, so errors name the field early
    return fields


def _include_usage(options: Any) -> bool:
    if options is None:
        return False
    if not isinstance(options, dict) or set(options) - {"include_usage"}:
        raise InvalidRequest("stream_options must be an object with only include_usage", "stream_options")
    value = options.get("include_usage", False)
    if not isinstance(value, bool):
        raise InvalidRequest("stream_options.include_usage must be true or false", "stream_options")
    return value


def _max_tokens(body: dict[str, Any], name: str) -> int | None:
    value = body.get(name)
    if value is None:
        return None
    if not isinstance(value, int) or isinstance(value, bool) or value < 1:
        raise InvalidRequest(f"{name} must be an integer >= 1, got {value!r}", name)
    return value


def _completion_prompt(prompt: Any) -> str | list[int]:
    """A string, or token ids; a list of one of those is unwrapped (several prompts: one request each)."""
    if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], (str, list)):
        prompt = prompt[0]
    if isinstance(prompt, str):
        if not prompt:
            raise InvalidRequest("prompt must not be empty", "prompt")
        return prompt
    if isinstance(prompt, list) and prompt and all(isinstance(t, int) and not isinstance(t, bool) for t in prompt):
        return prompt
    if isinstance(prompt, list) and len(prompt) > 1 and all(isinstance(p, (str, list)) for p in prompt):
        raise InvalidRequest("one prompt per request is supported; send several requests", "prompt",
                             "unsupported_value")
    raise InvalidRequest("prompt is required: a non-empty string or a non-empty list of token ids", "prompt")


def _chat_messages(messages: Any) -> list[dict[str, str]]:
    """Messages with string content; content given as a list of text parts is joined."""
    if not isinstance(messages, list) or not messages:
        raise InvalidRequest("messages is required: a non-empty list of {role, content} objects", "messages")
    out = []
    for i, message in enumerate(messages):
        if isinstance(message, dict) and isinstance(message.get("content"), list):
            message = {**message, "content": _text_parts(message["content"], i)}
        out.append(message)
    return out


def _text_parts(parts: list[Any], index: int) -> str:
    texts = []
    for part in parts:
        if not isinstance(part, dict) or part.get("type") != "text" or not isinstance(part.get("text"), str):
            raise InvalidRequest(f"messages[{index}].content: only text parts are supported",
                                 f"messages[{index}].content", "unsupported_value")
        texts.append(part["text"])
    return "".join(texts)


def _show(values: tuple) -> str:
    return " or ".join("null" if v is None else repr(v) for v in values)


@dataclass(frozen=True)
class TokenizeRequest:
    """A validated /tokenize body: ``prompt`` or ``messages``, with vLLM's defaults (special tokens added to a prompt
    and not to messages, whose template brings its own; the assistant turn opened after messages)."""

    model: str | None
    prompt: str | None
    messages: list[dict[str, str]] | None
    add_special_tokens: bool
    add_generation_prompt: bool
    return_token_strs: bool


@dataclass(frozen=True)
class DetokenizeRequest:
    model: str | None
    tokens: list[int]


def parse_tokenize_request(body: Any) -> TokenizeRequest:
    body = _check_body(body, TOKENIZE_FIELDS)
    model = _optional_model(body)
    has_prompt, has_messages = body.get("prompt") is not None, body.get("messages") is not None
    if has_prompt == has_messages:
        raise InvalidRequest("give either prompt (a string) or messages (a list of {role, content}), not both",
                             "messages" if has_messages else "prompt")
    if has_prompt and not isinstance(body["prompt"], str):
        raise InvalidRequest("prompt must be a string", "prompt")
    flags = {name: _flag(body, name, default) for name, default in (
        ("add_special_tokens", has_prompt), ("add_generation_prompt", True), ("return_token_strs", False))}
    return TokenizeRequest(model=model, prompt=body.get("prompt"),
                           messages=_chat_messages(body["messages"]) if has_messages else None, **flags)


def parse_detokenize_request(body: Any) -> DetokenizeRequest:
    body = _check_body(body, DETOKENIZE_FIELDS)
    tokens = body.get("tokens")
    if not isinstance(tokens, list) or not all(isinstance(t, int) and not isinstance(t, bool) for t in tokens):
        raise InvalidRequest("tokens is required: a list of token ids", "tokens")
    return DetokenizeRequest(model=_optional_model(body), tokens=tokens)


def _optional_model(body: dict[str, Any]) -> str | None:
    model = body.get("model")
    if model is not None and (not isinstance(model, str) or not model):
        raise InvalidRequest("model must be a string (see GET /v1/models) or left out", "model")
    return model


def _flag(body: dict[str, Any], name: str, default: bool) -> bool:
    value = body.get(name)
    if value is None:
        return default
    if not isinstance(value, bool):
        raise InvalidRequest(f"{name} must be true or false, got {value!r}", name)
    return value


# ------------------------------------------------------------------------------------------------ responses
def usage(prompt_tokens: int, completion_tokens: int) -> dict[str, int]:
    return {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens}


def completion_body(response_id: str, created: int, model: str, text: str, finish_reason: str | None,
                    usage_: dict | None = None, chunk: bool = False) -> dict[str, Any]:
    body = {
        "id": response_id, "object": "text_completion", "created": created, "model": model,
        "choices": [{"index": 0, "text": text, "logprobs": None, "finish_reason": finish_reason}],
    }
    if usage_ is not None or not chunk:
        body["usage"] = usage_
    return body


def chat_body(response_id: str, created: int, model: str, text: str, finish_reason: str | None,
              usage_: dict | None = None) -> dict[str, Any]:
    return {
        "id": response_id, "object": "chat.completion", "created": created, "model": model,
        "choices": [{"index": 0, "message": {"role": "assistant", "content": text}, "logprobs": None,
                     "finish_reason": finish_reason}],
        "usage": usage_,
    }


def chat_chunk(response_id: str, created: int, model: str, delta: dict[str, str] | None,
               finish_reason: str | None, usage_: dict | None = None) -> dict[str, Any]:
    choices = [] if delta is None else [{"index": 0, "delta": delta, "logprobs": None,
                                          "finish_reason": finish_reason}]
    body = {"id": response_id, "object": "chat.completion.chunk", "created": created, "model": model,
            "choices": choices}
    if usage_ is not None:
        body["usage"] = usage_
    return body


def error_body(message: str, type_: str, param: str | None = None, code: str | None = None) -> dict[str, Any]:
    return {"error": {"message": message, "type": type_, "param": param, "code": code}}
