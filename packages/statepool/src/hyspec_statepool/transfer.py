"""Host-to-device copies of small index and metadata tensors that do not synchronise the stream.

Every copy is non-blocking: from pageable memory for small tensors, which the driver stages during the
call, and from pinned memory for large ones (`hyspec_kernels.transfer`, whose `pin_for` decides). Either
way the host tensor may be dropped, or changed, as soon as the copy is queued: pageable sources were staged,
and each pinned one is a fresh block that torch's caching host allocator keeps alive until the copy has run
(it is never written after the copy is queued).

`to_device` makes a new device tensor; `write_into` (and `host_staging` + `upload`, for callers that fill the
host tensor in place) write into the front of an existing device buffer instead, whose storage never changes:
what a CUDA graph captured against it reads.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from hyspec_kernels.transfer import pin_for, to_device

__all__ = ["host_staging", "pin_for", "to_device", "upload", "write_into"]


def host_staging(shape: Sequence[int], *, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """A fresh, uninitialised host tensor to fill and then `upload` to `device`: pinned when it is a large
    one bound for CUDA (`pin_for`).

    Fresh per call (cheap: the caching host allocator reuses pinned blocks once the copies that read them
    have run), never a persistent buffer: a pinned buffer refilled while an earlier non-blocking copy from it
    is still queued would hand that copy the new values.
    """
    nbytes = dtype.itemsize * int(torch.Size(tuple(shape)).numel())
    return torch.empty(tuple(shape), dtype=dtype, pin_memory=pin_for(nbytes, device))


def upload(staged: torch.Tensor, buffer: torch.Tensor) -> torch.Tensor:
    """`staged` (from `host_staging`, or a small one: `pin_for`; never written again if pinned) copied into
    the leading part of `buffer`.

    One non-blocking copy, so no stream sync on CUDA; a plain copy on the CPU. `buffer` keeps its storage (a
    CUDA graph captured against it reads the new values). Returns the written view of `buffer`.
    """
    view = _leading(buffer, staged.shape)
    if staged.numel():
        view.copy_(staged, non_blocking=True)
    return view


def write_into(
    buffer: torch.Tensor, values: torch.Tensor | Sequence[int] | Sequence[float] | Sequence[bool]
) -> torch.Tensor:
    """`values` written into the leading part of `buffer` without a stream sync; returns the written view.

    Host values (a sequence, or a CPU tensor, which the caller may change afterwards) go in one non-blocking
    copy (staged as `to_device` stages them); a tensor already on a device is copied there (a device op).
    """
    if isinstance(values, torch.Tensor) and values.device.type != "cpu":
        view = _leading(buffer, values.shape)
        view.copy_(values)
        return view
    if isinstance(values, torch.Tensor):
        # a pinned tensor of the caller's would be read when the copy runs, not now: copied first
        staged = values.to(buffer.dtype, copy=values.is_pinned())
    else:
        staged = torch.tensor(values, dtype=buffer.dtype)
    if pin_for(staged.numel() * buffer.dtype.itemsize, buffer.device):
        staged = staged.pin_memory()  # a fresh pinned copy, never written again
    return upload(staged, buffer)


def _leading(buffer: torch.Tensor, shape: Sequence[int]) -> torch.Tensor:
    """The view `buffer[:shape[0], :shape[1], ...]`, checked to hold `shape` whole."""
    if buffer.shape == shape:
        return buffer  # already the view (slicing costs a torch call)
    if len(shape) != buffer.dim() or any(s > b for s, b in zip(shape, buffer.shape, strict=True)):
        raise ValueError(f"buffer: expected room for {list(shape)} values, got shape {list(buffer.shape)}")
    return buffer[tuple(slice(0, s) for s in shape)]
