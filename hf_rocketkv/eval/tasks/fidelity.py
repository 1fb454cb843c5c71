"""Fidelity on real text: how closely each method's next-token distribution follows the full cache's.

Context: ``fidelity_context`` tokens of the offline English prose (no chat template), prefilled once per method;
then the next ``fidelity_positions`` tokens of the same text are fed one at a time (teacher forcing) through the
method's cache, exactly like decode steps. At every position we compare with the full cache (sdpa + DynamicCache):
top-1 agreement (same argmax), mean KL(full || method) in nats, and each method's own next-token accuracy.
"""

from __future__ import annotations

from ..haystack import haystack_text
from .base import FidelitySample, Task, rng


class FidelityTask(Task):
    name = "fidelity"
    kind = "fidelity"

    def build(self, tokenizer, settings) -> list[FidelitySample]:
        need = settings.fidelity_context + settings.fidelity_positions
        samples = []
        for index in range(max(settings.samples, 1)):
            seed = rng(settings.seed, self.name, index).randrange(2**31)
            chars = need * 6
            while True:
                ids = tokenizer(haystack_text(chars, seed=seed), add_special_tokens=False).input_ids
                if len(ids) >= need:
                    break
                chars *= 2
            samples.append(
                FidelitySample(
                    task=self.name,
                    index=index,
                    context_ids=ids[: settings.fidelity_context],
                    continuation_ids=ids[settings.fidelity_context : need],
                    meta={"length": settings.fidelity_context},
                )
            )
        return samples
