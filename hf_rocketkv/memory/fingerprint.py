"""Model fingerprint: SHA-256 naming whose KV a page holds (prefix hash root, prefix file check).

Covers the architecture, layer count, KV heads, head_dim, RoPE settings and the KV storage dtype; with a model (not
only a config) also a digest of a few sampled weight tensors, so a fine-tuned checkpoint of the same architecture
gets another fingerprint. A config-only pool and a model pool therefore never share prefix files (conservative).
"""

from __future__ import annotations

import hashlib
import json

import torch

from .geometry import ModelGeometry, dtype_name

SAMPLED_ELEMENTS = 4096  # elements read from each end of each sampled tensor


def _tensor_digest(name: str, tensor: torch.Tensor) -> str:
    tensor = tensor.detach()
    if hasattr(tensor, "to_local"):  # a DTensor shard: this rank's piece
        tensor = tensor.to_local()
    digest = hashlib.sha256(f"{name}|{tuple(tensor.shape)}|{tensor.dtype}".encode())
    if tensor.device.type != "meta" and tensor.numel():
        flat = tensor.reshape(-1)
        for piece in (flat[:SAMPLED_ELEMENTS], flat[-SAMPLED_ELEMENTS:]):
            digest.update(piece.to("cpu").contiguous().view(torch.uint8).numpy().tobytes())
    return digest.hexdigest()


def weights_digest(model: torch.nn.Module, samples: int = 4) -> str:
    """SHA-256 over ``samples`` parameters spread evenly over the sorted parameter names."""
    named = sorted(model.named_parameters(), key=lambda item: item[0])
    if not named:
        return hashlib.sha256(b"no parameters").hexdigest()
    count = min(samples, len(named))
    picks = sorted({round(i * (len(named) - 1) / max(count - 1, 1)) for i in range(count)})
    digest = hashlib.sha256()
    for index in picks:
        digest.update(_tensor_digest(*named[index]).encode())
    return digest.hexdigest()


def fingerprint_fields(geometry: ModelGeometry, kv_dtype: torch.dtype, model: torch.nn.Module | None,
                       samples: int = 4) -> dict[str, object]:
    return {
        "architecture": geometry.architecture,
        "num_layers": geometry.num_layers,
        "num_kv_heads": geometry.num_kv_heads,
        "head_dim": geometry.head_dim,
        "rope": geometry.rope,
        "kv_dtype": dtype_name(kv_dtype),
        "weights": weights_digest(model, samples) if model is not None else None,
    }


def model_fingerprint(geometry: ModelGeometry, kv_dtype: torch.dtype, model: torch.nn.Module | None = None,
                      samples: int = 4) -> str:
    """Hex SHA-256 of :func:`fingerprint_fields` as canonical JSON."""
    return fingerprint_of(fingerprint_fields(geometry, kv_dtype, model, samples))


def fingerprint_of(fields: dict[str, object]) -> str:
    text = json.dumps(fields, sort_keys=True, separators=(",", ":"))
    return hashlib.sha256(text.encode()).hexdigest()
