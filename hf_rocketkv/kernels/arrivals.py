"""Arrival counters: the last program of a group finishes the group's work in the same launch.

A two-pass kernel pair (each program writes a partial result, then a second launch combines the partials of its
group) can run as one launch when the group's last program to finish does the combining: each program writes its
partial, then counts itself in on its group's counter; the program that brings the count to the group size has
every partial of its group visible and combines them. The decode step's page selection (chunk lists, then their
merge: ``select_pages.py``) and its sparse attention (splits, then their log-sum-exp combine:
``sparse_decode_attention.py``) take this form, one launch fewer each per layer and step. A sliding-window layer's
ring attention does not: its last split combining the others made Gemma-3-12B's step slower (docs/kernels.md).

    counters   int32 [>= groups], contiguous, on the kernels' device; every entry 0 before a launch, and the launch
               leaves it 0 (the last program resets its group's entry), so one buffer serves launch after launch,
               CUDA-graph replays included, without a memset.

The caller owns the buffer through an ``ArrivalCounters`` (a compressed layer has one: made at its first decode step
outside any capture, or reserved for the engine's widest bucket, and never replaced, so a captured graph's pointer
stays valid); the launchers check its shape
(``check_counters``) and take the two-launch form when given None.

Memory order (PTX): a program's threads meet at a barrier after writing its partial, then one thread adds 1 with
acquire-release semantics at GPU scope; the program that reads ``group - 1`` has acquired every earlier program's
release, and it reads the partials with ``.cg`` loads (L2, never a stale L1 line). Under Triton's interpreter the
programs run one after another, so the last program in launch order combines.
"""

from __future__ import annotations

import torch

# Whether callers get counters at all (``ArrivalCounters.get`` answers None when off, the two-launch form everywhere).
# A module constant for A/B runs: benchmarks set it False to time the two-launch form.
ENABLED = True


class ArrivalCounters:
    """One caller's counters, made once and then kept (a captured step holds their address): ``get`` makes the zeroed
    buffer at its first call outside a CUDA-graph capture (``reserve``: ahead, for the widest batch a caller will
    ask for) and returns it. None, the two-launch form: with ``ENABLED`` off, under torch.compile (the registered ops
    take no counters), while only a capture has asked (it would record the zero fill), or for more entries than the
    buffer holds."""

    __slots__ = ("buffer",)

    def __init__(self) -> None:
        self.buffer: torch.Tensor | None = None  # int32 [entries]

    def reserve(self, entries: int, device: torch.device) -> None:
        self.buffer = torch.zeros(entries, dtype=torch.int32, device=device)

    def get(self, entries: int, device: torch.device) -> torch.Tensor | None:
        if not ENABLED or torch.compiler.is_compiling():
            return None
        if self.buffer is None:
            if device.type == "cuda" and torch.cuda.is_current_stream_capturing():
                return None
            self.reserve(entries, device)
        return self.buffer if self.buffer.numel() >= entries else None


try:  # triton is optional: ArrivalCounters and check_counters serve without it
    import triton
    import triton.language as tl

    @triton.jit
    def last_arrival(counter_ptr, group_size):
        """Whether this program is the last of the ``group_size`` programs counting in on ``counter_ptr``; the last
        one sees every other program's stores made before its count and resets the counter to 0."""
        tl.debug_barrier()  # every thread's partial is written before the count below releases it
        arrived = tl.atomic_add(counter_ptr, 1, sem="acq_rel", scope="gpu")
        last = arrived == group_size - 1
        if last:
            tl.atomic_xchg(counter_ptr, 0, sem="relaxed", scope="gpu")
        return last
except ImportError:
    triton = None


def check_counters(counters: torch.Tensor | None, groups: int, device: torch.device, op: str) -> None:
    """ValueError unless ``counters`` is None or an int32 tensor of at least ``groups`` contiguous entries on
    ``device`` (the module docstring's contract; that its entries are 0 is the owner's invariant, not checked here:
    that would cost a device sync)."""
    if counters is None:
        return
    if (not isinstance(counters, torch.Tensor) or counters.dtype != torch.int32 or not counters.is_contiguous()
            or counters.numel() < groups or counters.device != device):
        got = (f"{counters.dtype} {list(counters.shape)} on {counters.device}" if isinstance(counters, torch.Tensor)
               else type(counters).__name__)
        raise ValueError(f"{op}: counters must be None or a contiguous int32 tensor of at least {groups} entries "
                         f"(one per row and KV head) on {device}, got {got}")
