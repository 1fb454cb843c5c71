"""IncrementalDetokenizer: token ids in, text deltas out, one step at a time.

Decoding each new token alone is wrong for byte-level BPE (a character split over two tokens decodes as U+FFFD) and
for SentencePiece (a token's leading space depends on what precedes it). So every step decodes a short window twice:
the tokens already turned into text (``prefix``) and the same window plus the new tokens (``full``); the delta is
what ``full`` adds. A delta ending in U+FFFD is held back until the character completes; when the request ends first
(max_tokens cut a character in two), the bytes of that half character are dropped, so no text, streamed or whole,
ever ends in half a UTF-8 character. The window starts on the last few prompt tokens, so the first generated token is
decoded in context.
"""

from __future__ import annotations

from collections.abc import Sequence

REPLACEMENT_CHAR = "\ufffd"
PROMPT_CONTEXT_TOKENS = 6


class IncrementalDetokenizer:
    """Turns a request's generated ids into text deltas (special tokens skipped)."""

    def __init__(self, tokenizer, prompt_ids: Sequence[int] = (), context_tokens: int = PROMPT_CONTEXT_TOKENS):
        self.tokenizer = tokenizer
        self._ids: list[int] = list(prompt_ids[-context_tokens:]) if context_tokens else []
        self._prefix = 0  # window start
        self._read = len(self._ids)  # ids before this index are already text

    def add(self, token_ids: Sequence[int]) -> str:
        """Append ids; return the text that is now complete (may be empty)."""
        self._ids.extend(token_ids)
        return self._advance(final=False)

    def flush(self) -> str:
        """The text still held back at the end of the request, less a character left incomplete by the last tokens
        (its bytes decode as U+FFFD)."""
        return self._advance(final=True).rstrip(REPLACEMENT_CHAR)

    def _advance(self, final: bool) -> str:
        if self._read == len(self._ids):
            return ""
        prefix_text = self._decode(self._ids[self._prefix : self._read])
        full_text = self._decode(self._ids[self._prefix :])
        if len(full_text) <= len(prefix_text) and not final:
            return ""
        if full_text.endswith(REPLACEMENT_CHAR) and not final:
            return ""  # a character still split across tokens
        delta = full_text[len(prefix_text) :]
        self._prefix, self._read = self._read, len(self._ids)
        return delta

    def _decode(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=True, clean_up_tokenization_spaces=False)
