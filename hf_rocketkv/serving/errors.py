"""The serving layer's exceptions. Each one says what happened and what is allowed; the server maps them to HTTP.

    InvalidRequest   a request we cannot serve as asked (bad field, prompt too long, unsupported option) -> 400
    Overloaded       the engine's waiting queue is full -> 429 (the caller may retry later)
    EngineStopped    the manager / engine was stopped and admits nothing new -> 503
    UnknownRequest   no such request id (never added, or already consumed) -> 404
    ServeDependencyError   FastAPI / uvicorn / prometheus-client missing (``pip install hf_rocketkv[serve]``)
"""

from __future__ import annotations


class InvalidRequest(ValueError):
    """A request that cannot be served as asked.

    ``param`` names the offending field (OpenAI's ``error.param``, e.g. ``"max_tokens"``), ``code`` is a short
    machine-readable reason (``"invalid_value"``, ``"context_length_exceeded"``, ``"model_not_found"``, ...).
    """

    def __init__(self, message: str, param: str | None = None, code: str = "invalid_value", status: int = 400):
        super().__init__(message)
        self.message = message
        self.param = param
        self.code = code
        self.status = status  # the HTTP status the server answers with (413: a request body over the limit)


class Overloaded(RuntimeError):
    """The engine's waiting queue is full: the request was not admitted (nothing about it is kept)."""

    def __init__(self, waiting: int, max_queue: int):
        self.waiting = waiting
        self.max_queue = max_queue
        super().__init__(
            f"server overloaded: {waiting} requests already wait for the engine (max_queue={max_queue}); "
            f"retry later"
        )


class EngineStopped(RuntimeError):
    """The manager or its engine was stopped (or its thread is gone): no new request is admitted."""


class UnknownRequest(KeyError):
    """No request with this id is known to the manager (never added, or its outputs were already consumed)."""

    def __init__(self, request_id: str):
        self.request_id = request_id
        super().__init__(request_id)

    def __str__(self) -> str:
        return f"no request with id {self.request_id!r} (never added, or its final output was already read)"


class ServeDependencyError(ImportError):
    """The HTTP server's optional dependencies are not installed."""
