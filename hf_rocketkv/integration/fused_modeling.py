"""``fused_modeling``: the fused paths a RocketKV call takes through the model's own modules, switched on together.

RoPE (``rope.py``, ``RocketKVConfig.fused_rope``), RMSNorm (``norm.py``, ``fused_norm``), gated MLPs (``mlp.py``,
``fused_mlp``), attention projections (``qkv.py``, ``fused_qkv``), residual adds with their norms (``residual.py``,
``fused_residual``) and mixture-of-experts layers (``experts.py``, ``fused_experts``): each wraps a transformers
function once and takes its fused path only while its switch is on for the calling thread (``fused_switch.py``).
"""

from __future__ import annotations

import contextlib

from .experts import fused_experts
from .mlp import fused_mlp
from .norm import fused_norm
from .qkv import fused_qkv
from .residual import fused_residual
from .rope import fused_rope


@contextlib.contextmanager
def fused_modeling(model, config, enabled: bool = True):
    """The fused paths ``config`` (a RocketKVConfig) turns on, for ``model`` within the block, when ``enabled`` (the
    call is RocketKV's)."""
    with fused_rope(model, enabled and config.fused_rope), fused_norm(model, enabled and config.fused_norm), \
            fused_experts(model, enabled and config.fused_experts), fused_mlp(model, enabled and config.fused_mlp), \
            fused_qkv(model, enabled and config.fused_qkv), \
            fused_residual(model, enabled and config.fused_residual and config.fused_norm):
        yield
