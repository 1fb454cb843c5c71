"""Mixture-of-experts layers inside RocketKV calls (``integration/experts.py``, ``RocketKVConfig.fused_experts``).

On CPU the kernel runs under Triton's interpreter; the tests let the wrapper take it on CPU (``FUSED_DEVICE_TYPES``)
and count its calls, so they prove the path is taken, not only that outputs agree. Oracles: the experts module's own
forward (transformers' code, by the configured implementation), and the same generation with
``fused_experts=False``. Calls with more (token, expert) pairs per expert than ``FUSED_MAX_PAIRS_PER_EXPERT`` (a
prefill) take the grouped prefill path instead (the GEMMs' reference on CPU); calls that are not RocketKV's take
neither.
"""

from __future__ import annotations

import pytest
import torch
from transformers import DynamicCache, GptOssConfig, MixtralConfig
from transformers.models.gpt_oss.modeling_gpt_oss import GptOssExperts
from transformers.models.mixtral.modeling_mixtral import MixtralExperts

from hf_rocketkv import RocketKVCache
from hf_rocketkv.integration import compat, experts
from tests.support.hybrid_models import make_hybrid_models
from tests.support.tiny_models import compressing_config, greedy_with_logits, left_pad, random_ids

pytest.importorskip("triton")

DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")
pytestmark = pytest.mark.gpu  # the model and kernels run on the GPU where one is present (pytest -m gpu)


@pytest.fixture
def counted(monkeypatch):
    """Lets the wrapper take the kernel on CPU (the interpreter) and records each call's (pairs, output features)."""
    calls = []
    kernel = experts.expert_linear_triton

    def counting(x, weight, bias, ids, transposed, rows_per_x=1):
        out = kernel(x, weight, bias, ids, transposed, rows_per_x)
        calls.append(tuple(out.shape))
        return out

    monkeypatch.setattr(experts, "FUSED_DEVICE_TYPES", ("cuda", "cpu"))
    monkeypatch.setattr(experts, "expert_linear_triton", counting)
    return calls


def random_experts(module_cls, config, dtype, seed=0):
    """``(module, config)``: an experts module of ``config`` with every parameter drawn from N(0, 0.3^2)."""
    module = module_cls(config)
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in module.parameters():
            p.copy_(torch.randn(p.shape, generator=g) * 0.3)
    return module.to(DEVICE, dtype), config


def gpt_oss_experts(dtype, seed=0):
    config = GptOssConfig(hidden_size=48, intermediate_size=40, num_local_experts=6, num_experts_per_tok=3)
    return random_experts(GptOssExperts, config, dtype, seed)


def mixtral_experts(dtype, seed=0):
    config = MixtralConfig(hidden_size=48, intermediate_size=40, num_local_experts=6, num_experts_per_tok=2)
    return random_experts(MixtralExperts, config, dtype, seed)


def routed(tokens, config, seed=1, dtype=torch.float32):
    g = torch.Generator().manual_seed(seed)
    hidden = torch.randn((tokens, config.hidden_size), generator=g).to(DEVICE, dtype)
    logits = torch.randn((tokens, config.num_local_experts), generator=g)
    top, ids = torch.topk(logits, config.num_experts_per_tok, dim=-1)
    return hidden, ids.to(DEVICE), torch.softmax(top, dim=-1).to(DEVICE, dtype)


def against_truth(module, hidden, ids, weights, dtype):
    """``(got, want, truth)``: the module's call under the switch and alone, in ``dtype``, and its float64 forward."""
    with torch.no_grad():
        truth = module.double()(hidden.double(), ids, weights.double())
        module.to(dtype)
        want = module(hidden, ids, weights)
        with experts.fused_experts(module, True):
            got = module(hidden, ids, weights)
    return got, want, truth


def assert_within_rounding_of_truth(got, want, truth):
    """Within a few bf16 ulps of the float64 truth, and no further from it than transformers' own forward."""
    error, theirs = (float((out.double() - truth).abs().max()) for out in (got, want))
    assert error <= 0.03 * float(truth.abs().max())
    assert error <= 1.5 * theirs + 1e-3


@pytest.mark.parametrize("make", [gpt_oss_experts, mixtral_experts], ids=["gpt_oss", "mixtral"])
@pytest.mark.parametrize("tokens", [1, 2])
def test_a_decode_steps_experts_equal_transformers_forward(make, tokens, counted):
    """gpt-oss (weights [E, in, out], biases, interleaved gate/up with its clamped gate) and Mixtral ([E, out, in],
    no bias, concatenated gate/up): the module called as the modeling code calls it and by keyword, against its own
    forward outside a RocketKV call."""
    module, config = make(torch.float32)
    hidden, ids, weights = routed(tokens, config)
    with torch.no_grad():
        want = module(hidden, ids, weights)
        with experts.fused_experts(module, True):
            got = module(hidden, ids, weights)
            by_keyword = module(hidden_states=hidden, **dict(zip(_param_names(module)[1:], (ids, weights))))
    pairs = tokens * config.num_experts_per_tok
    assert counted == [(pairs, 2 * config.intermediate_size), (pairs, config.hidden_size)] * 2
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    assert torch.equal(got, by_keyword)


def _param_names(module):
    import inspect

    return tuple(inspect.signature(type(module).forward).parameters)[1:]


def test_bf16_experts_are_within_rounding_of_the_float64_truth(counted):
    """The in-place path rounds each projection once (fp32 sums); transformers' rounds the same products. Both within
    a few bf16 ulps of the float64 computation of the module's own forward."""
    module, config = gpt_oss_experts(torch.bfloat16)
    hidden, ids, weights = routed(2, config, dtype=torch.bfloat16)
    got, want, truth = against_truth(module, hidden, ids, weights, torch.bfloat16)
    assert len(counted) == 2
    assert_within_rounding_of_truth(got, want, truth)


@pytest.mark.parametrize("make", [gpt_oss_experts, mixtral_experts], ids=["gpt_oss", "mixtral"])
def test_a_batched_steps_experts_group_by_expert_and_equal_transformers_forward(make, counted):
    """More pairs than experts, within ``FUSED_MAX_PAIRS_PER_EXPERT`` (a batched decode step: the kernel's grouped
    schedule), including the largest step that still takes the kernel."""
    module, config = make(torch.float32)
    top_k, experts_count = config.num_experts_per_tok, config.num_local_experts
    for tokens in (5, experts.FUSED_MAX_PAIRS_PER_EXPERT * experts_count // top_k):
        counted.clear()
        hidden, ids, weights = routed(tokens, config, seed=tokens)
        with torch.no_grad():
            want = module(hidden, ids, weights)
            with experts.fused_experts(module, True):
                got = module(hidden, ids, weights)
        pairs = tokens * top_k
        assert pairs > experts_count
        assert counted == [(pairs, 2 * config.intermediate_size), (pairs, config.hidden_size)]
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


@pytest.fixture
def prefill_counted(monkeypatch):
    """Lets the grouped prefill path run on CPU (the kernels interpreted, the GEMMs' reference) and records which
    of its kernels ran."""
    calls = []
    for name in ("clamped_glu_triton", "combine_triton"):
        kernel = getattr(experts, name)
        monkeypatch.setattr(experts, name, lambda *a, _k=kernel, _n=name: calls.append(_n) or _k(*a))
    monkeypatch.setattr(experts, "FUSED_DEVICE_TYPES", ("cuda", "cpu"))
    return calls


@pytest.mark.parametrize("make, gate", [(gpt_oss_experts, "clamped_glu_triton"), (mixtral_experts, None)],
                         ids=["gpt_oss", "mixtral"])
def test_a_prefills_experts_grouped_by_expert_equal_transformers_forward(make, gate, prefill_counted, counted):
    """More pairs per expert than the decode path takes (a prefill chunk): the pairs sorted by expert, both
    projections grouped, gpt-oss' gate in one kernel (Mixtral: its own gate), the combine in one more; against the
    module's own forward, and the decode kernel not used."""
    dtype = torch.float32 if DEVICE.type == "cpu" else torch.bfloat16  # torch's grouped GEMM: bf16 on CUDA
    module, config = make(dtype)
    tokens = experts.FUSED_MAX_PAIRS_PER_EXPERT * config.num_local_experts // config.num_experts_per_tok + 7
    hidden, ids, weights = routed(tokens, config, seed=3, dtype=dtype)
    got, want, truth = against_truth(module, hidden, ids, weights, dtype)
    assert prefill_counted == ([gate] if gate else []) + ["combine_triton"] and counted == []
    if dtype == torch.float32:
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    else:
        assert_within_rounding_of_truth(got, want, truth)


def test_a_prefill_in_bf16_is_within_rounding_of_the_float64_truth(prefill_counted):
    """The grouped path rounds fewer times than transformers' forward: within a few bf16 ulps of the float64
    computation of the module's own forward, and no further from it than transformers' bf16 forward."""
    module, config = gpt_oss_experts(torch.bfloat16)
    hidden, ids, weights = routed(120, config, dtype=torch.bfloat16)
    got, want, truth = against_truth(module, hidden, ids, weights, torch.bfloat16)
    assert prefill_counted == ["clamped_glu_triton", "combine_triton"]
    assert_within_rounding_of_truth(got, want, truth)


def test_a_float32_prefill_on_a_gpu_keeps_transformers_forward(prefill_counted):
    """torch's grouped GEMM runs in bf16 only: a float32 prefill on CUDA keeps transformers' forward (on the CPU the
    tests run the GEMMs' reference instead)."""
    if DEVICE.type != "cuda":
        pytest.skip("the grouped GEMM's dtype rule is CUDA's")
    module, config = gpt_oss_experts(torch.float32)
    hidden, ids, weights = routed(120, config)
    with torch.no_grad(), experts.fused_experts(module, True):
        module(hidden, ids, weights)
    assert prefill_counted == []


def test_calls_outside_rocketkv_keep_transformers_forward(counted, prefill_counted):
    module, config = gpt_oss_experts(torch.float32)
    tokens = experts.FUSED_MAX_PAIRS_PER_EXPERT * config.num_local_experts // config.num_experts_per_tok + 1
    many = routed(tokens, config)  # one pair over the decode path's cap: a prefill's shape
    one = routed(1, config)
    with torch.no_grad():
        module(*many)
        assert counted == [] and prefill_counted == []  # the switch is off outside the block
        module(*one)
        assert counted == []
        with experts.fused_experts(module, False):
            module(*one)
            module(*many)
        assert counted == [] and prefill_counted == []


def test_only_experts_classes_are_wrapped():
    model, _ = make_hybrid_models("gpt_oss")
    assert compat.experts_classes(model) == [GptOssExperts]
    assert compat.experts_layout(model.model.layers[0].mlp.experts).transposed is True
    assert compat.experts_layout(model.model.layers[0].mlp) is None  # the block around it (router, experts)
    mixtral, _ = mixtral_experts(torch.float32)
    layout = compat.experts_layout(mixtral)
    assert (layout.transposed, layout.bias, layout.clamped_glu) == (False, False, None)
    gpt_oss = model.model.layers[0].mlp.experts
    assert compat.experts_layout(gpt_oss).clamped_glu == (gpt_oss.alpha, gpt_oss.limit)


def test_a_gpt_oss_subclass_with_its_own_gate_keeps_it():
    """The one-kernel gate reproduces ``GptOssExperts._apply_gate`` only: a subclass that overrides it is run with
    its own gate (no ``clamped_glu``)."""
    class OtherGate(GptOssExperts):
        def _apply_gate(self, gate_up):
            return torch.relu(gate_up[..., ::2]) * gate_up[..., 1::2]

    module = OtherGate(GptOssConfig(hidden_size=16, intermediate_size=8, num_local_experts=2, num_experts_per_tok=1))
    assert compat.experts_layout(module).clamped_glu is None


def test_generate_on_gpt_oss_takes_the_experts_path_in_decode_with_the_same_tokens(counted):
    """A padded batch of two on a tiny gpt-oss (4 experts, top 2): its prefill (more pairs than experts) keeps
    transformers' forward, each decode step (4 pairs) reads its experts in place; tokens and logits as with
    ``fused_experts=False``; a DynamicCache generation never takes it."""
    model, oracle = (m.to(DEVICE) for m in make_hybrid_models("gpt_oss"))
    rows = [random_ids(1, 30, seed=3)[0], random_ids(1, 21, seed=4)[0]]
    ids, mask = (t.to(DEVICE) for t in left_pad(rows))
    config = compressing_config(kt_cache_dtype="float32")
    new_tokens = 5
    plain = RocketKVCache(config.replace(fused_experts=False))
    plain_tokens, plain_logits = greedy_with_logits(model, ids, mask, plain, new_tokens)
    greedy_with_logits(oracle, ids, mask, DynamicCache(), new_tokens)
    assert counted == []
    tokens, logits = greedy_with_logits(model, ids, mask, RocketKVCache(config), new_tokens)
    layers, pairs = model.config.num_hidden_layers, 2 * model.config.num_experts_per_tok
    assert counted and set(counted) <= {(pairs, 2 * model.config.intermediate_size), (pairs, model.config.hidden_size)}
    if DEVICE.type == "cpu":  # every decode forward runs Python (on CUDA the replayed graph skips it)
        assert len(counted) == 2 * layers * (new_tokens - 1)
    assert torch.equal(tokens, plain_tokens)
    torch.testing.assert_close(logits, plain_logits, rtol=1e-4, atol=1e-4)
