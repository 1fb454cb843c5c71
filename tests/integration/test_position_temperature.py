"""integration/position_temperature.py: Llama 4's per-position query scale for rows at different positions, against
transformers' own Llama 4 attention run on one row at a time (its forward scales the queries before the cache sees
them: a hook on ``cache.update`` catches them)."""

from __future__ import annotations

import pytest
import torch

from hf_rocketkv.cache.batch_view import BatchedDecodeLayer
from hf_rocketkv.cache.hints import GenerationHints
from hf_rocketkv.integration.attention import check_supported
from hf_rocketkv.integration.compat import cache_kwargs
from hf_rocketkv.integration.position_temperature import scale_rows_by_position, scales_by_position
from hf_rocketkv.memory.layer_kinds import position_scaled_layers
from hf_rocketkv.selection.logit_features import PLAIN
from tests.support.hybrid_models import llama4_config, make_llama4_models
from tests.support.tiny_models import compressing_config

NOPE = 3  # the NoPE layer of llama4_config (no_rope_layers [1, 1, 1, 0])


class _LengthOnly:
    """The smallest cache Llama 4's attention accepts: a length, and an update that records the queries' keys."""

    def __init__(self, length: int):
        self.length = length

    def get_seq_length(self, layer_idx: int = 0) -> int:
        return self.length

    def update(self, key_states, value_states, layer_idx, *args, **kwargs):
        return key_states, value_states


def transformers_query(module, hidden: torch.Tensor, position: int, monkeypatch) -> torch.Tensor:
    """The query ``[1, Hq, 1, D]`` transformers' Llama 4 attention hands its attention function for one token at
    ``position`` (its own forward: projection, then the temperature from the cache's length), caught by standing in
    for its eager attention."""
    from transformers.models.llama4 import modeling_llama4

    caught = {}

    def attend(module, query, key, value, mask, **kwargs):
        caught["query"] = query
        return torch.zeros(query.shape[0], query.shape[2], query.shape[1], query.shape[3]), None

    with monkeypatch.context() as patch:
        patch.setattr(modeling_llama4, "eager_attention_forward", attend)
        patch.setattr(module.config, "_attn_implementation", "eager")
        module(hidden, position_embeddings=None, attention_mask=None, **cache_kwargs(_LengthOnly(position)))
    return caught["query"]


@pytest.mark.parametrize("floor_scale", [4, 1])
def test_each_row_gets_the_scale_transformers_gives_it_alone(floor_scale, monkeypatch):
    model, _ = make_llama4_models(floor_scale=floor_scale)
    module = model.model.layers[NOPE].self_attn
    assert scales_by_position(module) and not scales_by_position(model.model.layers[0].self_attn)
    positions = [0, 3, 4, 7, 8, 33, 1000]
    hidden = torch.randn(len(positions), 1, model.config.hidden_size, generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        alone = torch.cat([transformers_query(module, hidden[b:b + 1], p, monkeypatch) for b, p in enumerate(positions)])
        at_zero = torch.cat([transformers_query(module, hidden[b:b + 1], 0, monkeypatch) for b in range(len(positions))])
    seen = torch.tensor(positions) + 1  # this step's token included
    scaled = scale_rows_by_position(module, at_zero, seen)
    if floor_scale >= 2:  # s(0) == 1: the bits of the row alone
        assert torch.equal(scaled, alone)
    else:
        torch.testing.assert_close(scaled, alone, rtol=1e-6, atol=1e-6)
    ratios = [float(alone[b].norm() / at_zero[b].norm()) for b in range(len(positions))]
    assert ratios[0] < ratios[-1] and len({round(r, 4) for r in ratios}) >= 3  # the scales do differ by position


def test_wrong_shapes_are_refused():
    model, _ = make_llama4_models()
    module = model.model.layers[NOPE].self_attn
    with pytest.raises(ValueError, match=r"query \[B, Hq, 1, D\] and seen \[B\]"):
        scale_rows_by_position(module, torch.zeros(2, 4, 3, 8), torch.ones(2, dtype=torch.long))
    with pytest.raises(ValueError, match=r"query \[B, Hq, 1, D\] and seen \[B\]"):
        scale_rows_by_position(module, torch.zeros(2, 4, 1, 8), torch.ones(3, dtype=torch.long))


def test_the_config_names_the_nope_layers_only_under_temperature_tuning():
    assert position_scaled_layers(llama4_config()) == frozenset({NOPE})
    assert position_scaled_layers(llama4_config(attn_temperature_tuning=False)) == frozenset()
    assert position_scaled_layers(llama4_config(no_rope_layers=[0, 1, 1, 0])) == frozenset({0, NOPE})


def test_a_batch_layer_told_otherwise_than_its_attention_is_refused():
    model, _ = make_llama4_models(layer_types=["full_attention"] * 4)
    key = torch.zeros(1, model.config.num_key_value_heads, 0, 16)
    told = BatchedDecodeLayer(compressing_config(), GenerationHints(), 0, scales_rows_by_position=True)
    with pytest.raises(ValueError, match=r"the batch was told that this attention scales its queries by position"):
        check_supported(model.model.layers[0].self_attn, {}, told, key, PLAIN)
    untold = BatchedDecodeLayer(compressing_config(), GenerationHints(), NOPE)
    with pytest.raises(ValueError, match=r"the batch was not told that this attention scales"):
        check_supported(model.model.layers[NOPE].self_attn, {}, untold, key, PLAIN)
