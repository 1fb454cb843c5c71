"""Fused RMSNorm in RocketKV's forwards (``RocketKVConfig.fused_norm``, default True).

transformers' ``LlamaRMSNorm`` is six to seven launches per norm (to fp32, square, mean, add eps and rsqrt, multiply,
back to the input dtype, multiply by the weight), two per layer and one after the last: 65 per forward of a 32-layer
model, each a pass over the hidden states (in an 8k-token prefill of Llama-3.1-8B, tens of ms of device time in fp32
copies and products). Inside a RocketKV call (``generate()`` with a RocketKVCache, the batching engine's prefills
and decode steps) hidden states ``[B, T, hidden]`` on CUDA in bf16/fp16 go through
``kernels/rms_norm.rms_norm_triton`` instead: one launch, the same formula rounded at the same places (within one ulp
of eager PyTorch: ``tests/kernels/test_rms_norm.py``). Everything else runs transformers' own forward with the
arguments it received: fp32, CPU, other caches, other threads, a call traced by torch.compile, and inputs that are
not 3-D hidden states (Qwen3's per-head ``q_norm``/``k_norm`` see ``[B, T, heads, head_dim]``).

Which norms: the classes of the model whose ``forward`` has exactly the byte code of ``LlamaRMSNorm.forward``
(``compat.llama_norm_classes``: Mistral, Qwen2/3, Phi-3, Granite... copy it verbatim), on 3-D hidden states; and
those whose ``forward`` and ``_norm`` have the byte code of ``GemmaRMSNorm`` (``compat.gemma_norm_classes``: Gemma,
Gemma 2 and 3), whose ``(1 + weight)`` formula the kernel computes with ``unit_offset``, on hidden states and on the
per-head q/k norms' ``[B, T, heads, head_dim]`` (Gemma 3 runs six norms per layer: without them a decode step of
Gemma-3-12B is ~4,600 launches). Other formulas (OLMo2's order of operations) are never touched. How a call is
recognised as RocketKV's: ``fused_norm(model, enabled)`` sets a ContextVar for the duration of the call (per thread
and per asyncio task, never process-wide), after making sure those classes have their ``forward`` wrapped
(``compat.install_norm``; once per class).
"""

from __future__ import annotations

import contextlib
import functools

from ..kernels.rms_norm import rms_norm_supported, rms_norm_triton
from . import compat
from .fused_switch import FusedSwitch
from .rope import fused_rope

FUSED_DEVICE_TYPES = ("cuda",)  # the kernel's devices (the CPU tests add "cpu": Triton's interpreter)


def _compute(run_original, hidden_states, weight, eps):
    shape = hidden_states.shape
    if (len(shape) == 3 and hidden_states.device.type in FUSED_DEVICE_TYPES
            and rms_norm_supported(hidden_states, weight)):
        return rms_norm_triton(hidden_states, weight, eps)
    return run_original()


def _compute_gemma(run_original, hidden_states, weight, eps):
    if (hidden_states.dim() in (3, 4) and hidden_states.device.type in FUSED_DEVICE_TYPES
            and rms_norm_supported(hidden_states, weight)):
        return rms_norm_triton(hidden_states, weight, eps, unit_offset=True)
    return run_original()


_SWITCH = FusedSwitch("hf_rocketkv_fused_norm", "_hf_rocketkv_norm_installed", compat.llama_norm_classes,
                      compat.install_norm, _compute)
_GEMMA_SWITCH = FusedSwitch("hf_rocketkv_fused_gemma_norm", "_hf_rocketkv_gemma_norm_installed",
                            compat.gemma_norm_classes, functools.partial(compat.install_norm, eps_attribute="eps"),
                            _compute_gemma)


def install_for(model) -> None:
    """Wrap the forward of every LlamaRMSNorm- and GemmaRMSNorm-formula class ``model`` is made of (idempotent)."""
    _SWITCH.install_for(model)
    _GEMMA_SWITCH.install_for(model)


@contextlib.contextmanager
def fused_norm(model, enabled: bool):
    """Within the block, this thread's forwards of ``model`` take the fused RMSNorm (when ``enabled``)."""
    with _SWITCH.enabled(model, enabled), _GEMMA_SWITCH.enabled(model, enabled):
        yield


fused_norm_active = _SWITCH.active


@contextlib.contextmanager
def fused_modeling(model, config, enabled: bool = True):
    """Both fused paths of ``config`` (``fused_rope``, ``fused_norm``; a RocketKVConfig) for ``model`` within
    the block, when ``enabled`` (the call is RocketKV's)."""
    with fused_rope(model, enabled and config.fused_rope), fused_norm(model, enabled and config.fused_norm):
        yield
