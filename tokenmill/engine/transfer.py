"""A step's host inputs to the device in one transfer.

The runner and the sampler build a step's inputs (token ids, positions, slots, lengths, block tables, penalty
indices) as numpy arrays on the host. On the CPU they become tensors without a copy. On CUDA, one small copy per
array would cost a launch and a pageable-memory staging each (a dozen per step, 5-20 us apiece), so they are
packed into one pinned buffer, moved with one non-blocking copy, and viewed back as typed tensors on the device.
Pinned buffers come from torch's caching host allocator, which keeps a buffer until its copy has run."""
from __future__ import annotations

import numpy as np
import torch

ALIGN = 16  # bytes: every array starts at a multiple, so each typed view of the device buffer is aligned


def to_device(arrays: list[np.ndarray], device: torch.device) -> list[torch.Tensor]:
    """The arrays as tensors on device (same dtypes and shapes)."""
    arrays = [np.ascontiguousarray(a) for a in arrays]
    if device.type == "cpu":
        return [torch.from_numpy(a) for a in arrays]
    offsets, total = [], 0
    for a in arrays:
        offsets.append(total)
        total += -(-a.nbytes // ALIGN) * ALIGN
    host = torch.empty(max(total, ALIGN), dtype=torch.uint8, pin_memory=True)
    staging = host.numpy()
    for a, off in zip(arrays, offsets):
        staging[off:off + a.nbytes] = a.reshape(-1).view(np.uint8)
    dev = host.to(device, non_blocking=True)
    return [dev[off:off + a.nbytes].view(torch.from_numpy(a[:0].reshape(-1)).dtype).view(a.shape)
            for a, off in zip(arrays, offsets)]
