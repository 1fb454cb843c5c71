"""RULER-style variable tracking: a chain ``VAR A = 12345``, ``VAR B = VAR A``, ... hidden in prose.

The question asks for every variable that ends up holding the value; score = fraction named (string_match_all).
The statements appear in chain order at seeded random depths. Default: one chain of 2 hops (3 variables), easier
than RULER's 4 hops, because a 135M model fails the longer chain even with the full cache.
"""

from __future__ import annotations

import string

from .base import Sample, Task, haystack_prompt, rng

QUESTION = "Find all variables that are assigned the value {value} in the text above."
ANSWER_PREFIX = (
    "According to the chain of variable assignments in the text above, {n} variables are assigned the value {value}, "
    "they are:"
)


def variable_name(r) -> str:
    return "".join(r.choice(string.ascii_uppercase) for _ in range(5))


class VariableTrackingTask(Task):
    name = "variable_tracking"
    max_new_tokens = 30
    num_hops = 2

    def build(self, tokenizer, settings) -> list[Sample]:
        samples = []
        for length, _, index in self.cells(settings):
            r = rng(settings.seed, self.name, length, index)
            value = str(r.randint(10000, 99999))
            names: list[str] = []
            while len(names) < self.num_hops + 1:
                name = variable_name(r)
                if name not in names:
                    names.append(name)
            statements = [f"VAR {names[0]} = {value}."] + [
                f"VAR {names[i]} = VAR {names[i - 1]}." for i in range(1, len(names))
            ]
            depths = sorted(r.random() for _ in statements)
            prefix = ANSWER_PREFIX.format(n=len(names), value=value)
            prompt = haystack_prompt(
                tokenizer,
                length,
                r.randrange(2**31),
                list(zip(depths, statements)),
                QUESTION.format(value=value),
                settings.chat,
                answer_prefix=prefix,
            )
            samples.append(
                Sample(
                    task=self.name,
                    index=index,
                    prompt=prompt,
                    answers=names,
                    metrics=("string_match_all",),
                    max_new_tokens=settings.max_new_tokens or self.max_new_tokens,
                    answer_prefix=prefix,
                    length=length,
                )
            )
        return samples
