"""Host offload: one host buffer of page slots, and the copies between device pages and host slots.

HostBuffer   ``num_slots`` rows of ``slot_bytes`` in ONE host allocation of exactly ``num_slots * slot_bytes`` bytes.
             With CUDA it is pinned in place with ``cudaHostRegister`` (torch's ``pin_memory=True`` goes through the
             caching host allocator, which rounds a request up to a power of two); if registration fails it falls
             back to ``pin_memory=True``, then to pageable memory, with a warning each time (pinning only buys
             bandwidth). Without CUDA it is plain memory, no warning.
CopyEngine   moves page records (every byte of a page in every layer: K, V, KT, fp8 scales) between device pages and
             host slots. On CUDA the copies run on a dedicated stream that first waits for the events the pool
             recorded when those pages were last released (so their last writes, and their previous users' reads,
             come first), and each batch of copies ends with an event that the pool keeps on every physical page
             and slot it touches until the event completes. Without CUDA copies
             are synchronous and return no event.

Copies go through a device staging tensor of at most ``chunk_pages`` records (allocated on the copy stream, outside
``max_gpu_bytes``), so a slot is one contiguous host row and a batch of consecutive slots is one ``cudaMemcpyAsync``.
"""

from __future__ import annotations

import time
import warnings
import weakref
from collections.abc import Sequence

import torch

from .layout import RecordLayout
from .storage import PageStorage


def _unregister(data_ptr: int, keep_alive: torch.Tensor) -> None:
    try:
        torch.cuda.cudart().cudaHostUnregister(data_ptr)
    except Exception:  # noqa: BLE001 - interpreter shutdown: nothing left to do
        pass
    del keep_alive


class HostBuffer:
    def __init__(self, num_slots: int, slot_bytes: int):
        self.num_slots = num_slots
        self.slot_bytes = slot_bytes
        self.register_seconds = 0.0
        size = num_slots * slot_bytes
        if not torch.cuda.is_available():
            self.pinning = "none (no CUDA)"
            flat = torch.zeros(size, dtype=torch.uint8)
        else:
            flat, self.pinning = self._pinned(size)
        self.slots = flat.view(num_slots, slot_bytes)

    def _pinned(self, size: int) -> tuple[torch.Tensor, str]:
        flat = torch.empty(size, dtype=torch.uint8)
        start = time.perf_counter()
        try:
            error = int(torch.cuda.cudart().cudaHostRegister(flat.data_ptr(), size, 0))
        except Exception as err:  # noqa: BLE001 - any failure means: not registered
            error = repr(err)
        self.register_seconds = time.perf_counter() - start
        if error == 0:
            self._finalizer = weakref.finalize(self, _unregister, flat.data_ptr(), flat)
            return flat, "cudaHostRegister"
        warnings.warn(
            f"KVBlockPool: cudaHostRegister of the {size} byte host buffer failed ({error}); falling back to "
            f"pin_memory=True (may round the allocation up to a power of two)",
            RuntimeWarning,
            stacklevel=4,
        )
        try:
            return torch.empty(size, dtype=torch.uint8, pin_memory=True), "pin_memory"
        except RuntimeError as err:
            warnings.warn(
                f"KVBlockPool: pinning the {size} byte host buffer failed ({err}); using pageable memory "
                f"(host offload will be slower)",
                RuntimeWarning,
                stacklevel=4,
            )
            return flat, "pageable"

    def close(self) -> None:
        finalizer = getattr(self, "_finalizer", None)
        if finalizer is not None:
            finalizer()


def _device_ids(ids: Sequence[int], device: torch.device) -> torch.Tensor:
    """An int64 index tensor on ``device``; on CUDA copied from pinned memory without blocking the host."""
    ids = torch.tensor(list(ids), dtype=torch.long)
    if device.type != "cuda":
        return ids.to(device)
    return ids.pin_memory().to(device, non_blocking=True)


def _runs(slots: Sequence[int]) -> list[tuple[int, int, int]]:
    """``(first row, first slot, count)`` for each run of consecutive slots."""
    runs = []
    row = 0
    while row < len(slots):
        end = row + 1
        while end < len(slots) and slots[end] == slots[end - 1] + 1:
            end += 1
        runs.append((row, slots[row], end - row))
        row = end
    return runs


class CopyEngine:
    def __init__(self, host: HostBuffer, chunk_pages: int = 64):
        self.host = host
        self.chunk_pages = chunk_pages
        self._streams: dict[torch.device, torch.cuda.Stream] = {}

    def stream(self, device: torch.device) -> "torch.cuda.Stream | None":
        if device.type != "cuda":
            return None
        if device not in self._streams:
            self._streams[device] = torch.cuda.Stream(device=device)
        return self._streams[device]

    def _chunks(self, page_ids: Sequence[int], slots: Sequence[int]):
        for first in range(0, len(page_ids), self.chunk_pages):
            yield page_ids[first : first + self.chunk_pages], slots[first : first + self.chunk_pages]

    def offload(self, storage: PageStorage, layout: RecordLayout, page_ids: Sequence[int], slots: Sequence[int],
                wait_for: Sequence = ()):
        """Copy device pages ``page_ids`` into host slots ``slots`` once the ``wait_for`` events (the pages' last
        writes) have completed; returns the completion event (None on CPU)."""
        device = storage.device()
        stream = self.stream(device)
        if stream is None:
            for chunk_pages, chunk_slots in self._chunks(page_ids, slots):
                ids = _device_ids(chunk_pages, device)
                records = storage.gather_records(ids, layout, row_bytes=self.host.slot_bytes)
                self.host.slots[torch.tensor(chunk_slots, dtype=torch.long)] = records
            return None
        for event in wait_for:  # the pages' last writes land first
            stream.wait_event(event)
        with torch.cuda.stream(stream):
            for chunk_pages, chunk_slots in self._chunks(page_ids, slots):
                ids = _device_ids(chunk_pages, device)
                records = storage.gather_records(ids, layout, row_bytes=self.host.slot_bytes)
                for row, slot, count in _runs(chunk_slots):
                    self.host.slots[slot : slot + count].copy_(records[row : row + count], non_blocking=True)
            event = torch.cuda.Event()
            event.record(stream)
        return event

    def onload(self, storage: PageStorage, layout: RecordLayout, slots: Sequence[int], page_ids: Sequence[int],
               wait_for: Sequence = ()):
        """Copy host slots ``slots`` into device pages ``page_ids`` once the ``wait_for`` events (the pages' previous
        users) have completed; returns the completion event (None on CPU). The caller makes the compute stream
        wait for it before anything reads those pages."""
        device = storage.device()
        stream = self.stream(device)
        if stream is None:
            for chunk_pages, chunk_slots in self._chunks(page_ids, slots):
                records = self.host.slots[torch.tensor(chunk_slots, dtype=torch.long)]
                storage.scatter_records(_device_ids(chunk_pages, device), records, layout)
            return None
        for event in wait_for:  # earlier users of the target pages are done
            stream.wait_event(event)
        with torch.cuda.stream(stream):
            for chunk_pages, chunk_slots in self._chunks(page_ids, slots):
                records = torch.empty(len(chunk_pages), self.host.slot_bytes, dtype=torch.uint8, device=device)
                for row, slot, count in _runs(chunk_slots):
                    records[row : row + count].copy_(self.host.slots[slot : slot + count], non_blocking=True)
                ids = _device_ids(chunk_pages, device)
                storage.scatter_records(ids, records, layout)
            event = torch.cuda.Event()
            event.record(stream)
        return event

    def read_slots(self, layout: RecordLayout, slots: Sequence[int]) -> torch.Tensor:
        """CPU uint8 ``[len(slots), record_bytes]`` copies of host slots (the caller has waited for their copies)."""
        return self.host.slots[torch.tensor(list(slots), dtype=torch.long)][:, : layout.record_bytes].clone()
