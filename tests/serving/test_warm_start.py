"""warm_up_engine (serving/warm_start.py): the batching engine run through every bucket and one batch per size, on
the tiny random Llama (CPU: eager decode, nothing to capture; what it compiles on CUDA is checked by
benchmarks/first_call.py --warm-up-only / --compile-cache on a GPU).

Oracle: each request alone through model.generate with its own RocketKVCache (the ``oracle`` fixture); counts of
batches and buckets written out by hand.
"""

from __future__ import annotations

import pytest

from hf_rocketkv.serving import SamplingParams, generate_batch
from hf_rocketkv.serving.batching.scheduler import BatchingConfig
from hf_rocketkv.serving.warm_start import warm_up_engine
from tests.serving.helpers import CFG, make_pool, prompt_of

BATCHING = BatchingConfig(max_running=4, buckets=(1, 2, 4, 8))


def test_warm_up_engine_steps_every_bucket_and_each_batch_then_the_pool_serves_as_before(tiny_pair, oracle):
    model = tiny_pair[0]
    pool = make_pool(model)
    report = warm_up_engine(model, CFG, pool=pool, batch_sizes=(3, 1), prompt_tokens=40, new_tokens=3,
                            max_tokens=12, batching=BATCHING)
    # buckets up to bucket_for(max_running=4): 1, 2, 4; batches in increasing size
    assert report["startup_capture"]["buckets"] == (1, 2, 4)
    assert report["startup_capture"]["max_new_tokens"] == 12
    assert [b["batch"] for b in report["batches"]] == [1, 3]
    assert pool.free_pages() == pool.total_pages()  # every page back (prompt pages cached, still free)
    # the pool (warm-up pages cached under a salt of their own) then serves exactly each request alone
    prompts = [prompt_of(n, seed=700 + n) for n in (30, 45)]
    results = generate_batch(model, prompts, config=CFG, pool=pool, sampling=SamplingParams.greedy(6, ignore_eos=True))
    assert [list(r.token_ids) for r in results] == [oracle(p, 6) for p in prompts]


def test_warm_up_engine_max_tokens_0_skips_the_bucket_pass(tiny_pair):
    model = tiny_pair[0]
    report = warm_up_engine(model, CFG, pool=make_pool(model), batch_sizes=2, prompt_tokens=20, new_tokens=2,
                            max_tokens=0, batching=BATCHING)
    assert report["startup_capture"] is None
    assert [b["batch"] for b in report["batches"]] == [2]


@pytest.mark.parametrize(("kwargs", "field"), [
    ({"batch_sizes": ()}, "batch_sizes"),
    ({"batch_sizes": (0,)}, "batch_sizes"),
    ({"batch_sizes": (True,)}, "batch_sizes"),
    ({"batch_sizes": (5,)}, "max_running"),
    ({"prompt_tokens": 0}, "prompt_tokens"),
    ({"new_tokens": 1}, "new_tokens"),
    ({"max_tokens": -1}, "max_tokens"),
    ({"prompt_tokens": 10**6}, "max_position_embeddings"),
    ({"pool": None}, "pool"),
])
def test_warm_up_engine_bad_input_names_the_argument(tiny_pair, kwargs, field):
    model = tiny_pair[0]
    args = {"pool": make_pool(model), "batch_sizes": (1,), "prompt_tokens": 20, "new_tokens": 2, **kwargs}
    with pytest.raises(ValueError, match=field):
        warm_up_engine(model, CFG, batching=BATCHING, **args)
