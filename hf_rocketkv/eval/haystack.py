"""Offline haystack text: prose paragraphs of the Python Language Reference shipped with every CPython.

``pydoc_data.topics`` (part of the standard library, the text behind ``help("if")``) holds about 460 kB of English
documentation. We keep only its prose paragraphs (no grammar rules, no indented code), in a fixed order, so the
haystack is real English text, identical on every machine, and needs no download.
"""

from __future__ import annotations

import functools
import random
import re


@functools.lru_cache(maxsize=1)
def prose_paragraphs() -> tuple[str, ...]:
    """Prose paragraphs (>= 200 characters, no code or grammar lines), whitespace-normalised."""
    from pydoc_data.topics import topics

    paragraphs = []
    for name in sorted(topics):
        for block in re.split(r"\n\s*\n", topics[name]):
            lines = block.splitlines()
            if not lines or any(line.startswith((" ", "\t")) for line in lines):
                continue  # code samples and grammar rules are indented
            text = " ".join(line.strip() for line in lines)
            if len(text) < 200 or "::=" in text or ">>>" in text or set(text) <= set("*=-~^ "):
                continue
            paragraphs.append(text)
    return tuple(paragraphs)


def _take_paragraphs(budget: int, cost, seed: int) -> list[str]:
    """Paragraphs in a seeded order (cycling when needed) until their summed ``cost`` reaches ``budget``."""
    paragraphs = list(prose_paragraphs())
    random.Random(seed).shuffle(paragraphs)
    out, total = [], 0
    while total < budget:
        paragraph = paragraphs[len(out) % len(paragraphs)]
        out.append(paragraph)
        total += cost(paragraph)
    return out


def haystack_text(num_chars: int, seed: int = 0) -> str:
    """About ``num_chars`` characters of prose, paragraphs drawn in a seeded order (whole paragraphs only)."""
    return "\n\n".join(_take_paragraphs(num_chars, lambda p: len(p) + 2, seed))


def haystack_tokens(tokenizer, num_tokens: int, seed: int = 0) -> list[str]:
    """Paragraphs whose concatenation is about ``num_tokens`` tokens (for placing needles between paragraphs)."""
    return _take_paragraphs(num_tokens, lambda p: len(tokenizer(p, add_special_tokens=False).input_ids) + 1, seed)
