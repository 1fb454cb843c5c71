"""The checks that every layer of a cache saw the same forwards: a model running another attention than 'rocketkv',
keys that no ``rocketkv`` attention call consumed, or an earlier forward interrupted half-way, are refused before a
new forward writes anything."""

from __future__ import annotations

INTERRUPTED_FORWARD = (
    "RocketKVCache: its layers have seen different numbers of tokens ({detail}): an earlier forward on this cache "
    "was interrupted (an exception), which leaves it inconsistent. Start again with a fresh RocketKVCache."
)

UNCONSUMED_KEYS = (
    "RocketKVCache: a layer stored keys that no 'rocketkv' attention call consumed. Either the model's attention is "
    "not 'rocketkv' (enable it with `hf_rocketkv.enable(model)` or `from_pretrained(..., attn_implementation="
    "'rocketkv')`), or an earlier forward on this cache was interrupted by an exception, which leaves it "
    "inconsistent: start again with a fresh RocketKVCache."
)

OTHER_ATTENTION = (
    "RocketKVCache: the model storing keys in it runs the {name!r} attention, which would attend to every stored key "
    "densely and bypass RocketKV; the cache refuses before anything is written. Switch the model to the 'rocketkv' "
    "attention (`hf_rocketkv.enable(model)` or `from_pretrained(..., attn_implementation='rocketkv')`), or give "
    "this model another cache (e.g. transformers' DynamicCache)."
)

BATCH_MISMATCH = (
    "RocketKVCache holds {cache} row(s) (batch size {cache}) but this forward's input has batch size {got}: every "
    "forward on a cache must have the batch it was prefilled with. Decode all {cache} row(s) together, pick rows "
    "first (`cache.batch_select_indices(...)`), or use a fresh RocketKVCache for a different batch."
)


def check_attention(other: str | None) -> None:
    """Raise a RuntimeError if the module storing keys runs another attention than 'rocketkv' (``other``: its name,
    None when it runs 'rocketkv' or is not known). Called before the first layer writes anything."""
    if other is not None:
        raise RuntimeError(OTHER_ATTENTION.format(name=other))


def check_batch(layers: list, layer_idx: int, batch: int) -> None:
    """Raise a ValueError if ``layer_idx`` already holds rows and ``batch`` (the new keys' rows) differs.

    Host ints only (tensor shapes): no device sync. Called before the forward writes anything, so the cache stays
    usable with the right batch.
    """
    if layer_idx < len(layers) and layers[layer_idx].is_initialized:
        held = layers[layer_idx].batch_size
        if batch != held:
            raise ValueError(BATCH_MISMATCH.format(cache=held, got=batch))


def check_layers_consistent(layers: list, layer_idx: int, query_length: int) -> None:
    """Raise if an earlier forward left these layers half-updated, or their keys were never consumed.

    Each layer counts on the host the tokens it stored (eager updates; compiled steps skip every layer alike), so at
    layer 0 all layers agree, and at layer i > 0 layer i is exactly this forward's tokens behind layer 0. Shared by
    ``RocketKVCache`` and ``BatchedDecodeCache`` (one batch of several requests' rows).
    """
    for index in (layer_idx - 1, layer_idx):
        if 0 <= index < len(layers) and layers[index].awaiting_attention:
            raise RuntimeError(UNCONSUMED_KEYS)
    if not layers:
        return
    reference = layers[0].host_seen
    if layer_idx == 0:
        counts = [layer.host_seen for layer in layers]
        if len(set(counts)) > 1:
            raise RuntimeError(INTERRUPTED_FORWARD.format(detail=f"per layer: {counts}"))
        return
    seen = layers[layer_idx].host_seen if layer_idx < len(layers) else 0
    if seen + query_length != reference:
        raise RuntimeError(
            INTERRUPTED_FORWARD.format(detail=f"layer {layer_idx}: {seen}, layer 0: {reference - query_length}")
        )
