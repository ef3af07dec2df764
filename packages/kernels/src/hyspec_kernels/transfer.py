"""Host values to a CUDA tensor without synchronising the stream (one implementation for every package).

A blocking copy to CUDA waits until everything queued before it has run. A `non_blocking=True` copy does not:
- from pageable memory, the driver copies the source into its own staging memory during the call and
  queues the transfer, so the call returns at once and the source may change right after (measured on an
  H200: about 15 us per small copy, and one copy behind 430 ms of queued work returned in 0.1 ms);
- from pinned (page-locked) memory it is only queued, and torch's caching host allocator keeps the block
  alive until the copy has run (each call pins a fresh block: about 45 us per small copy, 3x the above).
So small copies (at most `PAGEABLE_COPY_MAX_BYTES`, a round's metadata) go from pageable memory, and larger
ones, for which the driver's staging could wait on the stream, through pinned memory (`pin_for`).
`hyspec_statepool.transfer` re-exports these beside its buffer writers.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

# the largest host-to-device copy made from pageable memory (module docstring); larger ones are pinned
PAGEABLE_COPY_MAX_BYTES = 16 * 1024


def pin_for(nbytes: int, device: torch.device) -> bool:
    """Whether a host tensor of `nbytes` bytes, copied to `device` without blocking, is staged in pinned
    memory: on CUDA above `PAGEABLE_COPY_MAX_BYTES` (module docstring), never elsewhere."""
    return device.type == "cuda" and nbytes > PAGEABLE_COPY_MAX_BYTES


def to_device(
    values: torch.Tensor | Sequence[int] | Sequence[float] | Sequence[Sequence[int]],
    *,
    dtype: torch.dtype,
    device: torch.device,
) -> torch.Tensor:
    """`values` as a `dtype` tensor on `device`; host values go to CUDA without a stream sync (pinned memory
    for large ones, `pin_for`).

    A tensor already on `device`, or any copy that does not go from the CPU to CUDA, is a plain `.to`, so
    the result may be `values` itself: treat it as read-only.
    """
    if isinstance(values, torch.Tensor):
        if values.device.type != "cpu" or device.type != "cuda":
            return values.to(device, dtype)
        if values.numel() == 0:
            return torch.empty(values.shape, dtype=dtype, device=device)  # nothing to copy
        if not pin_for(values.numel() * dtype.itemsize, device):
            # staged by the driver during the call; a pinned source would be read when the copy runs: copied
            return values.to(dtype, copy=values.is_pinned()).to(device, non_blocking=True)
        staged = torch.empty(values.shape, dtype=dtype, pin_memory=True)  # fresh, even if values is pinned
        staged.copy_(values)
    elif device.type != "cuda":
        return torch.tensor(values, dtype=dtype, device=device)
    elif len(values) == 0:
        return torch.empty(0, dtype=dtype, device=device)  # nothing to copy
    else:
        staged = torch.tensor(values, dtype=dtype)
        if pin_for(staged.numel() * dtype.itemsize, device):
            staged = staged.pin_memory()
    return staged.to(device, non_blocking=True)
