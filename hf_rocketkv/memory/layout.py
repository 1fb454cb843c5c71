"""Page geometry: the tensors one pool page holds in every layer, and their bytes.

Per layer and page (H KV heads, p = pool page_size tokens, q = kt_page_size, D head_dim):

    k, v      [H, p, D]          storage dtype (bfloat16 / float16 / float32 / float8_e4m3fn)
    kt        [H, p // q, 2, D]  KT dtype: min and max of the keys of each KT page (RocketKV stage 2)
    k_scale   [] or [H]          float32, fp8 storage only: one scale per page ("page") or per page and head ("head")
    v_scale   [] or [H]

A *page record* is those tensors for all layers, laid end to end as bytes: the unit copied to and from a host slot
and the unit a prefix file stores. Segment offsets are aligned to ``RECORD_ALIGN`` bytes so a byte view of a record
can be re-viewed as any of the dtypes above.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from ..kernels.fp8 import SCALE_DTYPE, SCALE_GRANULARITIES  # noqa: F401  (re-exported)
from .geometry import FP8_KV_DTYPE

RECORD_ALIGN = 16


def _align(n: int, to: int = RECORD_ALIGN) -> int:
    return -(-n // to) * to


@dataclass(frozen=True)
class LayerShape:
    """The page geometry of one layer (``num_kv_heads`` is what this layer's K/V actually have)."""

    num_kv_heads: int
    head_dim: int
    page_size: int
    kt_page_size: int
    kv_dtype: torch.dtype
    kt_dtype: torch.dtype
    scale_granularity: str  # "page" or "head"; only used when kv_dtype is fp8

    @property
    def is_fp8(self) -> bool:
        return self.kv_dtype == FP8_KV_DTYPE

    def page_tensors(self) -> dict[str, tuple[tuple[int, ...], torch.dtype]]:
        """Name -> (shape of one page's slice, dtype), in record order."""
        heads, dim = self.num_kv_heads, self.head_dim
        tensors = {
            "k": ((heads, self.page_size, dim), self.kv_dtype),
            "v": ((heads, self.page_size, dim), self.kv_dtype),
            "kt": ((heads, self.page_size // self.kt_page_size, 2, dim), self.kt_dtype),
        }
        if self.is_fp8:
            scale_shape = () if self.scale_granularity == "page" else (heads,)
            tensors["k_scale"] = (scale_shape, SCALE_DTYPE)
            tensors["v_scale"] = (scale_shape, SCALE_DTYPE)
        return tensors

    def bytes_per_page(self) -> int:
        """Device bytes of one page of this layer (K + V + KT + fp8 scales), no padding."""
        return sum(math.prod(shape) * dtype.itemsize for shape, dtype in self.page_tensors().values())


@dataclass(frozen=True)
class Segment:
    """Where one layer's tensor lies inside a page record."""

    layer: int
    name: str
    offset: int
    nbytes: int
    shape: tuple[int, ...]  # one page's slice
    dtype: torch.dtype


class RecordLayout:
    """Byte layout of a page record over the layers that hold pages (host slots, staging rows, prefix files).

    ``layers`` are those layers' indices in the model (default ``0 .. len(layer_shapes) - 1``); a hybrid model's pages
    span its full-attention layers only (``hybrid.py``), so its records hold those layers and no others.
    """

    def __init__(self, layer_shapes: list[LayerShape], layers: list[int] | tuple[int, ...] | None = None):
        self.layer_shapes = list(layer_shapes)
        self.layers = tuple(range(len(self.layer_shapes))) if layers is None else tuple(layers)
        if len(self.layers) != len(self.layer_shapes):
            raise ValueError(f"RecordLayout: {len(self.layer_shapes)} layer shapes for layers {self.layers}")
        segments = []
        offset = 0
        for layer, shape in zip(self.layers, self.layer_shapes):
            for name, (page_shape, dtype) in shape.page_tensors().items():
                nbytes = math.prod(page_shape) * dtype.itemsize
                segments.append(Segment(layer, name, offset, nbytes, page_shape, dtype))
                offset = _align(offset + nbytes)
        self.segments: tuple[Segment, ...] = tuple(segments)
        self.record_bytes = max(offset, RECORD_ALIGN)

    def unpack(self, records: torch.Tensor) -> dict[tuple[int, str], torch.Tensor]:
        """``records`` uint8 ``[n, record_bytes]`` -> {(layer, name): tensor ``[n, *page shape]``} (copies)."""
        n = records.shape[0]
        out = {}
        for seg in self.segments:
            raw = records[:, seg.offset : seg.offset + seg.nbytes].contiguous()
            out[(seg.layer, seg.name)] = raw.view(seg.dtype).reshape(n, *seg.shape)
        return out

    def pack(self, tensors: dict[tuple[int, str], torch.Tensor], n: int, device: torch.device | str = "cpu") -> torch.Tensor:
        """Inverse of :meth:`unpack`: uint8 ``[n, record_bytes]`` (alignment padding zeroed)."""
        records = torch.zeros(n, self.record_bytes, dtype=torch.uint8, device=device)
        for seg in self.segments:
            tensor = tensors[(seg.layer, seg.name)]
            if tuple(tensor.shape) != (n, *seg.shape) or tensor.dtype != seg.dtype:
                raise ValueError(
                    f"page tensor layer {seg.layer} {seg.name}: expected shape {(n, *seg.shape)} {seg.dtype}, "
                    f"got {tuple(tensor.shape)} {tensor.dtype}"
                )
            records[:, seg.offset : seg.offset + seg.nbytes] = tensor.reshape(n, -1).contiguous().view(torch.uint8).reshape(n, -1)
        return records


def pool_sizes(planned: LayerShape, num_layers: int, max_gpu_bytes: int, host_bytes: int) -> tuple[int, int, int, int]:
    """``(bytes_per_page, num_pages, slot_bytes, num_slots)`` of a pool whose ``num_layers`` paged layers (every
    layer, or a hybrid model's full-attention ones) all have the ``planned`` shape: a device page counts those
    layers' tensors; a host slot holds one page record of the same layers (segments aligned)."""
    bytes_per_page = planned.bytes_per_page() * num_layers
    num_pages = max_gpu_bytes // bytes_per_page
    if num_pages < 1:
        raise ValueError(
            f"KVBlockPool.max_gpu_bytes={max_gpu_bytes} holds no page: one page of {planned.page_size} tokens takes "
            f"{bytes_per_page} bytes over {num_layers} layers"
        )
    slot_bytes = RecordLayout([planned] * num_layers).record_bytes
    num_slots = host_bytes // slot_bytes
    if host_bytes and num_slots < 1:
        raise ValueError(f"KVBlockPool.host_bytes={host_bytes} holds no page: one host slot takes {slot_bytes} bytes")
    return bytes_per_page, num_pages, slot_bytes, num_slots
