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
(``compat.llama_norm_classes``: Mistral, Qwen2/3, Phi-3, Granite... copy it verbatim); others, such as Gemma's
``(1 + weight)`` norm, are never touched. How a call is recognised as RocketKV's: ``fused_norm(model, enabled)`` sets
a ContextVar for the duration of the call (per thread and per asyncio task, never process-wide), after making sure
those classes have their ``forward`` wrapped (``compat.install_norm``; once per class).
"""

from __future__ import annotations

import contextlib

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


_SWITCH = FusedSwitch("hf_rocketkv_fused_norm", "_hf_rocketkv_norm_installed", compat.llama_norm_classes,
                      compat.install_norm, _compute)
install_for = _SWITCH.install_for  # wrap the forward of every LlamaRMSNorm-formula class a model is made of


def fused_norm(model, enabled: bool):
    """Within the block, this thread's forwards of ``model`` take the fused RMSNorm (when ``enabled``)."""
    return _SWITCH.enabled(model, enabled)


fused_norm_active = _SWITCH.active


@contextlib.contextmanager
def fused_modeling(model, config, enabled: bool = True):
    """Both fused paths of ``config`` (``fused_rope``, ``fused_norm``; a RocketKVConfig) for ``model`` within
    the block, when ``enabled`` (the call is RocketKV's)."""
    with fused_rope(model, enabled and config.fused_rope), fused_norm(model, enabled and config.fused_norm):
        yield
