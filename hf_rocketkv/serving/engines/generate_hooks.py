"""Adapters that let one ``model.generate`` call serve one engine request: stream, cancel, sample per request.

    TokenStreamer            generate's streamer: forwards each new token to the engine's sink as an EngineEvent
    CancelCriteria           a StoppingCriteria reading the request's cancel flag at every step (stop within a step)
    SamplingLogitsProcessor  samples with the request's own torch.Generator and forces that token, so generate's
                             greedy selection returns it (generate itself would draw from the global RNG)
"""

from __future__ import annotations

import threading

import torch
from transformers import LogitsProcessor, StoppingCriteria
from transformers.generation.streamers import BaseStreamer

from ..sampling import SamplingParams
from .interface import EngineEvent, EngineRequest, EventSink
from .sampler import sample_tokens


class TokenStreamer(BaseStreamer):
    """Receives generate()'s tokens for a single-row request and sends each one to ``sink``.

    generate() first puts the prompt (skipped), then one token per step. Tokens after the request's end (a stop id
    or max_new_tokens reached, or the cancel flag set) are dropped: with a deferred stop check generate may run one
    step past EOS, and a cancelled request must not emit anything after the step that saw the flag.
    """

    def __init__(self, request: EngineRequest, sink: EventSink):
        self.request = request
        self.sink = sink
        self.tokens: list[int] = []
        self.ended = False  # a stop id or max_new_tokens reached: later tokens are padding
        self._prompt_seen = False

    def put(self, value: torch.Tensor) -> None:
        if not self._prompt_seen:
            self._prompt_seen = True
            return
        if self.ended or self.request.cancelled.is_set():
            return
        ids = value.reshape(-1).tolist()
        if len(ids) != 1:
            raise ValueError(f"TokenStreamer serves one row at a time, got {len(ids)} tokens in one step")
        token = int(ids[0])
        self.tokens.append(token)
        self.ended = token in self.request.stop_token_ids or len(self.tokens) >= self.request.max_new_tokens
        self.sink(EngineEvent(self.request.request_id, (token,)))

    def end(self) -> None:
        """generate() is done; the engine sends the final event itself, after freeing the cache."""


class CancelCriteria(StoppingCriteria):
    """Stops generation at the step boundary after ``flag`` is set (client disconnect, stop string, stop())."""

    def __init__(self, flag: threading.Event):
        self.flag = flag

    def __call__(self, input_ids: torch.LongTensor, scores, **kwargs) -> torch.BoolTensor:
        return torch.full((input_ids.shape[0],), self.flag.is_set(), dtype=torch.bool, device=input_ids.device)


class SamplingLogitsProcessor(LogitsProcessor):
    """Draws the next token with ``sample_tokens(scores, params, generator)`` and returns scores that are 0 there
    and -inf elsewhere: generate's argmax then picks exactly the drawn token."""

    def __init__(self, params: SamplingParams, generator: torch.Generator):
        self.params = params
        self.generator = generator

    def __call__(self, input_ids: torch.LongTensor, scores: torch.FloatTensor) -> torch.FloatTensor:
        tokens = sample_tokens(scores, self.params, self.generator)
        forced = torch.full_like(scores, float("-inf"))
        return forced.scatter_(1, tokens[:, None], 0.0)
