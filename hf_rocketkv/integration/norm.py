"""Fused RMSNorm in RocketKV's forwards (``RocketKVConfig.fused_norm``, default True).

transformers' ``LlamaRMSNorm`` is six to seven launches per norm (to fp32, square, mean, add eps and rsqrt, multiply,
back to the input dtype, multiply by the weight), two per layer and one after the last: 65 per forward of a 32-layer
model, each a pass over the hidden states (in an 8k-token prefill of Llama-3.1-8B, tens of ms of device time in fp32
copies and products). Inside a RocketKV call (``generate()`` with a RocketKVCache, the batching engine's prefills
and decode steps) hidden states ``[B, T, hidden]`` on CUDA in bf16/fp16 go through
``kernels/rms_norm.rms_norm_triton`` instead: one launch, the same formula rounded at the same places (within one ulp
of eager PyTorch: ``tests/kernels/test_rms_norm.py``). Everything else runs transformers' own forward with the
arguments it received: fp32, CPU, other caches, other threads, a call traced by torch.compile, and inputs of another
rank than 3-D hidden states and 4-D per-head rows (Gemma 3's and Qwen3's ``q_norm``/``k_norm``).

Which norms: the classes of the model whose methods have exactly the byte code of one of the formulas the kernel
knows (``compat.NORM_FORMULAS``, ``compat.norm_classes``): ``LlamaRMSNorm.forward`` (Mistral, Qwen2/3, Phi-3,
Granite... copy it verbatim), on 3-D hidden states and on Qwen3's per-head q/k norms' ``[B, T, heads, head_dim]``
(two per layer, each six launches unfused); ``GptOssRMSNorm.forward`` (the product in fp32; OLMo2's norm has
its byte code), on 3-D hidden states; ``GemmaRMSNorm.forward`` and ``._norm`` (Gemma, Gemma 2 and 3: ``(1 +
weight)``), on hidden states and on the per-head q/k norms' ``[B, heads, T, head_dim]`` (Gemma 3 runs six norms per
layer: without them a decode step of Gemma-3-12B is ~4,600 launches). Other formulas (T5's) are never touched. How a
call is recognised as RocketKV's: ``fused_norm(model, enabled)`` sets a ContextVar for the duration of the call (per
thread and per asyncio task, never process-wide), after making sure those classes have their ``forward`` wrapped
(``compat.install_forward``; once per class, tagged with the formula: ``compat.forward_tag`` reads it back for the
residual adds of ``residual.py``).
"""

from __future__ import annotations

import contextlib
import functools

from ..kernels.rms_norm import Norm, rms_norm_supported, rms_norm_triton
from . import compat
from .fused_switch import FusedSwitch, all_enabled
from .mlp import no_hooks

FUSED_DEVICE_TYPES = ("cuda",)  # the kernel's devices (the CPU tests add "cpu": Triton's interpreter)


# formulas whose per-head (4-D) norms take the kernel too: Gemma 3's q/k norms on [B, heads, T, head_dim], Qwen3's on
# [B, T, heads, head_dim] (Llama's formula)
PER_HEAD_FORMULAS = ("gemma", "llama")


def _computer(formula: str):
    """The wrapper's choice for ``formula``: the kernel for bf16/fp16 CUDA hidden states (and per-head inputs where
    ``PER_HEAD_FORMULAS`` says so), the module's own forward otherwise (``eps``: the module's attribute the formula
    names, Llama's ``variance_epsilon``, Gemma's ``eps``)."""
    ranks = (3, 4) if formula in PER_HEAD_FORMULAS else (3,)
    eps_attribute = compat.NORM_FORMULAS[formula].attribute

    def compute(run_original, module, hidden_states):
        if (hidden_states.dim() in ranks and hidden_states.device.type in FUSED_DEVICE_TYPES
                and rms_norm_supported(hidden_states, module.weight)):
            return rms_norm_triton(hidden_states, module.weight, getattr(module, eps_attribute), formula)
        return run_original()

    return compute


_SWITCHES = tuple(
    FusedSwitch(f"hf_rocketkv_fused_norm_{formula}", f"_hf_rocketkv_norm_{formula}_installed",
                functools.partial(compat.norm_classes, formula=formula),
                functools.partial(compat.install_forward, tag=formula), _computer(formula))
    for formula in compat.NORM_FORMULAS
)


def install_for(model) -> None:
    """Wrap the forward of every norm class of a known formula that ``model`` is made of (idempotent)."""
    for switch in _SWITCHES:
        switch.install_for(model)


@contextlib.contextmanager
def fused_norm(model, enabled: bool):
    """Within the block, this thread's forwards of ``model`` take the fused RMSNorm (when ``enabled``)."""
    with all_enabled(_SWITCHES, model, enabled):
        yield


fused_norm_active = _SWITCHES[0].active


def fused_norm_of(module, formula: str) -> Norm | None:
    """``(weight, eps)`` of a norm module whose forward the fused RMSNorm computes by ``formula`` (its class wrapped
    with that formula, no forward of its own on the instance, no hooks), for kernels that fold the norm into another
    launch (``residual.py``, Gemma 3's q/k norms in the RoPE launch); None for any other module."""
    if compat.forward_tag(module) != formula or "forward" in vars(module) or not no_hooks(module):
        return None
    eps = getattr(module, compat.NORM_FORMULAS[formula].attribute, None)
    return (module.weight, eps) if isinstance(eps, float) else None
