"""Small host lists as device tensors without a host-device synchronisation.

``torch.tensor(values, device="cuda")`` copies from pageable host memory, and CUDA synchronises the stream before
such a copy: on a prefill path that builds a block table or a lengths vector once per layer, each of those waits for
the GPU to drain (an idle bubble while the host then launches the next kernels). A pinned staging tensor copied with
``non_blocking=True`` does not wait; PyTorch's pinned-memory allocator keeps the staging block alive until the copy
has run, so the host list can be dropped at once.
"""

from __future__ import annotations

import torch


def device_tensor(values, dtype: torch.dtype, device: torch.device | str) -> torch.Tensor:
    """``torch.tensor(values, dtype=dtype, device=device)`` without waiting for the device (CUDA: pinned staging
    and an asynchronous copy; other devices: the plain constructor)."""
    device = torch.device(device)
    if device.type != "cuda":
        return torch.tensor(values, dtype=dtype, device=device)
    return torch.tensor(values, dtype=dtype, pin_memory=True).to(device, non_blocking=True)


def filled(batch: int, values: list[int], dtype: torch.dtype, device: torch.device | str) -> torch.Tensor:
    """``[batch]`` tensor of ``values`` (one per row): a fill kernel when every row has the same value (no copy at
    all), else ``device_tensor``."""
    if len(set(values)) == 1:
        return torch.full((batch,), values[0], dtype=dtype, device=device)
    return device_tensor(values, dtype, device)
