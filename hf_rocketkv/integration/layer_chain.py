"""LayerChain: one forward's hand-over of a normalized input from a decoder layer to the next one.

A decoder layer ends with a residual add (``hidden = residual + mlp(h)``) and the next layer starts by normalizing
that sum (``input_layernorm``): two launches over the same row. ``residual.py`` folds the next layer's norm into the
add's launch (``kernels/residual_norm``'s ``post``) and hands the normed row over through this object: layer i calls
``hand_over(summed, next_layer, normed)`` and returns ``summed``; layer i + 1 calls ``take(self, hidden_states)`` and
gets ``normed`` only if ``hidden_states`` is that very tensor object and it is the layer the row was normed for.
Anything else (a hook that replaced the output, another model's forward in between) gets None and the layer runs its
own norm; ``residual.py`` hands nothing over to or from a layer with hooks.

Which layers follow which: the ``layers`` list of the transformers model classes in ``LAYER_LOOPS``, whose forward
passes each layer's output straight to the next layer (``for decoder_layer in self.layers: hidden_states =
decoder_layer(hidden_states, ...)``), nothing written in place between two layers. A layer list of any other owner
(a user's model around copied decoder layers) has no successors here, so nothing is handed over.

Per call: ``residual.fused_residual`` makes one chain per block and keeps it in a ContextVar (per thread and asyncio
task, never process-wide); the order is read from the model the first time a layer asks for its successor, so a
replayed CUDA graph, which runs no Python, costs nothing.
"""

from __future__ import annotations

import torch

LAYER_LOOPS = ("LlamaModel", "MistralModel", "Qwen2Model", "Qwen3Model", "Gemma2Model", "Gemma3TextModel")


class LayerChain:
    """The hand-over of one forward's normalized rows between consecutive decoder layers of ``model``."""

    def __init__(self, model: torch.nn.Module):
        self._model = model
        self._next: dict[int, torch.nn.Module] | None = None  # id(layer) -> the layer after it, found at first need
        self._carried: tuple | None = None  # (summed, the layer it is for, normed)

    def successor(self, layer: torch.nn.Module) -> torch.nn.Module | None:
        """The decoder layer that runs after ``layer`` (None: the last one, or a layer outside the ``layers`` of a
        ``LAYER_LOOPS`` model)."""
        if self._next is None or id(layer) not in self._next:
            self._next = _successors(self._model, layer)
        return self._next.get(id(layer))

    def hand_over(self, summed: torch.Tensor, layer: torch.nn.Module, normed: torch.Tensor) -> None:
        """``normed`` is ``layer.input_layernorm(summed)``, for ``layer``'s forward on ``summed``."""
        self._carried = (summed, layer, normed)

    def take(self, layer: torch.nn.Module, hidden_states: torch.Tensor) -> torch.Tensor | None:
        """The normed input handed over for ``layer`` if ``hidden_states`` is the tensor it was computed from; None
        otherwise. Either way the hand-over is consumed."""
        carried, self._carried = self._carried, None
        if carried is None or carried[0] is not hidden_states or carried[1] is not layer:
            return None
        return carried[2]


def _successors(model: torch.nn.Module, layer: torch.nn.Module) -> dict[int, torch.nn.Module]:
    """id(layer) -> the next layer, for the ``layers`` of the ``LAYER_LOOPS`` model in ``model`` that holds ``layer``
    (empty: none does)."""
    for owner in model.modules():
        kind = type(owner)
        if kind.__name__ not in LAYER_LOOPS or not kind.__module__.startswith("transformers.models."):
            continue
        layers = getattr(owner, "layers", None)
        if isinstance(layers, torch.nn.ModuleList) and any(member is layer for member in layers):
            members = list(layers)
            return {id(a): b for a, b in zip(members, members[1:])}
    return {}
