"""Gated MLPs of a few tokens in one launch in RocketKV's forwards (``RocketKVConfig.fused_mlp``, default True).

transformers' ``LlamaMLP.forward`` (copied by Mistral, Qwen2/3, Gemma 1-3, Cohere 2, Granite, OLMo2...) is
``down_proj(act_fn(gate_proj(x)) * up_proj(x))``: in a decode step, three weight-bound GEMMs that cuBLAS runs split-K
with a reduce each at a few rows, the activation and the product, six to nine launches per layer. Inside a
RocketKV call (``generate()`` with a RocketKVCache, the batching engine's decode steps), hidden states ``[B, T,
hidden]`` of at most ``kernels/gated_projection.MAX_ROWS`` tokens on CUDA in bf16/fp16 go through
``kernels/gated_projection.gated_projection_triton`` (both weights read once, the activation and the product on the
tile, one store), then ``down_proj`` through the same kernel's plain form (``projection_triton``; the module's own
``down_proj`` where that one is not a plain bias-free ``nn.Linear`` or carries hooks): two launches per layer. The
values are rounded where eager PyTorch rounds them (``tests/kernels/test_gated_projection.py``).

Everything else runs transformers' own forward with the arguments it received: forwards of more tokens (prefill
chunks: cuBLAS at full tiles), fp32, CPU, other caches, other threads, a call traced by torch.compile or recording
gradients, projections that are not plain bias-free ``nn.Linear`` modules over plain tensors (quantized, LoRA
wrappers, DTensor), a projection or activation with hooks (the kernel would skip them), activations other than
transformers' SiLU and C tanh-GELU (``compat.mlp_activation``), and a process group in use (tensor parallelism: the
projections carry the plan's hooks). Which classes: those whose ``forward`` has exactly ``LlamaMLP.forward``'s byte
code (``compat.mlp_classes``), wrapped once per class (``compat.install_forward``); ``fused_mlp(model, enabled)`` sets
a ContextVar for the call (per thread and per asyncio task, never process-wide).
"""

from __future__ import annotations

import torch

from ..kernels.gated_projection import (
    gated_projection_supported,
    gated_projection_triton,
    projection_supported,
    projection_triton,
)
from . import compat
from .fused_switch import FusedSwitch

FUSED_DEVICE_TYPES = ("cuda",)  # the kernel's devices (the CPU tests add "cpu": Triton's interpreter)


def distributed() -> bool:
    """A process group in use (tensor parallelism: the projections carry the plan's hooks)."""
    return torch.distributed.is_available() and torch.distributed.is_initialized()


def no_hooks(module) -> bool:
    """No hooks on ``module`` (the kernel reads the weights and computes the activation itself: it would skip them)."""
    return not (module._forward_hooks or module._forward_pre_hooks)


def plain_linear(linear) -> bool:
    """A bias-free ``nn.Linear`` itself (no subclass or wrapper) without hooks: the kernels read its weight."""
    return type(linear) is torch.nn.Linear and linear.bias is None and no_hooks(linear)


def _compute(run_original, module, x):
    """The kernel for a decode step's hidden states, the module's own forward otherwise (module docstring)."""
    gate, up, act_fn = module.gate_proj, module.up_proj, module.act_fn
    if (x.dim() == 3 and x.device.type in FUSED_DEVICE_TYPES and not torch.is_grad_enabled()
            and plain_linear(gate) and plain_linear(up) and isinstance(act_fn, torch.nn.Module) and no_hooks(act_fn)
            and gated_projection_supported(x, gate.weight, up.weight) and not distributed()):
        act = compat.mlp_activation(act_fn)
        if act is not None:
            hidden = gated_projection_triton(x, gate.weight, up.weight, act)
            down = module.down_proj
            if plain_linear(down) and projection_supported(hidden, down.weight):
                return projection_triton(hidden, down.weight)
            return down(hidden)
    return run_original()


_SWITCH = FusedSwitch("hf_rocketkv_fused_mlp", "_hf_rocketkv_mlp_installed", compat.mlp_classes,
                      compat.install_forward, _compute)


def fused_mlp(model, enabled: bool):
    """Within the block, this thread's forwards of ``model`` run their gated MLPs' first half fused (when
    ``enabled``)."""
    return _SWITCH.enabled(model, enabled)


fused_mlp_active = _SWITCH.active
