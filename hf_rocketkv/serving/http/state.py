"""ServerState: what one HTTP app serves and answers with, one object per app (``app.state.server``).

The app's routes read it; ``start_when_ready`` (startup.py) swaps the built manager in through ``hand_over``. No
other code writes its fields.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field


@dataclass
class ServerState:
    """``manager``: the ``GenerationManager`` (a ``Starting`` until the build swaps it in); ``model_name``: the id
    /v1/models lists; ``model_ids``: every id a request may name (the name and its aliases); ``default_max_tokens``:
    a chat request's max_tokens when it gives none; ``max_body_bytes``: the largest request body read;
    ``chat_template``: a Jinja template used instead of the tokenizer's own; ``created``: /v1/models' Unix time."""

    manager: object
    model_name: str
    model_ids: frozenset[str]
    default_max_tokens: int
    max_body_bytes: int
    chat_template: str | None = None
    created: int = field(default_factory=lambda: int(time.time()))

    def hand_over(self, manager) -> None:
        """The built manager replaces the ``Starting`` (one reference assignment: a request sees one or the other)."""
        self.manager = manager


def server_state(app) -> ServerState:
    """The ``ServerState`` of an app made by ``create_app``."""
    return app.state.server
