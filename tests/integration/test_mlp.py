"""The fused gated MLP inside RocketKV calls (``integration/mlp.py``, ``RocketKVConfig.fused_mlp``).

On CPU the kernels (``kernels/gated_projection.gated_projection_triton`` for the first half, ``projection_triton``
for ``down_proj``) run under Triton's interpreter; the tests let the wrapper take them on CPU (``FUSED_DEVICE_TYPES``)
and record every call (activation name and input shape), so they prove where the path is taken and where it is not,
not only that outputs agree. Oracles:

- generate() on a tiny Llama (SiLU) and a tiny Gemma 3 (C tanh-GELU) in bf16 with a left-padded batch of two: the same
  generation with ``fused_mlp=False`` (transformers' own ``LlamaMLP`` / ``Gemma3MLP`` forward): the same tokens, every
  step's logits within a small tolerance. Decode forwards (one token per row) take the kernel; a prefill of more than
  ``MAX_ROWS`` (64) rows does not, one of at most 64 rows does.
- one MLP module called directly under the switch: a float64 computation of ``down_proj(act(gate x) * (up x))`` from
  the same 16-bit weights and inputs, within a bound derived from the 16-bit roundings (the module's own unfused output
  must satisfy the same bound, and the bound must be under 5% of the output's norm).
- a ``down_proj`` that is not a plain bias-free ``nn.Linear`` or carries hooks: the first half fused, ``down_proj``
  called as the module, bit for bit the module applied to the kernel's first half.
- calls that must never take the kernel (fp32, a DynamicCache, a plain forward, projections with a bias, a LoRA-style
  wrapper or a projection without ``weight``, hooks on a projection or the activation, grad mode, activations other
  than transformers' SiLU and C tanh-GELU, more than 64 rows, 2-D inputs, a process group, torch.compile's tracing
  flag): no kernel call, and the output equal bit for bit to the module's own forward outside the switch.
- ``compat.mlp_classes``: LlamaMLP's byte code is found in Llama, Mistral, Qwen2 and Gemma 3's MLP classes, not in
  Phi-3's (one fused gate/up projection); a LlamaMLP.forward with another signature raises ``CompatError`` naming the
  transformers version and ``fused_mlp=False``.
On a GPU the same tests run on CUDA (generate() may capture the decode step as a CUDA graph, so the wrapper runs on
the warm-up and capture steps only).
"""

from __future__ import annotations

import functools
import math

import pytest
import torch
from transformers import DynamicCache, Gemma3TextConfig, LlamaConfig, Phi3Config
from transformers.activations import ACT2FN, GELUTanh, SiLUActivation
from transformers.models.gemma3.modeling_gemma3 import Gemma3MLP
from transformers.models.llama.modeling_llama import LlamaMLP
from transformers.models.mistral.modeling_mistral import MistralMLP
from transformers.models.phi3.modeling_phi3 import Phi3MLP
from transformers.models.qwen2.modeling_qwen2 import Qwen2MLP

from hf_rocketkv import RocketKVCache, RocketKVConfig
from hf_rocketkv.integration import compat, mlp
from hf_rocketkv.integration.compat import cache_kwargs
from hf_rocketkv.kernels.gated_projection import MAX_ROWS
from tests.support.hybrid_models import make_hybrid_models
from tests.support.kernel_calls import record_calls
from tests.support.tiny_models import (BASE_CONFIG, compressing_config, greedy, greedy_with_logits, make_models,
                                      padded_batch, random_ids)

pytest.importorskip("triton")

DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")
pytestmark = pytest.mark.gpu  # the model and kernels run on the GPU where one is present (pytest -m gpu)


@pytest.fixture
def down_calls(monkeypatch):
    """Records the plain kernel's calls (``down_proj``): h's shape."""
    return record_calls(monkeypatch, mlp, "projection_triton")


@pytest.fixture
def counted(monkeypatch, down_calls):
    """Lets the wrapper take the kernels on CPU (the interpreter) and records the gated kernel's calls: (act, x's
    shape). Every gated call here is followed by a plain call for ``down_proj`` (checked at the end of the test)."""
    calls = []
    kernel = mlp.gated_projection_triton

    def counting(x, gate, up, act, *args, **kwargs):
        calls.append((act, tuple(x.shape)))
        return kernel(x, gate, up, act, *args, **kwargs)

    monkeypatch.setattr(mlp, "FUSED_DEVICE_TYPES", ("cuda", "cpu"))
    monkeypatch.setattr(mlp, "gated_projection_triton", counting)
    yield calls
    assert [shape[:-1] for shape in down_calls] == [shape[:-1] for _, shape in calls]  # one down_proj per MLP


def decode_calls_ok(calls: int, layers: int, decode_forwards: int) -> bool:
    """Every decode forward's MLPs on CPU; on CUDA the replayed graph skips Python (some forwards)."""
    if DEVICE.type == "cpu":
        return calls == layers * decode_forwards
    return calls % layers == 0 and layers <= calls <= layers * decode_forwards


def check_generate(model, counted, lengths, act, new_tokens=5, logits_atol=2.0**-7):
    """generate() with the fused MLP against ``fused_mlp=False``; the kernel on the decode steps (rows = batch) and on
    the prefill only when it has at most MAX_ROWS rows."""
    ids, mask = padded_batch(lengths, DEVICE)
    config = compressing_config(kt_cache_dtype="float32")
    plain = RocketKVCache(config.replace(fused_mlp=False))
    plain_tokens, plain_logits = greedy_with_logits(model, ids, mask, plain, new_tokens)
    assert counted == []
    tokens, logits = greedy_with_logits(model, ids, mask, RocketKVCache(config), new_tokens)
    layers, hidden = model.config.num_hidden_layers, model.config.hidden_size
    batch, length = ids.shape
    prefill = [call for call in counted if call[1][1] > 1]
    decode = [call for call in counted if call[1][1] == 1]
    assert len(prefill) + len(decode) == len(counted)
    if batch * length > MAX_ROWS:
        assert prefill == []  # cuBLAS's two GEMMs (transformers' forward) for a long prefill
    else:
        assert prefill == [(act, (batch, length, hidden))] * layers
    assert set(decode) == {(act, (batch, 1, hidden))}  # one token per row: rows = batch
    assert decode_calls_ok(len(decode), layers, new_tokens - 1)
    assert torch.equal(tokens, plain_tokens)
    torch.testing.assert_close(logits, plain_logits, rtol=0, atol=logits_atol)


@pytest.mark.parametrize("lengths", [(70, 66), (30, 21)], ids=["prefill-140-rows", "prefill-60-rows"])
def test_generate_on_llama_takes_the_kernel_on_decode_steps_and_keeps_the_tokens(counted, lengths):
    """Prompts of 70 and 66 tokens: a 2 x 70 prefill (more than 64 rows) runs transformers' forward; prompts of 30
    and 21: the 2 x 30 prefill takes the kernel too. Logits within 2 bf16 ulps at the largest logits (~0.6)."""
    model = make_models("llama")[0].to(DEVICE, torch.bfloat16)
    check_generate(model, counted, lengths, "silu")


def test_generate_on_gemma3_takes_the_tanh_gelu_kernel_and_keeps_the_tokens(counted):
    """Gemma 3's MLP (``gelu_pytorch_tanh``: transformers' GELUTanh with the C formula) is recognised as the kernel's
    ``gelu_tanh``; logits (up to ~5.3 here) within 2 bf16 ulps at that magnitude."""
    model = make_hybrid_models("gemma3")[0].to(DEVICE, torch.bfloat16)
    assert compat.mlp_classes(model) == [Gemma3MLP]
    assert {compat.mlp_activation(m.act_fn) for m in model.modules() if isinstance(m, Gemma3MLP)} == {"gelu_tanh"}
    check_generate(model, counted, (70, 66), "gelu_tanh", logits_atol=2.0**-4)


# --------------------------------------------------------------------------------------------------- never fused
def llama_mlp(hidden=64, inter=128, dtype=torch.bfloat16, seed=0, **overrides):
    torch.manual_seed(seed)
    config = LlamaConfig(**{**BASE_CONFIG, "hidden_size": hidden, "intermediate_size": inter, **overrides})
    module = LlamaMLP(config).to(DEVICE, dtype)
    with torch.no_grad():
        for linear in (module.gate_proj, module.up_proj, module.down_proj):
            linear.weight.normal_(0.0, 2.0 / math.sqrt(linear.in_features))  # gate outputs of order 1-2
            if linear.bias is not None:
                linear.bias.normal_(0.0, 0.5)
    return module


def hidden_states(shape, dtype=torch.bfloat16, seed=1):
    return torch.randn(shape, generator=torch.Generator().manual_seed(seed)).to(DEVICE, dtype)


def fused_call(module, x, counted):
    """``module(x)`` under the switch: (number of kernel calls it made, whether it equals the module's own output
    outside the switch bit for bit)."""
    before = len(counted)
    with torch.no_grad():
        want = module(x)
        with mlp.fused_mlp(module, True):
            got = module(x)
    return len(counted) - before, torch.equal(got, want)


def test_the_switch_takes_the_kernel_for_a_decode_step_in_bf16_and_fp16(counted):
    """The positive control of the tests below: the same module and shapes do take the kernel."""
    assert fused_call(llama_mlp(), hidden_states((2, 1, 64)), counted)[0] == 1
    assert fused_call(llama_mlp(dtype=torch.float16), hidden_states((2, 1, 64), torch.float16), counted)[0] == 1
    assert fused_call(llama_mlp(), hidden_states((4, 16, 64)), counted)[0] == 1  # exactly MAX_ROWS rows
    assert fused_call(llama_mlp(), hidden_states((1, 64, 64)), counted)[0] == 1
    with torch.no_grad():  # outside the switch: never
        llama_mlp()(hidden_states((2, 1, 64)))
    assert counted == [("silu", (2, 1, 64)), ("silu", (2, 1, 64)), ("silu", (4, 16, 64)), ("silu", (1, 64, 64))]


@pytest.mark.parametrize("shape", [(1, 65, 64), (65, 1, 64), (5, 13, 64), (3, 64)],
                         ids=["1x65", "65x1", "5x13", "2-D"])
def test_more_than_max_rows_or_2d_inputs_run_the_modules_own_forward(counted, shape):
    assert fused_call(llama_mlp(), hidden_states(shape), counted) == (0, True)
    assert counted == []


def test_fp32_runs_the_modules_own_forward(counted):
    assert fused_call(llama_mlp(dtype=torch.float32), hidden_states((2, 1, 64), torch.float32), counted) == (0, True)
    assert counted == []


def test_projections_with_a_bias_run_the_modules_own_forward(counted):
    """``mlp_bias=True``: the kernel has no bias term; a module call and generate() on a Llama with biases."""
    module = llama_mlp(mlp_bias=True)
    assert module.gate_proj.bias is not None
    assert fused_call(module, hidden_states((2, 1, 64)), counted) == (0, True)
    model = make_models("llama", mlp_bias=True)[0].to(DEVICE, torch.bfloat16)
    ids, mask = padded_batch((20, 13), DEVICE)
    config = compressing_config(kt_cache_dtype="float32")
    tokens, _ = greedy_with_logits(model, ids, mask, RocketKVCache(config), 3)
    plain_tokens, _ = greedy_with_logits(model, ids, mask, RocketKVCache(config.replace(fused_mlp=False)), 3)
    assert counted == []
    assert torch.equal(tokens, plain_tokens)


class ReluSiLU(SiLUActivation):  # transformers' class, another forward: not recognised by its type
    def forward(self, input):
        return torch.relu(input)


def c_gelu_none():
    act = GELUTanh()
    act.act = functools.partial(torch.nn.functional.gelu, approximate="none")
    return act


@pytest.mark.parametrize("make_act", [lambda: GELUTanh(use_gelu_tanh_python=True), lambda: ACT2FN["gelu_python_tanh"],
                                      torch.nn.ReLU, lambda: ACT2FN["gelu"], ReluSiLU, c_gelu_none],
                         ids=["gelu-tanh-python", "act2fn-gelu_python_tanh", "relu", "gelu-erf", "silu-subclass",
                              "gelu-tanh-approximate-none"])
def test_other_activations_run_the_modules_own_forward(counted, make_act):
    act = make_act()
    assert compat.mlp_activation(act) is None
    module = llama_mlp()
    module.act_fn = act
    assert fused_call(module, hidden_states((2, 1, 64)), counted) == (0, True)
    assert counted == []


class AdapterLinear(torch.nn.Module):
    """A LoRA-style wrapper: it exposes the base layer's ``weight`` and ``bias`` and adds its own term in forward."""

    def __init__(self, base):
        super().__init__()
        self.base_layer = base
        self.extra = torch.nn.Linear(base.in_features, base.out_features, bias=False).to(base.weight)

    weight = property(lambda self: self.base_layer.weight)
    bias = property(lambda self: self.base_layer.bias)

    def forward(self, x):
        return self.base_layer(x) + self.extra(x)


class PackedLinear(torch.nn.Module):
    """A quantized-style projection: packed weights, no ``weight`` attribute."""

    def __init__(self, base):
        super().__init__()
        self.base = base

    def forward(self, x):
        return self.base(x)


def change_part(module, name: str, change: str) -> list:
    """Makes ``module.<name>`` not a plain bias-free ``nn.Linear`` (or gives it a hook): ``change`` is one of
    "adapter", "packed", "hook", "pre-hook", "bias". Returns the list the hooks append to."""
    ran, part = [], getattr(module, name)
    if change == "adapter":
        setattr(module, name, AdapterLinear(part))
    elif change == "packed":
        setattr(module, name, PackedLinear(part))
    elif change == "hook":
        part.register_forward_hook(lambda *args: ran.append("hook"))
    elif change == "pre-hook":
        part.register_forward_pre_hook(lambda *args: ran.append("hook"))
    else:
        biased = torch.nn.Linear(part.in_features, part.out_features, bias=True)
        setattr(module, name, biased.to(DEVICE, part.weight.dtype))
    return ran


@pytest.mark.parametrize("name, change", [("gate_proj", "adapter"), ("up_proj", "packed"), ("gate_proj", "hook"),
                                          ("up_proj", "pre-hook"), ("act_fn", "hook")])
def test_projections_that_are_not_plain_linears_or_carry_hooks_run_the_modules_own_forward(counted, name, change):
    """The kernel reads the weights itself: a wrapper's own term, a projection without ``weight`` and any forward
    hook or pre-hook on the projections or the activation would be skipped, so these keep the module's forward."""
    module = llama_mlp()
    ran = change_part(module, name, change)
    assert fused_call(module, hidden_states((2, 1, 64)), counted) == (0, True)
    assert counted == []
    assert ran == (["hook", "hook"] if change.endswith("hook") else [])  # once outside the switch, once inside


@pytest.mark.parametrize("change", ["adapter", "packed", "hook", "pre-hook", "bias"])
def test_a_down_proj_that_is_not_a_plain_linear_runs_as_a_module_after_the_fused_first_half(counted, down_calls,
                                                                                             change):
    """The first half still takes the gated kernel; ``down_proj`` is called as the module (its own term, its hooks),
    so the output is the module's ``down_proj`` of the kernel's first half, bit for bit."""
    module, x = llama_mlp(), hidden_states((2, 1, 64))
    ran = change_part(module, "down_proj", change)
    with torch.no_grad():
        with mlp.fused_mlp(module, True):
            got = module(x)
        want = module.down_proj(mlp.gated_projection_triton(x, module.gate_proj.weight, module.up_proj.weight,
                                                            "silu"))
    assert torch.equal(got, want)
    assert len(counted) == 2 and down_calls == []  # the switch's call and this test's own
    assert ran == (["hook", "hook"] if change.endswith("hook") else [])
    counted.clear()


def test_a_forward_recording_gradients_runs_the_modules_own_forward(counted):
    """The kernel has no backward: with grad mode on, the module's own forward (its output keeps its graph)."""
    module, x = llama_mlp(), hidden_states((2, 1, 64))
    with torch.enable_grad(), mlp.fused_mlp(module, True):  # whatever grad mode another test left this process in
        out = module(x)
    assert counted == [] and out.requires_grad


def test_transformers_silu_and_c_tanh_gelu_are_recognised():
    assert compat.mlp_activation(ACT2FN["silu"]) == "silu"
    assert compat.mlp_activation(ACT2FN["swish"]) == "silu"  # torch's nn.SiLU
    assert compat.mlp_activation(ACT2FN["gelu_pytorch_tanh"]) == "gelu_tanh"
    assert compat.mlp_activation(GELUTanh()) == "gelu_tanh"


def test_a_process_group_in_use_runs_the_modules_own_forward(counted, monkeypatch):
    """Tensor parallelism: the projections carry the plan's hooks (a sharded weight read raw would be wrong)."""
    monkeypatch.setattr(mlp, "distributed", lambda: True)
    assert fused_call(llama_mlp(), hidden_states((2, 1, 64)), counted) == (0, True)
    assert counted == []


def test_torch_compile_tracing_runs_the_modules_own_forward(counted, monkeypatch):
    """The wrapper's guard for a traced call (``torch.compiler.is_compiling()``); compiling itself is not exercised."""
    monkeypatch.setattr(torch.compiler, "is_compiling", lambda: True)
    assert fused_call(llama_mlp(), hidden_states((2, 1, 64)), counted) == (0, True)
    assert counted == []


def test_calls_that_are_not_rocketkvs_keep_transformers_mlp(counted, down_calls):
    model, sdpa = (m.to(DEVICE, torch.bfloat16) for m in make_models("llama"))
    ids = random_ids(1, 20, seed=5).to(DEVICE)
    greedy(model, ids, max_new_tokens=3, **cache_kwargs(RocketKVCache(compressing_config())))
    layers = model.config.num_hidden_layers
    assert counted and decode_calls_ok(len(counted) - layers, layers, 2)  # installed now (prefill + decode)
    counted.clear()
    down_calls.clear()
    greedy(sdpa, ids, max_new_tokens=3, **cache_kwargs(DynamicCache(config=sdpa.config)))  # the same class
    with torch.no_grad():
        model(ids[:, :1], **cache_kwargs(RocketKVCache(compressing_config())))  # a plain forward: not generate()
    fp32 = make_models("llama")[0].to(DEVICE)
    greedy(fp32, ids, max_new_tokens=3, **cache_kwargs(RocketKVCache(compressing_config())))  # fp32 (RocketKV)
    greedy(model, ids, max_new_tokens=3, **cache_kwargs(RocketKVCache(compressing_config(fused_mlp=False))))
    assert counted == []


# --------------------------------------------------------------------------------------------------- the classes
def test_llama_mistral_qwen2_and_gemma3_mlps_are_found_phi3s_is_not():
    config = LlamaConfig(**BASE_CONFIG)
    gemma = Gemma3TextConfig(**BASE_CONFIG)
    phi3 = Phi3Config(**{k: v for k, v in BASE_CONFIG.items() if k != "head_dim"})
    modules = torch.nn.ModuleList([Phi3MLP(phi3), LlamaMLP(config), MistralMLP(config), Qwen2MLP(config),
                                   Gemma3MLP(gemma), LlamaMLP(config), torch.nn.Linear(4, 4)])
    assert compat.mlp_classes(modules) == [LlamaMLP, MistralMLP, Qwen2MLP, Gemma3MLP]
    assert compat.mlp_classes(torch.nn.ModuleList([Phi3MLP(phi3)])) == []
    for arch, klass in (("llama", LlamaMLP), ("mistral", MistralMLP), ("qwen2", Qwen2MLP)):  # whole models
        assert compat.mlp_classes(make_models(arch)[0]) == [klass]


def test_a_changed_llama_mlp_signature_fails_naming_fused_mlp_false(monkeypatch):
    """transformers renaming LlamaMLP.forward's parameter: ``CompatError`` at the first RocketKV call that would wrap
    it, naming the version and the way out (``fused_mlp=False``), which then generates as before."""
    model = make_models("llama")[0].to(DEVICE, torch.bfloat16)  # its MLPs not wrapped by this model yet
    ids = random_ids(1, 12, seed=6).to(DEVICE)
    want = greedy(model, ids, max_new_tokens=2, **cache_kwargs(RocketKVCache(compressing_config(fused_mlp=False))))

    def forward(self, hidden_states):  # the same computation under another parameter name
        return self.down_proj(self.act_fn(self.gate_proj(hidden_states)) * self.up_proj(hidden_states))

    monkeypatch.setattr(LlamaMLP, "forward", forward)
    message = f"transformers {compat.TRANSFORMERS_VERSION}.*LlamaMLP.*fused_mlp=False"
    with pytest.raises(compat.CompatError, match=message):
        compat.mlp_classes(torch.nn.Sequential(LlamaMLP(LlamaConfig(**BASE_CONFIG))))
    with pytest.raises(compat.CompatError, match=message):
        greedy(model, ids, max_new_tokens=2, **cache_kwargs(RocketKVCache(compressing_config())))
    got = greedy(model, ids, max_new_tokens=2, **cache_kwargs(RocketKVCache(compressing_config(fused_mlp=False))))
    assert torch.equal(got, want)


def test_fused_mlp_config_is_validated():
    assert RocketKVConfig().fused_mlp is True
    with pytest.raises(ValueError, match="fused_mlp must be True or False, got 1"):
        RocketKVConfig(fused_mlp=1)


# --------------------------------------------------------------------------------------------------- float64 oracle
LIPSCHITZ = 1.13  # max |act'|: SiLU's is 1.0998 (at g ~ 2.4), tanh-GELU's 1.1289 (at g ~ 1.5)


def float64_mlp(module, x):
    """down_proj(act(gate x) * (up x)) in float64 from the module's 16-bit weights: (y, a, g, u, |W_d| |h|)."""
    wg, wu, wd = (lin.weight.detach().double() for lin in (module.gate_proj, module.up_proj, module.down_proj))
    x64 = x.double()
    g, u = x64 @ wg.T, x64 @ wu.T
    if compat.mlp_activation(module.act_fn) == "gelu_tanh":
        a = 0.5 * g * (1.0 + torch.tanh(math.sqrt(2.0 / math.pi) * (g + 0.044715 * g**3)))
    else:
        a = g * torch.sigmoid(g)
    return (a * u) @ wd.T, a, g, u, (a * u).abs() @ wd.abs().T


def rounding_bound(module, x, dtype):
    """Per token, a bound on ``||y_16 - y_64||_2`` for any computation that rounds like eager PyTorch: g and u are
    GEMM outputs accumulated in fp32 and rounded to ``dtype`` (|dg| <= eps|g| + K 2^-24 (|x| |W_g|), the same for u),
    ``act(g)`` is rounded (|da| <= LIPSCHITZ |dg| + eps|a|), the product is rounded (+ eps|h|), so, to first order,
    |dh| <= LIPSCHITZ |dg| |u| + |a| |du| + 2 eps |a u| (times 1.05 for the second-order terms). down_proj
    propagates it by at most its spectral norm, ``||W_d dh||_2 <= ||W_d||_2 ||dh||_2``, then accumulates in fp32
    (K' 2^-24 |W_d| |h|) and rounds its output (eps |y|). ``eps`` is the dtype's unit roundoff (2^-8 for bf16)."""
    eps = torch.finfo(dtype).eps / 2
    y, a, g, u, abs_wd_h = float64_mlp(module, x)
    x64 = x.double().abs()
    hidden, inter = module.gate_proj.in_features, module.gate_proj.out_features
    dg = eps * g.abs() + hidden * 2.0**-24 * (x64 @ module.gate_proj.weight.detach().double().abs().T)
    du = eps * u.abs() + hidden * 2.0**-24 * (x64 @ module.up_proj.weight.detach().double().abs().T)
    dh = 1.05 * (LIPSCHITZ * dg * u.abs() + a.abs() * du + 2 * eps * (a * u).abs())
    spectral = torch.linalg.matrix_norm(module.down_proj.weight.detach().double(), ord=2)
    bound = (spectral * dh.norm(dim=-1) + eps * 1.01 * y.norm(dim=-1)
             + inter * 2.0**-24 * abs_wd_h.norm(dim=-1))
    return y, bound


@pytest.mark.parametrize("hidden_act, dtype", [("silu", torch.bfloat16), ("gelu_pytorch_tanh", torch.bfloat16),
                                               ("silu", torch.float16)])
@pytest.mark.parametrize("shape", [(3, 1, 300), (2, 5, 300)])
def test_the_fused_mlp_is_within_a_rounding_bound_of_a_float64_oracle(counted, down_calls, hidden_act, dtype,
                                                                     shape):
    """hidden 300 (not a multiple of the kernel's 128-wide reduction tile: a masked last tile), intermediate 100 (not
    a multiple of its 32-wide column tile: a masked last column tile; for ``down_proj``'s plain kernel the other way
    round), gate outputs of standard deviation 2 (both branches of the activation). The bound is ``rounding_bound``'s (rigorous to first order; here ~3.5% of the
    output's norm in bf16, ~0.5% in fp16, and the measured errors ~10-20% of it); it must be under 5% of the output's
    norm per token, and transformers' own module must satisfy it too (the bound is the roundings', not the
    kernel's)."""
    module = llama_mlp(hidden=300, inter=100, dtype=dtype, hidden_act=hidden_act)
    x = hidden_states(shape, dtype)
    with torch.no_grad():
        unfused = module(x)
        with mlp.fused_mlp(module, True):
            fused, by_keyword = module(x), module(x=x)
        want, bound = rounding_bound(module, x, dtype)
    act = compat.mlp_activation(module.act_fn)
    assert counted == [(act, shape)] * 2 and down_calls == [(*shape[:-1], 100)] * 2
    assert torch.equal(fused, by_keyword) and fused.dtype == dtype and fused.shape == want.shape
    assert bool((bound < 0.05 * want.norm(dim=-1)).all()), "the bound is vacuous"
    unfused_error = (unfused.double() - want).norm(dim=-1)
    fused_error = (fused.double() - want).norm(dim=-1)
    assert bool((unfused_error <= bound).all()), (unfused_error / bound).max()
    assert bool((fused_error <= bound).all()), (fused_error / bound).max()
