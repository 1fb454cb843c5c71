"""What the pool needs to know about a model, read from a model, its config, or any object with the attributes.

Read without importing transformers: a transformers ``PreTrainedModel`` is recognised as a ``torch.nn.Module`` with
a ``config``; a composite config (vision-language models) is narrowed with ``get_text_config()`` when it has one.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

import torch

KV_DTYPES: dict[str, torch.dtype] = {
    "bfloat16": torch.bfloat16,
    "float16": torch.float16,
    "float32": torch.float32,
    "float8_e4m3fn": torch.float8_e4m3fn,
}
# Same names as RocketKVConfig.kt_cache_dtype (duplicated here: memory/ imports nothing from the cache floors).
KT_DTYPES: dict[str, torch.dtype] = {
    "float8_e5m2": torch.float8_e5m2,
    "bfloat16": torch.bfloat16,
    "float16": torch.float16,
    "float32": torch.float32,
}
FP8_KV_DTYPE = torch.float8_e4m3fn
# RoPE settings that change the keys stored in the cache (keys are cached after rotation).
ROPE_ATTRIBUTES = ("rope_theta", "rope_scaling", "rope_parameters", "partial_rotary_factor", "rotary_dim")


def dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def parse_dtype(value: Any, field: str, allowed: dict[str, torch.dtype]) -> torch.dtype:
    """``value`` (a torch.dtype or its name, with or without ``torch.``) as a dtype from ``allowed``."""
    if isinstance(value, torch.dtype):
        name = dtype_name(value)
    elif isinstance(value, str):
        name = value.removeprefix("torch.")
    else:
        raise ValueError(f"{field} must be a torch.dtype or its name, got {value!r} ({type(value).__name__})")
    if name not in allowed:
        raise ValueError(f"{field} must be one of {sorted(allowed)}, got {value!r}")
    return allowed[name]


def storage_dtype(value: Any, geometry: ModelGeometry) -> torch.dtype:
    """KVBlockPool's ``dtype`` argument as a K/V storage dtype; None: the model's (which it must name)."""
    if value is None:
        if geometry.dtype is None:
            raise ValueError(
                f"KVBlockPool.dtype is None and the model/config names no dtype; pass dtype= one of {sorted(KV_DTYPES)}"
            )
        value = geometry.dtype
    return parse_dtype(value, "KVBlockPool.dtype", KV_DTYPES)


@dataclass(frozen=True)
class ModelGeometry:
    """The model facts that shape a KV page and identify whose KV it is.

    ``num_kv_heads`` is what the config says (or the override); a tensor-parallel shard sees fewer heads, which the
    pool learns from the first key_states it stores.
    """

    architecture: str
    num_layers: int
    num_kv_heads: int
    head_dim: int
    rope: str  # canonical JSON of the RoPE settings ("{}" when the config names none)
    dtype: torch.dtype | None  # the model's dtype when the model or config names one


def _text_config(config: Any) -> Any:
    get_text_config = getattr(config, "get_text_config", None)
    return get_text_config() if callable(get_text_config) else config


def _positive_int(config: Any, name: str) -> int | None:
    value = getattr(config, name, None)
    if value is None:
        return None
    if not isinstance(value, int) or isinstance(value, bool) or value < 1:
        raise ValueError(f"model config attribute {name} must be a positive integer, got {value!r}")
    return value


def _config_dtype(config: Any) -> torch.dtype | None:
    for name in ("dtype", "torch_dtype"):
        if name == "torch_dtype" and hasattr(config, "dtype"):
            break  # transformers 5 names it dtype; reading torch_dtype there only warns that it is deprecated
        value = getattr(config, name, None)
        if isinstance(value, torch.dtype) and value.is_floating_point:
            return value
        if isinstance(value, str) and isinstance(getattr(torch, value.removeprefix("torch."), None), torch.dtype):
            return getattr(torch, value.removeprefix("torch."))
    return None


def _model_dtype(model: torch.nn.Module) -> torch.dtype | None:
    for parameter in model.parameters():
        if parameter.is_floating_point():
            return parameter.dtype
    return None


def _rope_json(config: Any) -> str:
    settings = {name: getattr(config, name) for name in ROPE_ATTRIBUTES if getattr(config, name, None) is not None}
    return json.dumps(settings, sort_keys=True, separators=(",", ":"), default=str)


def split_model_and_config(model_or_config: Any) -> tuple[torch.nn.Module | None, Any]:
    """``(model or None, text config)``."""
    if isinstance(model_or_config, torch.nn.Module):
        config = getattr(model_or_config, "config", None)
        if config is None:
            raise ValueError(
                f"KVBlockPool(model_or_config): the module {type(model_or_config).__name__} has no .config; "
                f"pass its config (an object with num_hidden_layers, num_key_value_heads, head_dim) instead"
            )
        return model_or_config, _text_config(config)
    if model_or_config is None:
        raise ValueError("KVBlockPool(model_or_config) needs a model or a config, got None")
    return None, _text_config(model_or_config)


def model_geometry(model_or_config: Any, num_kv_heads: int | None = None) -> tuple[ModelGeometry, torch.nn.Module | None]:
    """Read layers, KV heads, head_dim, RoPE settings and dtype; returns ``(geometry, model or None)``."""
    model, config = split_model_and_config(model_or_config)
    num_layers = _positive_int(config, "num_hidden_layers")
    if num_layers is None:
        raise ValueError(
            f"KVBlockPool(model_or_config): {type(config).__name__} has no num_hidden_layers; the pool allocates "
            f"one page tensor per layer"
        )
    num_heads = _positive_int(config, "num_attention_heads")
    config_kv_heads = _positive_int(config, "num_key_value_heads") or num_heads
    if num_kv_heads is not None:
        if not isinstance(num_kv_heads, int) or isinstance(num_kv_heads, bool) or num_kv_heads < 1:
            raise ValueError(f"KVBlockPool.num_kv_heads must be a positive integer or None, got {num_kv_heads!r}")
        config_kv_heads = num_kv_heads
    if config_kv_heads is None:
        raise ValueError(
            f"KVBlockPool(model_or_config): {type(config).__name__} has neither num_key_value_heads nor "
            f"num_attention_heads; pass num_kv_heads="
        )
    head_dim = _positive_int(config, "head_dim")
    if head_dim is None:
        hidden = _positive_int(config, "hidden_size")
        if hidden is None or num_heads is None:
            raise ValueError(
                f"KVBlockPool(model_or_config): {type(config).__name__} has no head_dim and no "
                f"hidden_size/num_attention_heads to derive it from"
            )
        head_dim = hidden // num_heads
    architectures = getattr(config, "architectures", None)
    if architectures:
        architecture = str(architectures[0])
    else:
        architecture = str(getattr(config, "model_type", None) or type(config).__name__)
    dtype = (_model_dtype(model) if model is not None else None) or _config_dtype(config)
    geometry = ModelGeometry(architecture, num_layers, config_kv_heads, head_dim, _rope_json(config), dtype)
    return geometry, model
