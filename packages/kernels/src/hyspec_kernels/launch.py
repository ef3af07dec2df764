"""Programmatic dependent launch (PDL): on Hopper and later GPUs a kernel is launched, and its programs set
up, while the kernel before it in the stream finishes; they wait on the device for that kernel's writes.

A decode step is hundreds of small kernels back to back (projections, norms, gating, conv, recurrence and
attention steps), replayed from a CUDA graph. Without PDL each one's launch begins only once the one before it
has finished and flushed its writes. `HYSPEC_PDL` picks the mode; outputs are bit-identical in every mode
(benchmarks/results/nvidia-h200-pdl.md: an H200, hyspec's kernels in a 32-layer MLP stack and the 9B-shaped
decode step against the tree without PDL):
- `0` (the default): off. Neither mode below is faster at every batch size yet.
- `wait`: kernels launch with PDL and wait at their start; the next one is released when this one's
  programs exit. MLP stack 1.006-1.027x at 1, 8 and 32 tokens a step; 9B decode step 1.01-1.04x at batch 1,
  1.02-1.08x at 32, but 0.96-0.97x at 8 (two runs).
- `early`: each kernel also releases the next one as it starts, so the next one's programs are resident and
  waiting while this one runs. MLP stack 1.035-1.099x at one token a step, 0.80-0.94x at 8 and 32 (the
  projections there are tensor-core kernels with large shared-memory tiles); 9B decode step 1.02-1.03x at
  batch 1, 0.89-0.90x at 8, 0.91-0.93x at 32.
- `mixed`: as `early`, except that the heavy kernels (tensor-core tiles in shared memory: the projections of
  2 or more rows, paged attention, GDN's chunked prefill; their launches pass `heavy=True`) release the next
  one only as they exit, as in `wait`: the programs waiting behind a kernel are those of a heavy one, not
  programs that would hold shared memory a heavy one is using. 9B decode step 1.01-1.03x at batch 1, but
  0.96-0.98x at 8 and 0.98-1.01x at 32 (two rounds in one call): most of `early`'s batch-8 loss stays.

The contract, checked on every kernel's source by `tests/test_pdl.py`: every hyspec Triton kernel takes a
`PDL: tl.constexpr` and starts with `wait_for_inputs(PDL)` before it touches memory, and every launch passes
`**pdl_args(device)`. A kernel launched with PDL that read or wrote memory before its wait would race with
the kernel before it. Kernels that are not Triton's (torch's, cuBLAS's) launch as usual; a Triton kernel
after one of them simply starts when it ends.
"""

from __future__ import annotations

import functools
import os

import torch
import triton
import triton.language as tl
from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait


@triton.jit  # type: ignore[untyped-decorator]
def wait_for_inputs(PDL: tl.constexpr):  # type: ignore[no-untyped-def]
    """The first statement of every hyspec kernel (PDL: 0 off, 1 wait, 2 release the next kernel and wait)."""
    if PDL == 2:
        # the next kernel may begin launching now (its programs wait at their own wait_for_inputs) ...
        gdc_launch_dependents()
    if PDL:
        # ... and this one touches no memory before the previous kernel's writes are visible
        gdc_wait()


@functools.cache
def _supported(index: int) -> bool:
    return torch.cuda.get_device_capability(index)[0] >= 9  # griddepcontrol is Hopper's (sm_90) and later


# mode -> (PDL level of a kernel, of a heavy one)
_LEVELS = {"0": (0, 0), "wait": (1, 1), "early": (2, 2), "mixed": (2, 1)}
DEFAULT_MODE = "0"


def pdl_args(device: torch.device, *, heavy: bool = False) -> dict[str, int | bool]:
    """The launch arguments of a hyspec kernel on `device`: `PDL` (its constexpr) and `launch_pdl`. `heavy`:
    the kernel runs tensor-core tiles in shared memory (`mixed` mode then releases the next kernel at its
    exit only)."""
    level = 0
    if device.type == "cuda" and _supported(
        device.index if device.index is not None else torch.cuda.current_device()
    ):
        mode = os.environ.get("HYSPEC_PDL", DEFAULT_MODE)
        if mode not in _LEVELS:
            raise ValueError(f"HYSPEC_PDL: expected one of {sorted(_LEVELS)}, got {mode!r}")
        level = _LEVELS[mode][heavy]
    return {"PDL": level, "launch_pdl": level > 0}
