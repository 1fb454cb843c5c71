"""Passkey retrieval (needle in a haystack) over a grid of context lengths x needle depths.

User message: prose paragraphs with the needle sentence inserted between two paragraphs, then the question. On
SmolLM2-135M-Instruct the full cache answers this format reliably at 1k-4k tokens; dropping "Answer with the number
only." made even the full cache fail, so the wording is fixed here. Score: 1 if the key occurs in the answer.
"""

from __future__ import annotations

from .base import Sample, Task, haystack_prompt, rng

NEEDLE = "The pass key is {key}. Remember it. {key} is the pass key."
QUESTION = "What is the pass key? Answer with the number only."


class PasskeyTask(Task):
    name = "passkey"
    uses_depth = True
    max_new_tokens = 16  # "The pass key is 12345." is 11 tokens on SmolLM2 (digits are single tokens)

    def build(self, tokenizer, settings) -> list[Sample]:
        samples = []
        for length, depth, index in self.cells(settings):
            r = rng(settings.seed, self.name, length, depth, index)
            key = str(r.randint(10000, 99999))
            needle = NEEDLE.format(key=key)
            prompt = haystack_prompt(tokenizer, length, r.randrange(2**31), [(depth, needle)], QUESTION, settings.chat)
            samples.append(
                Sample(
                    task=self.name,
                    index=index,
                    prompt=prompt,
                    answers=[key],
                    metrics=("substring",),
                    max_new_tokens=settings.max_new_tokens or self.max_new_tokens,
                    length=length,
                    depth=depth,
                    meta={"needle": needle, "key": key},
                )
            )
        return samples
