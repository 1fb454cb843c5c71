"""An OpenAI-compatible HTTP server over a GenerationManager (FastAPI; ``pip install hf_rocketkv[serve]``).

    app = create_app(manager, "smollm2")        # then: uvicorn.run(app, host="127.0.0.1", port=8000)

    POST /v1/completions, /v1/chat/completions   streaming (SSE ``data: {...}`` chunks, ``data: [DONE]``) or not
    POST /tokenize, /detokenize                  vLLM's: text or messages to token ids, token ids to text
    GET  /v1/models, /health, /metrics           model list; 200/503 (503 with the reason while starting:
                                                 serving/http/startup.py); Prometheus text

Every error, on every route, is OpenAI-shaped, ``{"error": {"message", "type", "param", "code"}}``: 400 invalid
request (prompt longer than the context, bad or unsupported parameters), 401 a missing or wrong API key (with
``api_key``: every route but /health and /metrics wants ``Authorization: Bearer KEY``), 404 an unknown model
(``model_not_found``) or route, 405 a route asked with another method, 429 queue full (the request was not admitted),
503 stopped, 500 a failure inside the request. A client that disconnects gets its request cancelled (the engine
stops it within one step and frees its cache and pages). The app keeps what it serves in one ``ServerState``
(``app.state.server``, state.py).
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
from collections.abc import AsyncIterator, Callable
from typing import Any

from .deps import require_serve_deps

require_serve_deps()  # a clear "pip install hf_rocketkv[serve]" instead of a bare ModuleNotFoundError

import anyio
from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response
from starlette.concurrency import run_in_threadpool
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.requests import ClientDisconnect
from starlette.responses import StreamingResponse

from ..errors import EngineStopped, InvalidRequest, Overloaded
from ..outputs import FinishReason
from ..prompts import chat_template_error, encode_chat, encode_text, tokenize_ids
from .protocol import (
    CHAT_DEFAULT_MAX_TOKENS,
    ParsedRequest,
    chat_body,
    chat_chunk,
    completion_body,
    error_body,
    parse_chat_request,
    parse_completion_request,
    parse_detokenize_request,
    parse_tokenize_request,
    usage,
)
from .startup import Starting
from .state import ServerState, server_state

logger = logging.getLogger(__name__)

DISCONNECT_POLL_S = 0.2  # how often a non-streaming request checks that its client is still there


OPEN_PATHS = ("/health", "/metrics")  # answered without the API key (probes, Prometheus), as vLLM does


def max_body_bytes(max_model_len: int) -> int:
    """The largest request body read: 64 bytes per token of the context (a JSON-escaped character takes up to 6
    bytes, a token a few characters) plus 64 KiB for the other fields. A larger one is refused with 413 unread,
    instead of being read whole and tokenized only to be refused as longer than the context."""
    return 64 * max_model_len + (64 << 10)


def create_app(manager, model_name: str, *, default_max_tokens: int = CHAT_DEFAULT_MAX_TOKENS,
               aliases: tuple[str, ...] = (), api_key: str | None = None, chat_template: str | None = None):
    """The FastAPI app serving ``manager`` under the model id ``model_name``.

    ``default_max_tokens``: max_tokens of a chat request that gives none (capped by the rest of the context).
    Completions without max_tokens get OpenAI's 16. ``api_key``: every route but /health and /metrics wants
    ``Authorization: Bearer <api_key>`` (401 otherwise). ``chat_template``: a Jinja chat template used instead of the
    tokenizer's own (chat completions, /tokenize with messages).
    """
    if not isinstance(default_max_tokens, int) or isinstance(default_max_tokens, bool) or default_max_tokens < 1:
        raise ValueError(f"default_max_tokens must be an integer >= 1, got {default_max_tokens!r}")
    if api_key is not None and (not isinstance(api_key, str) or not api_key):
        raise ValueError("api_key must be a non-empty string, or None for no key")
    template_error = chat_template_error(chat_template) if chat_template is not None else None
    if template_error is not None:
        raise ValueError(f"chat_template: {template_error}")
    app = FastAPI(title="hf_rocketkv", description="RocketKV KV-cache compression, OpenAI-compatible API")
    state = ServerState(manager, model_name, frozenset((model_name, *aliases)), default_max_tokens,
                        max_body_bytes(manager.max_model_len), chat_template)
    app.state.server = state
    _openai_errors(app)
    _answer_while_starting(app)
    if api_key is not None:
        _require_api_key(app, api_key)

    @app.post("/v1/completions")
    async def completions(request: Request):
        return await _guard(lambda: _generate(request, state, chat=False))

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request):
        return await _guard(lambda: _generate(request, state, chat=True))

    @app.get("/v1/models")
    async def models():
        return {"object": "list", "data": [{"id": model_name, "object": "model", "created": state.created,
                                            "owned_by": "hf_rocketkv"}]}

    @app.get("/v1/models/{model_id:path}")
    async def model(model_id: str):
        if model_id not in state.model_ids:
            return JSONResponse(error_body(f"model {model_id!r} does not exist", "invalid_request_error", "model",
                                           "model_not_found"), status_code=404)
        return {"id": model_name, "object": "model", "created": state.created, "owned_by": "hf_rocketkv"}

    @app.post("/tokenize")
    async def tokenize(request: Request):
        return await _guard(lambda: _tokenize(request, state))

    @app.post("/detokenize")
    async def detokenize(request: Request):
        return await _guard(lambda: _detokenize(request, state))

    @app.get("/health")
    async def health():
        current = state.manager
        if isinstance(current, Starting):
            return JSONResponse(current.health(), status_code=503)
        if current.healthy():
            return {"status": "ok"}
        return JSONResponse({"status": "unavailable"}, status_code=503)

    @app.get("/metrics")
    async def metrics():
        from .prometheus import render

        body, content_type = render(state.manager)
        return Response(body, media_type=content_type)

    return app


# ------------------------------------------------------------------------------------------------ errors
HTTP_ERROR_CODES = {401: "unauthorized", 403: "forbidden", 404: "not_found", 405: "method_not_allowed",
                    413: "request_too_large", 415: "unsupported_media_type"}


def _openai_errors(app) -> None:
    """Starlette's own errors (unknown route 404, wrong method 405, FastAPI's validation 422) in OpenAI's shape too,
    instead of FastAPI's ``{"detail": ...}``."""

    @app.exception_handler(StarletteHTTPException)
    async def http_error(request, exc: StarletteHTTPException):
        if exc.status_code == 404:
            message = f"no route {request.method} {request.url.path}; see GET /v1/models, POST /v1/completions, " \
                      f"/v1/chat/completions, /tokenize, /detokenize"
        elif exc.status_code == 405:
            message = f"{request.method} is not allowed on {request.url.path}"
        else:
            message = str(exc.detail)
        return JSONResponse(error_body(message, "invalid_request_error", None,
                                       HTTP_ERROR_CODES.get(exc.status_code, "http_error")),
                            status_code=exc.status_code, headers=getattr(exc, "headers", None))

    @app.exception_handler(RequestValidationError)
    async def validation_error(request, exc: RequestValidationError):
        errors = exc.errors()
        first = errors[0] if errors else {}
        where = ".".join(str(part) for part in first.get("loc", ()) if part != "body") or None
        message = f"{where}: {first.get('msg', 'invalid request')}" if where else first.get("msg", "invalid request")
        return JSONResponse(error_body(message, "invalid_request_error", where, "invalid_value"), status_code=422)


def _answer_while_starting(app) -> None:
    """While the app's manager is a ``Starting`` (serving/http/startup.py), every route but /health and the model
    list answers 503 with the reason (nothing could run yet)."""
    app.add_middleware(_StartingGate)


class _StartingGate:
    """ASGI middleware of ``_answer_while_starting``. A plain ASGI one, not ``@app.middleware("http")``: that wraps
    the request's receive channel, and an endpoint would no longer see its client disconnect."""

    def __init__(self, app):
        self.app = app

    async def __call__(self, scope, receive, send):
        current = server_state(scope["app"]).manager if scope["type"] == "http" else None
        path = scope.get("path", "")
        if not isinstance(current, Starting) or path == "/health" or path.startswith("/v1/models"):
            await self.app(scope, receive, send)
            return
        response = JSONResponse(error_body(f"the server is starting ({current.reason}): retry once /health answers "
                                           f"200", "service_unavailable", None, "starting"),
                                status_code=503, headers={"Retry-After": "5"})
        await response(scope, receive, send)


def _require_api_key(app, api_key: str) -> None:
    """Every route but OPEN_PATHS answers 401 without ``Authorization: Bearer <api_key>`` (compared in constant
    time)."""
    import hmac

    expected = f"Bearer {api_key}".encode()

    @app.middleware("http")
    async def check_key(request: Request, call_next):
        if request.url.path in OPEN_PATHS:
            return await call_next(request)
        given = request.headers.get("authorization", "").encode()
        if not hmac.compare_digest(given, expected):
            return JSONResponse(error_body("a valid API key is required: send the header 'Authorization: Bearer "
                                           "<key>' (the key given to --api-key)", "invalid_request_error", None,
                                           "invalid_api_key"),
                                status_code=401, headers={"WWW-Authenticate": "Bearer"})
        return await call_next(request)


async def _guard(handler: Callable):
    """Run an endpoint; every failure becomes an OpenAI-shaped error response, never an unhandled exception."""
    try:
        return await handler()
    except InvalidRequest as err:
        return JSONResponse(error_body(err.message, "invalid_request_error", err.param, err.code),
                            status_code=err.status)
    except Overloaded as err:
        return JSONResponse(error_body(str(err), "rate_limit_error", None, "overloaded"), status_code=429,
                            headers={"Retry-After": "1"})
    except EngineStopped as err:
        return JSONResponse(error_body(str(err), "service_unavailable", None, "engine_stopped"), status_code=503)
    except Exception as err:  # a bug in one request must not take the server down
        logger.exception("hf_rocketkv server: request failed")
        return JSONResponse(error_body(f"internal error: {type(err).__name__}: {err}", "server_error", None,
                                       "internal_error"), status_code=500)


# ------------------------------------------------------------------------------------------------ generation
async def _generate(request, state: ServerState, chat: bool):
    manager, model_name = state.manager, state.model_name
    body = await _json_body(request, state.max_body_bytes)
    parsed = parse_chat_request(body) if chat else parse_completion_request(body)
    _check_model(state, parsed.model)
    prompt_ids = await run_in_threadpool(_prompt_ids, manager, parsed, state.chat_template)  # long prompts: slow
    params = parsed.sampling_params(len(prompt_ids), manager.max_model_len, state.default_max_tokens)
    request_id = manager.add_request(prompt_ids, params)
    prefix = "chatcmpl-" if chat else "cmpl-"
    reply = _Reply(prefix + request_id, int(time.time()), model_name, chat)
    if parsed.stream:
        return _EventStream(_sse(manager, request_id, reply, parsed.include_usage), manager, request_id)
    return await _complete(request, manager, request_id, reply)


async def _json_body(request, limit: int) -> Any:
    """The body as JSON; one over ``limit`` bytes is refused (413) before it is read whole or tokenized."""
    declared = request.headers.get("content-length", "")
    size, chunks = int(declared) if declared.isdigit() else 0, []
    if size <= limit:
        size = 0
        try:
            async for chunk in request.stream():
                size += len(chunk)
                if size > limit:
                    break
                chunks.append(chunk)
        except ClientDisconnect:  # gone before its body ended: nobody reads the answer, and nothing failed here
            raise InvalidRequest("the client disconnected before its body ended", None, "client_disconnected")
    if size > limit:
        raise InvalidRequest(f"the request body has more than {limit} bytes, more than any prompt this server's "
                             f"context holds", None, "request_too_large", status=413)
    try:
        return json.loads(b"".join(chunks))
    except (json.JSONDecodeError, UnicodeDecodeError) as err:
        raise InvalidRequest(f"the request body is not valid JSON: {err}", None, "invalid_json") from err


def _check_model(state: ServerState, model: str | None) -> None:
    if model is not None and model not in state.model_ids:
        raise InvalidRequest(f"model {model!r} does not exist; this server serves {state.model_name!r}", "model",
                             "model_not_found", status=404)  # as OpenAI and vLLM answer an unknown model


def _prompt_ids(manager, parsed: ParsedRequest, chat_template: str | None = None) -> list[int]:
    if parsed.messages is not None:
        return encode_chat(manager.tokenizer, parsed.messages, chat_template=chat_template)
    if isinstance(parsed.prompt, str):
        return encode_text(manager.tokenizer, parsed.prompt)
    return list(parsed.prompt)


async def _tokenize(request, state: ServerState):
    """vLLM's /tokenize: ``{"prompt"}`` or ``{"messages"}`` to ``{"count", "max_model_len", "tokens",
    "token_strs"}``."""
    parsed = parse_tokenize_request(await _json_body(request, state.max_body_bytes))
    _check_model(state, parsed.model)
    manager = state.manager
    ids = await run_in_threadpool(tokenize_ids, manager.tokenizer, parsed, state.chat_template)
    strings = None
    if parsed.return_token_strs:
        strings = manager.tokenizer.convert_ids_to_tokens(ids)
    return {"count": len(ids), "max_model_len": manager.max_model_len, "tokens": ids, "token_strs": strings}


async def _detokenize(request, state: ServerState):
    """vLLM's /detokenize: ``{"tokens"}`` to ``{"prompt"}`` (the text, special tokens included, as vLLM gives it)."""
    parsed = parse_detokenize_request(await _json_body(request, state.max_body_bytes))
    _check_model(state, parsed.model)
    tokenizer = state.manager.tokenizer
    if tokenizer is None:
        raise InvalidRequest("this server has no tokenizer", "tokens")
    vocab = len(tokenizer)
    bad = [t for t in parsed.tokens if not 0 <= t < vocab]
    if bad:
        raise InvalidRequest(f"token id(s) {bad[:5]} outside the vocabulary [0, {vocab})", "tokens")
    return {"prompt": tokenizer.decode(parsed.tokens)}


class _Reply:
    """Builds one request's response bodies (completion or chat, whole or chunk)."""

    def __init__(self, response_id: str, created: int, model: str, chat: bool):
        self.id, self.created, self.model, self.chat = response_id, created, model, chat
        self._role_sent = False

    def whole(self, text: str, finish_reason: str, usage_: dict) -> dict:
        builder = chat_body if self.chat else completion_body
        return builder(self.id, self.created, self.model, text, finish_reason, usage_)

    def chunk(self, text: str, finish_reason: str | None) -> dict:
        if not self.chat:
            return completion_body(self.id, self.created, self.model, text, finish_reason, chunk=True)
        delta = {"content": text}
        if not self._role_sent:  # the first chunk carries the role, as OpenAI's do
            delta = {"role": "assistant", **delta}
            self._role_sent = True
        return chat_chunk(self.id, self.created, self.model, delta, finish_reason)

    def usage_chunk(self, usage_: dict) -> dict:
        if self.chat:
            return chat_chunk(self.id, self.created, self.model, None, None, usage_)
        return {"id": self.id, "object": "text_completion", "created": self.created, "model": self.model,
                "choices": [], "usage": usage_}


def _failure(reason: FinishReason, error: str | None) -> tuple[int, dict]:
    """HTTP status and error body for a request that ended cancelled (server stopping) or failed."""
    if reason is FinishReason.CANCELLED:
        return 503, error_body(error or "the request was cancelled (the server is stopping)", "service_unavailable",
                               None, "cancelled")
    return 500, error_body(f"generation failed: {error}", "server_error", None, "generation_error")


async def _complete(request, manager, request_id: str, reply: _Reply):
    """Non-streaming: gather the outputs; a client that leaves meanwhile cancels the request."""
    watcher = asyncio.ensure_future(_cancel_on_disconnect(request, manager, request_id))
    text, last = [], None
    try:
        async for output in manager.astream(request_id):
            text.append(output.text)
            last = output
    finally:
        watcher.cancel()
    if last.finish_reason in (FinishReason.CANCELLED, FinishReason.ERROR):
        status, body = _failure(last.finish_reason, last.error)
        return JSONResponse(body, status_code=status)
    return reply.whole("".join(text), last.finish_reason.value, usage(last.prompt_tokens, last.completion_tokens))


async def _cancel_on_disconnect(request, manager, request_id: str) -> None:
    while True:
        if await request.is_disconnected():
            manager.cancel(request_id)
            return
        await asyncio.sleep(DISCONNECT_POLL_S)


async def _sse(manager, request_id: str, reply: _Reply, include_usage: bool) -> AsyncIterator[str]:
    """Server-sent events: one chunk per output with text (and the final one), then usage if asked, then [DONE]."""
    stream = manager.astream(request_id)
    try:
        async for output in stream:
            if output.finish_reason in (FinishReason.CANCELLED, FinishReason.ERROR):
                yield _event(_failure(output.finish_reason, output.error)[1])
                break
            if output.text or output.finished:
                finish = output.finish_reason.value if output.finished else None
                yield _event(reply.chunk(output.text, finish))
            if output.finished and include_usage:
                yield _event(reply.usage_chunk(usage(output.prompt_tokens, output.completion_tokens)))
        yield "data: [DONE]\n\n"
    finally:
        await stream.aclose()  # leaving early (client gone) cancels the request and drops its record


def _event(body: dict) -> str:
    return f"data: {json.dumps(body, ensure_ascii=False)}\n\n"


class _EventStream(StreamingResponse):
    """SSE that, however the response ends (done, client gone, send failed), cancels the request and closes its
    event generator, so the engine stops within one step and frees the request's cache and pages."""

    media_type = "text/event-stream"

    def __init__(self, content: AsyncIterator[str], manager, request_id: str):
        super().__init__(content, headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})
        self._manager = manager
        self._request_id = request_id

    async def __call__(self, scope, receive, send) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            self._manager.cancel(self._request_id)  # a no-op when it finished
            with anyio.CancelScope(shield=True):
                await self.body_iterator.aclose()
