"""Host-to-device copies of small index and metadata tensors that do not synchronise the stream.

Copying a pageable host tensor to CUDA makes the host wait until the copy has run, and so until everything
queued before it has run: a step's metadata copies would each wait for the previous step's GPU work. A copy
from pinned (page-locked) memory with `non_blocking=True` is only queued. torch's caching host allocator
records the copy on the stream and keeps the pinned block alive until it has run, so the source may be
dropped at once; it is never written after the copy is queued (each call pins a fresh block).

`to_device` makes a new device tensor; `write_into` (and `host_staging` + `upload`, for callers that fill the
host tensor in place) write into the front of an existing device buffer instead, whose storage never changes:
what a CUDA graph captured against it reads.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from hyspec_kernels.transfer import to_device

__all__ = ["host_staging", "to_device", "upload", "write_into"]


def host_staging(shape: Sequence[int], *, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """A fresh, uninitialised host tensor to fill and then `upload` to `device`: pinned when it is CUDA.

    Fresh per call (cheap: the caching host allocator reuses blocks once the copies that read them have run),
    never a persistent buffer: a buffer refilled while an earlier non-blocking copy from it is still queued
    would hand that copy the new values.
    """
    return torch.empty(tuple(shape), dtype=dtype, pin_memory=device.type == "cuda")


def upload(staged: torch.Tensor, buffer: torch.Tensor) -> torch.Tensor:
    """`staged` (from `host_staging`, not written again) copied into the leading part of `buffer`.

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

    Host values (a sequence, or a CPU tensor, which is copied so the caller may change it afterwards) go
    through a fresh pinned tensor on CUDA; a tensor already on a device is copied there (a device op).
    """
    if isinstance(values, torch.Tensor) and values.device.type != "cpu":
        view = _leading(buffer, values.shape)
        view.copy_(values)
        return view
    pin = buffer.device.type == "cuda"
    if isinstance(values, torch.Tensor):
        staged = torch.empty(values.shape, dtype=buffer.dtype, pin_memory=pin)
        staged.copy_(values)
    else:
        staged = torch.tensor(values, dtype=buffer.dtype, pin_memory=pin)
    return upload(staged, buffer)


def _leading(buffer: torch.Tensor, shape: Sequence[int]) -> torch.Tensor:
    """The view `buffer[:shape[0], :shape[1], ...]`, checked to hold `shape` whole."""
    if buffer.shape == shape:
        return buffer  # already the view (slicing costs a torch call)
    if len(shape) != buffer.dim() or any(s > b for s, b in zip(shape, buffer.shape, strict=True)):
        raise ValueError(f"buffer: expected room for {list(shape)} values, got shape {list(buffer.shape)}")
    return buffer[tuple(slice(0, s) for s in shape)]
