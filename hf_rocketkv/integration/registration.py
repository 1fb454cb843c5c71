"""Registration with transformers, done once at ``import hf_rocketkv``, and the one public switch ``enable``."""

from __future__ import annotations

from ..cache.cache import RocketKVCache
from ..config import RocketKVConfig
from . import compat, generate
from .attention import rocketkv_attention
from .names import ATTN_NAME


def register() -> None:
    """Register the ``rocketkv`` attention and mask functions and the generate() glue (idempotent).

    Without a mask entry transformers hands the attention function no mask at all (padding would be lost). Prefill
    needs exactly sdpa's mask; compressed layers build validity from their own lengths and read only a later turn's
    padding from it.
    """
    RocketKVCache.install_integration(compat.require, other_attention)
    if compat.sdpa_mask is not None:
        compat.register_attention(ATTN_NAME, rocketkv_attention, compat.sdpa_mask)
    generate.install()


def other_attention() -> str | None:
    """The attention the module calling ``RocketKVCache.update`` runs, when it is not 'rocketkv' (None when it is,
    or when the caller is no transformers module). Called by ``RocketKVCache.update`` only."""
    name = compat.calling_module_attention(frames_up=2)  # RocketKVCache.update, then the module's forward
    return None if name in (None, ATTN_NAME) else name


def enable(model, config: RocketKVConfig | None = None):
    """Switch ``model`` to RocketKV attention and (optionally) set the config used when generate() gets no cache.

    ``model`` first gets its own copy of its transformers config (``model.config`` is a new object afterwards):
    models built from one config object share it, and the switch is written into the config, so without the copy a
    dense model built from the same config would silently run RocketKV too. Returns the model, so
    ``model = hf_rocketkv.enable(AutoModelForCausalLM.from_pretrained(...))`` reads well.
    """
    compat.require()
    compat.own_config(model)
    model.set_attn_implementation(ATTN_NAME)
    if config is not None:
        generate.set_config(model, config)
    return model
