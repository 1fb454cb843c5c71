"""RULER-style multi-value needle: one key with several magic numbers spread over the context; all are asked for.

Score: fraction of the values present in the answer (RULER's string_match_all). The values sit at seeded random
depths, so the grid uses lengths only.
"""

from __future__ import annotations

from .base import Sample, Task, haystack_prompt, rng
from .words import distinct_keys, magic_number

NEEDLE = "One of the special magic numbers for {key} is: {value}."
QUESTION = (
    "What are all the special magic numbers for {key} mentioned in the provided text? "
    "Answer with the numbers only, separated by commas."
)
ANSWER_PREFIX = "The special magic numbers for {key} mentioned in the provided text are:"  # as RULER's template


class NiahMultiValueTask(Task):
    name = "niah_multivalue"
    max_new_tokens = 48
    num_values = 4

    def build(self, tokenizer, settings) -> list[Sample]:
        samples = []
        for length, _, index in self.cells(settings):
            r = rng(settings.seed, self.name, length, index)
            (key,) = distinct_keys(r, 1)
            values = []
            while len(values) < self.num_values:
                v = magic_number(r)
                if v not in values:
                    values.append(v)
            inserts = [(r.random(), NEEDLE.format(key=key, value=v)) for v in values]
            prefix = ANSWER_PREFIX.format(key=key)
            prompt = haystack_prompt(
                tokenizer, length, r.randrange(2**31), inserts, QUESTION.format(key=key), settings.chat, prefix
            )
            samples.append(
                Sample(
                    task=self.name,
                    index=index,
                    prompt=prompt,
                    answers=values,
                    metrics=("string_match_all",),
                    max_new_tokens=settings.max_new_tokens or self.max_new_tokens,
                    answer_prefix=prefix,
                    length=length,
                )
            )
        return samples
