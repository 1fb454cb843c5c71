"""Mixture-of-experts layers in RocketKV's decode steps: each routed expert's weights read where they lie
(``RocketKVConfig.fused_experts``, default True).

A decode step routes each of its few tokens to ``top_k`` experts. transformers' ``batched_mm`` experts first copy the
chosen experts' weights into a new tensor, then multiply, so the weights cross memory three times; its
``grouped_mm`` reads each chosen expert once. Inside a RocketKV call (``generate()`` with a RocketKVCache, the
batching engine's decode steps) on CUDA, an experts module of transformers' ``use_experts_implementation`` kind
(gpt-oss, and the MoE families built the same way) runs its two projections through
``kernels/expert_linear.expert_linear_triton`` instead: one launch each, every pair's expert read once from the
parameter, the products summed in fp32 and rounded once; the module's own gate (``_apply_gate``), the routing weights
and the sum over experts stay transformers' code. It applies while the step's (token, expert) pairs are at most
``FUSED_MAX_PAIRS_PER_EXPERT`` per expert: decode, one request or a batch of them (up to the number of experts the
kernel reads each pair's expert, beyond it each chosen expert once for all its pairs: the kernel's ``grouped``
schedule). Prefill chunks (compute-bound: transformers' ``grouped_mm`` GEMMs), CPU, a torch.compile'd forward, expert
parallelism and other layouts keep transformers' forward, called with the arguments it received.

How a call is recognised as RocketKV's: ``fused_experts(model, enabled)`` sets a ContextVar for the duration of the
call (per thread and per asyncio task), after making sure the experts classes of ``model`` have their ``forward``
wrapped (``compat.install_forward``; once per class).
"""

from __future__ import annotations

import torch

from ..kernels.expert_linear import expert_linear_supported, expert_linear_triton
from . import compat
from .fused_switch import FusedSwitch

FUSED_DEVICE_TYPES = ("cuda",)  # the kernel's devices (the CPU tests add "cpu": Triton's interpreter)
# pairs per expert up to which the kernel runs the step (gpt-oss-20b, H200: benchmarks/expert_linear.py, docs/models.md)
FUSED_MAX_PAIRS_PER_EXPERT = 16


def applies(module, hidden_states: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor):
    """The module's ``compat.ExpertsLayout`` when the in-place path computes this call, else None: hidden states
    ``[T, H]`` on a fused device, ``ids`` and ``weights`` ``[T, top_k]``, at most ``FUSED_MAX_PAIRS_PER_EXPERT`` pairs
    per expert."""
    layout = compat.experts_layout(module)
    if layout is None or hidden_states.device.type not in FUSED_DEVICE_TYPES or hidden_states.dim() != 2:
        return None
    if ids.dim() != 2 or weights.shape != ids.shape or ids.shape[0] != hidden_states.shape[0] \
            or ids.numel() > FUSED_MAX_PAIRS_PER_EXPERT * module.gate_up_proj.shape[0]:
        return None
    bias = layout.bias
    if not (expert_linear_supported(hidden_states, module.gate_up_proj, module.gate_up_proj_bias if bias else None)
            and expert_linear_supported(hidden_states, module.down_proj, module.down_proj_bias if bias else None)):
        return None
    return layout


def experts_forward(module, layout, hidden_states: torch.Tensor, ids: torch.Tensor,
                    weights: torch.Tensor) -> torch.Tensor:
    """transformers' experts forward with both projections in place: ``[T, H]`` hidden states, ``[T, top_k]`` expert
    ids and routing weights, returns ``[T, H]`` in the hidden states' dtype."""
    tokens, top_k = ids.shape
    flat_ids = ids.reshape(-1)
    up = expert_linear_triton(hidden_states, module.gate_up_proj, module.gate_up_proj_bias if layout.bias else None,
                              flat_ids, layout.transposed, rows_per_x=top_k)  # [T * top_k, 2 * I]
    gated = layout.apply_gate(up)  # [T * top_k, I]
    down = expert_linear_triton(gated.contiguous(), module.down_proj, module.down_proj_bias if layout.bias else None,
                                flat_ids, layout.transposed)  # [T * top_k, H]
    weighted = down * weights.reshape(-1).unsqueeze(-1)  # as transformers' experts forward from here on
    return weighted.view(tokens, top_k, -1).sum(dim=1).to(hidden_states.dtype)


def _compute(run_original, module, hidden_states, ids, weights):
    layout = applies(module, hidden_states, ids, weights)
    if layout is None:
        return run_original()
    return experts_forward(module, layout, hidden_states, ids, weights)


_SWITCH = FusedSwitch("hf_rocketkv_fused_experts", "_hf_rocketkv_experts_installed", compat.experts_classes,
                      compat.install_forward, _compute)
install_for = _SWITCH.install_for  # wrap the forward of every experts class a model is made of


def fused_experts(model, enabled: bool):
    """Within the block, this thread's forwards of ``model`` read their experts in place (when ``enabled``)."""
    return _SWITCH.enabled(model, enabled)


fused_experts_active = _SWITCH.active
