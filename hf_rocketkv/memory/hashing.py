"""Prefix keys: chained SHA-256 over canonical bytes, so a page's key names its whole prefix.

    root    = SHA-256(ROOT_SEED || field("fingerprint", model fingerprint))
    h_i     = SHA-256(h_{i-1} || field("tokens", ids of page i as int64 little-endian)
                                 || [field("salt", cache_salt)]          page 0 only; the chain carries it
                                 || [field("adapter", adapter id)]       every page
                                 || field("mm", digest || int64 offset)  per multimodal item overlapping page i)
    field(tag, payload) = uint32 len(tag) || tag || uint64 len(payload) || payload      (little-endian)

Only full pages are hashed. Everything is fixed-width or length-prefixed, so two different inputs never encode to
the same bytes, and the bytes are the same in every process and on every machine (never ``pickle`` nor Python's
``hash()``). The model fingerprint in the root keeps two models' (or two KV dtypes') pages apart.

The salt isolates tenants only through the digest (no token re-compare), hence a 256-bit cryptographic hash. It must
come from the server's trusted side, and hits stay observable through latency and ``reused_tokens``.
"""

from __future__ import annotations

import hashlib
import struct
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch

HASH_SCHEME = "sha256-chain-v1"
ROOT_SEED = b"hf_rocketkv/prefix-hash/v1"
MAX_TOKEN_ID = 2**63 - 1


def _field(tag: bytes, payload: bytes) -> bytes:
    return struct.pack("<I", len(tag)) + tag + struct.pack("<Q", len(payload)) + payload


@dataclass(frozen=True)
class MultimodalItem:
    """A non-text input occupying prompt tokens ``[start, start + length)``, identified by a content ``digest``."""

    digest: str
    start: int
    length: int

    def __post_init__(self) -> None:
        if not isinstance(self.digest, str) or not self.digest:
            raise ValueError(f"MultimodalItem.digest must be a non-empty string, got {self.digest!r}")
        for name in ("start", "length"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < (0 if name == "start" else 1):
                raise ValueError(f"MultimodalItem.{name} must be an integer >= {0 if name == 'start' else 1}, got {value!r}")


@dataclass(frozen=True)
class PrefixKeys:
    """What besides the token ids decides a prefix page's KV: tenant salt, adapter, multimodal inputs.

    cache_salt  folded into page 0 only (chaining carries it): requests with different salts never share pages
    adapter     adapter identity (e.g. LoRA name + path, or a weight digest), on every page
    multimodal  items whose embeddings sit among the prompt tokens, on every page they overlap (with their offset)
    """

    cache_salt: str | None = None
    adapter: str | None = None
    multimodal: tuple[MultimodalItem, ...] = ()

    def __post_init__(self) -> None:
        for name in ("cache_salt", "adapter"):
            value = getattr(self, name)
            if value is not None and not isinstance(value, str):
                raise ValueError(f"PrefixKeys.{name} must be a string or None, got {value!r} ({type(value).__name__})")
        if not isinstance(self.multimodal, tuple) or not all(isinstance(m, MultimodalItem) for m in self.multimodal):
            raise ValueError(f"PrefixKeys.multimodal must be a tuple of MultimodalItem, got {self.multimodal!r}")

    def page_extra(self, page_index: int, page_size: int) -> bytes:
        """The extra-key bytes of page ``page_index``."""
        parts = []
        if page_index == 0 and self.cache_salt is not None:
            parts.append(_field(b"salt", self.cache_salt.encode("utf-8")))
        if self.adapter is not None:
            parts.append(_field(b"adapter", self.adapter.encode("utf-8")))
        first, end = page_index * page_size, (page_index + 1) * page_size
        for item in sorted(self.multimodal, key=lambda m: (m.start, m.length, m.digest)):
            if item.start < end and item.start + item.length > first:
                offset = item.start - first  # where the item starts relative to this page (negative: earlier)
                payload = _field(b"digest", item.digest.encode("utf-8")) + struct.pack("<q", offset)
                parts.append(_field(b"mm", payload))
        return b"".join(parts)


NO_KEYS = PrefixKeys()


def root_hash(fingerprint: str) -> bytes:
    """The parent of page 0: ties every chain to one model fingerprint."""
    return hashlib.sha256(ROOT_SEED + _field(b"fingerprint", fingerprint.encode("utf-8"))).digest()


def as_token_list(token_ids: Any, field: str = "token_ids") -> list[int]:
    """A 1-D sequence (list, tuple, 1-D integer tensor) of token ids as a list of ints, validated."""
    if isinstance(token_ids, torch.Tensor):
        integer = not (token_ids.is_floating_point() or token_ids.is_complex() or token_ids.dtype == torch.bool)
        if token_ids.dim() != 1 or not integer:
            raise ValueError(f"{field} must be a 1-D integer tensor, got shape {tuple(token_ids.shape)} {token_ids.dtype}")
        if token_ids.dtype != torch.uint64:  # (uint64 can exceed 2**63: checked one by one below)
            # checked on the tensor, not token by token in Python (~1 us per token: 30 ms for a 32k-token prompt)
            negative = (token_ids < 0).nonzero()
            if len(negative):
                position = int(negative[0, 0])
                raise ValueError(f"{field}[{position}] must be an integer token id in [0, 2**63), got "
                                 f"{int(token_ids[position])}")
            return token_ids.tolist()  # Python ints below 2**63
        token_ids = token_ids.tolist()
    if isinstance(token_ids, (str, bytes)) or not isinstance(token_ids, Sequence):
        raise ValueError(f"{field} must be a sequence of token ids, got {type(token_ids).__name__}")
    ids = list(token_ids)
    for position, token in enumerate(ids):
        if not isinstance(token, int) or isinstance(token, bool) or not 0 <= token <= MAX_TOKEN_ID:
            raise ValueError(f"{field}[{position}] must be an integer token id in [0, 2**63), got {token!r}")
    return ids


def page_hashes(root: bytes, token_ids: Sequence[int], page_size: int, keys: PrefixKeys | None = None) -> list[bytes]:
    """Chained hashes of the full pages of ``token_ids`` (``len(token_ids) // page_size`` of them)."""
    keys = keys or NO_KEYS
    hashes = []
    parent = root
    for page in range(len(token_ids) // page_size):
        ids = token_ids[page * page_size : (page + 1) * page_size]
        message = parent + _field(b"tokens", struct.pack(f"<{page_size}q", *ids)) + keys.page_extra(page, page_size)
        parent = hashlib.sha256(message).digest()
        hashes.append(parent)
    return hashes

