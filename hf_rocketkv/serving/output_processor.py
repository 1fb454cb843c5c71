"""RequestOutputProcessor: turns one request's engine events into ``GenerationOutput`` records.

It owns what is per request and independent of the engine: the text (incremental detokenization), stop strings
(the text ends before the first one; the manager then sets the request's cancel flag so the engine stops within a
step), stop token ids kept out of the text, cumulative counts and timestamps. Not thread-safe: the manager calls it
under the request's lock.
"""

from __future__ import annotations

import time
from collections.abc import Sequence

from .detokenizer import IncrementalDetokenizer
from .outputs import FinishReason, GenerationOutput, GenerationResult, RequestTimings
from .stop_strings import StopStringMatcher


class RequestOutputProcessor:
    """State of one request's output; ``on_tokens`` / ``on_finish`` return the event to hand to its consumer."""

    def __init__(self, request_id: str, prompt_ids: Sequence[int], stop: Sequence[str],
                 stop_token_ids: frozenset[int], tokenizer=None, queued_at: float | None = None):
        self.request_id = request_id
        self.prompt_ids = tuple(prompt_ids)
        self.stop_token_ids = stop_token_ids
        self._detokenizer = IncrementalDetokenizer(tokenizer, prompt_ids) if tokenizer is not None else None
        self._matcher = StopStringMatcher(stop)
        self.token_ids: list[int] = []
        self.text = ""  # every character produced so far (cut at a stop string)
        self._sent = 0  # characters of self.text already handed out
        self.finish_reason: FinishReason | None = None
        self.error: str | None = None
        self.queued_at = time.monotonic() if queued_at is None else queued_at
        self.first_token_at: float | None = None
        self.finished_at: float | None = None

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None

    def timings(self) -> RequestTimings:
        return RequestTimings(self.queued_at, self.first_token_at, self.finished_at)

    def on_tokens(self, token_ids: Sequence[int]) -> GenerationOutput:
        """New tokens; the output is final (finish_reason ``stop``) when they complete a stop string."""
        if self.finished:
            raise RuntimeError(f"request {self.request_id}: tokens after the end")
        now = time.monotonic()
        if self.first_token_at is None:
            self.first_token_at = now
        self.token_ids.extend(token_ids)
        text_ids = [t for t in token_ids if t not in self.stop_token_ids]  # a stop id ends the request: no text
        if self._detokenizer is not None and text_ids:
            self._append_text(self._detokenizer.add(text_ids))
        if self.finished:
            self.finished_at = now
        return self._output(tuple(token_ids))

    def on_finish(self, reason: FinishReason, error: str | None = None) -> GenerationOutput:
        """The engine ended the request: flush the held-back text and close it."""
        if self.finished:
            raise RuntimeError(f"request {self.request_id}: finished twice")
        if self._detokenizer is not None:
            self._append_text(self._detokenizer.flush())
        if not self.finished:  # a stop string found in the flushed text keeps its own reason
            self.finish_reason, self.error = FinishReason(reason), error
        self.finished_at = time.monotonic()
        return self._output(())

    def result(self) -> GenerationResult:
        if not self.finished:
            raise RuntimeError(f"request {self.request_id} has not finished")
        return GenerationResult(self.request_id, self.prompt_ids, tuple(self.token_ids), self.text,
                                self.finish_reason, self.timings(), self.error)

    # ------------------------------------------------------------------------------------------------ internals
    def _append_text(self, delta: str) -> None:
        searched = len(self.text)
        self.text += delta
        cut = self._matcher.find(self.text, searched)
        if cut is not None:
            self.text = self.text[:cut]
            self.finish_reason = FinishReason.STOP

    def _output(self, token_ids: tuple[int, ...]) -> GenerationOutput:
        end = len(self.text) if self.finished else len(self.text) - self._matcher.held_back(self.text)
        delta = self.text[self._sent : end] if end > self._sent else ""
        self._sent = max(self._sent, end)
        return GenerationOutput(
            request_id=self.request_id,
            token_ids=token_ids,
            text=delta,
            finish_reason=self.finish_reason,
            prompt_tokens=len(self.prompt_ids),
            completion_tokens=len(self.token_ids),
            timings=self.timings(),
            error=self.error,
        )
