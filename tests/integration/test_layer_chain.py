"""``integration/layer_chain.LayerChain``: the hand-over of a normed row from one decoder layer to the next.

The oracle is the definition of a safe hand-over: the next layer gets the row only if its input is the very tensor
the row was computed from and it is the layer the row was computed for; every other case gets None (the layer then
runs its own norm). The successor map is checked against the model's own layer list, and is empty for a layer list
that a model class outside ``LAYER_LOOPS`` holds.
"""

from __future__ import annotations

import torch

from hf_rocketkv.integration.layer_chain import LayerChain
from tests.support.tiny_models import make_models


def chain_and_layers():
    model = make_models("llama")[0]
    return LayerChain(model), list(model.model.layers), model


def test_each_layer_is_followed_by_the_next_of_the_models_list_and_the_last_by_none():
    chain, layers, model = chain_and_layers()
    assert len(layers) >= 2
    for first, second in zip(layers, layers[1:]):
        assert chain.successor(first) is second
    assert chain.successor(layers[-1]) is None
    assert chain.successor(model.model.norm) is None  # not in any layer list


def test_the_row_is_taken_once_by_its_layer_for_its_tensor():
    chain, layers, _ = chain_and_layers()
    summed, normed = torch.randn(1, 1, 8), torch.randn(1, 1, 8)
    chain.hand_over(summed, layers[1], normed)
    assert chain.take(layers[1], summed) is normed
    assert chain.take(layers[1], summed) is None  # consumed


def test_another_tensor_or_another_layer_gets_none():
    chain, layers, _ = chain_and_layers()
    summed, normed = torch.randn(1, 1, 8), torch.randn(1, 1, 8)
    chain.hand_over(summed, layers[1], normed)
    assert chain.take(layers[1], summed.clone()) is None  # equal values, another tensor
    assert chain.take(layers[1], summed) is None  # and a refused hand-over is gone too
    chain.hand_over(summed, layers[1], normed)
    assert chain.take(layers[0], summed) is None


def test_layers_of_a_model_class_outside_the_known_loops_have_no_successor():
    """A user's module around transformers' decoder layers: its forward could do anything between two layers."""
    model = make_models("llama")[0]

    class Wrapper(torch.nn.Module):
        def __init__(self, layers):
            super().__init__()
            self.layers = torch.nn.ModuleList(layers)

    wrapper = Wrapper(list(model.model.layers))
    assert LayerChain(wrapper).successor(wrapper.layers[0]) is None
    assert LayerChain(model).successor(model.model.layers[0]) is model.model.layers[1]
