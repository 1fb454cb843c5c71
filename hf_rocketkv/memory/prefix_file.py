"""Prefix files: a cached prompt prefix's pages in safetensors (never pickle), with a digest of everything.

Tensors, for n pages of p tokens:

    token_ids        int64 [n * p]
    layer.{i}.k      [n, H, p, D]          storage dtype (likewise layer.{i}.v)
    layer.{i}.kt     [n, H, p // q, 2, D]  KT dtype
    layer.{i}.k_scale, layer.{i}.v_scale   float32 [n] or [n, H] (fp8 storage only)

Metadata (strings): ``format``, ``format_version``, ``hash_scheme``, ``model_fingerprint``, the model facts behind it
(for messages), ``kv_dtype``, ``page_size``, ``kt_page_size``, ``kt_dtype``, ``scale_granularity``, ``token_count``,
``num_pages``, ``extra_keys`` (JSON: adapter and multimodal items; the tenant salt is never written) and
``content_digest``: SHA-256 over the other metadata and every tensor's name, dtype, shape and bytes. A file whose
digest does not match (truncated, edited) is refused. The digest detects damage, it is not a signature: anyone who
can write the file can recompute it, so load prefix files only from places you trust.
"""

from __future__ import annotations

import hashlib
import os
import tempfile
from pathlib import Path

import torch

from .errors import PrefixFileError

FORMAT = "hf_rocketkv.prefix"
FORMAT_VERSION = "1"
DIGEST_KEY = "content_digest"


def content_digest(tensors: dict[str, torch.Tensor], metadata: dict[str, str]) -> str:
    digest = hashlib.sha256()
    for key in sorted(k for k in metadata if k != DIGEST_KEY):
        for part in (key, metadata[key]):
            encoded = part.encode("utf-8")
            digest.update(len(encoded).to_bytes(8, "little") + encoded)
    for name in sorted(tensors):
        tensor = tensors[name].detach().to("cpu").contiguous()
        header = f"{name}|{tensor.dtype}|{tuple(tensor.shape)}".encode("utf-8")
        digest.update(len(header).to_bytes(8, "little") + header)
        raw = tensor.reshape(-1).view(torch.uint8).numpy().tobytes() if tensor.numel() else b""
        digest.update(len(raw).to_bytes(8, "little") + raw)
    return digest.hexdigest()


def write_prefix_file(path: str | Path, tensors: dict[str, torch.Tensor], metadata: dict[str, str]) -> None:
    """Write atomically (a temporary file in the same folder, then a rename)."""
    from safetensors.torch import save_file

    path = Path(path)
    tensors = {name: t.detach().to("cpu").contiguous() for name, t in tensors.items()}
    metadata = {**metadata, "format": FORMAT, "format_version": FORMAT_VERSION}
    metadata[DIGEST_KEY] = content_digest(tensors, metadata)
    path.parent.mkdir(parents=True, exist_ok=True)
    handle, temporary = tempfile.mkstemp(prefix=path.name + ".", suffix=".tmp", dir=path.parent)
    os.close(handle)
    try:
        save_file(tensors, temporary, metadata=metadata)
        os.replace(temporary, path)
    except BaseException:
        Path(temporary).unlink(missing_ok=True)
        raise


def read_prefix_file(path: str | Path) -> tuple[dict[str, torch.Tensor], dict[str, str]]:
    """``(tensors on CPU, metadata)``; raises PrefixFileError unless the file is complete and unchanged."""
    from safetensors import safe_open

    path = Path(path)
    if not path.is_file():
        raise PrefixFileError(f"prefix file {str(path)!r} does not exist")
    try:
        with safe_open(str(path), framework="pt") as handle:
            metadata = dict(handle.metadata() or {})
            tensors = {name: handle.get_tensor(name) for name in handle.keys()}
    except Exception as err:  # noqa: BLE001 - any parse failure means the file is damaged
        raise PrefixFileError(
            f"prefix file {str(path)!r} cannot be read as safetensors (truncated or not a prefix file): {err}"
        ) from err
    if metadata.get("format") != FORMAT:
        raise PrefixFileError(f"{str(path)!r} is not an hf_rocketkv prefix file (format={metadata.get('format')!r})")
    if metadata.get("format_version") != FORMAT_VERSION:
        raise PrefixFileError(
            f"prefix file {str(path)!r} has format_version {metadata.get('format_version')!r}; this version reads "
            f"{FORMAT_VERSION!r}"
        )
    expected = metadata.get(DIGEST_KEY)
    actual = content_digest(tensors, metadata)
    if expected != actual:
        raise PrefixFileError(
            f"prefix file {str(path)!r} fails its content digest (stored {expected}, computed {actual}): the file "
            f"was truncated or modified; refusing to load it"
        )
    return tensors, metadata
