"""The fused RoPE inside RocketKV calls, prefill and decode (``integration/rope.py``, ``RocketKVConfig.fused_rope``).

On CPU the kernel runs under Triton's interpreter; the tests let the wrapper take it on CPU
(``FUSED_DEVICE_TYPES``) and count its calls, so they prove the path is taken, not only that outputs agree. The
oracle is the same generation with ``fused_rope=False`` (transformers' own RoPE): tokens and every step's logits
must be equal bit for bit, for each architecture the tests know, in bf16 with a padded batch. On a GPU the same
tests run on CUDA (Triton backend; generate() captures the decode step as a CUDA graph, so the wrapper runs on the
warm-up and capture steps only). Also: calls that are
not RocketKV's (a DynamicCache, another thread, a plain forward, fp32) never take it, and a modeling module whose
rotary function takes other parameters is left alone.
"""

from __future__ import annotations

import sys
import types

import pytest
import torch
from transformers import DynamicCache

from hf_rocketkv import RocketKVCache
from hf_rocketkv.integration.compat import cache_kwargs
from hf_rocketkv.integration import rope
from tests.support.markers import slow_except
from tests.support.tiny_models import ARCHS, compressing_config, greedy, left_pad, make_models, random_ids

pytest.importorskip("triton")


@pytest.fixture
def counted(monkeypatch):
    """Lets the wrapper take the kernel on CPU (the interpreter) and counts the kernel's calls."""
    calls = []
    kernel = rope.rope_triton

    def counting(q, k, cos, sin):
        calls.append(tuple(q.shape))
        return kernel(q, k, cos, sin)

    monkeypatch.setattr(rope, "FUSED_DEVICE_TYPES", ("cuda", "cpu"))
    monkeypatch.setattr(rope, "rope_triton", counting)
    return calls


DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")
pytestmark = pytest.mark.gpu  # the model and kernels run on the GPU where one is present (pytest -m gpu)


def bf16_model(arch):
    rocket, _ = make_models(arch)
    return rocket.to(DEVICE, torch.bfloat16)


def forwards_per_layer_ok(calls: int, layers: int, decode_forwards: int) -> bool:
    """Every decode forward of every layer on CPU; on CUDA the replayed graph skips Python (some forwards)."""
    if DEVICE.type == "cpu":
        return calls == layers * decode_forwards
    return calls % layers == 0 and layers <= calls <= layers * decode_forwards


def generate(model, ids, mask, cache, new_tokens):
    out = greedy(model, ids, max_new_tokens=new_tokens, attention_mask=mask, **cache_kwargs(cache),
                 output_logits=True, return_dict_in_generate=True)
    return out.sequences, torch.stack(out.logits)


@pytest.mark.parametrize("arch", slow_except(sorted(ARCHS), keep=["llama"]))  # the others: 8-10 s each
def test_prefill_and_decode_steps_take_the_fused_rope_bit_for_bit(arch, counted):
    model = bf16_model(arch)
    rows = [random_ids(1, 40, seed=3)[0], random_ids(1, 29, seed=4)[0]]
    ids, mask = (t.to(DEVICE) for t in left_pad(rows))
    new_tokens = 6
    config = compressing_config(kt_cache_dtype="float32")
    plain_tokens, plain_logits = generate(model, ids, mask, RocketKVCache(config.replace(fused_rope=False)), new_tokens)
    assert counted == []
    tokens, logits = generate(model, ids, mask, RocketKVCache(config), new_tokens)
    layers = model.config.num_hidden_layers
    heads, head_dim = model.config.num_attention_heads, model.config.head_dim
    prefill = [shape for shape in counted if shape[2] > 1]
    assert prefill == [(2, heads, ids.shape[1], head_dim)] * layers  # the prefill: one call per layer
    assert forwards_per_layer_ok(len(counted) - len(prefill), layers, new_tokens - 1)
    assert set(counted) - set(prefill) == {(2, heads, 1, head_dim)}
    assert torch.equal(tokens, plain_tokens)
    assert torch.equal(logits.view(torch.int16), plain_logits.view(torch.int16))


def test_calls_that_are_not_rocketkvs_keep_transformers_rope(counted):
    model, sdpa = (m.to(DEVICE, torch.bfloat16) for m in make_models("llama"))
    ids = random_ids(1, 20, seed=5).to(DEVICE)
    greedy(model, ids, max_new_tokens=3, **cache_kwargs(RocketKVCache(compressing_config())))
    layers = model.config.num_hidden_layers
    assert forwards_per_layer_ok(len(counted) - layers, layers, 2)  # the wrapper is installed now (prefill + decode)
    counted.clear()
    greedy(sdpa, ids, max_new_tokens=3, **cache_kwargs(DynamicCache(config=sdpa.config)))  # same modeling module
    with torch.no_grad():
        model(ids, **cache_kwargs(RocketKVCache(compressing_config())))  # a plain forward: not a generate() call
    fp32 = make_models("llama")[0].to(DEVICE)
    greedy(fp32, ids, max_new_tokens=3)  # fp32 (RocketKV): transformers' formula
    assert counted == []


def test_a_rotary_function_with_other_parameters_is_left_alone(monkeypatch):
    name = "transformers.models.hf_rocketkv_fake.modeling_hf_rocketkv_fake"
    fake = types.ModuleType(name)

    def apply_rotary_pos_emb(q, k, cos, sin, position_ids=None, unsqueeze_dim=1):
        raise AssertionError("never called here")

    fake.apply_rotary_pos_emb = apply_rotary_pos_emb

    class FakeAttention(torch.nn.Module):
        pass

    FakeAttention.__module__ = name
    monkeypatch.setitem(sys.modules, name, fake)
    model = torch.nn.Sequential(FakeAttention())
    assert rope.compat.rotary_modules(model) == []
    rope.install_for(model)
    assert fake.apply_rotary_pos_emb is apply_rotary_pos_emb

    llama = make_models("llama")[0]
    owners = rope.compat.rotary_modules(llama)
    assert [owner.__name__ for owner in owners] == ["transformers.models.llama.modeling_llama"]


def test_fused_rope_config_is_validated():
    from hf_rocketkv import RocketKVConfig

    assert RocketKVConfig().fused_rope is True
    with pytest.raises(ValueError, match="fused_rope must be True or False, got 1"):
        RocketKVConfig(fused_rope=1)
