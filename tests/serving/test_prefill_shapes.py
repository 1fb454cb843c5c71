"""What the batching engine's prefill computes, by shape (the transient memory of a long prompt): a prompt runs in
chunks of ``prefill_chunk_tokens``, and every forward computes the LM head's logits for one position per row only
(``logits_to_keep=1``: for a 32k prompt of a 128k-vocabulary model, all positions' fp32 logits would be 16 GiB).

Oracle: chunk counts written out by hand (ceil(prompt / chunk)); each request's tokens equal the request alone through
model.generate (the ``oracle`` fixture).
"""

from __future__ import annotations

from hf_rocketkv.serving import SamplingParams
from hf_rocketkv.serving.batching.scheduler import BatchingConfig
from tests.serving.helpers import CFG, make_pool, prompt_of


def test_chunked_prefill_computes_logits_of_one_position_per_row(tiny_pair, make_manager, oracle):
    model = tiny_pair[0]
    forwards, heads = [], []
    hooks = [
        model.model.register_forward_pre_hook(lambda _m, args, kw: forwards.append(tuple(kw["input_ids"].shape)),
                                              with_kwargs=True),
        model.lm_head.register_forward_hook(lambda _m, args, out: heads.append(tuple(out.shape))),
    ]
    try:
        manager = make_manager(config=CFG, engine="batching", pool=make_pool(model),
                               batching=BatchingConfig(max_running=4, buckets=(1, 2, 4), prefill_chunk_tokens=16,
                                                       prefill_token_budget=16))
        prompts = [prompt_of(40, seed=801), prompt_of(20, seed=802)]
        params = SamplingParams.greedy(5, ignore_eos=True)
        ids = [manager.add_request(p, params) for p in prompts]
        tokens = [list(manager.result(i).token_ids) for i in ids]
    finally:
        for hook in hooks:
            hook.remove()
    assert tokens == [oracle(p, 5) for p in prompts]
    prefills = [shape for shape in forwards if shape[1] > 1]
    # 40 tokens: chunks of 16, 16, 8; 20 tokens: 16, 4 (one row each)
    assert sorted(prefills) == sorted([(1, 16), (1, 16), (1, 8), (1, 16), (1, 4)])
    assert len(heads) == len(forwards)
    assert all(shape[1] == 1 for shape in heads), heads  # one position per row, prefill and decode alike
