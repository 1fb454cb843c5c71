"""What a request produces: a stream of ``GenerationOutput`` events, and a ``GenerationResult`` once finished.

    for out in manager.stream(request_id):       # one GenerationOutput per engine step (or text flush)
        print(out.text, end="")                   # the text delta since the previous event
    out.finish_reason                             # on the last event: stop, length, cancelled or error

Timestamps are ``time.monotonic()`` seconds (durations only): TTFT = first_token_at - queued_at; decode speed =
(completion tokens - 1) / (finished_at - first_token_at).
"""

from __future__ import annotations

import enum
from dataclasses import dataclass


class FinishReason(str, enum.Enum):
    """Why a request ended. ``stop``: a stop string or stop token id (EOS included); ``length``: max_tokens;
    ``cancelled``: cancel() (a client disconnect) or a non-draining stop(); ``error``: this request failed."""

    STOP = "stop"
    LENGTH = "length"
    CANCELLED = "cancelled"
    ERROR = "error"

    def __str__(self) -> str:
        return self.value


@dataclass(frozen=True)
class RequestTimings:
    """Monotonic timestamps of one request; None until reached."""

    queued_at: float
    first_token_at: float | None = None
    finished_at: float | None = None

    @property
    def ttft(self) -> float | None:
        """Seconds from add_request to the first new token."""
        return None if self.first_token_at is None else self.first_token_at - self.queued_at

    @property
    def latency(self) -> float | None:
        """Seconds from add_request to the end."""
        return None if self.finished_at is None else self.finished_at - self.queued_at

    def decode_tokens_per_s(self, completion_tokens: int) -> float | None:
        """Tokens after the first one per second of decoding (None with fewer than 2 tokens or no duration)."""
        if self.first_token_at is None or self.finished_at is None or completion_tokens < 2:
            return None
        elapsed = self.finished_at - self.first_token_at
        return (completion_tokens - 1) / elapsed if elapsed > 0 else None


@dataclass(frozen=True)
class GenerationOutput:
    """One event of a request's stream.

    token_ids          new token ids since the previous event (a stop token id that ended the request included)
    text               new text since the previous event (stop strings and stop tokens excluded; text that could
                       still begin a stop string is held back until it cannot)
    finish_reason      None while running; set on the request's last event
    error              the error message when finish_reason is ``error``
    prompt_tokens      tokens of the prompt
    completion_tokens  new tokens so far (cumulative)
    timings            timestamps so far
    """

    request_id: str
    token_ids: tuple[int, ...]
    text: str
    finish_reason: FinishReason | None
    prompt_tokens: int
    completion_tokens: int
    timings: RequestTimings
    error: str | None = None

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None


@dataclass(frozen=True)
class GenerationResult:
    """A finished request, all events joined: ``manager.result(id)`` and ``generate_batch`` return these."""

    request_id: str
    prompt_token_ids: tuple[int, ...]
    token_ids: tuple[int, ...]
    text: str
    finish_reason: FinishReason
    timings: RequestTimings
    error: str | None = None

    @property
    def completion_tokens(self) -> int:
        return len(self.token_ids)
