"""The fused RMSNorm inside RocketKV calls, prefill and decode (``integration/norm.py``, ``RocketKVConfig.fused_norm``).

On CPU the kernel runs under Triton's interpreter; the tests let the wrapper take it on CPU (``FUSED_DEVICE_TYPES``)
and count its calls, so they prove the path is taken, not only that outputs agree. The oracle is the same generation
with ``fused_norm=False`` (transformers' own module): the same tokens, and every step's logits (the prefill's
included) within a small tolerance (the kernel's sum of squares is reduced in another order than PyTorch's, so a
norm's output may differ by one ulp), for each architecture the tests know, in bf16 with a padded batch. On a GPU the same tests run on CUDA
(generate() captures the decode step as a CUDA graph, so the wrapper runs on the warm-up and capture steps only).
Gemma's ``(1 + weight)`` norm (Gemma 2 and 3, their per-head q/k norms included) takes the kernel's ``unit_offset``
form: recorded as ``("gemma", *shape)``, against transformers' Gemma3RMSNorm and in generate() on a tiny Gemma 3
whose norm weights are drawn at random (transformers starts them at zero, where ``1 + weight`` hides the formula).
Qwen3's per-head q/k norms (``[B, T, heads, head_dim]``) take the Llama form. Also: calls that are not RocketKV's (a
DynamicCache, a plain forward, another thread: test_fused_switch.py, fp32) never take it, and norms with another
formula (T5's) are never wrapped. ``fused_residual`` and ``fused_qkv`` are off here: on a GPU they fold some norms
into their own launches (tests/integration/test_residual.py, test_qkv.py).
"""

from __future__ import annotations

import pytest
import torch
from transformers import DynamicCache
from transformers.models.gemma.modeling_gemma import GemmaRMSNorm
from transformers.models.gemma3.modeling_gemma3 import Gemma3RMSNorm
from transformers.models.gpt_oss.modeling_gpt_oss import GptOssRMSNorm
from transformers.models.llama.modeling_llama import LlamaRMSNorm
from transformers.models.mistral.modeling_mistral import MistralRMSNorm
from transformers.models.olmo2.modeling_olmo2 import Olmo2RMSNorm
from transformers.models.t5.modeling_t5 import T5LayerNorm

from hf_rocketkv import RocketKVCache, RocketKVConfig
from hf_rocketkv.integration import compat, norm
from hf_rocketkv.integration.compat import cache_kwargs
from tests.support.hybrid_models import make_hybrid_models
from tests.support.tiny_models import (
    ARCHS,
    compressing_config,
    greedy,
    greedy_with_logits,
    left_pad,
    make_models,
    random_ids,
)

pytest.importorskip("triton")

DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")
pytestmark = pytest.mark.gpu  # the model and kernels run on the GPU where one is present (pytest -m gpu)


@pytest.fixture
def counted(monkeypatch):
    """Lets the wrapper take the kernel on CPU (the interpreter) and counts the kernel's calls."""
    calls = []
    kernel = norm.rms_norm_triton

    def counting(x, weight, eps, formula="llama"):
        calls.append(tuple(x.shape) if formula == "llama" else (formula, *x.shape))
        return kernel(x, weight, eps, formula)

    monkeypatch.setattr(norm, "FUSED_DEVICE_TYPES", ("cuda", "cpu"))
    monkeypatch.setattr(norm, "rms_norm_triton", counting)
    return calls


NORM_ALONE = dict(fused_residual=False, fused_qkv=False)  # on a GPU those take some norms into their own launches


def norms_per_forward_ok(calls: int, per_forward: int, decode_forwards: int) -> bool:
    """Every decode forward's norms on CPU; on CUDA the replayed graph skips Python (some forwards)."""
    if DEVICE.type == "cpu":
        return calls == per_forward * decode_forwards
    return calls % per_forward == 0 and per_forward <= calls <= per_forward * decode_forwards


@pytest.mark.parametrize("arch", sorted(ARCHS))
def test_prefill_and_decode_steps_take_the_fused_norm(arch, counted):
    model = make_models(arch)[0].to(DEVICE, torch.bfloat16)
    rows = [random_ids(1, 40, seed=3)[0], random_ids(1, 29, seed=4)[0]]
    ids, mask = (t.to(DEVICE) for t in left_pad(rows))
    new_tokens = 6
    config = compressing_config(kt_cache_dtype="float32", **NORM_ALONE)
    plain = RocketKVCache(config.replace(fused_norm=False))
    plain_tokens, plain_logits = greedy_with_logits(model, ids, mask, plain, new_tokens)
    assert counted == []
    tokens, logits = greedy_with_logits(model, ids, mask, RocketKVCache(config), new_tokens)
    layers = model.config.num_hidden_layers
    # two per layer and the final norm per forward on the hidden states; Qwen3's q_norm / k_norm on [B, T, heads, D]
    hidden = model.config.hidden_size
    per_head = [shape for shape in counted if len(shape) == 4]
    counted = [shape for shape in counted if len(shape) == 3]
    prefill = [shape for shape in counted if shape[1] > 1]
    assert prefill == [(2, ids.shape[1], hidden)] * (2 * layers + 1)
    assert norms_per_forward_ok(len(counted) - len(prefill), 2 * layers + 1, new_tokens - 1)
    assert set(counted) - set(prefill) == {(2, 1, hidden)}
    if arch == "qwen3":
        head_dim = model.config.head_dim
        q, k = model.config.num_attention_heads, model.config.num_key_value_heads
        assert per_head[:2 * layers] == [(2, ids.shape[1], q, head_dim), (2, ids.shape[1], k, head_dim)] * layers
        assert norms_per_forward_ok(len(per_head) - 2 * layers, 2 * layers, new_tokens - 1)
        assert set(per_head[2 * layers:]) == {(2, 1, q, head_dim), (2, 1, k, head_dim)}
    else:
        assert per_head == []
    assert torch.equal(tokens, plain_tokens)
    torch.testing.assert_close(logits, plain_logits, rtol=0, atol=2.0**-7)  # 4 bf16 ulps at the largest logits (~0.5)


def test_the_fused_norm_is_within_an_ulp_of_transformers_module(counted):
    """One norm module called as the modeling code calls it, and by keyword: the kernel, near transformers' value."""
    module = LlamaRMSNorm(64, eps=1e-6).to(DEVICE, torch.bfloat16)
    with torch.no_grad():
        module.weight.copy_(torch.randn(64, generator=torch.Generator().manual_seed(0)).to(torch.bfloat16))
    x = torch.randn((3, 1, 64), generator=torch.Generator().manual_seed(1)).to(DEVICE, torch.bfloat16)
    with torch.no_grad():
        want = module(x)
        with norm.fused_norm(module, True):
            got, by_keyword = module(x), module(hidden_states=x)
    assert counted == [(3, 1, 64), (3, 1, 64)]
    assert torch.equal(got, by_keyword)
    spacing = torch.finfo(torch.bfloat16).eps * want.float().abs().clamp_min(2.0**-126)
    assert bool(((got.float() - want.float()).abs() <= 2 * spacing).all())


def within_two_ulps(got: torch.Tensor, want: torch.Tensor) -> bool:
    spacing = torch.finfo(torch.bfloat16).eps * want.float().abs().clamp_min(2.0**-126)
    return bool(((got.float() - want.float()).abs() <= 2 * spacing).all())


@pytest.mark.parametrize("eps, scale", [(0.25, 1.0), (1e-5, 0.01), (1e-3, 0.05)])
def test_the_fused_norm_uses_the_modules_own_epsilon(counted, eps, scale):
    """A norm whose epsilon is not the default, on inputs of ordinary magnitude where that epsilon moves the output
    by far more than the two ulps allowed: N(0, 1) activations with eps 0.25, and embedding-sized ones (0.01, 0.05:
    a real model's first norm sees its token embeddings) with the 1e-5 / 1e-3 of real configs. The fused call must
    equal the module's own forward within two ulps; the same module with another epsilon must not (so the
    comparison can see the epsilon at all)."""
    module = LlamaRMSNorm(64, eps=eps).to(DEVICE, torch.bfloat16)
    with torch.no_grad():
        module.weight.copy_(torch.randn(64, generator=torch.Generator().manual_seed(0)).to(torch.bfloat16))
    x = (torch.randn((4, 1, 64), generator=torch.Generator().manual_seed(1)) * scale).to(DEVICE, torch.bfloat16)
    with torch.no_grad():
        want = module(x)
        with norm.fused_norm(module, True):
            got = module(x)
        for other in (eps * 2, eps / 2, 0.0, 1e-6):
            module.variance_epsilon = other
            assert not within_two_ulps(module(x), want), f"eps {other} is not told from {eps} at this tolerance"
    assert counted == [(4, 1, 64)]
    assert within_two_ulps(got, want)


def test_generate_with_a_large_norm_epsilon_keeps_the_models_logits(counted):
    """A tiny Llama whose ``rms_norm_eps`` (0.1) matters on its hidden states: generate() with the fused norm gives
    the logits of transformers' own norm (``fused_norm=False``) within the bf16 tolerance of the other tests, and
    the same weights with the default epsilon do not (the tolerance sees a wrong epsilon)."""
    model = make_models("llama", rms_norm_eps=0.1)[0].to(DEVICE, torch.bfloat16)
    other = make_models("llama", rms_norm_eps=1e-6)[0].to(DEVICE, torch.bfloat16)
    ids, mask = (t.to(DEVICE) for t in left_pad([random_ids(1, 30, seed=7)[0], random_ids(1, 21, seed=8)[0]]))
    config = compressing_config(kt_cache_dtype="float32")
    plain = RocketKVCache(config.replace(fused_norm=False))
    plain_tokens, plain_logits = greedy_with_logits(model, ids, mask, plain, 4)
    _, default_eps_logits = greedy_with_logits(other, ids, mask, RocketKVCache(config.replace(fused_norm=False)), 4)
    assert counted == []
    tokens, logits = greedy_with_logits(model, ids, mask, RocketKVCache(config), 4)
    assert counted
    tolerance = dict(rtol=0, atol=2.0**-7)
    assert not torch.allclose(default_eps_logits, plain_logits, **tolerance)
    assert torch.equal(tokens, plain_tokens)
    torch.testing.assert_close(logits, plain_logits, **tolerance)


def test_calls_that_are_not_rocketkvs_keep_transformers_norm(counted):
    model, sdpa = (m.to(DEVICE, torch.bfloat16) for m in make_models("llama"))
    ids = random_ids(1, 20, seed=5).to(DEVICE)
    greedy(model, ids, max_new_tokens=3, **cache_kwargs(RocketKVCache(compressing_config(**NORM_ALONE))))
    per_forward = 2 * model.config.num_hidden_layers + 1
    assert norms_per_forward_ok(len(counted) - per_forward, per_forward, 2)  # installed now (prefill + decode)
    counted.clear()
    greedy(sdpa, ids, max_new_tokens=3, **cache_kwargs(DynamicCache(config=sdpa.config)))  # the same classes
    with torch.no_grad():
        model(ids[:, :1], **cache_kwargs(RocketKVCache(compressing_config())))  # a plain forward: not generate()
    fp32 = make_models("llama")[0].to(DEVICE)
    greedy(fp32, ids, max_new_tokens=3)  # fp32 (RocketKV): transformers' formula
    greedy(model, ids, max_new_tokens=3, **cache_kwargs(RocketKVCache(compressing_config(fused_norm=False))))
    assert counted == []


def test_the_llama_gpt_oss_and_gemma_formulas_are_wrapped_t5s_is_left_alone(counted):
    """OLMo2's norm has gpt-oss' byte code (the product in fp32); T5's (variance only, cast to the weight's dtype) is
    none of the three."""
    norms = torch.nn.ModuleList([GemmaRMSNorm(64), LlamaRMSNorm(64), Olmo2RMSNorm(64), MistralRMSNorm(64),
                                 LlamaRMSNorm(64), Gemma3RMSNorm(64), GptOssRMSNorm(64), T5LayerNorm(64)])
    norms = norms.to(DEVICE, torch.bfloat16)
    assert compat.norm_classes(norms, "llama") == [LlamaRMSNorm, MistralRMSNorm]
    assert compat.norm_classes(norms, "gemma") == [GemmaRMSNorm, Gemma3RMSNorm]
    assert compat.norm_classes(norms, "gpt_oss") == [Olmo2RMSNorm, GptOssRMSNorm]
    t5_forward = T5LayerNorm.forward
    norm.install_for(norms)
    assert T5LayerNorm.forward is t5_forward
    assert all(getattr(klass.forward, compat.WRAPPED_MARK, False)
               for klass in (MistralRMSNorm, GemmaRMSNorm, Gemma3RMSNorm, Olmo2RMSNorm, GptOssRMSNorm))
    x = torch.randn((2, 1, 64), generator=torch.Generator().manual_seed(2)).to(DEVICE, torch.bfloat16)
    with torch.no_grad():
        for module in norms:
            module.weight.normal_(0.0, 0.5)
        want = [module(x) for module in norms]
        with norm.fused_norm(norms, True):
            got = [module(x) for module in norms]
    assert counted == [("gemma", 2, 1, 64), (2, 1, 64), ("gpt_oss", 2, 1, 64), (2, 1, 64), (2, 1, 64),
                       ("gemma", 2, 1, 64), ("gpt_oss", 2, 1, 64)]
    assert torch.equal(got[7], want[7])
    assert all(within_two_ulps(a, b) for a, b in zip(got, want))


@pytest.mark.parametrize("shape", [(3, 1, 96), (2, 5, 96), (2, 4, 1, 32), (1, 3, 7, 32)])
@pytest.mark.parametrize("eps", [1e-6, 0.25])
def test_the_fused_gemma_norm_is_within_an_ulp_of_transformers_module(counted, shape, eps):
    """Hidden states and the per-head q/k norms' 4-D inputs; the module's own ``eps`` (0.25 moves every output by far
    more than the tolerance: another eps must be told apart)."""
    module = Gemma3RMSNorm(shape[-1], eps=eps).to(DEVICE, torch.bfloat16)
    with torch.no_grad():
        module.weight.copy_(torch.randn(shape[-1], generator=torch.Generator().manual_seed(0)).to(torch.bfloat16))
    x = torch.randn(shape, generator=torch.Generator().manual_seed(1)).to(DEVICE, torch.bfloat16)
    if len(shape) == 4:  # as Gemma 3's q/k norms see it: [B, T, heads, D] transposed to [B, heads, T, D]
        x = x.transpose(1, 2).contiguous().transpose(1, 2)
    with torch.no_grad():
        want = module(x)
        with norm.fused_norm(module, True):
            got, by_keyword = module(x), module(x=x)
        module.eps = eps * 4
        assert not within_two_ulps(module(x), want) or eps < 1e-3, "the eps is not told apart at this tolerance"
        lighter = Gemma3RMSNorm(shape[-1], eps=eps).to(DEVICE, torch.bfloat16)  # weight 0: 1 + w is 1, not 0
        assert not torch.equal(lighter(x), torch.zeros_like(x))
    assert counted == [("gemma", *shape)] * 2
    assert torch.equal(got, by_keyword) and got.shape == want.shape
    assert within_two_ulps(got, want)
    assert float((got != want).float().mean()) < 0.05  # an ulp near a rounding boundary, not a systematic offset


@pytest.mark.parametrize("arch", ["gemma3", "gemma2", "gpt_oss"])
def test_generate_on_gemma_and_gpt_oss_takes_the_fused_norm_for_every_norm_and_keeps_the_tokens(arch, counted):
    """Gemma 3: four norms per layer on the hidden states and two per-head ones (q/k); Gemma 2: four per layer;
    gpt-oss: two per layer (its own formula: the product in fp32)."""
    model = make_hybrid_models(arch)[0].to(DEVICE, torch.bfloat16)
    with torch.no_grad():
        generator = torch.Generator().manual_seed(5)
        for module in model.modules():
            if type(module).__name__.endswith("RMSNorm"):
                module.weight.copy_(torch.randn(module.weight.shape, generator=generator).to(torch.bfloat16) * 0.5)
    rows = [random_ids(1, 30, seed=3)[0], random_ids(1, 21, seed=4)[0]]
    ids, mask = (t.to(DEVICE) for t in left_pad(rows))
    new_tokens = 5
    config = compressing_config(kt_cache_dtype="float32", **NORM_ALONE)
    plain = RocketKVCache(config.replace(fused_norm=False))
    plain_tokens, plain_logits = greedy_with_logits(model, ids, mask, plain, new_tokens)
    assert counted == []
    tokens, logits = greedy_with_logits(model, ids, mask, RocketKVCache(config), new_tokens)
    layers, hidden = model.config.num_hidden_layers, model.config.hidden_size
    heads, kv_heads, head_dim = (model.config.num_attention_heads, model.config.num_key_value_heads,
                                 model.config.head_dim)
    prefill = [c for c in counted if ids.shape[1] in c[2:-1]]
    formula = "gpt_oss" if arch == "gpt_oss" else "gemma"
    per_layer = [(formula, 2, ids.shape[1], hidden)] * (2 if arch == "gpt_oss" else 4)
    if arch == "gemma3":  # q/k norms on [B, heads, T, head_dim]
        per_layer += [("gemma", 2, heads, ids.shape[1], head_dim), ("gemma", 2, kv_heads, ids.shape[1], head_dim)]
    assert sorted(prefill) == sorted(per_layer * layers + [(formula, 2, ids.shape[1], hidden)])
    assert norms_per_forward_ok(len(counted) - len(prefill), len(per_layer) * layers + 1, new_tokens - 1)
    assert torch.equal(tokens, plain_tokens)
    torch.testing.assert_close(logits, plain_logits, rtol=0, atol=2.0**-6)


def test_a_changed_llama_norm_signature_fails_naming_the_transformers_version(monkeypatch):
    def forward(self, hidden_states, residual=None):
        raise AssertionError("never called here")

    monkeypatch.setattr(LlamaRMSNorm, "forward", forward)
    with pytest.raises(compat.CompatError, match=f"transformers {compat.TRANSFORMERS_VERSION}.*fused_norm=False"):
        compat.norm_classes(torch.nn.Sequential(LlamaRMSNorm(8)), "llama")


def test_fused_norm_config_is_validated():
    assert RocketKVConfig().fused_norm is True
    with pytest.raises(ValueError, match="fused_norm must be True or False, got 1"):
        RocketKVConfig(fused_norm=1)
