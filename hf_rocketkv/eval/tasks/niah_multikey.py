"""RULER-style multi-key needle: several "magic number" needles with different keys, the question names one.

The asked-for needle sits at the grid depth; the distractor needles sit at seeded random depths. The answer starts
with RULER's answer prefix, so the number comes within the first few generated tokens.
"""

from __future__ import annotations

from .base import Sample, Task, haystack_prompt, rng
from .words import distinct_keys, magic_number

NEEDLE = "One of the special magic numbers for {key} is: {value}."
QUESTION = "What is the special magic number for {key} mentioned in the provided text? Answer with the number only."
ANSWER_PREFIX = "The special magic number for {key} mentioned in the provided text is"  # as RULER's template


class NiahMultiKeyTask(Task):
    name = "niah_multikey"
    uses_depth = True
    max_new_tokens = 16
    num_needles = 4

    def build(self, tokenizer, settings) -> list[Sample]:
        samples = []
        for length, depth, index in self.cells(settings):
            r = rng(settings.seed, self.name, length, depth, index)
            keys = distinct_keys(r, self.num_needles)
            values = [magic_number(r) for _ in keys]
            inserts = [(depth, NEEDLE.format(key=keys[0], value=values[0]))]
            inserts += [(r.random(), NEEDLE.format(key=k, value=v)) for k, v in zip(keys[1:], values[1:])]
            prefix = ANSWER_PREFIX.format(key=keys[0])
            prompt = haystack_prompt(
                tokenizer, length, r.randrange(2**31), inserts, QUESTION.format(key=keys[0]), settings.chat, prefix
            )
            samples.append(
                Sample(
                    task=self.name,
                    index=index,
                    prompt=prompt,
                    answers=[values[0]],
                    metrics=("string_match_all",),
                    max_new_tokens=settings.max_new_tokens or self.max_new_tokens,
                    answer_prefix=prefix,
                    length=length,
                    depth=depth,
                    meta={"distractors": values[1:], "needle": inserts[0][1], "key": values[0]},
                )
            )
        return samples
