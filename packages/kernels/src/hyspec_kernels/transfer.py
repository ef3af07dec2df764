"""Host values to a CUDA tensor without synchronising the stream (one implementation for every package).

Copying a pageable host tensor to CUDA makes the host wait until the copy has run, and so until everything
queued before it has run. A copy from pinned (page-locked) memory with `non_blocking=True` is only queued;
torch's caching host allocator records the copy on the stream and keeps the pinned block alive until it has
run, so the source may be dropped at once (each call pins a fresh block). `hyspec_statepool.transfer`
re-exports `to_device` beside its buffer writers.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch


def to_device(
    values: torch.Tensor | Sequence[int] | Sequence[float] | Sequence[Sequence[int]],
    *,
    dtype: torch.dtype,
    device: torch.device,
) -> torch.Tensor:
    """`values` as a `dtype` tensor on `device`; host values go to CUDA through pinned memory, without a sync.

    A tensor already on `device`, or any copy that does not go from the CPU to CUDA, is a plain `.to`, so
    the result may be `values` itself: treat it as read-only.
    """
    if isinstance(values, torch.Tensor):
        if values.device.type != "cpu" or device.type != "cuda":
            return values.to(device, dtype)
        if values.numel() == 0:
            return torch.empty(values.shape, dtype=dtype, device=device)  # nothing to copy
        pinned = torch.empty(values.shape, dtype=dtype, pin_memory=True)  # fresh, even if values is pinned
        pinned.copy_(values)
    elif device.type != "cuda":
        return torch.tensor(values, dtype=dtype, device=device)
    elif len(values) == 0:
        return torch.empty(0, dtype=dtype, device=device)  # nothing to copy
    else:
        pinned = torch.tensor(values, dtype=dtype, pin_memory=True)
    return pinned.to(device, non_blocking=True)
