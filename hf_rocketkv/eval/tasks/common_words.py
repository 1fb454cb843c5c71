"""RULER-style common-words extraction (cwe): a numbered word list where a few words repeat many times.

The answer must name the ``num_common`` most frequent words; score = fraction named (string_match_all). Words come
from the haystack prose vocabulary. The list is filled with words that appear ``rare_freq`` times until the prompt
reaches the target length.
"""

from __future__ import annotations

import random

from .base import Sample, Task, encode_prompt, rng, vocabulary

INTRO = (
    "Below is a numbered list of words. In these words, some appear more often than others. "
    "Memorize the ones that appear most often."
)
QUESTION = "Question: What are the {n} most common words in the above list?"
ANSWER_PREFIX = "Answer: The top {n} words that appear most often in the list are:"


class CommonWordsTask(Task):
    name = "common_words"
    max_new_tokens = 40
    num_common = 5
    common_freq = 20
    rare_freq = 2

    def build(self, tokenizer, settings) -> list[Sample]:
        samples = []
        for length, _, index in self.cells(settings):
            r = rng(settings.seed, self.name, length, index)
            words = list(vocabulary())
            r.shuffle(words)
            common, rare_pool = words[: self.num_common], words[self.num_common :]
            prefix = ANSWER_PREFIX.format(n=self.num_common)
            question = QUESTION.format(n=self.num_common)
            shuffle_seed = r.randrange(2**31)

            def make(n_rare: int, freq: int) -> str:
                listing = [w for w in common for _ in range(freq)]
                listing += [w for w in rare_pool[:n_rare] for _ in range(self.rare_freq)]
                random.Random(shuffle_seed).shuffle(listing)
                body = " ".join(f"{i + 1}. {w}" for i, w in enumerate(listing))
                return f"{INTRO}\n{body}\n{question}"

            def size(text: str) -> int:
                return len(encode_prompt(tokenizer, text, settings.chat, prefix))

            # size the list in two passes: estimate tokens per entry, then correct with the measured length
            per_entry = max((size(make(50, 1)) - size(make(0, 1))) / (50 * self.rare_freq), 1.0)
            entries = max(int((length - size(make(0, 0))) / per_entry), self.num_common * 3)
            freq = max(min(self.common_freq, entries // (2 * self.num_common)), self.rare_freq + 1)
            n_rare = max((entries - freq * self.num_common) // self.rare_freq, 0)
            for _ in range(2):
                missing = length - size(make(n_rare, freq))
                n_rare = max(n_rare + int(missing / (per_entry * self.rare_freq)), 0)
            while n_rare > 0 and size(make(n_rare, freq)) > length:
                n_rare -= 1
            prompt = make(n_rare, freq)
            samples.append(
                Sample(
                    task=self.name,
                    index=index,
                    prompt=prompt,
                    answers=common,
                    metrics=("string_match_all",),
                    max_new_tokens=settings.max_new_tokens or self.max_new_tokens,
                    answer_prefix=prefix,
                    length=length,
                    meta={"common_freq": freq, "rare_freq": self.rare_freq},
                )
            )
        return samples
