"""How the ``rocketkv`` attention function finds its cache layer: the key tensor a layer's ``update()`` returns
carries a weak reference to that layer (docs/seam.md)."""

from __future__ import annotations

import weakref

import torch

OWNER_ATTRIBUTE = "_hf_rocketkv_layer"  # on the key tensor update() returns: weakref.ref(its RocketKVLayer)


def layer_of(key: torch.Tensor):
    """The RocketKVLayer whose ``update()`` returned ``key``, or None (another cache, or no cache).

    A weak reference, so the layer and its buffers are freed as soon as the cache is (no reference cycle through
    the tensor). Traceable by torch.compile: reading it adds no graph break and a fresh cache per request adds no
    recompilation.
    """
    ref = getattr(key, OWNER_ATTRIBUTE, None)
    return ref() if ref is not None else None


def tag(tensor: torch.Tensor, layer) -> None:
    """Mark ``tensor`` as returned by ``layer``'s ``update()`` (once: a tagged tensor keeps its owner). Called in
    eager code wherever that tensor is (re)allocated, so compiled decode steps find it tagged."""
    if getattr(tensor, OWNER_ATTRIBUTE, None) is None:
        setattr(tensor, OWNER_ATTRIBUTE, weakref.ref(layer))
