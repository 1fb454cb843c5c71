"""A decode step's q/k/v projections in one launch in RocketKV's forwards (``RocketKVConfig.fused_qkv``, default True).

transformers' ``LlamaAttention.forward`` projects its hidden states three times (``q_proj``, ``k_proj``,
``v_proj``): at a few rows three weight-bound GEMMs, the two narrow ones (``Hkv * D`` outputs) read at about a third
of the card's bandwidth. Inside a RocketKV call (``generate()`` with a RocketKVCache, the batching engine's decode
steps), hidden states ``[B, T, hidden]`` of at most ``kernels/stacked_projection.MAX_ROWS`` tokens on CUDA in
bf16/fp16 go through ``kernels/stacked_projection.stacked_projection_triton`` (each weight read once, one launch);
the rest of the forward is transformers' own, step for step: the views, the modeling module's
``apply_rotary_pos_emb`` (the fused RoPE where that is on: in the Llama form inside the projection kernel itself,
``ROTARY_IN_PROJECTION``; Gemma 3's ``q_norm`` / ``k_norm`` folded into its launch where the fused RMSNorm takes them
too: ``rope.normed_rope``), the cache's ``update``, the ``rocketkv`` attention
function with the same arguments, ``o_proj`` (a one-row step's through ``kernels/gated_projection.projection_triton``,
one launch where cuBLAS runs split-K and a reduce: ``O_PROJ_MAX_ROWS``). Each projection is rounded once, as cuBLAS
rounds it (``tests/kernels/test_stacked_projection.py``, ``tests/kernels/test_gated_projection.py``).

Everything else runs transformers' own forward with the arguments it received: forwards of more tokens (prefill
chunks), fp32, CPU, a cache that is not RocketKV's, another attention implementation, a call traced by torch.compile
or recording gradients, the cache passed under its old name, projections that are not plain bias-free
``nn.Linear`` modules over plain tensors (quantized, LoRA wrappers, DTensor) or carry hooks, and a process group in
use (tensor parallelism). Which classes: those whose undecorated ``forward`` has exactly the byte code of
``LlamaAttention.forward`` or of ``Gemma3Attention.forward`` (the same steps with per-head ``q_norm`` / ``k_norm``
before RoPE and the layer's ``sliding_window`` passed on; ``compat.forward_classes``), wrapped once per class
(``compat.install_forward``); ``fused_qkv(model, enabled)`` sets a ContextVar per form for the call (per thread and
per asyncio task, never process-wide).
"""

from __future__ import annotations

import contextlib

import torch

from ..cache import BatchedDecodeCache, PackedStepCache, RocketKVCache
from ..kernels.gated_projection import projection_supported, projection_triton
from ..kernels.stacked_projection import rotary_supported, stacked_projection_supported, stacked_projection_triton
from .names import ATTN_NAME
from . import compat
from .attention import rocketkv_attention
from .fused_switch import FusedSwitch, all_enabled
from .mlp import distributed, plain_linear
from .norm import fused_norm_active, fused_norm_of
from .rope import fused_rope_active, normed_rope

FUSED_DEVICE_TYPES = ("cuda",)  # the kernel's devices (the CPU tests add "cpu": Triton's interpreter)
ROCKETKV_CACHES = (RocketKVCache, BatchedDecodeCache, PackedStepCache)
# decode rows at most whose o_proj runs the plain projection kernel (one launch where cuBLAS runs split-K and its
# reduce at one row); more rows keep the module (cuBLAS is faster at 16 and 64 rows: docs/kernels.md, "A decode step
# per layer")
O_PROJ_MAX_ROWS = 1
# the Llama form's RoPE inside the projection kernel where the fused RoPE would run it (one launch fewer per layer;
# docs/kernels.md, "A decode step per layer")
ROTARY_IN_PROJECTION = True


def _projected(run_original, module, hidden_states, position_embeddings, attention_mask, cache, kwargs, normed):
    """The kernel's projections and transformers' forward around them for a decode step, the original otherwise.
    ``normed``: Gemma 3's form (per-head ``q_norm`` / ``k_norm`` before RoPE, the layer's ``sliding_window`` passed
    to the attention function)."""
    projections = (module.q_proj, module.k_proj, module.v_proj)
    weights = tuple(getattr(p, "weight", None) for p in projections)
    if not (isinstance(kwargs, dict) and compat.LEGACY_CACHE_ARG not in kwargs and isinstance(cache, ROCKETKV_CACHES)
            and position_embeddings is not None and hidden_states.dim() == 3
            and hidden_states.device.type in FUSED_DEVICE_TYPES and not torch.is_grad_enabled()
            and all(plain_linear(p) for p in projections) and not distributed()
            and compat.attn_implementation(module) == ATTN_NAME
            and stacked_projection_supported(hidden_states, weights)):
        return run_original()
    input_shape = hidden_states.shape[:-1]
    hidden_shape = (*input_shape, -1, module.head_dim)
    rotary = None if normed else _rotary_in_projection(module, hidden_states, weights, *position_embeddings)
    query, key, value = (
        out.view(hidden_shape).transpose(1, 2)
        for out in stacked_projection_triton(hidden_states, weights, rotary=rotary)
    )
    window = {"sliding_window": module.sliding_window} if normed else {}
    if rotary is None:
        query, key = _rotated(module, query, key, *position_embeddings, normed)
    key, value = cache.update(key, value, module.layer_idx)
    output, attention_weights = rocketkv_attention(
        module, query, key, value, attention_mask,
        dropout=0.0 if not module.training else module.attention_dropout, scaling=module.scaling, **window, **kwargs,
    )
    output = output.reshape(*input_shape, -1).contiguous()
    return _output_projection(module.o_proj, output), attention_weights


def _output_projection(o_proj, output: torch.Tensor) -> torch.Tensor:
    """``o_proj(output)`` (``output`` ``[B, T, Hq * D]``): through ``kernels/gated_projection.projection_triton`` (each
    row rounded once, as cuBLAS rounds it) for at most ``O_PROJ_MAX_ROWS`` rows of a plain bias-free ``nn.Linear``;
    the module otherwise."""
    if (output.numel() // output.shape[-1] <= O_PROJ_MAX_ROWS and plain_linear(o_proj)
            and projection_supported(output, o_proj.weight)):
        return projection_triton(output, o_proj.weight)
    return o_proj(output)


def _rotary_in_projection(module, hidden_states, weights, cos, sin):
    """(cos, sin, head_dim) when the projection kernel applies the forward's RoPE itself (the fused RoPE would take
    this call: its switch on, the modeling module's ``apply_rotary_pos_emb`` wrapped, and the kernel reads these
    tensors; ``ROTARY_IN_PROJECTION``), None otherwise: the forward's own RoPE follows the projection."""
    if not (ROTARY_IN_PROJECTION and fused_rope_active()
            and getattr(compat.attention_rotary(module), compat.WRAPPED_MARK, False)
            and rotary_supported(hidden_states, weights, cos, sin, module.head_dim)):
        return None
    return cos, sin, module.head_dim


def _rotated(module, query, key, cos, sin, normed: bool):
    """The forward's RoPE (Gemma 3's form: after the per-head ``q_norm`` / ``k_norm``; the three in one launch where
    the fused RMSNorm and the fused RoPE both take them, ``rope.normed_rope``)."""
    rotary = compat.attention_rotary(module)
    if not normed:
        return rotary(query, key, cos, sin)
    norms = (fused_norm_of(module.q_norm, "gemma"), fused_norm_of(module.k_norm, "gemma"))
    fused = None
    if None not in norms and fused_norm_active():
        fused = normed_rope(rotary, query, key, cos, sin, *norms, "gemma")
    return fused if fused is not None else rotary(module.q_norm(query), module.k_norm(key), cos, sin)


def _switch(form: str, normed: bool) -> FusedSwitch:
    """The switch of one attention form (``compat.ATTENTION_FORMULAS``): its classes wrapped once per model."""
    def compute(run_original, module, hidden_states, position_embeddings, attention_mask, cache, kwargs):
        return _projected(run_original, module, hidden_states, position_embeddings, attention_mask, cache, kwargs,
                          normed)

    return FusedSwitch(f"hf_rocketkv_fused_qkv_{form}", f"_hf_rocketkv_qkv_{form}_installed",
                       lambda model: compat.forward_classes(model, compat.ATTENTION_FORMULAS[form]),
                       compat.install_forward, compute)


_SWITCHES = (_switch("llama", normed=False), _switch("gemma3", normed=True))


@contextlib.contextmanager
def fused_qkv(model, enabled: bool):
    """Within the block, this thread's forwards of ``model`` project q/k/v in one launch (when ``enabled``)."""
    with all_enabled(_SWITCHES, model, enabled):
        yield


def fused_qkv_active() -> bool:
    return any(switch.active() for switch in _SWITCHES)
