"""q/k/v projections in one launch inside RocketKV calls (``integration/qkv.py``, ``RocketKVConfig.fused_qkv``).

On CPU the kernel (``kernels/stacked_projection.stacked_projection_triton``) runs under Triton's interpreter; the
tests let the wrapper take it on CPU (``FUSED_DEVICE_TYPES``) and record every call, so they prove where the path is
taken and where it is not. Oracles:

- transformers' own ``LlamaAttention.forward``: with the kernel replaced by its twin (``F.linear`` per weight, bit
  for bit the modules' projections), the fused forward must equal the original bit for bit on decode steps of a
  RocketKVCache: the views, RoPE, the cache's update, the attention call and ``o_proj`` are transformers' own
  (``o_proj``'s plain kernel at one row replaced by its twin too).
- generate() on a tiny Llama in bf16 with a left-padded batch of two: the same generation with ``fused_qkv=False``:
  the same tokens, every step's logits within a small tolerance; decode forwards take the kernel, a prefill of more
  than 64 rows does not.
- calls that must never take the kernel (fp32, a DynamicCache, projections with a bias or hooks, grad mode, a
  prefill, a process group): no kernel call, and the output equal bit for bit to the forward outside the switch.
- ``compat.forward_classes``: LlamaAttention's undecorated byte code is found in Llama, not in Mistral's or
  Gemma 3's attention (a sliding window argument, q/k norms); Gemma3Attention's only in Gemma 3.
- Gemma 3 (the ``gemma3`` form: q/k norms before RoPE, sliding and global layers): the twin's logits bit for bit
  those of ``fused_qkv=False`` through generate() and through the batching engine's decode steps, every attention
  layer of a decode step taking the kernel.
"""

from __future__ import annotations

import pytest
import torch
from transformers import DynamicCache

from hf_rocketkv import RocketKVCache
from hf_rocketkv.integration import compat, qkv
from hf_rocketkv.integration.compat import cache_kwargs
from hf_rocketkv.kernels.gated_projection import projection_reference
from hf_rocketkv.kernels.stacked_projection import stacked_projection_reference
from tests.support.hybrid_models import make_hybrid_models
from tests.support.kernel_calls import record_calls
from tests.support.tiny_models import compressing_config, greedy_with_logits, make_models, padded_batch, random_ids

pytest.importorskip("triton")

DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")
pytestmark = pytest.mark.gpu  # the model and kernels run on the GPU where one is present (pytest -m gpu)


@pytest.fixture
def counted(monkeypatch):
    """Lets the wrapper take the kernel on CPU (the interpreter) and records its calls: x's shape."""
    monkeypatch.setattr(qkv, "FUSED_DEVICE_TYPES", ("cuda", "cpu"))
    return record_calls(monkeypatch, qkv, "stacked_projection_triton")


def llama(dtype=torch.bfloat16, **overrides):
    return make_models("llama", **overrides)[0].to(DEVICE, dtype)


def gemma3(**overrides):
    return make_hybrid_models("gemma3", **overrides)[0].to(DEVICE, torch.bfloat16)


@pytest.fixture
def o_proj_calls(monkeypatch):
    """Records every ``o_proj`` that took the plain projection kernel (x's shape); the kernel itself still runs."""
    return record_calls(monkeypatch, qkv, "projection_triton")


@pytest.fixture
def twin(counted, o_proj_calls, monkeypatch):
    """Both kernels replaced by their twins (the modules' own projections, bit for bit), calls still recorded: q/k/v
    in the returned list, ``o_proj`` in ``o_proj_calls``."""
    monkeypatch.setattr(qkv, "stacked_projection_triton", lambda x, weights, rotary=None: (
        counted.append(tuple(x.shape)), stacked_projection_reference(x, weights, rotary))[1])
    monkeypatch.setattr(qkv, "projection_triton", lambda x, weight: (
        o_proj_calls.append(tuple(x.shape)), projection_reference(x, weight))[1])
    return counted


@pytest.mark.parametrize("build", [llama, gemma3], ids=["llama", "gemma3"])
def test_the_fused_forward_is_transformers_forward_around_the_projections(twin, build):
    """The kernel swapped for its twin: every decode step's logits equal ``fused_qkv=False``'s bit for bit, so
    nothing but the projections' launch changed, and each decode forward's attention layers take the kernel. Gemma 3:
    sliding layers (window 8) and a global one, a left-padded batch past the window."""
    model = build()
    ids, mask = padded_batch((30, 27), DEVICE)
    # Gemma 3's q/k norms and RoPE in one launch are the fused path's other change (tested below): kept out here
    config = compressing_config(kt_cache_dtype="float32", fused_mlp=False, fused_qkv=True, fused_rope=build is llama)
    plain = RocketKVCache(config.replace(fused_qkv=False))
    plain_tokens, plain_logits = greedy_with_logits(model, ids, mask, plain, 5)
    assert twin == []
    tokens, logits = greedy_with_logits(model, ids, mask, RocketKVCache(config), 5)
    decode = [shape for shape in twin if shape[1] == 1]
    assert set(decode) == {(2, 1, model.config.hidden_size)}
    if DEVICE.type == "cpu":
        assert len(decode) == model.config.num_hidden_layers * 4
    assert torch.equal(tokens, plain_tokens)
    assert torch.equal(logits, plain_logits)


@pytest.mark.parametrize("lengths", [(70, 66), (30, 21)], ids=["prefill-140-rows", "prefill-60-rows"])
def test_generate_takes_the_kernel_on_decode_steps_and_keeps_the_tokens(counted, lengths):
    model = llama()
    ids, mask = padded_batch(lengths, DEVICE)
    config = compressing_config(kt_cache_dtype="float32", fused_qkv=True)
    plain = RocketKVCache(config.replace(fused_qkv=False))
    plain_tokens, plain_logits = greedy_with_logits(model, ids, mask, plain, 5)
    assert counted == []
    tokens, logits = greedy_with_logits(model, ids, mask, RocketKVCache(config), 5)
    layers, hidden = model.config.num_hidden_layers, model.config.hidden_size
    batch, length = ids.shape
    prefill = [shape for shape in counted if shape[1] > 1]
    decode = [shape for shape in counted if shape[1] == 1]
    assert prefill == ([] if batch * length > 64 else [(batch, length, hidden)] * layers)
    assert set(decode) == {(batch, 1, hidden)}
    if DEVICE.type == "cpu":
        assert len(decode) == layers * 4  # every decode forward's attention layers
    assert torch.equal(tokens, plain_tokens)
    torch.testing.assert_close(logits, plain_logits, rtol=0, atol=2.0**-7)


# --------------------------------------------------------------------------------------------------- o_proj
@pytest.mark.parametrize("build", [llama, gemma3], ids=["llama", "gemma3"])
@pytest.mark.parametrize("batch", [1, 2])
def test_one_row_decode_steps_run_o_proj_through_the_plain_kernel(twin, o_proj_calls, build, batch):
    """With both kernels swapped for their twins, a decode step's logits equal ``fused_qkv=False``'s bit for bit at
    one row and at two; only the one-row steps take ``o_proj`` through the plain kernel, every attention layer of
    every decode forward, never a prefill."""
    model = build()
    ids, mask = padded_batch((30, 27)[:batch], DEVICE)
    config = compressing_config(kt_cache_dtype="float32", fused_mlp=False, fused_qkv=True, fused_rope=build is llama)
    plain_tokens, plain_logits = greedy_with_logits(model, ids, mask, RocketKVCache(config.replace(fused_qkv=False)),
                                                    5)
    assert o_proj_calls == []
    tokens, logits = greedy_with_logits(model, ids, mask, RocketKVCache(config), 5)
    width = model.config.num_attention_heads * model.config.head_dim
    if batch == 1:
        assert set(o_proj_calls) == {(1, 1, width)}
        if DEVICE.type == "cpu":  # on CUDA the replayed graph skips Python
            assert len(o_proj_calls) == model.config.num_hidden_layers * 4
    else:
        assert o_proj_calls == []
    assert torch.equal(tokens, plain_tokens)
    assert torch.equal(logits, plain_logits)


def test_the_o_proj_kernel_keeps_the_tokens(counted, o_proj_calls):
    """The real kernels (the interpreter on CPU) at one row: the tokens of ``fused_qkv=False``, every step's logits
    within bf16's tolerance of it (each projection rounded once, as cuBLAS rounds it)."""
    model = llama()
    ids, mask = padded_batch((30,), DEVICE)
    config = compressing_config(kt_cache_dtype="float32", fused_qkv=True)
    plain_tokens, plain_logits = greedy_with_logits(model, ids, mask, RocketKVCache(config.replace(fused_qkv=False)),
                                                    5)
    tokens, logits = greedy_with_logits(model, ids, mask, RocketKVCache(config), 5)
    assert o_proj_calls and counted
    assert torch.equal(tokens, plain_tokens)
    torch.testing.assert_close(logits, plain_logits, rtol=0, atol=2.0**-7)


def test_an_o_proj_with_a_hook_keeps_its_module(o_proj_calls, counted):
    """A hook on one layer's ``o_proj`` (the kernel would skip it) keeps that module: the hook runs at every decode
    step, the other layers take the kernel."""
    model = llama()
    seen = []
    model.model.layers[0].self_attn.o_proj.register_forward_hook(lambda module, args, out: seen.append(out.shape))
    ids, mask = padded_batch((30,), DEVICE)
    greedy_with_logits(model, ids, mask, RocketKVCache(compressing_config(kt_cache_dtype="float32")), 5)
    if DEVICE.type == "cpu":  # on CUDA the replayed graph skips Python: the hook's and the wrapper's
        assert len(seen) == 5  # the prefill and four decode steps
        assert len(o_proj_calls) == (model.config.num_hidden_layers - 1) * 4
    else:
        width = model.config.num_attention_heads * model.config.head_dim
        assert len(seen) >= 2 and set(o_proj_calls) == {(1, 1, width)}


# --------------------------------------------------------------------------------------------------- never fused
def one_step(model, cache_factory, counted, **forward):
    """A decode step of ``model`` after a short prefill, under the switch: (kernel calls, equal to the same step of
    a fresh run outside the switch bit for bit)."""
    ids = random_ids(1, 12, seed=5).to(DEVICE)
    outputs = []
    for on in (False, True):
        cache = cache_factory()
        with torch.no_grad(), qkv.fused_qkv(model, on):
            model(ids, **cache_kwargs(cache))
            before = len(counted)
            outputs.append(model(ids[:, -1:], **cache_kwargs(cache), **forward).logits)
    return len(counted) - before, torch.equal(*outputs)


def rocketkv_cache():
    return RocketKVCache(compressing_config(kt_cache_dtype="float32"))


def test_the_positive_control_takes_the_kernel(counted):
    assert one_step(llama(), rocketkv_cache, counted)[0] == llama().config.num_hidden_layers


@pytest.mark.parametrize("case", ["fp32", "dynamic-cache", "bias", "hook", "grad", "process-group"])
def test_calls_that_keep_transformers_forward(counted, monkeypatch, case):
    model = llama(torch.float32 if case == "fp32" else torch.bfloat16,
                  **({"attention_bias": True} if case == "bias" else {}))
    factory = DynamicCache if case == "dynamic-cache" else rocketkv_cache
    if case == "hook":
        model.model.layers[0].self_attn.k_proj.register_forward_hook(lambda *args: None)
        model.model.layers[1].self_attn.q_proj.register_forward_pre_hook(lambda *args: None)
    if case == "process-group":
        monkeypatch.setattr(qkv, "distributed", lambda: True)
    if case == "grad":
        ids = random_ids(1, 12, seed=5).to(DEVICE)
        with torch.enable_grad(), qkv.fused_qkv(model, True):
            model(ids, **cache_kwargs(rocketkv_cache()))
        assert counted == []
        return
    assert one_step(model, factory, counted) == (0, True)
    assert counted == []


def attention_classes(model, form="llama"):
    return compat.forward_classes(model, compat.ATTENTION_FORMULAS[form])


def test_which_attention_classes_are_llamas():
    """Only forwards with LlamaAttention's undecorated byte code: Mistral's and Qwen2's pass a sliding window,
    Qwen3's and Gemma's norm q and k, gpt-oss adds sinks."""
    from transformers.models.llama.modeling_llama import LlamaAttention

    assert attention_classes(llama()) == [LlamaAttention]
    for arch in ("mistral", "qwen2", "qwen3"):
        assert attention_classes(make_models(arch)[0]) == [], arch
    for arch in ("gemma3", "gpt_oss"):
        assert attention_classes(make_hybrid_models(arch)[0]) == [], arch


def test_which_attention_classes_are_gemma3s():
    """Gemma3Attention's byte code (q/k norms on ``[B, H, T, D]`` before RoPE, the sliding window passed on) is
    Gemma 3's alone: Qwen3 norms q and k before the transpose, Gemma 2 soft-caps, Cohere 2 has no norms."""
    from transformers.models.gemma3.modeling_gemma3 import Gemma3Attention

    assert attention_classes(make_hybrid_models("gemma3")[0], "gemma3") == [Gemma3Attention]
    for arch in ("llama", "qwen3"):
        assert attention_classes(make_models(arch)[0], "gemma3") == [], arch
    for arch in ("gemma2", "cohere2", "gpt_oss", "mistral"):
        assert attention_classes(make_hybrid_models(arch)[0], "gemma3") == [], arch


@pytest.mark.parametrize("form, model", [("llama", llama), ("gemma3", lambda: make_hybrid_models("gemma3")[0])],
                         ids=["llama", "gemma3"])
def test_a_changed_attention_signature_fails_naming_fused_qkv_false(monkeypatch, form, model):
    """transformers renaming a parameter of the attention forward: ``CompatError`` naming the version, the class and
    the way out (``fused_qkv=False``), at the first call that would wrap it."""
    formula = compat.ATTENTION_FORMULAS[form]
    monkeypatch.setitem(compat.ATTENTION_FORMULAS, form, formula.__class__(
        **{**formula.__dict__, "params": ("self", "hidden", "position_embeddings")}))
    with pytest.raises(compat.CompatError, match=f"transformers {compat.TRANSFORMERS_VERSION}.*{formula.name}.*"
                                                 f"fused_qkv=False"):
        attention_classes(model(), form)


# --------------------------------------------------------------------------------------------------- Gemma 3
def test_gemma3_decode_steps_in_the_batching_engine_keep_their_tokens(twin):
    """The engine's batched decode (``BatchedDecodeCache``: ragged rows, sliding-window slots) with the twin: each
    request's tokens those of ``fused_qkv=False``, the kernel taken by the batched steps."""
    from tests.support.engine_ab import engine_tokens_off_and_on

    config = compressing_config(kt_cache_dtype="float32", fused_mlp=False, fused_rope=False)
    runs = engine_tokens_off_and_on(gemma3(), config, "fused_qkv", twin, DEVICE.type)
    assert {shape[0] for shape in twin if shape[1] == 1} - {1}  # batched decode steps (rows > 1) took the kernel
    assert runs[True] == runs[False]


@pytest.fixture
def normed_rope_calls(twin, monkeypatch):
    """The fused norms and RoPE on CPU too (the interpreter); records each RoPE launch: (tokens, with the norms)."""
    from hf_rocketkv.integration import norm, rope

    calls = []
    kernel = rope.rope_triton

    def counting(q, k, cos, sin, *norms):
        calls.append((q.shape[2], bool(norms)))
        return kernel(q, k, cos, sin, *norms)

    monkeypatch.setattr(rope, "FUSED_DEVICE_TYPES", ("cuda", "cpu"))
    monkeypatch.setattr(norm, "FUSED_DEVICE_TYPES", ("cuda", "cpu"))
    monkeypatch.setattr(rope, "rope_triton", counting)
    return calls


@pytest.mark.parametrize("hooked", [False, True], ids=["plain", "hook-on-a-q-norm"])
def test_gemma3_q_k_norms_and_rope_take_one_launch_and_keep_the_tokens(normed_rope_calls, hooked):
    """Gemma 3's decode steps norm q and k and rotate them in one launch (``rope.normed_rope``); the oracle is the
    same generation with ``fused_rope=False`` (the fused norm modules, then transformers' RoPE): the same tokens,
    every step's logits within bf16's tolerance of the reference path. A q norm carrying a hook keeps its module
    (that layer's RoPE launch carries no norms)."""
    model = gemma3()
    if hooked:
        model.model.layers[0].self_attn.q_norm.register_forward_hook(lambda *args: None)
    ids, mask = padded_batch((30, 27), DEVICE)
    config = compressing_config(kt_cache_dtype="float32", fused_mlp=False, fused_qkv=True)
    plain = RocketKVCache(config.replace(fused_rope=False))
    plain_tokens, plain_logits = greedy_with_logits(model, ids, mask, plain, 5)
    assert normed_rope_calls == []
    tokens, logits = greedy_with_logits(model, ids, mask, RocketKVCache(config), 5)
    layers = model.config.num_hidden_layers
    decode = [with_norms for tokens_, with_norms in normed_rope_calls if tokens_ == 1]
    if DEVICE.type == "cpu":  # on CUDA the replayed graph skips Python
        assert decode.count(True) == (layers - hooked) * 4 and decode.count(False) == hooked * 4
    assert True in decode
    assert torch.equal(tokens, plain_tokens)
    torch.testing.assert_close(logits, plain_logits, rtol=0, atol=2.0**-7)


def test_fused_qkv_is_on_by_default_and_validated():
    from hf_rocketkv import RocketKVConfig

    assert RocketKVConfig().fused_qkv is True
    assert RocketKVConfig(fused_qkv=False).fused_qkv is False
    with pytest.raises(ValueError, match="fused_qkv must be True or False, got 1"):
        RocketKVConfig(fused_qkv=1)


# --------------------------------------------------------------------------------------------------- RoPE inside
@pytest.fixture
def rotary_calls(counted, monkeypatch):
    """Every kernel call's ``rotary`` argument: None, or (cos, sin, head_dim); the kernel itself still runs."""
    calls = []
    kernel = qkv.stacked_projection_triton

    def recording(x, weights, rotary=None):
        calls.append(rotary)
        return kernel(x, weights, rotary=rotary)

    monkeypatch.setattr(qkv, "stacked_projection_triton", recording)
    return calls


@pytest.mark.parametrize("batch", [1, 2])
def test_the_llama_form_rotates_inside_the_projection_and_keeps_the_tokens(rotary_calls, batch, monkeypatch):
    """With the fused RoPE on, every decode forward's attention layers hand the kernel the forward's cos/sin, and the
    tokens and logits are those of the projection followed by the forward's own RoPE (``ROTARY_IN_PROJECTION`` off):
    transformers' formula on the same rounded projection, so equal up to the kernel's rare reordered sums."""
    model = llama()
    ids, mask = padded_batch((30, 27)[:batch], DEVICE)
    config = compressing_config(kt_cache_dtype="float32", fused_qkv=True, fused_rope=True)
    monkeypatch.setattr(qkv, "ROTARY_IN_PROJECTION", False)
    apart_tokens, apart_logits = greedy_with_logits(model, ids, mask, RocketKVCache(config), 5)
    assert rotary_calls and all(rotary is None for rotary in rotary_calls)
    rotary_calls.clear()
    monkeypatch.setattr(qkv, "ROTARY_IN_PROJECTION", True)
    tokens, logits = greedy_with_logits(model, ids, mask, RocketKVCache(config), 5)
    rotated = [rotary for rotary in rotary_calls if rotary is not None]
    decode = [rotary for rotary in rotated if rotary[0].shape[1] == 1]
    if DEVICE.type == "cpu":  # a prefill of at most 64 rows takes the kernel too (its cos/sin per token)
        assert len(decode) == model.config.num_hidden_layers * 4  # every decode forward's layers
        assert len(rotated) == len(decode) + (model.config.num_hidden_layers if ids.numel() <= 64 else 0)
    assert decode and {rotary[2] for rotary in rotated} == {model.config.head_dim}
    assert all(rotary[0].shape[0] in (1, batch) and rotary[0].shape[2] == model.config.head_dim
               for rotary in decode)
    assert torch.equal(tokens, apart_tokens)
    torch.testing.assert_close(logits, apart_logits, rtol=0, atol=2.0**-7)


@pytest.mark.parametrize("case", ["fused-rope-off", "gemma3"])
def test_where_the_projection_does_not_rotate(rotary_calls, case):
    """The kernel rotates only where the fused RoPE would run: not with ``fused_rope=False`` (transformers' own
    formula runs), not in Gemma 3's form (its q/k norms come before RoPE: ``rope.normed_rope``)."""
    model = gemma3() if case == "gemma3" else llama()
    ids, mask = padded_batch((30,), DEVICE)
    config = compressing_config(kt_cache_dtype="float32", fused_qkv=True, fused_rope=case == "gemma3")
    greedy_with_logits(model, ids, mask, RocketKVCache(config), 3)
    assert rotary_calls and all(rotary is None for rotary in rotary_calls)


def test_llama_decode_steps_in_the_batching_engine_rotate_inside_the_projection(twin, monkeypatch):
    """The engine's batched decode (ragged rows, each at its own position): the projection rotates each row by its own
    cos/sin (the kernel swapped for its twin, which rotates with transformers' formula), and each request's tokens are
    those of ``fused_qkv=False`` (the modules' projections, then the forward's own RoPE)."""
    from tests.support.engine_ab import engine_tokens_off_and_on

    rotated = []
    projection = qkv.stacked_projection_triton

    def recording(x, weights, rotary=None):
        rotated.append((x.shape[0], rotary is not None and rotary[0].shape[0] == x.shape[0]))
        return projection(x, weights, rotary)

    monkeypatch.setattr(qkv, "stacked_projection_triton", recording)
    config = compressing_config(kt_cache_dtype="float32", fused_mlp=False, fused_rope=True)
    runs = engine_tokens_off_and_on(llama(), config, "fused_qkv", twin, DEVICE.type, sliding_slots=None)
    assert any(rows > 1 and per_row for rows, per_row in rotated)  # batched steps, cos/sin per row
    assert runs[True] == runs[False]
