"""Hybrid models (sliding-window + global layers, gpt-oss' sinks, Gemma 2's soft-capping) on a GPU with the default
decode runner (``decode_runner="cuda_graphs"``): the Triton kernels take the sinks and the cap, the sliding layers
decode into their ring, and the captured decode step replays.

- graphed decode is bit-identical to eager decode (the same kernels), bf16, with eviction on the global layers;
- every page read (keep-all), fp32: graphed decode gives the tokens of transformers' own eager attention and cache;
- Llama 4 (chunked layers, a NoPE layer scaled by position): graphed decode gives the tokens of eager decode.

Tiny random configs of tests/support/hybrid_models.py (4 layers, window 8) moved to the GPU: about a minute on one
H100, most of it the Triton kernels' first compilations.
"""

from __future__ import annotations

import pytest
import torch

from hf_rocketkv import RocketKVCache, RocketKVConfig, SlidingWindowLayer
from hf_rocketkv.integration.call_state import call_state
from tests.integration.test_chunked_models import GENERATE_BROKEN
from tests.support.hybrid_models import make_hybrid_models, make_llama4_models

from .gpu_models import CUDA, greedy, hybrid_models_on_cuda

ARCHS = ["gpt_oss", "gemma3", "gemma2"]
PROMPT, NEW_TOKENS = 200, 24
REPLAYS = NEW_TOKENS - 2  # the first decode step runs eagerly (warm-up), the second captures, every later replays
COMPRESSING = RocketKVConfig(prompt_budget=64, window_size=8, kernel_size=5, topk=6, topr=8, page_size=4,
                             backend="triton")
KEEP_ALL = RocketKVConfig(prompt_budget=1024, window_size=8, kernel_size=5, topk=4096, topr=16, page_size=4,
                          kt_cache_dtype="float32", backend="triton")


def _prompt(vocab: int, batch: int = 1) -> torch.Tensor:
    generator = torch.Generator("cuda").manual_seed(batch)
    return torch.randint(3, vocab, (batch, PROMPT), device=CUDA, generator=generator)


def _run(model, ids, config, compiled):
    cache = RocketKVCache(config)
    tokens = greedy(model, ids, cache, NEW_TOKENS, compiled)
    step = call_state(cache).graphed_step
    return tokens, (step.replays if step is not None else None), cache


@pytest.mark.parametrize("arch", ARCHS)
@pytest.mark.parametrize("batch", [1, 3])
def test_graphed_decode_is_bit_identical_to_eager(arch, batch):
    rocket, _ = make_hybrid_models(arch)
    rocket = rocket.to(CUDA, torch.bfloat16)
    ids = _prompt(rocket.config.vocab_size, batch)
    eager, eager_replays, _ = _run(rocket, ids, COMPRESSING, compiled=False)
    assert eager_replays is None
    tokens, replays, cache = _run(rocket, ids, COMPRESSING, compiled=True)
    assert replays == REPLAYS, f"{arch}: the decode steps did not replay one CUDA graph ({replays} replays)"
    assert torch.equal(tokens, eager), f"{arch}: {(tokens == eager).float().mean().item():.3f} of tokens equal"
    assert any(isinstance(layer, SlidingWindowLayer) and layer.ring for layer in cache.layers)


@pytest.mark.parametrize("arch", ARCHS)
def test_graphed_keep_all_decode_equals_transformers_eager(arch):
    rocket, oracle = hybrid_models_on_cuda(arch)
    ids = _prompt(rocket.config.vocab_size)
    tokens, replays, _ = _run(rocket, ids, KEEP_ALL, compiled=True)
    assert replays == REPLAYS
    with torch.no_grad():
        want = oracle.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=NEW_TOKENS,
                               min_new_tokens=NEW_TOKENS, do_sample=False, eos_token_id=None, pad_token_id=0,
                               disable_compile=True)[:, PROMPT:]
    assert torch.equal(tokens, want), f"{arch}: {(tokens == want).float().mean().item():.3f} of tokens equal"


@pytest.mark.parametrize("arch", ARCHS)
def test_inductor_decode_keeps_cuda_graphs_and_the_tokens(arch):
    """``decode_runner="torch_compile"``: each step writes the sliding rings and their position counter in place, so
    those tensors must carry static addresses, or inductor skips its CUDA graphs for the whole step ("mutated
    inputs") and the compiled step runs launch by launch (gpt-oss-20b shapes at 32k: 26.0 ms/token against 11.5
    graphed). Keep-all in float32: the tokens equal eager decode's."""
    from torch._dynamo import utils as dynamo_utils

    rocket, _ = hybrid_models_on_cuda(arch)
    ids = _prompt(rocket.config.vocab_size)
    eager, _, _ = _run(rocket, ids, KEEP_ALL, compiled=False)
    torch._dynamo.reset()
    dynamo_utils.counters.clear()
    tokens, _, _ = _run(rocket, ids, KEEP_ALL.replace(decode_runner="torch_compile"), compiled=True)
    skips = dict(dynamo_utils.counters["inductor"])
    assert not skips.get("cudagraph_skips"), f"{arch}: inductor skipped its CUDA graphs: {skips}"
    assert torch.equal(tokens, eager), f"{arch}: {(tokens == eager).float().mean().item():.3f} of tokens equal"


@pytest.mark.skipif(GENERATE_BROKEN, reason="this transformers' generate() cannot run Llama 4")
@pytest.mark.parametrize("config", [COMPRESSING, KEEP_ALL], ids=["compressing", "keep_all"])
def test_llama4_graphed_decode_equals_eager(config):
    """Llama 4 (chunked layers of 8, a NoPE layer scaled by position, dense MLPs): one captured step replayed across
    chunk boundaries gives the tokens of eager decode; the NoPE layer's position comes from a device counter."""
    rocket, _ = make_llama4_models(moe_layers=[])
    rocket = rocket.to(CUDA, torch.float32)
    ids = _prompt(rocket.config.vocab_size, 2)
    eager, _, _ = _run(rocket, ids, config, compiled=False)
    tokens, replays, _ = _run(rocket, ids, config, compiled=True)
    assert replays == REPLAYS
    assert torch.equal(tokens, eager), f"{(tokens == eager).float().mean().item():.3f} of tokens equal"


@pytest.mark.parametrize("arch,runner", [("gemma3", "cuda_graphs"), ("gpt_oss", "cuda_graphs"),
                                         ("gemma3", "torch_compile")])
def test_deferred_stop_takes_a_captured_sliding_step_back(arch, runner):
    """generate()'s deferred stop check, on by default for RocketKV caches on CUDA: the EOS stop comes after more
    decode steps than the window holds, so the extra step (a replay of the captured step) overwrote the oldest slot
    of every sliding layer's full ring, and ``crop(-1)`` puts it back from what the ring kept inside the replay.
    Oracle: the plain check's run (``deferred_stop_check=False``, the same runner): the same tokens, the same rings
    slot by slot and counts, and a next turn that continues the same."""
    from torch._dynamo import utils as dynamo_utils

    from tests.support.hybrid_models import WINDOW

    rocket, _ = hybrid_models_on_cuda(arch)
    ids = _prompt(rocket.config.vocab_size)
    config = COMPRESSING.replace(decode_runner=runner)
    new_tokens = WINDOW + 8
    probe = greedy(rocket, ids, RocketKVCache(config.replace(deferred_stop_check=False)), new_tokens, True)[0]
    firsts = [i for i in range(2, new_tokens - 1) if int(probe[i]) not in probe[:i].tolist()]
    assert firsts, f"{arch}: the probe's tokens repeat from the start: no token to stop on"
    stop = next((i for i in firsts if i > WINDOW), firsts[-1])  # past a whole window of decode steps if it can
    eos = int(probe[stop])  # the first time the probe emits it: generation stops after ``stop`` decode steps
    torch._dynamo.reset()
    dynamo_utils.counters.clear()
    runs = []
    for deferred in (True, False):
        cache = RocketKVCache(config.replace(deferred_stop_check=deferred))
        crops, crop = [], cache.crop
        cache.crop = lambda n, _c=crop, _l=crops: (_l.append(n), _c(n))[1]
        with torch.no_grad():
            out = rocket.generate(ids, attention_mask=torch.ones_like(ids), cache=cache, max_new_tokens=new_tokens,
                                  do_sample=False, eos_token_id=eos, pad_token_id=0)
        step = call_state(cache).graphed_step
        runs.append((out, cache, crops, step.replays if step is not None else None))
    (out, cache, crops, replays), (plain_out, plain, plain_crops, _) = runs
    assert out.shape[1] == ids.shape[1] + stop + 1 and torch.equal(out, plain_out)
    steps_back = [n for n in crops + plain_crops if n]  # crop(0) is a no-op
    assert -1 in crops and steps_back == [-1], f"the deferred check did not take one extra step back: {steps_back}"
    if runner == "cuda_graphs":
        assert replays == stop, f"{arch}: the extra step was not a replay ({replays} replays)"
    else:
        assert not dynamo_utils.counters["inductor"].get("cudagraph_skips"), dict(dynamo_utils.counters["inductor"])
    sliding = [i for i, layer in enumerate(plain.layers) if isinstance(layer, SlidingWindowLayer)]
    assert sliding
    for i in sliding:
        got, want = cache.layers[i], plain.layers[i]
        for mine, theirs in zip(got.ring.row_tensors(), want.ring.row_tensors()):
            assert torch.equal(mine, theirs), f"{arch}: sliding layer {i}'s ring differs after the step back"
        assert int(got.ring.seen) == int(want.ring.seen) and got.seen_tokens == want.seen_tokens, i
    follow = torch.cat([out, _prompt(rocket.config.vocab_size)[:, :3]], dim=1)
    again = [greedy(rocket, follow, c, 4, True) for c in (cache, plain)]
    assert torch.equal(again[0], again[1])
