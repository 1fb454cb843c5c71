"""One switch off and on through the batching engine: the tokens of each, for tests of fused paths."""

from __future__ import annotations

import torch


def engine_tokens_off_and_on(model, config, field: str, calls: list, device: str,
                             sliding_slots: int | None = 6) -> dict[bool, list]:
    """``generate_batch`` of three ragged prompts over a small CPU-sized pool, ``config`` with ``field`` False, then
    True: ``{on: [token ids per request]}``. ``calls`` (the recorded kernel calls) must stay empty while off and
    fill while on. ``sliding_slots``: the pool's sliding-window slots (None for a model without sliding layers)."""
    from hf_rocketkv.serving import SamplingParams, generate_batch
    from tests.serving.helpers import prompt_of
    from tests.support.tiny_models import cpu_pool

    prompts = [prompt_of(n, seed=40 + n) for n in (30, 17, 26)]
    runs = {}
    for on in (False, True):
        pool = cpu_pool(model, config, 2 << 20, 8, dtype=torch.bfloat16, sliding_slots=sliding_slots, device=device)
        results = generate_batch(model, prompts, config=config.replace(**{field: on}), pool=pool,
                                 sampling=SamplingParams.greedy(6))
        runs[on] = [result.token_ids for result in results]
        assert (calls != []) == on
    return runs
