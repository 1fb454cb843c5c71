"""SlidingSlab: the ring storage of a hybrid model's sliding-window layers, one fixed slab allocated with the pool.

A sliding layer attends only to its last ``window`` tokens, so a request needs exactly ``window`` token slots there,
however long its prompt and its generation: no pages, no scores, no prefix. The pool gives each admitted row one
*slot*: in every sliding layer ``l`` the slab holds

    k, v    [num_slots, Hkv, window_l, D]    slab dtype (the pool's; the model's under fp8 pages, hybrid.py), allocated
                                             on first use (like the page tensors)

and slot ``s`` is row ``[s]`` of every one of them (logical position ``p`` of the row lives at ``[s, :, p % window]``,
``cache/sliding_layer.py``). The tensors never move, so a decode step captured as a CUDA graph reads them through a
static tensor of slot ids, and rows join and leave by writing their slot id there.

Slots are counted exactly like pages (``core.py``): a free list (lowest id first), a reserved count set aside by
reservations, ``SlotLease`` objects that a request holds and gives back once. Bytes of one slot:
``sum over sliding layers of 2 * Hkv * window_l * D * itemsize``.
"""

from __future__ import annotations

import heapq

import torch

from .errors import PoolStateError


class SlotLease:
    """One row's slot (``index``), held until released (``KVBlockPool.release`` or ``release_later``)."""

    __slots__ = ("index", "released")

    def __init__(self, index: int):
        self.index = index
        self.released = False

    def end(self) -> None:
        """The slot went back to the slab (``SlidingSlab.release``)."""
        self.released = True

    def __repr__(self) -> str:
        return f"SlotLease({self.index}{', released' if self.released else ''})"


class SlidingSlab:
    """``num_slots`` ring slots over the sliding layers ``windows`` (layer index -> window)."""

    def __init__(self, windows: dict[int, int], num_slots: int, num_kv_heads: int, head_dim: int,
                 dtype: torch.dtype):
        self.windows = dict(windows)
        self.num_slots = num_slots
        self.num_kv_heads, self.head_dim, self.dtype = num_kv_heads, head_dim, dtype
        self._free = list(range(num_slots))  # a heap: the lowest free id first
        self.reserved = 0
        self._tensors: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}

    # ------------------------------------------------------------------------------------------ sizes
    @staticmethod
    def slot_bytes(windows: dict[int, int], num_kv_heads: int, head_dim: int, dtype: torch.dtype) -> int:
        """Bytes of one slot over every sliding layer: K and V of ``window`` tokens each."""
        return sum(2 * num_kv_heads * window * head_dim * dtype.itemsize for window in windows.values())

    @property
    def bytes_per_slot(self) -> int:
        return self.slot_bytes(self.windows, self.num_kv_heads, self.head_dim, self.dtype)

    def free_count(self) -> int:
        return len(self._free)

    def available(self, reservation=None) -> int:
        """Free slots an admission may take: all free ones less the reserved, plus its own reservation's."""
        return len(self._free) - self.reserved + (reservation.slots if reservation is not None else 0)

    def free_ids(self) -> list[int]:
        return sorted(self._free)

    # ------------------------------------------------------------------------------------------ taking, giving back
    def take(self, count: int) -> list[SlotLease]:
        """``count`` slots, lowest ids first (the caller checked ``count <= available``)."""
        return [SlotLease(heapq.heappop(self._free)) for _ in range(count)]

    def release(self, lease: SlotLease) -> None:
        if not isinstance(lease, SlotLease):
            raise TypeError(f"release expects a SlotLease, got {type(lease).__name__}")
        if lease.released:
            return
        if lease.index in self._free:
            raise PoolStateError(f"sliding slot {lease.index} released more often than taken")
        lease.end()
        heapq.heappush(self._free, lease.index)

    def set_aside(self, slots: int) -> None:
        """``slots`` more (or, negative, fewer) slots reserved for admitted requests."""
        self.reserved += slots

    # ------------------------------------------------------------------------------------------ tensors
    def bind(self, layer_idx: int, num_kv_heads: int, head_dim: int, device: torch.device
             ) -> tuple[torch.Tensor, torch.Tensor]:
        """Layer ``layer_idx``'s ``(k, v)`` slab ``[num_slots, Hkv, window, D]``, allocated on first use."""
        if layer_idx not in self.windows:
            raise ValueError(f"KVBlockPool: layer {layer_idx} is not a sliding-window layer (sliding layers: "
                             f"{sorted(self.windows)})")
        if head_dim != self.head_dim or num_kv_heads > self.num_kv_heads:
            raise ValueError(
                f"KVBlockPool sliding layer {layer_idx}: key_states have {num_kv_heads} KV heads of {head_dim}, the "
                f"slab was planned for {self.num_kv_heads} heads of {self.head_dim}")
        existing = self._tensors.get(layer_idx)
        if existing is not None:
            if existing[0].shape[1] != num_kv_heads or existing[0].device != torch.device(device):
                raise ValueError(f"KVBlockPool sliding layer {layer_idx} holds {existing[0].shape[1]} KV heads on "
                                 f"{existing[0].device}; got {num_kv_heads} on {device}")
            return existing
        shape = (self.num_slots, num_kv_heads, self.windows[layer_idx], head_dim)
        tensors = (torch.zeros(shape, dtype=self.dtype, device=device),
                   torch.zeros(shape, dtype=self.dtype, device=device))
        self._tensors[layer_idx] = tensors
        return tensors

    def allocated_bytes(self) -> int:
        """Bytes of the slab tensors allocated so far."""
        return sum(t.untyped_storage().nbytes() for pair in self._tensors.values() for t in pair)
