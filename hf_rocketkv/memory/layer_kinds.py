"""Which layers of a model slide (attend only to their last ``sliding_window`` tokens), read from its config.

transformers 5.x configs say it in two ways: ``layer_types`` lists ``"full_attention"`` / ``"sliding_attention"``
per layer (Gemma 2 and 3, Cohere 2, gpt-oss, Qwen2 with ``use_sliding_window``), and ``sliding_window`` is the window;
a config without ``layer_types`` but with ``sliding_window`` set (Mistral) slides on every layer. A RocketKVCache
gives each sliding layer a ``SlidingWindowLayer`` and each full-attention layer a RocketKV layer.

Llama 4's ``"chunked_attention"`` layers (``attention_chunk_size``) see only the keys of their query's chunk. As
transformers does for its own cache, such a layer keeps the last ``attention_chunk_size - 1`` tokens (a query never
sees more) and the mask decides which of them are visible: ``sliding_windows`` gives it the chunk size as its window,
and ``chunked_layers`` says which windows are chunks (generate()'s torch.compile'd decode does not serve them; the
pool holds their rings in its slab like a sliding layer's, and the batching engine decodes them there).
Llama 4's NoPE layers scale their queries by position, read as ``cache.get_seq_length(layer)`` inside the forward:
``position_scaled_layers`` names them.
"""

from __future__ import annotations

FULL, SLIDING, CHUNKED = "full_attention", "sliding_attention", "chunked_attention"


def sliding_windows(model_config) -> tuple[int | None, ...]:
    """The window of every layer of ``model_config`` (a transformers config), None for full-attention layers; a
    chunked-attention layer's window is ``attention_chunk_size``.

    Raises ValueError naming the config field for layer types RocketKV cannot serve (linear attention, ...) or a
    window or chunk size that is not a positive integer.
    """
    config, layer_types = _layer_types(model_config)
    window = getattr(config, "sliding_window", None)
    if SLIDING in layer_types and not _positive(window):
        raise ValueError(f"model config: sliding_window must be a positive integer for its '{SLIDING}' layers, "
                         f"got {window!r}")
    chunk = getattr(config, "attention_chunk_size", None)
    if CHUNKED in layer_types and not _positive(chunk):
        raise ValueError(f"model config: attention_chunk_size must be a positive integer for its '{CHUNKED}' "
                         f"layers, got {chunk!r}")
    return tuple({SLIDING: window, CHUNKED: chunk}.get(kind) for kind in layer_types)


def chunked_layers(model_config) -> tuple[bool, ...]:
    """Per layer of ``model_config``: whether it is a chunked-attention layer (Llama 4). Validated as
    ``sliding_windows``."""
    sliding_windows(model_config)
    return tuple(kind == CHUNKED for kind in _layer_types(model_config)[1])


def reads_seq_length_in_forward(model_config) -> bool:
    """Whether the model's attention reads ``cache.get_seq_length(layer)`` inside its forward (Llama 4's NoPE layers
    with ``attn_temperature_tuning`` scale their queries by position): a RocketKV layer answers with a device counter
    inside a captured or compiled decode step, the batching engine's batch with 0 and a per-row scale
    (``position_scaled_layers``)."""
    config, _ = _layer_types(model_config)
    no_rope = getattr(config, "no_rope_layers", None) or ()
    return bool(getattr(config, "attn_temperature_tuning", False)) and any(not use for use in no_rope)


def position_scaled_layers(model_config) -> frozenset[int]:
    """The layers whose attention scales its queries by the position it reads from ``cache.get_seq_length(layer)``
    (Llama 4's NoPE layers under ``attn_temperature_tuning``; ``reads_seq_length_in_forward``), empty for others."""
    if not reads_seq_length_in_forward(model_config):
        return frozenset()
    config, _ = _layer_types(model_config)
    return frozenset(index for index, use_rope in enumerate(config.no_rope_layers) if not use_rope)


def _positive(value) -> bool:
    return not isinstance(value, bool) and isinstance(value, int) and value >= 1


def _layer_types(model_config):
    """``(text config, layer types)``, the types checked against ``num_hidden_layers`` and the kinds served."""
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
    unknown = sorted(set(layer_types) - {FULL, SLIDING, CHUNKED})
    if unknown:
        raise ValueError(f"model config: layer_types has {', '.join(map(repr, unknown))} layers; RocketKV serves "
                         f"'{FULL}', '{SLIDING}' and '{CHUNKED}' layers only")
    return config, layer_types


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
