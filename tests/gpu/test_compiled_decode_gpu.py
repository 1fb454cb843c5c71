"""generate() without ``disable_compile`` on a GPU: RocketKV's decode steps go through the config's decode runner
(CUDA graphs by default) and must give the greedy tokens of eager decode (``disable_compile=True``), on a first
request and on a second of the same shapes, with no dynamo recompile or graph break between them. Also
transformers' deferred stop check (``RocketKVConfig.deferred_stop_check``, on by default on CUDA) against the
per-step check: the same tokens, and after an EOS stop (one extra step, undone by ``crop``) the same cache state.

Llama-3.1-8B layer shapes (2 layers), random bf16 weights, a 4,096-token prompt; batch 1, and batch 4 with the
first eighth of rows 1..3 left-padded.
"""

from __future__ import annotations

import pytest
import torch
import torch._dynamo.utils as dynamo_utils

from hf_rocketkv import RocketKVCache, RocketKVConfig

from .gpu_models import llama_8b_layers, random_prompt

LAYERS, CONTEXT, NEW_TOKENS = 2, 4096, 24
ROCKET = RocketKVConfig(prompt_budget=2048, topk=64, page_size=4)


@pytest.fixture(scope="module")
def model():
    return llama_8b_layers(LAYERS)


def _prompt(batch: int) -> tuple[torch.Tensor, torch.Tensor]:
    ids = random_prompt(batch, CONTEXT, seed=batch)
    mask = torch.ones_like(ids)
    if batch > 1:  # left padding on every row but the first
        mask[1:, : CONTEXT // 8] = 0
        ids[1:, : CONTEXT // 8] = 0
    return ids, mask


def _generate(model, ids, mask, config: RocketKVConfig, **kwargs) -> torch.Tensor:
    cache = kwargs.pop("cache", None)
    kwargs = dict(attention_mask=mask, max_new_tokens=NEW_TOKENS, do_sample=False, eos_token_id=None,
                  pad_token_id=0) | kwargs
    with torch.no_grad():
        return model.generate(ids, cache=RocketKVCache(config) if cache is None else cache, **kwargs)


@pytest.mark.parametrize("batch", [1, 4])
def test_compiled_decode_gives_eager_tokens_without_recompiling(model, batch):
    ids, mask = _prompt(batch)
    eager = _generate(model, ids, mask, ROCKET, disable_compile=True)
    dynamo_utils.counters.clear()
    for attempt in ("first request", "second request of the same shapes"):
        out = _generate(model, ids, mask, ROCKET)
        assert torch.equal(out, eager), (
            f"{attempt}: {(out == eager).float().mean().item():.4f} of the tokens equal eager decode's")
    assert not dynamo_utils.counters["recompiles"], dict(dynamo_utils.counters["recompiles"])
    assert not dynamo_utils.counters["graph_break"], dict(dynamo_utils.counters["graph_break"])


@pytest.mark.parametrize("batch", [1, 4])
def test_deferred_stop_check_gives_the_per_step_tokens_and_cache(model, batch):
    ids, mask = _prompt(batch)
    per_step = ROCKET.replace(deferred_stop_check=False)
    deferred = ROCKET.replace(deferred_stop_check=True)
    reference = _generate(model, ids, mask, per_step)
    assert torch.equal(_generate(model, ids, mask, deferred), reference)

    eos = int(reference[0, CONTEXT + 5])  # row 0 stops at its 6th new token
    stopped = {}
    for name, config in (("per_step", per_step), ("deferred", deferred)):
        cache = RocketKVCache(config)
        out = _generate(model, ids, mask, config, cache=cache, eos_token_id=eos)
        stopped[name] = (out, cache.get_seq_length(), cache.kept_tokens(0), cache.layers[0].lengths.clone())
    (out, length, kept, lengths), (d_out, d_length, d_kept, d_lengths) = stopped["per_step"], stopped["deferred"]
    assert torch.equal(d_out, out), "the deferred stop check changed the tokens of an EOS-stopped request"
    assert d_length == length, "the extra step after EOS was not undone (sequence length)"
    assert torch.equal(d_kept, kept) and torch.equal(d_lengths, lengths), "the cache kept other tokens after EOS"


@pytest.fixture(scope="module")
def float32_model():
    return llama_8b_layers(LAYERS, dtype=torch.float32)


@pytest.mark.parametrize("backend", ["triton", "torch"])
@pytest.mark.parametrize("kt_dtype", ["float8_e5m2", "bfloat16", "float16", "float32"])
def test_torch_compile_runner_with_every_kt_dtype_gives_eager_tokens(float32_model, kt_dtype, backend):
    """decode_runner="torch_compile" (inductor over the whole forward) with each KT dtype and both backends, on a
    float32 model (so the comparison is not about bf16 fusion): the eager tokens, one graph, and none more for a
    second request of the same shapes."""
    model = float32_model
    ids, mask = _prompt(2)
    ids, mask = ids[:, -2048:].contiguous(), mask[:, -2048:].contiguous()
    config = ROCKET.replace(prompt_budget=1024, kt_cache_dtype=kt_dtype, backend=backend,
                            decode_runner="torch_compile")
    eager = _generate(model, ids, mask, config, disable_compile=True, max_new_tokens=16)
    torch._dynamo.reset()
    dynamo_utils.counters.clear()
    for attempt in ("first request", "second request of the same shapes"):
        out = _generate(model, ids, mask, config, max_new_tokens=16)
        assert torch.equal(out, eager), (
            f"{attempt}: {(out == eager).float().mean().item():.4f} of the tokens equal eager decode's")
        assert dynamo_utils.counters["stats"]["unique_graphs"] == 1, dict(dynamo_utils.counters["stats"])

