"""FusedSwitch (``integration/fused_switch.py``), the per-call switch of the fused RoPE (``rope.py``) and the fused
RMSNorm (``norm.py``): a scope turns the fused path on for its own thread only, and a disabled inner scope changes
nothing. One test for both switches; ``fused_modeling``, which enters both, is tested in test_norm.py."""

from __future__ import annotations

import threading

import pytest

from hf_rocketkv import RocketKVConfig
from hf_rocketkv.integration import experts, mlp, norm, qkv, residual, rope
from hf_rocketkv.integration.fused_modeling import fused_modeling
from tests.support.tiny_models import make_models

pytest.importorskip("triton")


@pytest.mark.parametrize("scope, active", [(norm.fused_norm, norm.fused_norm_active),
                                           (rope.fused_rope, rope.fused_rope_active),
                                           (experts.fused_experts, experts.fused_experts_active),
                                           (mlp.fused_mlp, mlp.fused_mlp_active),
                                           (qkv.fused_qkv, qkv.fused_qkv_active),
                                           (residual.fused_residual, residual.fused_residual_active)],
                         ids=["norm", "rope", "experts", "mlp", "qkv", "residual"])
def test_the_scope_belongs_to_its_thread(scope, active):
    model = make_models("llama")[0]
    seen = []
    with scope(model, True):
        assert active()
        worker = threading.Thread(target=lambda: seen.append(active()))
        worker.start()
        worker.join()
        with scope(model, False):
            assert active()  # a disabled inner scope changes nothing
    assert seen == [False] and not active()


@pytest.mark.parametrize("off", [None, "fused_rope", "fused_norm", "fused_experts", "fused_mlp", "fused_qkv",
                                 "fused_residual"])
def test_fused_modeling_enters_the_switches_its_config_turns_on(off):
    model = make_models("llama")[0]
    actives = {"fused_rope": rope.fused_rope_active, "fused_norm": norm.fused_norm_active,
               "fused_experts": experts.fused_experts_active, "fused_mlp": mlp.fused_mlp_active,
               "fused_qkv": qkv.fused_qkv_active, "fused_residual": residual.fused_residual_active}
    config = RocketKVConfig() if off is None else RocketKVConfig(**{off: False})
    off_too = {off, "fused_residual"} if off == "fused_norm" else {off}  # the residual path fuses norms too
    with fused_modeling(model, config):
        assert {name: active() for name, active in actives.items()} == {name: name not in off_too for name in actives}
    with fused_modeling(model, RocketKVConfig(), enabled=False):
        assert not any(active() for active in actives.values())
    assert not any(active() for active in actives.values())
