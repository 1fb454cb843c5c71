"""How the attention function finds the cache: Llama-style attention modules call ``cache.update`` and then the
attention function, but never pass the cache to it. ``RocketKVCache.update`` leaves a pointer here, the
``rocketkv`` attention function of the same layer takes it (and clears it, so that a later run with another cache
never sees a stale one).

Setting Python attributes to objects is free under ``torch.compile``; a Python counter would not be.
"""

from __future__ import annotations

ATTN_NAME = "rocketkv"


class _Pointer:
    cache = None
    layer_idx: int | None = None


_ACTIVE = _Pointer()


def hand_to_attention(cache, layer_idx: int) -> None:
    """Called by ``RocketKVCache.update`` right before the layer's attention function runs."""
    if _ACTIVE.cache is not None:
        # the previous update's pointer was never taken: the model's attention is not "rocketkv"
        previous = _ACTIVE.layer_idx
        clear()
        raise RuntimeError(
            f"RocketKVCache stored layer {previous}'s keys but the '{ATTN_NAME}' attention function never ran, so "
            f"RocketKV would be silently skipped. Enable it with `hf_rocketkv.enable(model)` or load the model with "
            f"`from_pretrained(..., attn_implementation='{ATTN_NAME}')`."
        )
    _ACTIVE.cache, _ACTIVE.layer_idx = cache, layer_idx


def take(layer_idx: int):
    """The RocketKVCache that just stored ``layer_idx``'s keys, or None (another cache, or no cache)."""
    cache = _ACTIVE.cache if _ACTIVE.layer_idx == layer_idx else None
    clear()
    return cache


def clear() -> None:
    _ACTIVE.cache, _ACTIVE.layer_idx = None, None
