"""Mixture-of-experts layers in RocketKV calls: decode steps read each routed expert's weights where they lie, prefill
chunks run their experts grouped by expert with one pass around each grouped GEMM (``RocketKVConfig.fused_experts``,
default True).

Inside a RocketKV call (``generate()`` with a RocketKVCache, the batching engine's prefill chunks and decode steps) on
CUDA, an experts module of transformers' ``use_experts_implementation`` kind (gpt-oss, and the MoE families built the
same way) takes one of two paths instead of transformers' forward:

- decode (at most ``FUSED_MAX_PAIRS_PER_EXPERT`` (token, expert) pairs per expert: one request or a batch of them):
  both projections through ``kernels/expert_linear.expert_linear_triton``, one launch each, the weights read from the
  parameter (transformers' ``batched_mm`` copies the chosen experts' weights first; its ``grouped_mm`` reads every
  expert through a GEMM sized for prefill); each pair's expert read once up to as many pairs as experts, each chosen
  expert once for all its pairs beyond (the kernel's ``grouped`` schedule). The module's own gate
  (``_apply_gate``), the routing weights and the sum over experts stay transformers' code.
- prefill (more pairs per expert): the pairs sorted by expert, torch's grouped GEMM for both projections (as
  transformers' ``grouped_mm``), and ``kernels/expert_prefill.py`` around them: gpt-oss' gate with the expert bias in
  one pass (other gates: the bias added, then the module's own gate), and the expert bias, the routing weights, the
  pairs back in token order and the sum over experts in one more. Runs where torch's grouped GEMM does (CUDA, bf16).

CPU, a torch.compile'd forward, expert parallelism and other layouts keep transformers' forward, called with the
arguments it received.

How a call is recognised as RocketKV's: ``fused_experts(model, enabled)`` sets a ContextVar for the duration of the
call (per thread and per asyncio task), after making sure the experts classes of ``model`` have their ``forward``
wrapped (``compat.install_forward``; once per class).
"""
from __future__ import annotations

import torch

from ..kernels.expert_linear import expert_linear_supported, expert_linear_triton, sort_by_expert
from ..kernels.expert_prefill import (
    clamped_glu_triton,
    combine_triton,
    grouped_matmul,
    grouped_matmul_runs,
    prefill_kernels_run,
)
from . import compat
from .fused_switch import FusedSwitch

FUSED_DEVICE_TYPES = ("cuda",)  # the kernel's devices (the CPU tests add "cpu": Triton's interpreter)
# pairs per expert up to which the kernel runs the step (gpt-oss-20b, H200: benchmarks/expert_linear.py, docs/models.md)
FUSED_MAX_PAIRS_PER_EXPERT = 16


def routed_layout(module, hidden_states: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor):
    """The module's ``compat.ExpertsLayout`` when either path may compute this call, else None: a layout this module
    reads, hidden states ``[T, H]`` on a fused device, ``ids`` and ``weights`` ``[T, top_k]``."""
    layout = compat.experts_layout(module)
    if layout is None or hidden_states.device.type not in FUSED_DEVICE_TYPES or hidden_states.dim() != 2:
        return None
    if ids.dim() != 2 or weights.shape != ids.shape or ids.shape[0] != hidden_states.shape[0]:
        return None
    return layout


def decodes(module, layout, hidden_states: torch.Tensor, ids: torch.Tensor) -> bool:
    """Whether the in-place path computes this call (``routed_layout`` holds): at most ``FUSED_MAX_PAIRS_PER_EXPERT``
    pairs per expert, both projections as ``expert_linear_triton`` reads them."""
    if ids.numel() > FUSED_MAX_PAIRS_PER_EXPERT * module.gate_up_proj.shape[0]:
        return False
    bias = layout.bias
    return (expert_linear_supported(hidden_states, module.gate_up_proj, module.gate_up_proj_bias if bias else None)
            and expert_linear_supported(hidden_states, module.down_proj, module.down_proj_bias if bias else None))


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


def prefills(module, layout, hidden_states: torch.Tensor, ids: torch.Tensor) -> bool:
    """Whether the grouped prefill path computes this call (``routed_layout`` holds): more than
    ``FUSED_MAX_PAIRS_PER_EXPERT`` pairs per expert, torch's grouped GEMM taking both projections (the CPU tests: the
    kernels under Triton's interpreter, the GEMMs' reference)."""
    if ids.numel() <= FUSED_MAX_PAIRS_PER_EXPERT * module.gate_up_proj.shape[0]:
        return False
    projections = (module.gate_up_proj, module.down_proj)
    biases = (module.gate_up_proj_bias, module.down_proj_bias) if layout.bias else ()
    if type(hidden_states) is not torch.Tensor or any(type(w) not in (torch.Tensor, torch.nn.Parameter)
                                                      or w.device != hidden_states.device
                                                      or w.dtype != hidden_states.dtype for w in projections + biases):
        return False
    if any(b.dim() != 2 or b.stride(-1) != 1 for b in biases):
        return False
    if hidden_states.is_cuda:
        return all(grouped_matmul_runs(hidden_states, w if layout.transposed else w.transpose(1, 2))
                   for w in projections)
    return prefill_kernels_run(hidden_states)


def prefill_forward(module, layout, hidden_states: torch.Tensor, ids: torch.Tensor,
                    weights: torch.Tensor) -> torch.Tensor:
    """A prefill chunk's experts grouped by expert (module docstring): ``[T, H]`` hidden states, ``[T, top_k]``
    expert ids and routing weights, returns ``[T, H]`` in the hidden states' dtype."""
    top_k = ids.shape[1]
    flat = ids.reshape(-1)
    order, counts, starts = sort_by_expert(flat, module.gate_up_proj.shape[0])
    ends = starts + counts
    sorted_pairs = order.long()
    sorted_ids = flat.index_select(0, sorted_pairs)
    rows = hidden_states.index_select(0, sorted_pairs // top_k)  # [S, H], expert by expert
    up = grouped_matmul(rows, module.gate_up_proj, ends, layout.transposed)  # [S, 2I]
    up_bias = module.gate_up_proj_bias if layout.bias else None
    if layout.clamped_glu is not None:
        gated = clamped_glu_triton(up, up_bias, sorted_ids, *layout.clamped_glu)  # [S, I]
    else:
        gated = layout.apply_gate(up if up_bias is None else up + up_bias.index_select(0, sorted_ids))
    down = grouped_matmul(gated.contiguous(), module.down_proj, ends, layout.transposed)  # [S, H]
    position = torch.empty_like(sorted_pairs)
    position[sorted_pairs] = torch.arange(sorted_pairs.numel(), device=position.device)  # pair -> its sorted row
    return combine_triton(down, position, module.down_proj_bias if layout.bias else None, ids, weights)


def _compute(run_original, module, hidden_states, ids, weights):
    layout = routed_layout(module, hidden_states, ids, weights)
    if layout is not None and decodes(module, layout, hidden_states, ids):
        return experts_forward(module, layout, hidden_states, ids, weights)
    if layout is not None and prefills(module, layout, hidden_states, ids):
        return prefill_forward(module, layout, hidden_states, ids, weights)
    return run_original()


_SWITCH = FusedSwitch("hf_rocketkv_fused_experts", "_hf_rocketkv_experts_installed", compat.experts_classes,
                      compat.install_forward, _compute)
install_for = _SWITCH.install_for  # wrap the forward of every experts class a model is made of


def fused_experts(model, enabled: bool):
    """Within the block, this thread's forwards of ``model`` read their experts in place (when ``enabled``)."""
    return _SWITCH.enabled(model, enabled)


fused_experts_active = _SWITCH.active
