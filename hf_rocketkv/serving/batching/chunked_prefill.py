"""One request's prompt through the model into its own pool-backed cache, a chunk at a time, across engine steps.

The batching engine prefills a long prompt in chunks between its decode steps (scheduler.py plans them by a token
budget), so the running requests keep decoding while it is prefilled. The request's ``RocketKVCache.prefill(...)``
context (pool admission and prefix hit on entry, stage 1 on exit) is entered before the first chunk and left after
the last one, so it spans several engine iterations; between two chunks the cache holds the prompt so far densely,
every layer, and nothing else touches it. A prompt that fits one chunk runs in one forward with stage 1 inside it,
layer by layer, as without chunking; a longer one defers stage 1 to the last chunk (stage 1 needs the last queries
of the whole prompt), exactly as ``generate(prefill_chunk_size=...)`` does for one request.
"""

from __future__ import annotations

import torch

from ...cache import RocketKVCache
from ...integration import compat
from ...integration.fused_modeling import fused_modeling


class PrefillAborted(Exception):
    """Thrown into a prefill context left before its last chunk (a cancel, an error): no stage 1 runs."""


class ChunkedPrefill:
    """The prefill of one prompt, chunk by chunk (see the module docstring).

    Args:
        model: the causal LM.
        cache: the request's empty pool-backed ``RocketKVCache``.
        prompt_ids: the prompt's token ids.
        max_new_tokens: tokens the request may generate (sizes the cache's admission).
        reservation: the pool pages set aside at admission, handed to the cache's admission on entry.
        chunk_tokens: the most tokens of one forward: a prompt (after a prefix hit) longer than this defers stage 1
            to its last chunk.
        device: where the ids go.

    Entering the cache's prefill context happens here (``PoolExhaustedError`` or any admission error raises from
    the constructor, with the reservation already given back). ``position``: prompt tokens in the cache (a prefix
    hit's included); ``run(tokens)`` adds the next ones; ``abort()`` leaves the context without stage 1.
    """

    def __init__(self, model, cache: RocketKVCache, prompt_ids, max_new_tokens: int, reservation,
                 chunk_tokens: int, device: torch.device):
        self.model = model
        self.cache = cache
        self.ids = torch.tensor([list(prompt_ids)], dtype=torch.long, device=device)
        self.prompt_len = self.ids.shape[1]
        self._mask = torch.ones_like(self.ids)
        self._context = cache.prefill(self.ids, max_new_tokens=max_new_tokens, reservation=reservation,
                                      max_length=self.prompt_len + max_new_tokens)
        # the first column to compute: a prefix hit's end (columns before come from the pool), or on a model with
        # sliding-window layers where the hit's replay starts (docs/memory.md, "Prefix reuse by replay")
        self.position = self._context.__enter__()
        self._open = True
        cache.hints.plan(defer_compression=self.prompt_len - self.position > chunk_tokens)
        self.chunks = 0

    @property
    def done(self) -> bool:
        return self.position >= self.prompt_len

    @property
    def left(self) -> int:
        """Prompt tokens still to prefill."""
        return self.prompt_len - self.position

    def run(self, tokens: int, forward=None) -> torch.Tensor | None:
        """The next ``tokens`` prompt tokens (fewer at the prompt's end) through the model. After the last chunk the
        context is left (stage 1 runs on every layer where it was deferred) and the last position's logits ``[1, V]``
        (float32) are returned; None before.

        ``forward``: runs the chunk in a forward shared with other tokens (the engine's decoding rows:
        ``BatchDecoder.beside``), called as ``forward(ids [1, C], positions [1, C], cache, start)`` and returning the
        chunk's last logits ``[1, V]``; default a forward of the chunk alone."""
        if not self._open:
            raise RuntimeError("ChunkedPrefill.run: this prefill has ended")
        if tokens < 1:
            raise ValueError(f"ChunkedPrefill.run: tokens must be >= 1, got {tokens}")
        start, end = self.position, min(self.prompt_len, self.position + tokens)
        positions = torch.arange(start, end, device=self.ids.device)[None]
        try:
            with fused_modeling(self.model, self.cache.config):  # RoPE and RMSNorm in one launch each (as decode)
                if forward is not None:
                    logits = forward(self.ids[:, start:end], positions, self.cache, start)
                else:
                    logits = self.model(input_ids=self.ids[:, start:end], attention_mask=self._mask[:, :end],
                                        position_ids=positions, use_cache=True, logits_to_keep=1,
                                        **compat.cache_kwargs(self.cache)).logits[:, -1]
        except BaseException:
            self.abort()
            raise
        self.position = end
        self.chunks += 1
        if not self.done:
            return None
        self._open = False
        self._context.__exit__(None, None, None)  # stage 1 where it was deferred
        return logits.float()

    def abort(self) -> None:
        """Leave the cache's prefill context without stage 1 (the cache's pages go back when it is closed)."""
        if self._open:
            self._open = False
            error = PrefillAborted("the prefill was left before its last chunk")
            self._context.__exit__(PrefillAborted, error, None)
