"""A batching engine request's pool pages, from admission to release.

The scheduler admits the head of the queue only when the pool can set the request's cold prefill peak aside
(``pool.reserve``: its prompt pages and its view for all ``max_tokens``, so a decoding request never runs out of
pages; for a model with sliding-window layers, its sliding-window slot too). At its first prefill chunk those pages
go to the admission of the request's own pool-backed ``RocketKVCache`` (under the pool's lock, so nobody takes them
in between; chunked_prefill.py runs the chunks); when the request ends, an unfinished prefill is left, its cache is
closed and whatever the reservation still holds goes back.
"""

from __future__ import annotations

import torch

from ...cache import RocketKVCache, request_pages
from ...memory import PoolExhaustedError
from ..engines.interface import EngineRequest
from ..errors import InvalidRequest
from .chunked_prefill import ChunkedPrefill
from .running import RunningRequest


class PoolAdmission:
    """Sets a request's pages aside (``admit``), starts the prefill of its prompt into a cache that takes them
    (``start_prefill``, chunk by chunk; ``prefill``: in one forward) and gives them back (``release``). Holds the
    model, config, pool and device it was given; the state of each request is on its ``RunningRequest``
    (``reservation``, ``cache``, ``prefill``, ``error``)."""

    def __init__(self, model, config, pool, device: torch.device):
        self.model = model
        self.config = config
        self.pool = pool
        self.device = device

    def admit(self, running: RunningRequest) -> bool:
        """The scheduler's admission callback (engine lock held): set the request's cold prefill peak aside, or say
        "not now"; a request that can never fit is admitted only to end with an error at once (the manager refuses
        those when they are added: ``check_pool_fits``)."""
        request = running.request
        need = self.pages(request).peak_pages
        usable = self.pool.total_pages()
        if need > usable:
            running.refuse(
                f"the prompt ({request.prompt_len} tokens) with max_tokens={request.max_new_tokens} needs {need} "
                f"KV pool pages at its prefill peak, more than the pool's {usable} usable pages "
                f"(KVBlockPool max_gpu_bytes / page_size={self.pool.page_size}): it can never be admitted; "
                f"send a shorter prompt or fewer max_tokens, or give the pool more memory")
            return True
        try:
            # a model with sliding layers: the request's sliding-window slot too (memory/sliding_slab.py)
            running.set_aside(self.pool.reserve(need, f"admitting request {request.request_id}",
                                                slots=int(self.pool.has_sliding_layers)))
        except PoolExhaustedError:
            return False  # not now: pages come back as running requests finish
        return True

    def pages(self, request: EngineRequest):
        """The request's pool pages at its cold prefill peak and once compressed (``hf_rocketkv.cache``'s
        ``request_pages``)."""
        return request_pages(self.config, self.pool, request.prompt_len, request.max_new_tokens)

    def start_prefill(self, running: RunningRequest, chunk_tokens: int) -> ChunkedPrefill:
        """Give the request its own pool-backed cache and enter its prefill (the reserved pages go to the cache's
        admission, a prefix hit is looked up); its chunks then run through ``running.prefill.run``."""
        request = running.request
        cache = RocketKVCache(self.config, pool=self.pool, cache_salt=running.cache_salt,
                              model_config=self.model.config)
        reservation = running.take_reservation()  # the admission takes these pages
        try:
            prefill = ChunkedPrefill(self.model, cache, request.prompt_ids, request.max_new_tokens, reservation,
                                     chunk_tokens, self.device)
        except BaseException:
            cache.close()  # an admission that failed holds nothing; the reservation went back with it
            raise
        running.begin_prefill(cache, prefill)
        return prefill

    def prefill(self, running: RunningRequest) -> torch.Tensor:
        """The request's whole prompt through the model in one forward with its own pool-backed cache; returns the
        last logits [1, V]."""
        prefill = self.start_prefill(running, running.request.prompt_len)
        return prefill.run(prefill.left)

    def release(self, running: RunningRequest) -> None:
        """Leave an unfinished prefill, close the request's cache (its pages go back) and give back what its
        reservation still holds."""
        if running.prefill is not None:
            running.prefill.abort()
        cache = running.take_cache()
        if cache is not None:
            cache.close()
        reservation = running.take_reservation()
        if reservation is not None:
            self.pool.unreserve(reservation)


def check_pool_fits(config, pool, prompt_len: int, max_new_tokens: int) -> None:
    """Raise ``InvalidRequest`` (code ``context_length_exceeded``) for a request whose cold prefill peak exceeds the
    whole pool: it can never be admitted (prefix hits do not help: they are pages of the same pool), so it is refused
    when it is added (the server answers 400) instead of admitted to fail. ``param`` is "prompt" when even
    max_tokens=1 does not fit, else "max_tokens", with the most that fits in the message."""
    total = pool.total_pages()

    def need(tokens: int) -> int:
        return request_pages(config, pool, prompt_len, tokens).peak_pages

    if need(max_new_tokens) <= total:
        return
    if need(1) > total:
        raise InvalidRequest(
            f"the prompt ({prompt_len} tokens) needs {need(1)} KV pool pages at its prefill peak, more than the "
            f"pool's {total} pages (of {pool.page_size} tokens): it can never be served; send a shorter prompt",
            "prompt", "context_length_exceeded")
    low, high = 1, max_new_tokens - 1  # need(low) fits, need(high + 1) does not
    while low < high:
        middle = (low + high + 1) // 2
        low, high = (middle, high) if need(middle) <= total else (low, middle - 1)
    raise InvalidRequest(
        f"the prompt ({prompt_len} tokens) with max_tokens={max_new_tokens} needs {need(max_new_tokens)} KV pool "
        f"pages at its prefill peak, more than the pool's {total} pages (of {pool.page_size} tokens): it can never "
        f"be served; ask for at most {low} tokens", "max_tokens", "context_length_exceeded")
