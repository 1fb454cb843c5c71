"""Prefix files: a cached prompt prefix's pages in safetensors (never pickle), with a digest of everything.

Tensors, for n pages of p tokens and each layer i that holds pages (every layer; a model with sliding-window layers:
its full-attention layers only, ``hybrid.py``):

    token_ids        int64 [n * p]
    layer.{i}.k      [n, H, p, D]          storage dtype (likewise layer.{i}.v)
    layer.{i}.kt     [n, H, p // q, 2, D]  KT dtype
    layer.{i}.k_scale, layer.{i}.v_scale   float32 [n] or [n, H] (fp8 storage only)

Metadata (strings): ``format``, ``format_version``, ``hash_scheme``, ``model_fingerprint``, the model facts behind it
(for messages), ``kv_dtype``, ``page_size``, ``kt_page_size``, ``kt_dtype``, ``scale_granularity``, ``num_layers``,
``layer_windows`` (JSON: each layer's sliding window, null for full attention; a file without it is read as all full
attention), ``token_count``, ``num_pages``, ``extra_keys`` (JSON: adapter and multimodal items; the tenant salt is
never written) and ``content_digest``: SHA-256 over the other metadata and every tensor's name, dtype, shape and
bytes. A file whose digest does not match (truncated, edited) is refused. The digest detects damage, it is not a
signature: anyone who can write the file can recompute it, so load prefix files only from places you trust.

``PrefixFiles`` moves a pool's pages into and out of such files: ``save`` writes the longest resident chain (device
or host) of some token ids; ``load`` checks the file against the pool (named settings first, then the model
fingerprint), hashes its token ids anew under the loader's salt (hashes are never read from a file) and inserts its
pages as cached pages (ref 0) at a priority above ordinary cached prompts.
"""

from __future__ import annotations

import hashlib
import json
import os
import tempfile
import weakref
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from .core import PageCore
from .errors import PoolExhaustedError, PrefixFileError, check_device
from .geometry import dtype_name
from .hashing import HASH_SCHEME, MultimodalItem, PrefixKeys, as_token_list
from .offload import HostOffload
from .page_meta import LOADED_PREFIX_PRIORITY, Tier, check_priority
from .prefix_index import PrefixIndex

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
    if path.is_dir():
        raise PrefixFileError(f"prefix file {str(path)!r} is a directory; give the path of the file save_prefix wrote")
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


@dataclass(frozen=True)
class LoadedPrefix:
    """What ``load_prefix`` did: tokens in the file, pages it inserted, pages that were already resident."""

    num_tokens: int
    pages_loaded: int
    pages_already_resident: int


@dataclass(frozen=True)
class PoolFacts:
    """What a prefix file records of its pool, and what a loading pool must match.

    fingerprint, fingerprint_fields   the model fingerprint and the facts behind it (``fingerprint.py``)
    dtype, kt_dtype                   K/V storage and KT dtypes
    page_size, kt_page_size           tokens per pool page and per KT page
    scale_granularity                 fp8 scales per page or per page and KV head
    num_layers                        layers of the model
    layer_windows                     per layer: its sliding window, None for full attention (which layers the
                                      pages span, and how a hit replays the sliding ones)
    """

    fingerprint: str
    fingerprint_fields: dict[str, Any]
    dtype: torch.dtype
    kt_dtype: torch.dtype
    page_size: int
    kt_page_size: int
    scale_granularity: str
    num_layers: int
    layer_windows: tuple[int | None, ...] = ()

    def windows_json(self) -> str:
        return json.dumps(list(self.layer_windows or (None,) * self.num_layers))

    def metadata(self) -> dict[str, str]:
        return {
            "hash_scheme": HASH_SCHEME,
            "model_fingerprint": self.fingerprint,
            "model": json.dumps(self.fingerprint_fields, sort_keys=True),
            "kv_dtype": dtype_name(self.dtype),
            "page_size": str(self.page_size),
            "kt_page_size": str(self.kt_page_size),
            "kt_dtype": dtype_name(self.kt_dtype),
            "scale_granularity": self.scale_granularity,
            "num_layers": str(self.num_layers),
            "layer_windows": self.windows_json(),
        }

    def check(self, path: Path, meta: dict[str, str]) -> None:
        """Named settings first (their messages say exactly what differs), then the whole model fingerprint."""
        if meta.get("hash_scheme") != HASH_SCHEME:
            raise PrefixFileError(f"prefix file {str(path)!r} uses hash scheme {meta.get('hash_scheme')!r}; this "
                                  f"pool uses {HASH_SCHEME!r}")
        expected = {
            "kv_dtype": dtype_name(self.dtype), "page_size": str(self.page_size),
            "kt_page_size": str(self.kt_page_size), "kt_dtype": dtype_name(self.kt_dtype),
            "num_layers": str(self.num_layers),
        }
        if self.dtype == torch.float8_e4m3fn:
            expected["scale_granularity"] = self.scale_granularity
        for key, value in expected.items():
            if meta.get(key) != value:
                raise PrefixFileError(
                    f"prefix file {str(path)!r} has {key}={meta.get(key)!r}; this pool has {key}={value!r}"
                )
        saved_windows = meta.get("layer_windows", json.dumps([None] * self.num_layers))  # older files: all full
        if saved_windows != self.windows_json():
            raise PrefixFileError(
                f"prefix file {str(path)!r} has layer_windows={saved_windows} (each layer's sliding window, null for "
                f"full attention); this pool's model has layer_windows={self.windows_json()}: a file is loaded only "
                f"into a pool of the same layer kinds and windows"
            )
        if meta.get("model_fingerprint") != self.fingerprint:
            raise PrefixFileError(
                f"prefix file {str(path)!r} was saved for another model: fingerprint "
                f"{str(meta.get('model_fingerprint'))[:16]}... ({meta.get('model')}) != this pool's "
                f"{self.fingerprint[:16]}... ({json.dumps(self.fingerprint_fields, sort_keys=True)})"
            )


class PrefixFiles:
    """Saves and loads one pool's prefix pages (its core, index and host tier) as prefix files."""

    def __init__(self, facts: PoolFacts, core: PageCore, index: PrefixIndex, offload: HostOffload,
                 device: torch.device | None, model: torch.nn.Module | None):
        self.facts = facts
        self.core = core
        self.index = index
        self.offload = offload
        self.device = device  # where load allocates layers that have not stored anything yet
        # a model was given: load allocates unbound layers where its weights are (at load time)
        self._model_ref = weakref.ref(model) if model is not None else None


    def use_device(self, device) -> None:
        """Where ``load`` allocates layers that have not stored anything yet."""
        self.device = device
    def save(self, path: str | Path, token_ids: Any, keys: PrefixKeys | None = None) -> int:
        """Write the longest resident chain of full pages of ``token_ids``; returns its token count. The salt is
        never written (the loader brings its own)."""
        core = self.core
        if Path(path).is_dir():
            raise ValueError(f"save_prefix: {str(path)!r} is a directory; give a file path, e.g. "
                             f"{str(Path(path) / 'prefix.safetensors')!r}")
        ids = as_token_list(token_ids)
        with core.lock:
            chain = self.index.chain(self.index.hash_pages(ids, keys))
            if not chain:
                raise ValueError(
                    f"save_prefix: no page of these {len(ids)} token ids is resident (the first full page misses)"
                )
            layout = core.record_layout()
            core.events.synchronize()
            records = torch.empty(len(chain), layout.record_bytes, dtype=torch.uint8)
            device_rows = [row for row, meta in enumerate(chain) if meta.tier is Tier.DEVICE]
            host_rows = [row for row, meta in enumerate(chain) if meta.tier is Tier.HOST]
            if device_rows:
                page_ids = torch.tensor([chain[r].index for r in device_rows], dtype=torch.long,
                                        device=core.storage.device())
                records[device_rows] = core.storage.gather_records(page_ids, layout).cpu()
            if host_rows:
                records[host_rows] = self.offload.read_slots([chain[r].index for r in host_rows])
        num_tokens = len(chain) * self.facts.page_size
        tensors = {f"layer.{layer}.{name}": t for (layer, name), t in layout.unpack(records).items()}
        tensors["token_ids"] = torch.tensor(ids[:num_tokens], dtype=torch.int64)
        keys = keys or PrefixKeys()
        extra = {"adapter": keys.adapter, "multimodal": [vars(m) for m in keys.multimodal]}
        metadata = {**self.facts.metadata(), "token_count": str(num_tokens), "num_pages": str(len(chain)),
                    "extra_keys": json.dumps(extra, sort_keys=True)}
        write_prefix_file(path, tensors, metadata)
        return num_tokens

    def load(self, path: str | Path, cache_salt: str | None = None, priority: int = LOADED_PREFIX_PRIORITY,
             device: torch.device | str | None = None) -> LoadedPrefix:
        """Insert a prefix file's pages as cached pages (ref 0, ``priority``), hashed anew from the stored token ids
        under ``cache_salt`` and the file's adapter / multimodal keys."""
        core, page_size = self.core, self.facts.page_size
        path = Path(path)
        check_priority(priority, "priority")
        device = check_device(device, "load_prefix: device")
        if cache_salt is not None and not isinstance(cache_salt, str):  # the caller's, before the file is read
            raise ValueError(f"load_prefix: cache_salt must be a string or None, got {cache_salt!r} "
                             f"({type(cache_salt).__name__})")
        tensors, meta = read_prefix_file(path)
        self.facts.check(path, meta)
        try:
            ids = as_token_list(tensors["token_ids"], "token_ids (in the file)")
            num_pages = int(meta["num_pages"])
            extra = json.loads(meta["extra_keys"])
            keys = PrefixKeys(cache_salt=cache_salt, adapter=extra["adapter"],
                              multimodal=tuple(MultimodalItem(**item) for item in extra["multimodal"]))
        except (KeyError, ValueError, TypeError) as err:
            raise PrefixFileError(f"prefix file {str(path)!r} has malformed contents: {err}") from err
        if len(ids) != num_pages * page_size or meta.get("token_count") != str(len(ids)):
            raise PrefixFileError(f"prefix file {str(path)!r}: {len(ids)} token ids for {num_pages} pages of "
                                  f"{page_size} (token_count={meta.get('token_count')})")
        with core.lock:
            self._bind_for_file(path, tensors, device)
            layout = core.record_layout()
            try:
                records = layout.pack({(seg.layer, seg.name): tensors[f"layer.{seg.layer}.{seg.name}"]
                                       for seg in layout.segments}, num_pages)
            except (KeyError, ValueError) as err:
                raise PrefixFileError(f"prefix file {str(path)!r} does not match this pool's page layout: {err}") from err
            hashes = self.index.hash_pages(ids, keys)
            missing = [i for i, h in enumerate(hashes) if h not in self.index.entries]
            if len(missing) > core.available():
                raise PoolExhaustedError(f"loading {str(path)!r}", len(missing), core.available(), core.num_pages)
            core.events.poll()
            core.tick()
            targets = core.take_pages(len(missing))
            if missing:
                device_ = core.storage.device()
                core.storage.scatter_records(torch.tensor([m.index for m in targets], device=device_),
                                             records[missing].to(device_), layout)
            for page, meta in zip(missing, targets):
                self.index.register_page(meta, hashes[page], page, priority)
            core.unref_all([m.index for m in targets])
        return LoadedPrefix(len(ids), len(missing), len(hashes) - len(missing))

    def _bind_for_file(self, path: Path, tensors: dict[str, torch.Tensor], device) -> None:
        storage = self.core.storage
        device = device if device is not None else self.device
        model = self._model_ref() if self._model_ref is not None else None
        if device is None and model is not None:
            device = next((t.device for t in model.parameters()), None)
        for layer_idx in storage.paged_layers:
            if storage.is_bound(layer_idx):
                continue
            if device is None:
                raise ValueError(
                    f"load_prefix: layer {layer_idx} has not stored anything yet; pass device= (or build the pool "
                    f"with device=) so its pages can be allocated"
                )
            k = tensors.get(f"layer.{layer_idx}.k")
            if k is None or k.dim() != 4:
                raise PrefixFileError(f"prefix file {str(path)!r} lacks layer.{layer_idx}.k [pages, heads, tokens, dim]")
            storage.bind(layer_idx, k.shape[1], k.shape[3], torch.device(device))
