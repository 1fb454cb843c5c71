"""The seam's contract with transformers: every private transformers name hf_rocketkv relies on, in one place.

Nothing else in hf_rocketkv imports a private transformers name or patches transformers. This module imports only
transformers and ``compat_calls.py`` beside it (the cache argument's name and the signature-bound call wrapper, no
private name; re-exported here); it sits in the integration floor, so integration and the floors above
it use it. The cache floor relies on no private name: its one tie to this table is ``RocketKVCache.compatibility_check``,
which registration sets to ``require`` (a changed transformers then fails at the first RocketKVCache).

| symbol                                              | use         | why                                                   |
|-----------------------------------------------------|-------------|-------------------------------------------------------|
| GenerationMixin._prepare_cache_for_generation       | wrapped     | a fresh RocketKVCache per generate() call, capacity    |
|                                                     |             | hints, misuse errors (no cache registry exists)       |
| GenerationMixin._prefill                            | wrapped     | continuation guard, row-group prefill, stage 1 after  |
|                                                     |             | a chunked prefill                                     |
| GenerationMixin.prepare_inputs_for_generation       | wrapped     | records the ids a cache has served (continuation)     |
| PreTrainedModel.get_compiled_call                   | wrapped     | compiled decode steps: capacity check, guard policy   |
| generation.utils.DeferredStopCheck.is_supported     | wrapped     | defer the per-token stop check on CUDA (MPS only      |
|                                                     |             | upstream)                                             |
| integrations.sdpa_attention.sdpa_attention_forward  | called      | exact sdpa attention for dense prefill and for calls  |
|                                                     |             | without a RocketKVCache                               |
| masking_utils.sdpa_mask                             | registered  | the mask function of the "rocketkv" name              |
| cache_utils.Cache / CacheLayerMixin contract        | implemented | RocketKVCache / RocketKVLayer (update, get_mask_sizes, |
|                                                     |             | get_seq_length, get_query_offset, crop, reorder...)   |
| GenerationMixin.generate (public, but patched)      | wrapped     | batch-size buckets: pad a RocketKV request's rows,    |
|                                                     |             | strip them from the output (``batch_buckets``)        |
| CompileConfig._compile_all_devices                  | read        | whether generate() compiles decode off CUDA (tests)   |
|                                                     |             | (``compiles_on_every_device``)                        |
| PretrainedConfig._attn_implementation               | read        | the attention a model runs: whether generate() is     |
|                                                     |             | RocketKV's, and the name in misuse errors             |
|                                                     |             | (``attn_implementation``); the attention of the       |
|                                                     |             | module calling a RocketKVCache's update: another      |
|                                                     |             | one is refused before it runs dense                   |
|                                                     |             | (``calling_module_attention``)                        |
| PreTrainedModel._from_config                        | called      | random weights built directly in a dtype: the decode  |
|                                                     |             | benchmark's model (``model_from_config``)             |
| models.auto.modeling_auto.                          | read        | the model types with a causal-LM class, checked from  |
|   MODEL_FOR_CAUSAL_LM_MAPPING_NAMES                 |             | the config before any weight loads                    |
|                                                     |             | (``causal_lm_model_types``)                           |
| models.*.modeling_*.apply_rotary_pos_emb            | wrapped     | one fused launch for a decode step's RoPE inside      |
|                                                     | (optional)  | RocketKV calls (``integration/rope.py``); a model     |
|                                                     |             | whose function takes other parameters keeps its own   |
| models.llama.modeling_llama.LlamaRMSNorm.forward,   | wrapped     | one launch per RMSNorm in RocketKV calls              |
|   models.gpt_oss.modeling_gpt_oss.GptOssRMSNorm.    | (optional)  | (``integration/norm.py``, ``NORM_FORMULAS``): weight, |
|   forward, models.gemma.modeling_gemma.GemmaRMSNorm.|             | variance_epsilon (Gemma: eps)                         |
|   forward and ._norm (and classes with their codes) |             |                                                       |
| models.llama.modeling_llama.LlamaMLP.forward (and   | wrapped     | a few tokens' gate/up projection, activation and      |
|   classes with its byte code); read gate_proj,      | (optional)  | product in one launch in RocketKV calls               |
|   up_proj, down_proj, act_fn (ACT2FN's SiLU, GELU)  |             | (``integration/mlp.py``, ``mlp_classes``)             |
| models.llama.modeling_llama.LlamaAttention.forward, | wrapped     | a decode step's q/k/v projections in one launch in    |
|   models.gemma3.modeling_gemma3.Gemma3Attention.    | (optional)  | RocketKV calls (``integration/qkv.py``,               |
|   forward (and classes with their byte codes); read |             | ``forward_classes``); the rest of the forward as    |
|   q/k/v/o_proj, q_norm, k_norm, head_dim, scaling,  |             | transformers writes it                                |
|   sliding_window, layer_idx, apply_rotary_pos_emb   |             |                                                       |
| models.llama.modeling_llama.LlamaDecoderLayer.      | wrapped     | a residual add and the norms beside it in one launch  |
|   forward, models.gemma3.modeling_gemma3.Gemma3-    | (optional)  | in RocketKV calls (``integration/residual.py``); the  |
|   DecoderLayer.forward (and classes with their byte |             | sublayers called as transformers calls them           |
|   codes); read the norms, self_attn, mlp            |             |                                                       |
| use_experts_implementation classes: forward; read   | wrapped     | a few tokens' experts read in place in RocketKV calls |
|   has_gate, has_bias, is_transposed, _apply_gate... | (optional)  | (``integration/experts.py``, ``experts_layout``)      |
|   GptOssExperts._apply_gate (qualname), alpha, limit|             | gpt-oss' gate in one prefill kernel (``clamped_glu``) |

Outside this module the package reaches these names only through the wrappers ``install`` sets up and the accessor
functions below (``sdpa_attention_forward``, ``compiles_on_every_device``, ``attn_implementation``,
``calling_module_attention``, ``model_from_config``, ``causal_lm_model_types``): tests/integration/test_private_names.py fails, naming file and line, when any
other file spells a private transformers name or imports a private transformers module. torch's and Triton's private
names are listed in ``private_names.py`` beside this module.

Public extension points used as such (not listed above): ``AttentionInterface.register``,
``AttentionMaskInterface.register``, passing a ``Cache`` instance as ``cache`` (``past_key_values`` before
transformers 5.24: ``CACHE_ARG``; the rename is the only difference hf_rocketkv sees) (auto-compiled by generate()
when ``is_compileable``). ``generate(custom_generate=...)`` was considered for the fresh-cache-per-call behaviour and
rejected: users would have to pass it on every call, and ``pipeline()`` could not.

Every wrapper binds its arguments with ``inspect.signature(original).bind`` (never by position) and hands the call
to hf_rocketkv only when it involves RocketKV (``GenerateHooks.involves_*``); any other model and cache get the
original function, called with exactly the arguments it received. When the installed transformers changes a
signature listed here, the wrapper is not installed and the first use of RocketKV raises ``CompatError`` naming the
transformers version and the symbol (``require()``), instead of a TypeError deep inside generate().
"""

from __future__ import annotations

import copy
import functools
import importlib
import inspect
from dataclasses import dataclass
from typing import Any, Callable, NamedTuple

import torch
import transformers
from transformers import AttentionInterface, AttentionMaskInterface, GenerationMixin, PreTrainedModel
from transformers.activations import ACT2FN
from transformers.cache_utils import Cache

from .compat_calls import (  # noqa: F401 - all re-exported: the cache argument's name and the call binding
    CACHE_ARG, CACHE_ARGS, LEGACY_CACHE_ARG, MODELING_LOCK, ROTARY_NAME, ROTARY_PARAMS, WRAPPED_MARK, ArgumentBinder,
    Call, GenerateHooks, _unwrapped, _wrap, cache_from, cache_kwargs, code_key, forward_tag, install_forward,
    install_rotary, output_cache, rotary_modules, with_cache,
)

TRANSFORMERS_VERSION: str = transformers.__version__
VERIFIED_VERSIONS: tuple[str, ...] = ("5.17.0", "5.23.0", "5.24.0", "5.25.0")


class CompatError(RuntimeError):
    """The installed transformers no longer matches a private symbol hf_rocketkv relies on."""


@dataclass(frozen=True)
class PrivateSymbol:
    """One private transformers name: where it lives, the parameters hf_rocketkv binds by name, and why."""

    qualname: str
    resolve: Callable[[], Any]  # returns the function as it is looked up on its owner (raises if absent)
    params: tuple[str, ...]  # parameter names hf_rocketkv binds; each must exist in the signature
    why: str


def _generation_utils():
    from transformers.generation import utils

    return utils


def _sdpa_attention_forward():
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    return sdpa_attention_forward


def _sdpa_mask():
    from transformers.masking_utils import sdpa_mask

    return sdpa_mask


PREPARE_CACHE = PrivateSymbol(
    "GenerationMixin._prepare_cache_for_generation",
    lambda: _unwrapped(GenerationMixin._prepare_cache_for_generation),
    ("self", "generation_config", "model_kwargs", "generation_mode", "max_cache_length"),
    "a fresh RocketKVCache for each generate() call, the request's maximum length, misuse errors",
)
PREFILL = PrivateSymbol(
    "GenerationMixin._prefill",
    lambda: _unwrapped(GenerationMixin._prefill),
    ("self", "input_ids", "generation_config", "model_kwargs"),
    "continuation guard, row-group prefill, stage 1 after a chunked prefill",
)
PREPARE_INPUTS = PrivateSymbol(
    "GenerationMixin.prepare_inputs_for_generation",
    lambda: _unwrapped(GenerationMixin.prepare_inputs_for_generation),
    ("self", "input_ids", CACHE_ARG),
    "records every id a RocketKVCache has served, which a later turn must start with",
)
COMPILED_CALL = PrivateSymbol(
    "PreTrainedModel.get_compiled_call",
    lambda: _unwrapped(PreTrainedModel.get_compiled_call),
    ("self", "compile_config"),
    "compiled decode steps of RocketKV caches: host capacity check and guard policy",
)
DEFERRED_STOP = PrivateSymbol(
    "generation.utils.DeferredStopCheck.is_supported",
    lambda: _unwrapped(_generation_utils().DeferredStopCheck.is_supported),
    ("device", "cache", "cache_is_returned", "is_assistant"),
    "generate() reads its stop flag one step late on CUDA for RocketKV caches (upstream: MPS only)",
)
SDPA_ATTENTION = PrivateSymbol(
    "integrations.sdpa_attention.sdpa_attention_forward",
    _sdpa_attention_forward,
    ("module", "query", "key", "value", "attention_mask", "dropout", "scaling"),
    "exact sdpa attention for dense prefill and for forwards without a RocketKVCache",
)
SDPA_MASK = PrivateSymbol(
    "masking_utils.sdpa_mask",
    _sdpa_mask,
    ("batch_size", "q_length", "kv_length", "q_offset", "kv_offset", "attention_mask"),
    "the mask function registered for attn_implementation='rocketkv'",
)
CACHE_CONTRACT = PrivateSymbol(
    "cache_utils.Cache.get_query_offset",
    lambda: Cache.get_query_offset,
    ("self", "layer_idx"),
    "RocketKVCache answers the mask code's query offset with a device counter (no host sync per step)",
)
GENERATE = PrivateSymbol(
    "GenerationMixin.generate",
    lambda: _unwrapped(GenerationMixin.generate),
    ("self", "inputs", "generation_config", "prefix_allowed_tokens_fn", "assistant_model", "streamer",
     "negative_prompt_ids", "custom_generate", "kwargs"),
    "batch-size buckets: a RocketKV request's rows are padded to a bucket and stripped from the output",
)

SYMBOLS: tuple[PrivateSymbol, ...] = (GENERATE, PREPARE_CACHE, PREFILL, PREPARE_INPUTS, COMPILED_CALL, DEFERRED_STOP,
                                      SDPA_ATTENTION, SDPA_MASK, CACHE_CONTRACT)


def check_symbol(symbol: PrivateSymbol) -> str | None:
    """None when ``symbol`` exists with every parameter hf_rocketkv binds, else what changed (one line)."""
    try:
        function = symbol.resolve()
    except (ImportError, AttributeError) as err:
        return f"{symbol.qualname} is gone ({type(err).__name__}: {err})"
    try:
        parameters = inspect.signature(function).parameters
    except (TypeError, ValueError) as err:
        return f"{symbol.qualname} has no readable signature ({err})"
    missing = [name for name in symbol.params if name not in parameters]
    if missing:
        return f"{symbol.qualname} lost parameter(s) {missing}; it now takes ({', '.join(parameters)})"
    return None


def find_problems(symbols: tuple[PrivateSymbol, ...] = SYMBOLS) -> tuple[str, ...]:
    return tuple(problem for problem in map(check_symbol, symbols) if problem is not None)


# Computed once at import and never changed: the installed transformers does not change while the process runs.
PROBLEMS: tuple[str, ...] = find_problems()


def describe_problems(problems: tuple[str, ...]) -> str:
    return (
        f"hf_rocketkv cannot work with transformers {TRANSFORMERS_VERSION} (verified: "
        f"{', '.join(VERIFIED_VERSIONS)}): " + "; ".join(problems) + ". Install a verified transformers version "
        f"(pip install 'transformers=={VERIFIED_VERSIONS[-1]}') or an hf_rocketkv release that supports yours."
    )


def require(problems: tuple[str, ...] = PROBLEMS) -> None:
    """Raise ``CompatError`` if a private symbol hf_rocketkv relies on has changed (called at RocketKV's first use)."""
    if problems:
        raise CompatError(describe_problems(problems))


# --------------------------------------------------------------------------------------------------- accessors
def _resolved_or_none(symbol: PrivateSymbol):
    return symbol.resolve() if check_symbol(symbol) is None else None


_SDPA_ATTENTION = _resolved_or_none(SDPA_ATTENTION)
sdpa_mask = _resolved_or_none(SDPA_MASK)


def sdpa_attention_forward(*args, **kwargs):
    """transformers' sdpa attention function (``SDPA_ATTENTION``)."""
    if _SDPA_ATTENTION is None:
        require()
    return _SDPA_ATTENTION(*args, **kwargs)


def register_attention(name: str, attention_fn: Callable, mask_fn: Callable) -> None:
    """Public extension points: the attention function and the mask function of ``attn_implementation=name``."""
    AttentionInterface.register(name, attention_fn)
    AttentionMaskInterface.register(name, mask_fn)


# --------------------------------------------------------------------------------------------------- generate hooks
def _generate_handler(hooks: GenerateHooks):
    def handle(call: Call, args, kwargs):
        cache = cache_from(call.arguments["kwargs"])
        if not (hooks.involves_model(call.arguments["self"]) or hooks.involves_cache(cache)):
            return call.original(*args, **kwargs)
        return hooks.generate(call)

    return handle


def compiles_on_every_device(compile_config) -> bool:
    """``CompileConfig._compile_all_devices``: generate() compiles decode off CUDA too (tests force it on CPU)."""
    return bool(getattr(compile_config, "_compile_all_devices", False))


def attn_implementation(model) -> str | None:
    """``model.config._attn_implementation``: the name of the attention function the model runs (None if unset).
    transformers keeps it private; ``set_attn_implementation`` is its public writer, and there is no public reader."""
    return getattr(model.config, "_attn_implementation", None)


def own_config(model) -> None:
    """Give ``model`` and each of its modules their own copy of the config they were built with (sub-configs
    included). transformers hands one config object to every model built from it (``Model(config)``,
    ``from_config``) and to each of their modules, and ``set_attn_implementation`` writes the attention's name into
    that object: without the copy, switching one model to RocketKV would silently switch every model sharing it."""
    memo: dict[int, Any] = {}
    copied = copy.deepcopy(model.config, memo)
    for module in model.modules():
        config = getattr(module, "config", None)
        twin = memo.get(id(config)) if config is not None else None
        if twin is not None and type(twin) is type(config):
            module.config = twin
    assert model.config is copied


def calling_module_attention(frames_up: int) -> str | None:
    """``config._attn_implementation`` of the module whose method runs ``frames_up`` frames above this function's
    caller (frames of ``Cache`` objects in between are passed over: a subclass's ``super().update``), or None when
    that frame is no ``nn.Module`` with a config (a direct call). transformers' attention modules store their keys
    with ``past_key_values.update(...)`` from their own ``forward``, then run
    ``ALL_ATTENTION_FUNCTIONS[self.config._attn_implementation]``: seen from a cache's ``update``, this is the name of
    the attention that will read the keys being stored. Eager calls only (a frame lookup breaks a traced graph)."""
    frame = inspect.currentframe()
    try:
        for _ in range(frames_up + 1):
            frame = frame.f_back if frame is not None else None
        while frame is not None and isinstance(frame.f_locals.get("self"), Cache):
            frame = frame.f_back
        owner = frame.f_locals.get("self") if frame is not None else None
        if not isinstance(owner, torch.nn.Module):
            return None
        return getattr(getattr(owner, "config", None), "_attn_implementation", None)
    finally:
        del frame


def model_from_config(model_class, config, **kwargs):
    """``model_class._from_config(config, **kwargs)``: a model with freshly initialised weights, built directly in the
    ``dtype=`` given (no checkpoint), as the Auto classes' public ``from_config`` does for them."""
    return model_class._from_config(config, **kwargs)


def causal_lm_model_types():
    """The ``model_type`` names transformers has a causal-LM class for (``MODEL_FOR_CAUSAL_LM_MAPPING_NAMES``'s keys):
    what ``AutoModelForCausalLM`` can build, known from the config alone."""
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    return MODEL_FOR_CAUSAL_LM_MAPPING_NAMES.keys()


def _prepare_cache_handler(hooks: GenerateHooks):
    def handle(call: Call, args, kwargs):
        cache = cache_from(call.arguments["model_kwargs"])
        if not (hooks.involves_model(call.arguments["self"]) or hooks.involves_cache(cache)):
            return call.original(*args, **kwargs)
        return hooks.prepare_cache(call)

    return handle


def _prefill_handler(hooks: GenerateHooks):
    def handle(call: Call, args, kwargs):
        if not hooks.involves_cache(cache_from(call.arguments["model_kwargs"])):
            return call.original(*args, **kwargs)
        return hooks.prefill(call)

    return handle


def _prepare_inputs_handler(hooks: GenerateHooks):
    def handle(call: Call, args, kwargs):
        if not hooks.involves_cache(call.arguments.get(CACHE_ARG)):
            return call.original(*args, **kwargs)
        return hooks.prepare_inputs(call)

    return handle


class CompiledCallGate:
    """What ``get_compiled_call`` returns once hf_rocketkv is imported: for a call without a RocketKV cache, the
    compiled forward itself with the very same arguments (positional ones included); hf_rocketkv's compiled step
    otherwise."""

    def __init__(self, compiled: Callable, model, hooks: GenerateHooks):
        self.compiled = compiled
        self.model = model
        self.forward_signature = inspect.signature(model.forward)
        self.hooks = hooks

    def __call__(self, *args, **kwargs):
        cache = cache_from(kwargs)
        if cache is None and args:
            try:
                cache = cache_from(self.forward_signature.bind_partial(*args, **kwargs).arguments)
            except TypeError:
                cache = None  # let the compiled function itself report a bad call, exactly as without us
        if not self.hooks.involves_cache(cache):
            return self.compiled(*args, **kwargs)
        return self.hooks.compiled_step(self.compiled, self.model, cache, args, kwargs)

    def __getattr__(self, name):  # anything else a caller reads from the compiled function
        return getattr(self.compiled, name)


def _compiled_call_handler(hooks: GenerateHooks):
    def handle(call: Call, args, kwargs):
        compiled = call.original(*args, **kwargs)
        return CompiledCallGate(compiled, call.arguments["self"], hooks)

    return handle


def _deferred_stop_handler(hooks: GenerateHooks):
    def handle(call: Call, args, kwargs):
        if not hooks.involves_cache(call.arguments["cache"]):
            return call.original(*args, **kwargs)
        return hooks.deferred_stop_supported(call)

    return handle


def _install_method(owner: type, name: str, symbol: PrivateSymbol, handler, static: bool = False) -> None:
    current = owner.__dict__[name]
    function = current.__func__ if isinstance(current, staticmethod) else current
    if getattr(function, WRAPPED_MARK, False) or check_symbol(symbol) is not None:
        return  # already installed, or transformers changed it (require() reports it at RocketKV's first use)
    wrapper = _wrap(function, handler, renames_cache=symbol is GENERATE)
    setattr(owner, name, staticmethod(wrapper) if static else wrapper)


def install(hooks: GenerateHooks) -> None:
    """Wrap the private generate() steps listed in this module's table (idempotent)."""
    _install_method(GenerationMixin, "generate", GENERATE, _generate_handler(hooks))
    _install_method(GenerationMixin, "_prepare_cache_for_generation", PREPARE_CACHE, _prepare_cache_handler(hooks))
    _install_method(GenerationMixin, "_prefill", PREFILL, _prefill_handler(hooks))
    _install_method(GenerationMixin, "prepare_inputs_for_generation", PREPARE_INPUTS, _prepare_inputs_handler(hooks))
    _install_method(PreTrainedModel, "get_compiled_call", COMPILED_CALL, _compiled_call_handler(hooks))
    deferred = getattr(_generation_utils(), "DeferredStopCheck", None)
    if deferred is not None:
        _install_method(deferred, "is_supported", DEFERRED_STOP, _deferred_stop_handler(hooks), static=True)


# --------------------------------------------------------------------------------------------------- RMSNorm
@dataclass(frozen=True)
class ModuleFormula:
    """A transformers module whose formula a fused kernel computes (an RMSNorm: ``kernels/rms_norm.FORMULAS``; the
    gated MLP: ``kernels/gated_projection``): the class that defines it, the methods whose byte code identifies a copy
    of it (and their exact parameters), the attribute the kernel reads besides the weights (the norm's eps, the MLP's
    activation), the RocketKVConfig switch that turns the fused path off."""

    module: str  # under transformers.
    name: str
    methods: tuple[str, ...]
    params: tuple[str, ...]
    attribute: str
    switch: str = "fused_norm"


NORM_FORMULAS = {
    "llama": ModuleFormula("models.llama.modeling_llama", "LlamaRMSNorm", ("forward",), ("self", "hidden_states"),
                         "variance_epsilon"),
    "gpt_oss": ModuleFormula("models.gpt_oss.modeling_gpt_oss", "GptOssRMSNorm", ("forward",),
                           ("self", "hidden_states"), "variance_epsilon"),
    "gemma": ModuleFormula("models.gemma.modeling_gemma", "GemmaRMSNorm", ("forward", "_norm"), ("self", "x"), "eps"),
}


def _formula_reference(formula: ModuleFormula) -> tuple:
    """The byte-code keys of ``formula``'s methods (below any wrapper); ``CompatError`` when the class is gone or a
    method takes other parameters."""
    try:
        klass = getattr(importlib.import_module(f"transformers.{formula.module}"), formula.name)
        names = tuple(tuple(inspect.signature(getattr(klass, method)).parameters) for method in formula.methods)
    except (ImportError, AttributeError, TypeError, ValueError) as err:
        names = f"{type(err).__name__}: {err}"
    if names != (formula.params,) * len(formula.methods):
        problem = (f"{formula.module}.{formula.name}.{' and .'.join(formula.methods)} take {names}, not "
                   f"{formula.params}")
        raise CompatError(describe_problems((problem,)) + f" Or set RocketKVConfig({formula.switch}=False).")
    return tuple(code_key(getattr(klass, method)) for method in formula.methods)


def _forward_owners(model):
    """``(module, owner)`` for each of ``model``'s modules whose ``forward`` a transformers class defines (``owner``:
    the first class of its MRO that defines it, the class a fused path wraps)."""
    for module in model.modules():
        owner = next((klass for klass in type(module).__mro__ if "forward" in klass.__dict__), None)
        if owner is not None and owner.__module__.startswith("transformers."):
            yield module, owner


def norm_classes(model, formula: str) -> list[type]:
    """The transformers classes (those defining ``forward``) of ``model``'s modules whose methods have the byte code
    of ``NORM_FORMULAS[formula]``'s: Llama's is copied by Mistral, Qwen2/3, Phi-3, Granite...; gpt-oss' by OLMo2;
    Gemma's by Gemma 2 and 3; T5's is none of them."""
    spec = NORM_FORMULAS[formula]
    reference, found = _formula_reference(spec), {}
    for module, owner in _forward_owners(model):
        keys = tuple(code_key(owner.__dict__["forward"]) if method == "forward" else
                     code_key(getattr(type(module), method, None)) for method in spec.methods)
        if keys == reference and isinstance(getattr(module, spec.attribute, None), float):
            found[owner] = None
    return list(found)


# --------------------------------------------------------------------------------------------------- gated MLP
GATED_MLP = ModuleFormula("models.llama.modeling_llama", "LlamaMLP", ("forward",), ("self", "x"), "act_fn", "fused_mlp")
# the kernel's activation names (kernels/gated_projection.ACTIVATIONS) and the ACT2FN entries computing them
MLP_ACTIVATIONS = {"silu": "silu", "gelu_tanh": "gelu_pytorch_tanh"}
_ACTIVATION_CLASSES = {torch.nn.SiLU: "silu",  # ACT2FN["swish"]
                       **{type(ACT2FN[name]): kernel for kernel, name in MLP_ACTIVATIONS.items()}}


def mlp_classes(model) -> list[type]:
    """The transformers classes (those defining ``forward``) of ``model``'s modules whose ``forward`` has the byte
    code of ``LlamaMLP.forward``, ``down_proj(act_fn(gate_proj(x)) * up_proj(x))``: Mistral, Qwen2/3, Gemma 1-3,
    Cohere 2, Granite, OLMo2... copy it; Phi-3's (one fused gate/up projection) and Llama 4's are not it."""
    reference, found = _formula_reference(GATED_MLP)[0], {}
    for _, owner in _forward_owners(model):
        if owner not in found and code_key(owner.__dict__["forward"]) == reference:
            found[owner] = None
    return list(found)


def mlp_activation(act) -> str | None:
    """The kernel's name for an MLP's ``act_fn`` when it is transformers' SiLU (or torch's) or its C tanh-GELU (the
    class of ``ACT2FN["gelu_pytorch_tanh"]``; where it holds its function as ``act``, that must be
    ``F.gelu(approximate="tanh")``, not the Python formula ``gelu_python_tanh`` builds), else None."""
    kernel = _ACTIVATION_CLASSES.get(type(act))
    inner = getattr(act, "act", None)
    if kernel == "gelu_tanh" and inner is not None and not (
            isinstance(inner, functools.partial) and inner.func is torch.nn.functional.gelu
            and inner.keywords == {"approximate": "tanh"} and not inner.args):
        return None
    return kernel


# --------------------------------------------------------------------------------------------------- attention, layers
_ATTENTION_PARAMS = ("self", "hidden_states", "position_embeddings", "attention_mask", CACHE_ARG, "kwargs")
# the forwards integration/ replays around its kernels: attention (``qkv.py``: views, RoPE, update, attention,
# o_proj; Gemma 3's with per-head q/k norms before RoPE and the layer's sliding window) and decoder layers
# (``residual.py``: the residual adds beside the norms; Gemma 3's with a norm after each sublayer)
ATTENTION_FORMULAS = {
    "llama": ModuleFormula("models.llama.modeling_llama", "LlamaAttention", ("forward",), _ATTENTION_PARAMS,
                           "head_dim", "fused_qkv"),
    "gemma3": ModuleFormula("models.gemma3.modeling_gemma3", "Gemma3Attention", ("forward",), _ATTENTION_PARAMS,
                            "head_dim", "fused_qkv"),
}
DECODER_FORMULAS = {
    "llama": ModuleFormula("models.llama.modeling_llama", "LlamaDecoderLayer", ("forward",),
                           ("self", "hidden_states", "attention_mask", "position_ids", CACHE_ARG, "use_cache",
                            "position_embeddings", "kwargs"), "mlp", "fused_residual"),
    "gemma3": ModuleFormula("models.gemma3.modeling_gemma3", "Gemma3DecoderLayer", ("forward",),
                            ("self", "hidden_states", "position_embeddings", "attention_mask", "position_ids",
                             CACHE_ARG, "kwargs"), "mlp", "fused_residual"),
}


def _inner(function):
    """The function below every decorator (transformers' kernel routing and argument renames; our own wrapper)."""
    return inspect.unwrap(function)


def forward_classes(model, formula: ModuleFormula) -> list[type]:
    """The transformers classes of ``model``'s modules whose undecorated ``forward`` has the byte code of
    ``formula``'s class (``ATTENTION_FORMULAS``, ``DECODER_FORMULAS``); ``CompatError`` naming the formula's switch
    when that forward takes other parameters."""
    _formula_reference(formula)  # the parameters, bound by name
    reference = code_key(_inner(getattr(importlib.import_module(f"transformers.{formula.module}"),
                                        formula.name).forward))
    found = {}
    for _, owner in _forward_owners(model):
        if owner not in found and code_key(_inner(owner.__dict__["forward"])) == reference:
            found[owner] = None
    return list(found)


def attention_rotary(module) -> Callable:
    """The ``apply_rotary_pos_emb`` that ``module``'s attention forward calls (its modeling module's, as wrapped
    now: the fused RoPE of ``install_rotary`` included)."""
    owner = next(klass for klass in type(module).__mro__ if "forward" in klass.__dict__)
    return _inner(owner.__dict__["forward"]).__globals__[ROTARY_NAME]


# --------------------------------------------------------------------------------------------------- MoE experts
GATE = "_apply_gate"  # the experts module's gating of its gate/up projection (the table above)
CLAMPED_GLU_GATE = "GptOssExperts._apply_gate"  # the gate kernels/expert_prefill.clamped_glu computes


class ExpertsLayout(NamedTuple):
    """What ``integration/experts.py`` needs of a transformers experts module (``use_experts_implementation``)."""

    transposed: bool  # weights [E, in, out] (gpt-oss) rather than nn.Linear's [E, out, in]
    bias: bool
    apply_gate: Callable[[torch.Tensor], torch.Tensor]  # the module's own gating of the gate/up projection
    clamped_glu: tuple[float, float] | None = None  # (alpha, limit) where the gate is GptOssExperts' own method


def experts_layout(module) -> ExpertsLayout | None:
    """A gated ``use_experts_implementation`` module's layout (3-D weights, no post norm, one process), else None."""
    if not (getattr(module, "has_gate", None) is True and isinstance(getattr(module, "is_transposed", None), bool)
            and getattr(module, "has_post_expert_norm", False) is False and callable(getattr(module, GATE, 0))
            and getattr(module, "_is_expert_parallel", False) is False
            and all(isinstance(w := getattr(module, name, None), torch.Tensor) and w.dim() == 3
                    for name in ("gate_up_proj", "down_proj"))):
        return None
    alpha, limit = getattr(module, "alpha", None), getattr(module, "limit", None)
    clamped = (getattr(getattr(type(module), GATE, None), "__qualname__", None) == CLAMPED_GLU_GATE
               and all(type(v) in (int, float) for v in (alpha, limit)))
    return ExpertsLayout(module.is_transposed, getattr(module, "has_bias", False) is True, getattr(module, GATE),
                         (float(alpha), float(limit)) if clamped else None)


def experts_classes(model) -> list[type]:
    """The classes defining the forward of ``model``'s experts modules: ``(self, hidden_states, ids, weights)``."""
    found = {}
    for module, owner in _forward_owners(model):
        if (owner not in found and experts_layout(module) is not None
                and len(inspect.signature(owner.__dict__["forward"]).parameters) == 4):
            found[owner] = None
    return list(found)
