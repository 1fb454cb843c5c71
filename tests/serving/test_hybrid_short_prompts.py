"""The batching engine (``generate_batch`` with a ``KVBlockPool``) on every hybrid kind a pool serves (Gemma 2,
Gemma 3, Cohere 2, gpt-oss with sinks, Mistral with a window), prompts SHORTER than the sliding window decoded
together with longer ones: greedy fp32 on tiny random models.

A row's ring (``window`` slots of the pool's slab) is only partly filled while its request has seen fewer than
``window`` tokens; the batched decode step must mask the slots not yet written (they hold an earlier owner's bytes or
zeros) and, once the ring wraps, read every slot. Prompts of 1 to 7 tokens with 14 new tokens cross that point
during the run, while the longer rows of the same steps have wrapped long before.

Oracle: each prompt alone through transformers' own attention and cache (eager, ``DynamicCache`` with
``DynamicSlidingWindowLayer``), nothing of hf_rocketkv. The budget is above every prompt and every page is attended,
so RocketKV must equal dense attention. Every page and slot is back in the pool at the end.
"""

from __future__ import annotations

import pytest

from hf_rocketkv import generate_batch
from hf_rocketkv.serving import SamplingParams
from tests.support.hybrid_models import HYBRID_ARCHS, make_hybrid_models
from tests.support.tiny_models import cpu_pool, greedy, keep_all_config, random_ids

LENGTHS = (7, 2, 5, 1, 12, 3)  # window 8: five under it, one over
NEW = 14


@pytest.mark.parametrize("arch", list(HYBRID_ARCHS))
def test_short_prompts_batched_equal_each_alone_through_transformers(arch):
    rocket, oracle = make_hybrid_models(arch)
    config = keep_all_config()
    rows = [random_ids(1, n, seed=40 + n)[0] for n in LENGTHS]
    pool = cpu_pool(rocket, config, 2 << 20, 8)
    results = generate_batch(rocket, [row.tolist() for row in rows], config=config, pool=pool,
                             sampling=SamplingParams.greedy(NEW, ignore_eos=True))
    for i, (row, result) in enumerate(zip(rows, results)):
        expected = greedy(oracle, row[None], max_new_tokens=NEW)[0, len(row):].tolist()
        assert list(result.token_ids) == expected, f"{arch}: prompt {i} ({len(row)} tokens)"
    assert pool.free_pages() == pool.total_pages() and pool.free_slots() == pool.total_slots()
