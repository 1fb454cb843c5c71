"""A server that listens while its engine warms up: /health answers 503 with the reason until it is ready.

    app = create_app(Starting(max_model_len, tokenizer, "capturing the decode graphs"), "model")
    ready = start_when_ready(app, lambda: GenerationManager(...))   # builds on its own thread, then swaps it in

Until the build returns, the app's manager (its ``ServerState``, state.py) is a ``Starting``: /health answers 503 ``{"status": "starting",
"reason": ...}`` and every other route but /v1/models 503 with an OpenAI-shaped error saying so (a load balancer or
a Kubernetes readiness probe sends no traffic yet). Once the manager is built it replaces the ``Starting``: /health
answers 200 ``{"status": "ok"}``. A build that fails leaves /health at 503 ``{"status": "failed", "reason": ...}``
and calls ``on_failure`` with the exception (``hf-rocketkv serve`` then stops the server and exits with 1).
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable

from .state import server_state

logger = logging.getLogger(__name__)


class Starting:
    """Stands in for the manager while it is built: what the app reads before any request (the context limit, the
    tokenizer) and why it is not ready."""

    def __init__(self, max_model_len: int, tokenizer=None, reason: str = "the engine is warming up"):
        self.max_model_len = int(max_model_len)
        self.tokenizer = tokenizer
        self.reason = reason
        self.status = "starting"
        self.since = time.monotonic()

    def healthy(self) -> bool:
        return False

    def health(self) -> dict:
        """The body of /health's 503."""
        return {"status": self.status, "reason": self.reason, "seconds": round(time.monotonic() - self.since, 1)}

    def stop(self, drain: bool = True, timeout: float | None = None) -> None:
        """Nothing runs yet (a stop before the build ends: the build's manager is stopped by its thread)."""

    def failed(self, err: BaseException) -> None:
        """The build raised: /health says so from now on."""
        self.status, self.reason = "failed", f"{type(err).__name__}: {err}"


def start_when_ready(app, build: Callable[[], object],
                     on_failure: Callable[[BaseException], None] | None = None) -> threading.Thread:
    """Run ``build()`` (returns the manager) on a thread of its own; its result replaces the ``Starting`` as the
    app's manager (``ServerState.hand_over``). Returns the (started) thread."""
    state = server_state(app)
    starting = state.manager
    if not isinstance(starting, Starting):
        raise TypeError(f"start_when_ready: the app's manager must be a Starting, got {type(starting).__name__}")

    def run() -> None:
        try:
            manager = build()
        except BaseException as err:  # noqa: BLE001 - reported on /health and to on_failure
            starting.failed(err)
            logger.error("hf_rocketkv server: the engine failed to start: %s", starting.reason)
            if on_failure is not None:
                on_failure(err)
            return
        state.hand_over(manager)
        logger.info("hf_rocketkv server: ready after %.1f s (%s)", time.monotonic() - starting.since,
                    starting.reason)

    thread = threading.Thread(target=run, name="hf-rocketkv-startup", daemon=True)
    thread.start()
    return thread
