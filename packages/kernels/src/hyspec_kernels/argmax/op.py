"""`argmax_rows`: each row's argmax over the last dim, as torch.argmax picks it (first index of the largest
value, NaN largest), in two launches on a GPU: chunks of every row in parallel, then one small reduce per row.

torch's reduction reads a [128, 248320] bf16 logits block (a 9B verify of 32 x 4 tokens) at a fraction of the
bandwidth; the greedy choice of every decode step and verify is this op.
"""

from __future__ import annotations

from types import ModuleType

import torch

from hyspec_kernels._checks import FLOAT_DTYPES, Backend, implementation
from hyspec_kernels.argmax import reference, torch_impl


def _triton() -> ModuleType:
    # Imported on first use: under TRITON_INTERPRET the variable must be set before any @triton.jit runs.
    from hyspec_kernels.argmax import triton_kernel

    return triton_kernel


# torch.argmax takes fp64 too (the sampler's logits may be any float dtype): compared in fp64, not rounded
_DTYPES = (*FLOAT_DTYPES, torch.float64)


def argmax_rows(x: torch.Tensor, *, backend: Backend = "auto") -> torch.Tensor:
    """[..., V] float -> [...] int64, each row's first index of its largest value (NaN counts as largest)."""
    if not isinstance(x, torch.Tensor):
        raise ValueError(f"x: expected a tensor, got {type(x).__name__}")
    if x.dim() < 1 or x.shape[-1] == 0:
        raise ValueError(f"x: expected shape [..., V] with V >= 1, got {list(x.shape)}")
    if x.dtype not in _DTYPES:
        raise ValueError(f"x: expected a dtype in {[str(d) for d in _DTYPES]}, got {x.dtype}")
    fn = implementation(
        backend,
        x.device,
        reference=reference.argmax_rows_reference,
        torch_path=torch_impl.argmax_rows_torch,
        triton=lambda: _triton().argmax_rows_triton,
    )
    return fn(x)
