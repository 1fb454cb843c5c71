"""How the ``rocketkv`` attention function finds its cache layer: the key tensor a layer's ``update()`` returns
carries a weak reference to that layer (docs/seam.md)."""

from __future__ import annotations

import copy
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


def tag(tensor: torch.Tensor, layer, replace: bool = False) -> None:
    """Mark ``tensor`` as returned by ``layer``'s ``update()`` (once: a tagged tensor keeps its owner, unless
    ``replace``). Called in eager code wherever that tensor is (re)allocated, so compiled decode steps find it
    tagged."""
    if replace or getattr(tensor, OWNER_ATTRIBUTE, None) is None:
        setattr(tensor, OWNER_ATTRIBUTE, weakref.ref(layer))


def copy_with_owners(obj, memo: dict):
    """``copy.deepcopy(obj)`` for a cache whose ``__deepcopy__`` calls it: its attributes deep-copied, then each copied
    tensor tagged with a layer that was copied too names the copy. (``deepcopy`` copies a weak reference as it is, so
    a copy's attention would otherwise find the original's layers through the keys the copy returns.)"""
    copied = object.__new__(type(obj))
    memo[id(obj)] = copied
    copied.__dict__.update(copy.deepcopy(obj.__dict__, memo))
    for value in list(memo.values()):
        owner = layer_of(value) if isinstance(value, torch.Tensor) else None
        if owner is not None and id(owner) in memo:
            tag(value, memo[id(owner)], replace=True)
    return copied
