"""What every task produces, and the helpers the synthetic tasks share (seeded RNG, haystack filling, prompts).

A generation task turns ``(tokenizer, EvalSettings)`` into ``Sample`` objects: a user message, reference answers
and a metric. The runner encodes the message (chat template or not), runs every method on it and scores the answer.
A fidelity task produces ``FidelitySample`` objects (context ids + continuation ids) instead.
"""

from __future__ import annotations

import functools
import random
import re
from dataclasses import dataclass, field
from typing import Any

from ..haystack import prose_paragraphs


@dataclass
class Sample:
    """One question. ``metrics[0]`` is the headline metric; every metric in the tuple is recorded."""

    task: str
    index: int
    prompt: str  # the user message: context + question
    answers: list[str]
    metrics: tuple[str, ...] = ("substring",)
    max_new_tokens: int = 16
    answer_prefix: str = ""  # text the answer starts with (after the chat template's generation prompt)
    length: int | None = None  # grid cell: target prompt tokens (None for file-loaded samples)
    depth: float | None = None  # grid cell: relative needle position (None when the task has no depth)
    meta: dict[str, Any] = field(default_factory=dict)


@dataclass
class FidelitySample:
    """Teacher forcing: prefill ``context_ids``, then feed ``continuation_ids`` one token at a time."""

    task: str
    index: int
    context_ids: list[int]
    continuation_ids: list[int]
    meta: dict[str, Any] = field(default_factory=dict)


class Task:
    """Base class: ``build`` returns the samples; ``kind`` tells the runner how to run them."""

    name: str = ""
    kind: str = "generate"  # "generate" or "fidelity"
    uses_depth: bool = False  # samples span the lengths x depths grid (else lengths only)

    def build(self, tokenizer, settings) -> list:
        raise NotImplementedError

    def cells(self, settings):
        """``(length, depth, index)`` of every sample of the grid, depth None when the task has no depth."""
        depths = settings.depths if self.uses_depth else [None]
        for length in settings.lengths:
            for depth in depths:
                for index in range(max(settings.samples, 1)):
                    yield length, depth, index


def rng(seed: int, *parts: Any) -> random.Random:
    """A generator that depends only on its arguments (str seeding is stable across runs and machines)."""
    return random.Random("|".join(str(p) for p in (seed, *parts)))


def prompt_text(tokenizer, prompt: str, chat: bool, answer_prefix: str = "") -> tuple[str, bool]:
    """``(text, add_special_tokens)`` the model reads: chat template + generation prompt + prefix, or the raw text."""
    if chat and getattr(tokenizer, "chat_template", None):
        text = tokenizer.apply_chat_template(
            [{"role": "user", "content": prompt}], add_generation_prompt=True, tokenize=False
        )
        return text + answer_prefix, False
    return prompt + ("\n" + answer_prefix if answer_prefix else ""), True


def encode_prompt(tokenizer, prompt: str, chat: bool, answer_prefix: str = "") -> list[int]:
    """Token ids of a user message: the chat template with the generation prompt when ``chat``, then the prefix."""
    text, special = prompt_text(tokenizer, prompt, chat, answer_prefix)
    return tokenizer(text, add_special_tokens=special).input_ids


def span_token_positions(tokenizer, prompt: str, chat: bool, answer_prefix: str, span: str) -> list[int]:
    """Positions of the prompt tokens that overlap the first occurrence of ``span`` (empty if absent)."""
    text, special = prompt_text(tokenizer, prompt, chat, answer_prefix)
    start = text.find(span)
    if start < 0 or not getattr(tokenizer, "is_fast", False):
        return []
    end = start + len(span)
    offsets = tokenizer(text, add_special_tokens=special, return_offsets_mapping=True).offset_mapping
    return [i for i, (a, b) in enumerate(offsets) if a < end and b > start and b > a]


def _paragraph_token_counts(tokenizer) -> tuple[int, ...]:
    key = (getattr(tokenizer, "name_or_path", ""), len(tokenizer))
    return _COUNT_CACHE[key] if key in _COUNT_CACHE else _COUNT_CACHE.setdefault(key, _count(tokenizer))


_COUNT_CACHE: dict = {}


def _count(tokenizer) -> tuple[int, ...]:
    encoded = tokenizer(list(prose_paragraphs()), add_special_tokens=False).input_ids
    return tuple(len(ids) for ids in encoded)


def fill_paragraphs(tokenizer, num_tokens: int, seed: int) -> list[str]:
    """Prose paragraphs in a seeded order, as many as fit in ``num_tokens`` (each join costs ~1 token)."""
    paragraphs = list(prose_paragraphs())
    counts = _paragraph_token_counts(tokenizer)
    order = list(range(len(paragraphs)))
    random.Random(seed).shuffle(order)
    out, total, used = [], 0, set()
    while True:  # long contexts cycle through the pool again
        added = False
        for i in order:
            cost = counts[i] + 1
            if total + cost > num_tokens:
                continue  # skip what does not fit, a shorter paragraph may
            out.append(paragraphs[i])
            used.add(i)
            total += cost
            added = True
            if num_tokens - total < 8:
                return out
        if not added:
            break
    # top up with the leading sentences of the next paragraph that does not fit
    spare = next((i for i in order if i not in used), order[0] if order else None)
    sentences = re.split(r"(?<=[.!?]) ", paragraphs[spare]) if spare is not None else []
    extra: list[str] = []
    for sentence in sentences:
        cost = len(tokenizer(" ".join(extra + [sentence]), add_special_tokens=False).input_ids) + 1
        if total + cost > num_tokens:
            break
        extra.append(sentence)
    if extra:
        out.append(" ".join(extra))
    return out


def insert_at_depths(paragraphs: list[str], inserts: list[tuple[float, str]]) -> list[str]:
    """Put each text between paragraphs at ``round(depth * n)`` (0 = before the first, 1 = after the last)."""
    out = list(paragraphs)
    n = len(paragraphs)
    for depth, text in sorted(inserts, key=lambda item: item[0], reverse=True):
        out.insert(round(depth * n), text)
    return out


def haystack_prompt(
    tokenizer,
    length: int,
    seed: int,
    inserts: list[tuple[float, str]],
    question: str,
    chat: bool,
    answer_prefix: str = "",
) -> str:
    """A user message of about ``length`` prompt tokens: prose with the inserts at their depths, then the question."""
    fixed = "\n\n".join([text for _, text in inserts] + [question])
    overhead = len(encode_prompt(tokenizer, fixed, chat, answer_prefix)) + len(inserts) + 1
    paragraphs = fill_paragraphs(tokenizer, max(length - overhead, 0), seed)
    return "\n\n".join(insert_at_depths(paragraphs, inserts) + [question])


@functools.lru_cache(maxsize=1)
def vocabulary() -> tuple[str, ...]:
    """Lower-case words of 4 to 9 letters that occur in the haystack prose, sorted (a local word list)."""
    words = set()
    for paragraph in prose_paragraphs():
        words.update(w.lower() for w in re.findall(r"\b[A-Za-z]{4,9}\b", paragraph))
    return tuple(sorted(words))
