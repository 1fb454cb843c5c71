"""Which layers of a model slide (attend only to their last ``sliding_window`` tokens), read from its config.

transformers 5.x configs say it in two ways: ``layer_types`` lists ``"full_attention"`` / ``"sliding_attention"``
per layer (Gemma 2 and 3, Cohere 2, gpt-oss, Qwen2 with ``use_sliding_window``), and ``sliding_window`` is the window;
a config without ``layer_types`` but with ``sliding_window`` set (Mistral) slides on every layer. A RocketKVCache
gives each sliding layer a ``SlidingWindowLayer`` and each full-attention layer a RocketKV layer.
"""

from __future__ import annotations

FULL, SLIDING = "full_attention", "sliding_attention"


def sliding_windows(model_config) -> tuple[int | None, ...]:
    """The window of every layer of ``model_config`` (a transformers config), None for full-attention layers.

    Raises ValueError naming the config field for layer types RocketKV cannot serve (chunked, linear attention, ...)
    or a window that is not a positive integer.
    """
    config = model_config.get_text_config(decoder=True) if hasattr(model_config, "get_text_config") else model_config
    num_layers = getattr(config, "num_hidden_layers", None)
    if not isinstance(num_layers, int) or num_layers < 1:
        raise ValueError(f"model config: num_hidden_layers must be a positive integer, got {num_layers!r}")
    window = getattr(config, "sliding_window", None)
    layer_types = getattr(config, "layer_types", None)
    if layer_types is None:
        layer_types = [FULL if window is None else SLIDING] * num_layers
    layer_types = list(layer_types)
    if len(layer_types) != num_layers:
        raise ValueError(f"model config: layer_types lists {len(layer_types)} layers, num_hidden_layers is "
                         f"{num_layers}")
    unknown = sorted(set(layer_types) - {FULL, SLIDING})
    if unknown:
        raise ValueError(f"model config: layer_types has {', '.join(map(repr, unknown))} layers; RocketKV serves "
                         f"'{FULL}' and '{SLIDING}' layers only")
    if SLIDING in layer_types and (isinstance(window, bool) or not isinstance(window, int) or window < 1):
        raise ValueError(f"model config: sliding_window must be a positive integer for its '{SLIDING}' layers, "
                         f"got {window!r}")
    return tuple(window if kind == SLIDING else None for kind in layer_types)


def describe(windows: tuple[int | None, ...]) -> str:
    """``"4 layers: 3 sliding (window 16), 1 full attention"`` for error messages and reprs."""
    sliding = [w for w in windows if w is not None]
    parts = []
    if sliding:
        parts.append(f"{len(sliding)} sliding (window {', '.join(map(str, sorted(set(sliding))))})")
    if len(sliding) < len(windows):
        parts.append(f"{len(windows) - len(sliding)} full attention")
    return f"{len(windows)} layers: {', '.join(parts)}"


def replay_tokens(windows: tuple[int | None, ...]) -> int:
    """Prompt tokens a prefix hit recomputes on a model with sliding-window layers: the sum of their windows.

    The pool's pages hold the full-attention layers' K/V only, so a hit of ``P`` tokens rebuilds the sliding layers'
    windows at ``P`` by running the model again over input columns ``[P - R, P)``, each sliding layer starting with
    an empty window there. A sliding layer of window ``W`` is exact ``W - 1`` positions after its input became exact
    (full-attention layers read the hit's exact K/V), so after ``sum(W - 1)`` replayed positions every sliding
    layer's last window is exact; ``R = sum(W)`` bounds that. 0 for a model without sliding layers."""
    return sum(w for w in windows if w is not None)
