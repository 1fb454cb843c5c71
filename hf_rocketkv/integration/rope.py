"""Fused rotary embedding in RocketKV's forwards (``RocketKVConfig.fused_rope``, default True).

transformers applies RoPE inside the attention module, before the cache sees the keys: ``q * cos +
rotate_half(q) * sin`` and the same for k, ten launches (passes over q and k) per layer and forward. Inside a
RocketKV call (``generate()`` with a RocketKVCache, the batching engine's prefills and decode steps) a forward on
CUDA in bf16/fp16, prefill or decode, goes through ``kernels/rope.rope_triton`` instead: one launch, bit for bit the
same values (``tests/kernels/test_rope.py``). Everything else (fp32, CPU, other caches, other threads, a call traced
by torch.compile) runs transformers' own function with the arguments it received.

How a call is recognised as RocketKV's: ``fused_rope(model, enabled)`` sets a ContextVar for the duration of the
call (so it is per thread and per asyncio task, never process-wide), after making sure the modeling modules of
``model`` have their ``apply_rotary_pos_emb`` wrapped (``compat.install_rotary``; once per module).
"""

from __future__ import annotations

from ..kernels.rms_norm import Norm
from ..kernels.rope import rope_supported, rope_triton
from . import compat
from .fused_switch import FusedSwitch

FUSED_DEVICE_TYPES = ("cuda",)  # the kernel's devices (the CPU tests add "cpu": Triton's interpreter)


def _compute(original, arguments: dict):
    q, k, cos, sin = arguments["q"], arguments["k"], arguments["cos"], arguments["sin"]
    if (arguments["unsqueeze_dim"] == 1 and q.device.type in FUSED_DEVICE_TYPES
            and rope_supported(q, k, cos, sin)):
        return rope_triton(q, k, cos, sin)
    return original(**arguments)


_SWITCH = FusedSwitch("hf_rocketkv_fused_rope", "_hf_rocketkv_rotary_installed", compat.rotary_modules,
                      compat.install_rotary, _compute)
install_for = _SWITCH.install_for  # wrap the rotary function of every modeling module a model is made of


def fused_rope(model, enabled: bool):
    """Within the block, this thread's forwards of ``model`` take the fused RoPE (when ``enabled``)."""
    return _SWITCH.enabled(model, enabled)


fused_rope_active = _SWITCH.active


def normed_rope(rotary, q, k, cos, sin, q_norm: Norm, k_norm: Norm, formula: str):
    """``rotary(q_norm(q), k_norm(k), cos, sin)`` in one launch (``rope_triton`` with the per-head norms) where the
    fused RoPE takes this call: ``rotary`` is a modeling module's wrapped ``apply_rotary_pos_emb``, the switch is on
    and the kernel reads these tensors. None otherwise: the caller runs the norms and ``rotary`` itself."""
    if (fused_rope_active() and getattr(rotary, compat.WRAPPED_MARK, False) and q.device.type in FUSED_DEVICE_TYPES
            and rope_supported(q, k, cos, sin, q_norm, k_norm)):
        return rope_triton(q, k, cos, sin, q_norm, k_norm, formula)
    return None
