"""RunningRequest: one request admitted by the batching engine, as its engine thread follows it to its end."""

from __future__ import annotations

import threading
from dataclasses import dataclass

import torch

from ...cache import RocketKVCache
from ..engines.interface import EngineRequest
from .chunked_prefill import ChunkedPrefill


@dataclass(eq=False)  # identity: the scheduler finds a request's row with list.index
class RunningRequest:
    """What the batching engine holds for one request between ``submit`` and its final event: the pool pages set
    aside at admission, its cache and chunked prefill from its first prefill chunk on (the cache until the request
    joins the decoding rows, which take its pages), its sampling generator, and the tokens it has produced."""

    request: EngineRequest
    reservation: object = None  # the pool pages set aside at admission (given to the cache's admission at prefill)
    cache_salt: str | None = None  # the prefix-index salt of its cache (set only for the warm-up request)
    error: str | None = None  # set at admission: the request can never be served (ends with "error" at prefill)
    cache: RocketKVCache | None = None  # its prefill's cache (None once a decoding row holds its pages)
    prefill: ChunkedPrefill | None = None  # its prompt's prefill, from the first chunk on (done: joined the rows)
    generator: torch.Generator | None = None
    tokens: int = 0
    last_token: int = 0

    def refuse(self, error: str) -> None:
        """Admitted only to end with ``error`` at once: the request can never be served."""
        self.error = error

    def set_aside(self, reservation) -> None:
        """The pool pages set aside for it at admission."""
        self.reservation = reservation

    def begin_prefill(self, cache: RocketKVCache, prefill: ChunkedPrefill) -> None:
        """Its prefill starts in ``cache`` (which took the pages set aside: the reservation is spent)."""
        self.cache, self.prefill, self.reservation = cache, prefill, None

    def take_reservation(self):
        """The pages set aside for it, now handed to whoever takes them (None: none left)."""
        reservation, self.reservation = self.reservation, None
        return reservation

    def take_cache(self) -> RocketKVCache | None:
        """Its cache, handed to whoever closes it (None: none)."""
        cache, self.cache = self.cache, None
        return cache

    def sample_with(self, generator: torch.Generator) -> None:
        """Its own random generator (a sampled request)."""
        self.generator = generator

    def took(self, token: int) -> None:
        """One more token produced."""
        self.tokens += 1
        self.last_token = token

    def drop_cache(self) -> None:
        """Its prefill is over and its cache handed its pages to a decoding row (``BatchedDecodeCache.join``): the
        request is held by that row from now on."""
        self.cache = None

    @property
    def request_id(self) -> str:
        return self.request.request_id

    @property
    def prompt_left(self) -> int:
        """Prompt tokens still to prefill (the whole prompt before the first chunk, which may find a prefix hit)."""
        return self.prefill.left if self.prefill is not None else self.request.prompt_len

    @property
    def cancelled(self) -> threading.Event:
        """The cancel flag the engine reads (under lockstep, this rank's own copy)."""
        return self.request.cancelled
