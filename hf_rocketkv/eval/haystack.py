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


def haystack_text(num_chars: int, seed: int = 0) -> str:
    """About ``num_chars`` characters of prose, paragraphs drawn in a seeded order (whole paragraphs only)."""
    paragraphs = list(prose_paragraphs())
    random.Random(seed).shuffle(paragraphs)
    out, total, i = [], 0, 0
    while total < num_chars:
        paragraph = paragraphs[i % len(paragraphs)]
        out.append(paragraph)
        total += len(paragraph) + 2
        i += 1
    return "\n\n".join(out)


def haystack_tokens(tokenizer, num_tokens: int, seed: int = 0) -> list[str]:
    """Paragraphs whose concatenation is about ``num_tokens`` tokens (for placing needles between paragraphs)."""
    paragraphs = list(prose_paragraphs())
    random.Random(seed).shuffle(paragraphs)
    out, total, i = [], 0, 0
    while total < num_tokens:
        paragraph = paragraphs[i % len(paragraphs)]
        out.append(paragraph)
        total += len(tokenizer(paragraph, add_special_tokens=False).input_ids) + 1
        i += 1
    return out
