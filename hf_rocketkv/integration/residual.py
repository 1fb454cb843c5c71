"""A decoder layer's residual adds and the RMSNorms beside them in one launch each, in RocketKV's forwards
(``RocketKVConfig.fused_residual``, default True; it takes effect where ``fused_norm`` does).

transformers' ``LlamaDecoderLayer.forward`` adds the attention's output to the residual stream and normalizes the sum
for the MLP: an add and a norm launch. ``Gemma3DecoderLayer.forward`` also normalizes each sublayer's output before
its add (``post_attention_layernorm``, ``post_feedforward_layernorm``): per layer four norms and two adds. Inside a
RocketKV call (``generate()`` with a RocketKVCache, the batching engine's forwards), hidden states ``[B, T, hidden]``
on CUDA in bf16/fp16 take ``kernels/residual_norm.residual_norm_triton`` instead:

    Llama's form   hidden, h = residual + attention, post_attention_layernorm(residual + attention)    1 launch, not 2
    Gemma 3's form hidden, h = residual + post_attention_layernorm(attention), pre_feedforward_layernorm(hidden)
                                                                                               1 launch, not 3
                   hidden = hidden + post_feedforward_layernorm(mlp)                           1 launch, not 2

and each layer's last add also computes the next layer's ``input_layernorm`` of the sum in its launch, which the
next layer takes instead of running the norm (``layer_chain.LayerChain``: the same tensor, the layer it was meant for,
no hooks on either layer, a model class whose loop passes each output straight on): two launches per layer for its
adds and norms, where the fused norms alone take four (Llama's form: two norms, two adds) or six (Gemma 3's). The rest
of the layer is transformers' own, step for step: ``input_layernorm`` (the first layer's, and any layer handed
nothing), ``self_attn`` and ``mlp`` called as the modeling code calls them. The adds are eager PyTorch's bit for
bit; each norm is the fused RMSNorm's (within one unit in the last place of transformers' module,
``kernels/rms_norm.py``), so the tokens are those of ``fused_norm``.

Everything else runs transformers' own forward with the arguments it received: fp32, CPU, a cache that is not
RocketKV's, a call traced by torch.compile or recording gradients, the cache passed under its old name, and norms
that ``fused_norm`` does not take (another formula, hooks or a replaced forward on the norm module, weights the kernel
cannot read). Which classes: those whose undecorated ``forward`` has exactly the byte code of ``LlamaDecoderLayer``'s
(Mistral, Qwen2/3... copy it) or ``Gemma3DecoderLayer``'s (Gemma 2's is the same code; ``compat.DECODER_FORMULAS``,
``compat.forward_classes``), wrapped once per class (``compat.install_forward``); ``fused_residual(model, enabled)``
sets a ContextVar per form for the call (per thread and per asyncio task, never process-wide). Prefill forwards take
it too (any row count).
"""

from __future__ import annotations

import contextlib
import contextvars

import torch

from ..kernels.residual_norm import residual_norm_supported, residual_norm_triton
from . import compat
from .fused_switch import FusedSwitch, all_enabled
from .layer_chain import LayerChain
from .mlp import no_hooks
from .norm import fused_norm_active, fused_norm_of
from .qkv import ROCKETKV_CACHES

FUSED_DEVICE_TYPES = ("cuda",)  # the kernel's devices (the CPU tests add "cpu": Triton's interpreter)
_CHAIN: contextvars.ContextVar[LayerChain | None] = contextvars.ContextVar("hf_rocketkv_layer_chain", default=None)


def _eligible(hidden_states, cache, kwargs) -> bool:
    return (isinstance(kwargs, dict) and compat.LEGACY_CACHE_ARG not in kwargs and isinstance(cache, ROCKETKV_CACHES)
            and hidden_states.dim() == 3 and hidden_states.device.type in FUSED_DEVICE_TYPES
            and not torch.is_grad_enabled() and fused_norm_active())


def _llama_layer(run_original, layer, hidden_states, attention_mask, position_ids, cache, use_cache,
                 position_embeddings, kwargs):
    """``LlamaDecoderLayer.forward`` with its first residual add and ``post_attention_layernorm`` in one launch, and
    its last add with the next layer's ``input_layernorm`` (``_handed_over``)."""
    formula = compat.forward_tag(layer.post_attention_layernorm)
    post = fused_norm_of(layer.post_attention_layernorm, formula) if formula is not None else None
    if not (_eligible(hidden_states, cache, kwargs) and post is not None
            and residual_norm_supported(hidden_states, hidden_states, post=post)):
        return run_original()
    residual = hidden_states
    hidden_states, _ = layer.self_attn(
        hidden_states=_input_norm(layer, hidden_states), attention_mask=attention_mask, position_ids=position_ids,
        **{compat.CACHE_ARG: cache}, use_cache=use_cache, position_embeddings=position_embeddings, **kwargs,
    )
    residual, hidden_states = residual_norm_triton(hidden_states, residual, formula, post=post)
    return _handed_over(layer, layer.mlp(hidden_states), residual, formula, None)


def _gemma3_layer(run_original, layer, hidden_states, position_embeddings, attention_mask, position_ids, cache,
                  kwargs):
    """``Gemma3DecoderLayer.forward`` with each sublayer's output norm, its residual add and the next input norm in
    one launch."""
    norms = [fused_norm_of(getattr(layer, name), "gemma") for name in
             ("post_attention_layernorm", "pre_feedforward_layernorm", "post_feedforward_layernorm")]
    if not (_eligible(hidden_states, cache, kwargs) and None not in norms
            and residual_norm_supported(hidden_states, hidden_states, *norms[:2])
            and residual_norm_supported(hidden_states, hidden_states, norms[2])):
        return run_original()
    residual = hidden_states
    hidden_states, _ = layer.self_attn(
        hidden_states=_input_norm(layer, hidden_states), position_embeddings=position_embeddings,
        attention_mask=attention_mask, position_ids=position_ids, **{compat.CACHE_ARG: cache}, **kwargs,
    )
    residual, hidden_states = residual_norm_triton(hidden_states, residual, "gemma", pre=norms[0], post=norms[1])
    return _handed_over(layer, layer.mlp(hidden_states), residual, "gemma", norms[2])


def _input_norm(layer, hidden_states):
    """``layer.input_layernorm(hidden_states)``, or the row the layer before computed for it (``LayerChain``)."""
    chain = _CHAIN.get()
    normed = chain.take(layer, hidden_states) if chain is not None else None
    return normed if normed is not None else layer.input_layernorm(hidden_states)


def _handed_over(layer, x, residual, formula: str, pre):
    """The layer's last residual add, ``residual + pre_norm(x)`` (``pre`` None: ``x``), returned; in the same launch
    the next layer's ``input_layernorm`` of the sum, handed over to it (``LayerChain``), where the next layer runs
    the same wrapped forward, that norm is one the fused RMSNorm computes by ``formula`` and neither layer carries
    hooks (one could change the row between them)."""
    chain = _CHAIN.get()
    successor = chain.successor(layer) if chain is not None else None
    post = None
    if (successor is not None and type(successor).forward is type(layer).forward and no_hooks(layer)
            and no_hooks(successor)):
        post = fused_norm_of(successor.input_layernorm, formula)
    if post is None or not residual_norm_supported(x, residual, pre, post):
        if pre is None:
            return residual + x
        return residual_norm_triton(x, residual, formula, pre=pre)[0]
    summed, normed = residual_norm_triton(x, residual, formula, pre=pre, post=post)
    chain.hand_over(summed, successor, normed)
    return summed


def _switch(form: str, compute) -> FusedSwitch:
    """The switch of one decoder-layer form (``compat.DECODER_FORMULAS``): its classes wrapped once per model."""
    return FusedSwitch(f"hf_rocketkv_fused_residual_{form}", f"_hf_rocketkv_residual_{form}_installed",
                       lambda model: compat.forward_classes(model, compat.DECODER_FORMULAS[form]),
                       compat.install_forward, compute)


_SWITCHES = (_switch("llama", _llama_layer), _switch("gemma3", _gemma3_layer))


@contextlib.contextmanager
def fused_residual(model, enabled: bool):
    """Within the block, this thread's forwards of ``model`` fuse each residual add with its norms (when
    ``enabled``)."""
    with all_enabled(_SWITCHES, model, enabled):
        if not enabled:
            yield
            return
        token = _CHAIN.set(LayerChain(model))
        try:
            yield
        finally:
            _CHAIN.reset(token)


def fused_residual_active() -> bool:
    """Whether this thread's (task's) forwards are inside a ``fused_residual`` block that is on."""
    return any(switch.active() for switch in _SWITCHES)
