"""Residual adds fused with their RMSNorms inside RocketKV calls (``integration/residual.py``,
``RocketKVConfig.fused_residual``).

On CPU the kernels (``kernels/residual_norm.residual_norm_triton`` and the fused RMSNorm it builds on) run under
Triton's interpreter; the tests let the wrappers take them on CPU (``FUSED_DEVICE_TYPES`` of ``residual.py`` and
``norm.py``) and record every residual call (x's shape, whether ``pre`` and ``post`` were given), so they prove where
the path is taken and where it is not. The norm weights are drawn at random (transformers starts Llama's at one and
Gemma's at zero: every norm of a layer would be the same, and a norm swapped for another would go unseen). Oracles:

- transformers' own decoder-layer forward: with the kernels replaced by their twins (``residual_norm_reference``,
  ``rms_norm_reference``: eager PyTorch), generate() on a tiny Llama and a tiny Gemma 3 in bf16 (a left-padded batch
  of two, past Gemma's sliding window) gives the tokens and every step's logits of ``fused_residual=False`` bit for
  bit, and every decoder layer of every forward took the kernel: Llama once (``post`` only: the attention's add and
  ``post_attention_layernorm``), Gemma 3 twice (``pre`` and ``post``: the attention's add between its two norms;
  then ``pre`` only: the MLP's add after ``post_feedforward_layernorm``). A single decode step with the twins equals
  transformers' forward outside every switch bit for bit. Gemma 2's layers take Gemma 3's path (below): the same
  bit-for-bit oracle holds for them.
- the real kernels: the tokens of ``fused_residual=False``, every step's logits within a small tolerance.
- calls that must keep transformers' forward (fp32, a DynamicCache, grad mode, hooks on the norms the kernel would
  compute, ``fused_norm=False`` or the norm switch off, ``fused_residual=False``): no kernel call, and the output
  equal bit for bit to the forward outside the switch (hooks that change the output, so a skipped hook is seen).
- ``compat.forward_classes``: LlamaDecoderLayer's undecorated byte code is found in Llama, and Mistral, Qwen2 and
  Qwen3 copy it verbatim (their layers take the path); Gemma3DecoderLayer's is found in Gemma 3 and also in Gemma 2
  (whose decoder layer is the same code: norms after each sublayer), not in Cohere 2 or gpt-oss, nor in Llama's
  family. A changed signature raises ``CompatError`` naming ``fused_residual=False``.
- the batching engine's decode steps on Gemma 3 (ragged rows, sliding-window slots) with the twins: each request's
  tokens those of ``fused_residual=False``, batched decode steps taking the kernel.
"""

from __future__ import annotations

import contextlib

import pytest
import torch
from transformers import DynamicCache

from hf_rocketkv import RocketKVCache, RocketKVConfig
from hf_rocketkv.integration import compat, norm, residual
from hf_rocketkv.integration.compat import cache_kwargs
from hf_rocketkv.integration.fused_modeling import fused_modeling
from hf_rocketkv.kernels.residual_norm import residual_norm_reference
from hf_rocketkv.kernels.rms_norm import rms_norm_reference
from tests.support.hybrid_models import make_hybrid_models
from tests.support.tiny_models import compressing_config, greedy_with_logits, make_models, padded_batch, random_ids

pytest.importorskip("triton")

DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")
pytestmark = pytest.mark.gpu  # the model and kernels run on the GPU where one is present (pytest -m gpu)

LLAMA_CALL = (False, True)  # (pre given, post given) of the Llama form's one call per layer
GEMMA3_CALLS = ((True, True), (True, False))  # the attention's add between two norms, then the MLP's after its norm


def record(calls, x, pre, post):
    calls.append((tuple(x.shape), pre is not None, post is not None))


@pytest.fixture
def counted(monkeypatch):
    """Lets the wrappers take the kernels on CPU (the interpreter) and records the residual kernel's calls."""
    calls = []
    kernel = residual.residual_norm_triton

    def counting(x, residual_, formula="llama", pre=None, post=None):
        record(calls, x, pre, post)
        return kernel(x, residual_, formula, pre=pre, post=post)

    monkeypatch.setattr(residual, "FUSED_DEVICE_TYPES", ("cuda", "cpu"))
    monkeypatch.setattr(norm, "FUSED_DEVICE_TYPES", ("cuda", "cpu"))
    monkeypatch.setattr(residual, "residual_norm_triton", counting)
    return calls


@pytest.fixture
def twin(counted, monkeypatch):
    """Both kernels replaced by their twins (eager PyTorch, bit for bit transformers' adds and norms), the residual
    calls still recorded."""
    def reference(x, residual_, formula="llama", pre=None, post=None):
        record(counted, x, pre, post)
        return residual_norm_reference(x, residual_, formula, pre=pre, post=post)

    monkeypatch.setattr(residual, "residual_norm_triton", reference)
    monkeypatch.setattr(norm, "rms_norm_triton", rms_norm_reference)
    return counted


def random_norms(model, seed=5):
    """Every RMSNorm weight drawn at random (in place), so each norm of a layer computes something else."""
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for module in model.modules():
            if type(module).__name__.endswith("RMSNorm"):
                drawn = torch.randn(module.weight.shape, generator=generator) * 0.5
                module.weight.copy_(drawn + (0.0 if "Gemma" in type(module).__name__ else 1.0))
    return model


def llama(dtype=torch.bfloat16, **overrides):
    return random_norms(make_models("llama", **overrides)[0]).to(DEVICE, dtype)


def gemma3(dtype=torch.bfloat16, **overrides):
    return random_norms(make_hybrid_models("gemma3", **overrides)[0]).to(DEVICE, dtype)


def gemma2(dtype=torch.bfloat16, **overrides):
    return random_norms(make_hybrid_models("gemma2", **overrides)[0]).to(DEVICE, dtype)


def calls_per_forward(model):
    """(pre given, post given) of each residual call of one forward, in order: each layer's calls, the last add of
    every layer but the last one also normalizing the next layer's input (``post``: ``LayerChain``'s hand-over)."""
    layers = model.config.num_hidden_layers
    if model.config.model_type.startswith(("gemma2", "gemma3")):
        return [call for i in range(layers) for call in ((True, True), (True, i < layers - 1))]
    return [call for i in range(layers) for call in ((LLAMA_CALL,) if i == layers - 1 else (LLAMA_CALL, LLAMA_CALL))]


def expected_calls(model, ids, new_tokens):
    """Every decoder layer of every forward (the prefill's, then each decode step's), in order."""
    batch, length = ids.shape
    hidden = model.config.hidden_size
    return [((batch, rows, hidden), *call) for rows in [length] + [1] * (new_tokens - 1)
            for call in calls_per_forward(model)]


def check_calls(model, calls, ids, new_tokens):
    expected = expected_calls(model, ids, new_tokens)
    if DEVICE.type == "cpu":
        assert calls == expected
    else:  # generate() replays the decode step as a CUDA graph: the Python wrapper runs on some forwards only
        assert set(calls) == set(expected) and len(calls) % len(calls_per_forward(model)) == 0


@pytest.mark.parametrize("build", [llama, gemma3, gemma2], ids=["llama", "gemma3", "gemma2"])
def test_the_fused_forward_is_transformers_forward_around_the_adds_and_norms(twin, build):
    """The kernels swapped for their twins: the tokens and every step's logits equal ``fused_residual=False``'s bit
    for bit, so nothing but the launches changed; every layer of every forward took the kernel (Gemma 3: sliding
    layers of window 8 and a global one, a left-padded batch past the window; Gemma 2, whose decoder layer has Gemma
    3's byte code and so takes its path: alternating layers, soft-capped logits)."""
    model = build()
    ids, mask = padded_batch((30, 27), DEVICE)
    config = compressing_config(kt_cache_dtype="float32", fused_mlp=False, fused_residual=True)
    plain = RocketKVCache(config.replace(fused_residual=False))
    plain_tokens, plain_logits = greedy_with_logits(model, ids, mask, plain, 5)
    assert twin == []
    tokens, logits = greedy_with_logits(model, ids, mask, RocketKVCache(config), 5)
    check_calls(model, twin, ids, 5)
    assert torch.equal(tokens, plain_tokens)
    assert torch.equal(logits, plain_logits)


@pytest.mark.parametrize("build", [llama, gemma3], ids=["llama", "gemma3"])
def test_generate_with_the_kernel_keeps_the_tokens(counted, build):
    model = build()
    ids, mask = padded_batch((30, 27), DEVICE)
    config = compressing_config(kt_cache_dtype="float32", fused_residual=True)
    plain = RocketKVCache(config.replace(fused_residual=False))
    plain_tokens, plain_logits = greedy_with_logits(model, ids, mask, plain, 5)
    assert counted == []
    tokens, logits = greedy_with_logits(model, ids, mask, RocketKVCache(config), 5)
    check_calls(model, counted, ids, 5)
    assert torch.equal(tokens, plain_tokens)
    torch.testing.assert_close(logits, plain_logits, rtol=0, atol=2.0**-7)


# --------------------------------------------------------------------------------------------------- never fused
@contextlib.contextmanager
def residual_and_norm(model, on):
    with norm.fused_norm(model, on), residual.fused_residual(model, on):
        yield


def one_step(model, cache_factory, calls, switch=residual_and_norm, grad=False, **forward):
    """A decode step of ``model`` after a short prefill (past Gemma 3's window), inside ``switch(model, on)``: (kernel
    calls of the step, whether it equals the same step of a fresh run with the switch off bit for bit)."""
    ids = random_ids(1, 12, seed=5).to(DEVICE)
    outputs = []
    for on in (False, True):
        cache = cache_factory(model)
        with torch.set_grad_enabled(grad), switch(model, on):
            model(ids, **cache_kwargs(cache))
            before = len(calls)
            outputs.append(model(ids[:, -1:], **cache_kwargs(cache), **forward).logits)
    return len(calls) - before, torch.equal(*outputs)


def rocketkv_cache(model):
    return RocketKVCache(compressing_config(kt_cache_dtype="float32"), model_config=model.config)


def dynamic_cache(model):
    return DynamicCache(config=model.config)


def modeling(**switches):
    """``fused_modeling`` with ``switches`` over a config whose other fused paths are off (on a GPU they would change
    the output)."""
    config = RocketKVConfig(**{**dict(fused_rope=False, fused_mlp=False, fused_qkv=False, fused_experts=False),
                               **switches})
    return lambda model, on: fused_modeling(model, config, on)


@pytest.mark.parametrize("build", [llama, gemma3], ids=["llama", "gemma3"])
@pytest.mark.parametrize("switch", [residual_and_norm, modeling(fused_norm=True, fused_residual=True)],
                         ids=["residual-and-norm", "fused-modeling"])
def test_the_positive_control_takes_the_kernel_and_is_transformers_forward(twin, norm_calls, build, switch):
    """With the twins, a decode step through the fused layers equals transformers' forward outside every switch; the
    only separate norm launches left are the first layer's input norm and the model's final norm (every other
    layer's input norm came with the layer before's last add)."""
    model = build()
    per_forward = calls_per_forward(model)
    norms_before = len(norm_calls)
    calls, equal = one_step(model, rocketkv_cache, twin, switch)
    assert calls == len(per_forward)
    assert twin[-calls:] == [((1, 1, model.config.hidden_size), *call) for call in per_forward]
    assert equal
    # hidden-state norms through the kernel (outside the switch: transformers' modules): for the prefill and the
    # step, the first layer's input norm and the final norm (without the hand-over: every layer's, and the final)
    assert len([shape for shape in norm_calls[norms_before:] if len(shape) == 3]) == 2 * 2


@pytest.fixture
def norm_calls(twin, monkeypatch):
    """The fused RMSNorm's calls (its twin): one per norm module that ran it."""
    calls = []
    monkeypatch.setattr(norm, "rms_norm_triton",
                        lambda x, *args: (calls.append(x.shape), rms_norm_reference(x, *args))[1])
    return calls


def hooked(model, arch):
    """Hooks that change the output on the norms the kernel would compute, one norm per layer (so every layer)."""
    double = lambda module, args, output: output * 2  # noqa: E731
    double_input = lambda module, args: (args[0] * 2,)  # noqa: E731
    layers = model.model.layers
    if arch == "llama":
        layers[0].post_attention_layernorm.register_forward_hook(double)
        layers[1].post_attention_layernorm.register_forward_pre_hook(double_input)
    else:
        layers[0].post_attention_layernorm.register_forward_hook(double)
        layers[1].pre_feedforward_layernorm.register_forward_pre_hook(double_input)
        layers[2].post_feedforward_layernorm.register_forward_hook(double)
        layers[3].post_feedforward_layernorm.register_forward_pre_hook(double_input)
    return model


@pytest.mark.parametrize("case", ["fp32", "dynamic-cache", "grad", "hook", "gemma3-hook", "fused-norm-false",
                                  "norm-switch-off", "fused-residual-false"])
def test_calls_that_keep_transformers_forward(twin, case):
    """No kernel call, and the step (prefill included) equal bit for bit to transformers' own forward."""
    model = gemma3() if case == "gemma3-hook" else llama(torch.float32 if case == "fp32" else torch.bfloat16)
    if case.endswith("hook"):
        hooked(model, "gemma3" if case == "gemma3-hook" else "llama")
    switch = {"fused-norm-false": modeling(fused_norm=False, fused_residual=True),
              "fused-residual-false": modeling(fused_norm=True, fused_residual=False),
              "norm-switch-off": lambda model, on: residual.fused_residual(model, on)}.get(case, residual_and_norm)
    factory = dynamic_cache if case == "dynamic-cache" else rocketkv_cache
    assert one_step(model, factory, twin, switch, grad=case == "grad") == (0, True)
    assert twin == []


@pytest.mark.parametrize("build", [llama, gemma3], ids=["llama", "gemma3"])
@pytest.mark.parametrize("hook", ["output", "input"])
def test_a_decoder_layer_with_hooks_gets_no_hand_over(twin, build, hook):
    """A hook on decoder layer 1 that changes its output (or its input, in place): neither layer 0 nor layer 1 hands
    its last add's norm over (``residual.py`` checks hooks on both), and the step still equals transformers' forward
    outside the switch bit for bit."""
    model = build()
    layer = model.model.layers[1]
    if hook == "output":
        layer.register_forward_hook(lambda module, args, output: output * 2)
    else:
        layer.register_forward_pre_hook(lambda module, args: (args[0].mul_(2), None)[1])
    calls, equal = one_step(model, rocketkv_cache, twin, residual_and_norm)
    assert equal
    layers, gemma = model.config.num_hidden_layers, model.config.model_type.startswith("gemma")
    expected = []
    for i in range(layers):
        hands_over = i < layers - 1 and i not in (0, 1)
        expected += [(True, True), (True, hands_over)] if gemma else [LLAMA_CALL] + [LLAMA_CALL] * hands_over
    assert [call[1:] for call in twin[-calls:]] == expected


# --------------------------------------------------------------------------------------------------- classes
def layer_classes(model, form="llama"):
    return compat.forward_classes(model, compat.DECODER_FORMULAS[form])


def test_which_decoder_layers_are_llamas():
    """LlamaDecoderLayer's undecorated byte code: Mistral's, Qwen2's and Qwen3's decoder layers copy it verbatim (the
    differences are in their attention modules); no Gemma or gpt-oss layer has it."""
    from transformers.models.llama.modeling_llama import LlamaDecoderLayer
    from transformers.models.mistral.modeling_mistral import MistralDecoderLayer
    from transformers.models.qwen2.modeling_qwen2 import Qwen2DecoderLayer
    from transformers.models.qwen3.modeling_qwen3 import Qwen3DecoderLayer

    assert layer_classes(llama()) == [LlamaDecoderLayer]
    for arch, klass in (("mistral", MistralDecoderLayer), ("qwen2", Qwen2DecoderLayer), ("qwen3", Qwen3DecoderLayer)):
        assert layer_classes(make_models(arch)[0]) == [klass], arch
    for arch in ("gemma3", "gemma2", "cohere2", "gpt_oss"):
        assert layer_classes(make_hybrid_models(arch)[0]) == [], arch


def test_which_decoder_layers_are_gemma3s():
    """Gemma3DecoderLayer's byte code (a norm after each sublayer, before its add): Gemma 2's layer is the same code;
    Cohere 2 (one parallel block) and gpt-oss (Llama's form, MoE) are not it, nor are Llama's family."""
    from transformers.models.gemma2.modeling_gemma2 import Gemma2DecoderLayer
    from transformers.models.gemma3.modeling_gemma3 import Gemma3DecoderLayer

    assert layer_classes(make_hybrid_models("gemma3")[0], "gemma3") == [Gemma3DecoderLayer]
    assert layer_classes(make_hybrid_models("gemma2")[0], "gemma3") == [Gemma2DecoderLayer]
    for arch in ("cohere2", "gpt_oss", "mistral"):
        assert layer_classes(make_hybrid_models(arch)[0], "gemma3") == [], arch
    for arch in ("llama", "qwen3"):
        assert layer_classes(make_models(arch)[0], "gemma3") == [], arch


@pytest.mark.parametrize("form, model", [("llama", lambda: make_models("llama")[0]),
                                         ("gemma3", lambda: make_hybrid_models("gemma3")[0])],
                         ids=["llama", "gemma3"])
def test_a_changed_decoder_signature_fails_naming_fused_residual_false(monkeypatch, form, model):
    """transformers renaming a parameter of the decoder layer's forward: ``CompatError`` naming the version, the
    class and the way out (``fused_residual=False``), at the first call that would wrap it."""
    formula = compat.DECODER_FORMULAS[form]
    monkeypatch.setitem(compat.DECODER_FORMULAS, form, formula.__class__(
        **{**formula.__dict__, "params": ("self", "hidden", "position_embeddings")}))
    with pytest.raises(compat.CompatError, match=f"transformers {compat.TRANSFORMERS_VERSION}.*{formula.name}.*"
                                                 f"fused_residual=False"):
        layer_classes(model(), form)
    with pytest.raises(compat.CompatError, match="fused_residual=False"), residual.fused_residual(model(), True):
        pass


# --------------------------------------------------------------------------------------------------- Gemma 3
def test_gemma3_decode_steps_in_the_batching_engine_keep_their_tokens(twin):
    """The engine's batched decode (``BatchedDecodeCache``: ragged rows, sliding-window slots) with the twins: each
    request's tokens those of ``fused_residual=False``, the kernel taken by the batched steps."""
    from tests.support.engine_ab import engine_tokens_off_and_on

    config = compressing_config(kt_cache_dtype="float32", fused_mlp=False)
    runs = engine_tokens_off_and_on(gemma3(), config, "fused_residual", twin, DEVICE.type)
    batched = [call for call in twin if call[0][1] == 1 and call[0][0] > 1]
    assert batched  # batched decode steps (rows > 1) took the kernel
    assert {call[1:] for call in batched} == set(GEMMA3_CALLS)
    assert runs[True] == runs[False]


def test_fused_residual_is_on_by_default_and_validated():
    assert RocketKVConfig().fused_residual is True
    assert RocketKVConfig(fused_residual=False).fused_residual is False
    with pytest.raises(ValueError, match="fused_residual must be True or False, got 1"):
        RocketKVConfig(fused_residual=1)
