"""The pool's device tensors: one allocation per layer and tensor, made lazily from the first key_states seen.

Per layer (n = num_pages, H KV heads actually seen, p page_size, q kt_page_size, D head_dim):

    k, v      [n, H, p, D]          storage dtype
    kt        [n, H, p // q, 2, D]  KT dtype
    k_scale   [n] or [n, H]         float32, fp8 storage only (initialised to 1)
    v_scale   [n] or [n, H]

A page id means the same token slots in every layer. Sizes come from the key_states a layer first stores, never only
from the config: a tensor-parallel shard holds fewer KV heads than the config names. The page count was fixed from
the config's geometry (an upper bound), so a shard uses less than ``max_gpu_bytes``; pass ``num_kv_heads=`` to the
pool to plan with the shard's count.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import torch

from .layout import SCALE_DTYPE, LayerShape, RecordLayout


@dataclass
class LayerStorage:
    """One layer's page tensors (see the module docstring for shapes)."""

    shape: LayerShape
    k: torch.Tensor
    v: torch.Tensor
    kt: torch.Tensor
    k_scale: torch.Tensor | None = None
    v_scale: torch.Tensor | None = None

    @property
    def device(self) -> torch.device:
        return self.k.device

    def tensors(self) -> dict[str, torch.Tensor]:
        """Name -> tensor, in record order (the names of ``LayerShape.page_tensors``)."""
        return {name: getattr(self, name) for name in self.shape.page_tensors()}


class PageStorage:
    def __init__(self, num_layers: int, num_pages: int, planned: LayerShape,
                 paged_layers: tuple[int, ...] | None = None):
        self.num_layers = num_layers
        self.num_pages = num_pages
        self.planned = planned
        # the layers that hold pages: all of them, or a hybrid model's full-attention layers (hybrid.py)
        self.paged_layers = tuple(range(num_layers)) if paged_layers is None else tuple(paged_layers)
        self._layers: list[LayerStorage | None] = [None] * num_layers

    def _check_layer(self, layer_idx: int) -> None:
        if not isinstance(layer_idx, int) or isinstance(layer_idx, bool) or not 0 <= layer_idx < self.num_layers:
            raise ValueError(f"KVBlockPool layer index must be in [0, {self.num_layers}), got {layer_idx!r}")

    def is_bound(self, layer_idx: int) -> bool:
        self._check_layer(layer_idx)
        return self._layers[layer_idx] is not None

    @property
    def all_bound(self) -> bool:
        return all(self._layers[i] is not None for i in self.paged_layers)

    @property
    def any_bound(self) -> bool:
        return any(layer is not None for layer in self._layers)

    def bind(self, layer_idx: int, num_kv_heads: int, head_dim: int, device: torch.device) -> LayerStorage:
        """Allocate layer ``layer_idx`` for ``num_kv_heads`` heads on ``device`` (or check an existing binding)."""
        self._check_layer(layer_idx)
        if layer_idx not in self.paged_layers:
            raise ValueError(f"KVBlockPool layer {layer_idx} is a sliding-window layer: it holds no pages (its ring "
                             f"is in the pool's sliding slab)")
        planned = self.planned
        if head_dim != planned.head_dim:
            raise ValueError(
                f"KVBlockPool layer {layer_idx}: key_states have head_dim {head_dim}, the pool was planned for "
                f"head_dim {planned.head_dim} (from the model config)"
            )
        if num_kv_heads > planned.num_kv_heads:
            raise ValueError(
                f"KVBlockPool layer {layer_idx}: key_states have {num_kv_heads} KV heads, more than the "
                f"{planned.num_kv_heads} the pool's page count was planned for; pass num_kv_heads={num_kv_heads}"
            )
        existing = self._layers[layer_idx]
        if existing is not None:
            if existing.shape.num_kv_heads != num_kv_heads or existing.device != torch.device(device):
                raise ValueError(
                    f"KVBlockPool layer {layer_idx} holds {existing.shape.num_kv_heads} KV heads on "
                    f"{existing.device}; got {num_kv_heads} on {device}"
                )
            return existing
        shape = dataclasses.replace(planned, num_kv_heads=num_kv_heads)
        n = self.num_pages
        tensors = {}
        for name, (page_shape, dtype) in shape.page_tensors().items():
            fill = 1.0 if dtype == SCALE_DTYPE and name.endswith("_scale") else 0
            tensors[name] = torch.full((n, *page_shape), fill, dtype=dtype, device=device)
        storage = LayerStorage(shape=shape, **tensors)
        self._layers[layer_idx] = storage
        return storage

    def layer(self, layer_idx: int) -> LayerStorage:
        self._check_layer(layer_idx)
        storage = self._layers[layer_idx]
        if storage is None:
            raise ValueError(f"KVBlockPool layer {layer_idx} has not stored anything yet (bind it with key_states)")
        return storage

    def device(self) -> torch.device:
        """The one device every bound layer lives on (page records need a single device)."""
        devices = {layer.device for layer in self._layers if layer is not None}
        if len(devices) != 1:
            raise ValueError(
                f"KVBlockPool: moving page records needs every layer bound and on one device, got {sorted(map(str, devices))}"
            )
        return devices.pop()

    def record_layout(self) -> RecordLayout:
        """The page record of the paged layers (a hybrid model's sliding layers hold no pages: not in it)."""
        if not self.all_bound:
            missing = [i for i in self.paged_layers if self._layers[i] is None]
            raise ValueError(
                f"KVBlockPool: layers {missing} have not stored anything yet; offload and prefix files need "
                f"every paged layer's pages"
            )
        self.device()
        return RecordLayout([self._layers[i].shape for i in self.paged_layers], self.paged_layers)

    # ------------------------------------------------------------------------------------------ page records
    def gather_records(self, page_ids: torch.Tensor, layout: RecordLayout, row_bytes: int | None = None) -> torch.Tensor:
        """uint8 ``[len(page_ids), row_bytes]`` on the pages' device: every byte of each page in every layer.

        ``row_bytes`` (default ``layout.record_bytes``) may be larger, e.g. a host slot's size; the rest is zero.
        """
        row_bytes = layout.record_bytes if row_bytes is None else row_bytes
        if row_bytes < layout.record_bytes:
            raise ValueError(f"row_bytes={row_bytes} is smaller than a page record ({layout.record_bytes} bytes)")
        records = torch.zeros(page_ids.numel(), row_bytes, dtype=torch.uint8, device=page_ids.device)
        for seg in layout.segments:
            tensor = getattr(self._layers[seg.layer], seg.name)
            raw = tensor.view(torch.uint8).reshape(self.num_pages, seg.nbytes) if tensor.dim() > 1 else \
                tensor.reshape(self.num_pages, 1).view(torch.uint8)
            records[:, seg.offset : seg.offset + seg.nbytes] = raw.index_select(0, page_ids)
        return records

    def scatter_records(self, page_ids: torch.Tensor, records: torch.Tensor, layout: RecordLayout) -> None:
        """Write ``records`` (uint8 ``[len(page_ids), record_bytes]``) into pages ``page_ids`` of every layer."""
        for seg in layout.segments:
            tensor = getattr(self._layers[seg.layer], seg.name)
            raw = tensor.view(torch.uint8).reshape(self.num_pages, seg.nbytes) if tensor.dim() > 1 else \
                tensor.reshape(self.num_pages, 1).view(torch.uint8)
            raw.index_copy_(0, page_ids, records[:, seg.offset : seg.offset + seg.nbytes])
