"""Validated wrapper of `linear`: y = x @ weight.T (+ bias), as `torch.nn.functional.linear`.

Every projection of the models runs through it (`hyspec_models.layers.Linear`). On CUDA, bf16 and fp16
products of at most `MAX_SKINNY_ROWS` rows (decode steps, small verify blocks; the same in CUDA graphs and
eagerly, so a replay equals an eager run bit for bit) take the Triton kernels, which read the weight
closer to the memory bandwidth than cuBLAS does at these shapes; everything else is torch's GEMM. The
checks read only metadata: this runs for every projection of an eager step.
"""

from __future__ import annotations

import torch

from hyspec_kernels._checks import FLOAT_DTYPES, Backend, resolve_backend
from hyspec_kernels.linear import reference, torch_impl

# Rows up to which the Triton kernels run (a 32-row tile at most; measured faster than cuBLAS up to here)
MAX_SKINNY_ROWS = 32
_AUTO_DTYPES = (torch.bfloat16, torch.float16)  # fp32 stays on torch's GEMM (and its TF32 settings)


def _needs_grad(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> bool:
    if not torch.is_grad_enabled():
        return False
    return x.requires_grad or weight.requires_grad or (bias is not None and bias.requires_grad)


def linear(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None = None,
    *,
    backend: Backend = "auto",
) -> torch.Tensor:
    """x [.., K], weight [N, K], bias [N] or None (all one dtype and device) -> [.., N] in x's dtype.

    `backend="triton"` takes at most MAX_SKINNY_ROWS rows of fp32, bf16 or fp16; `"auto"` picks it on CUDA
    for bf16 / fp16 inputs of at most that many rows and torch's GEMM otherwise (fp64 included, and
    whenever autograd records: the kernels have no backward)."""
    if not isinstance(x, torch.Tensor) or x.dim() < 1:
        raise ValueError(f"x: expected a tensor [.., K], got {getattr(x, 'shape', type(x).__name__)}")
    if not isinstance(weight, torch.Tensor) or weight.dim() != 2:
        raise ValueError(
            f"weight: expected a tensor [N, K], got {getattr(weight, 'shape', type(weight).__name__)}"
        )
    n, k = weight.shape
    if x.shape[-1] != k:
        raise ValueError(f"x: expected shape [.., {k}] (weight's in_features), got {list(x.shape)}")
    if not x.dtype.is_floating_point:
        raise ValueError(f"x: expected a floating dtype, got {x.dtype}")
    if weight.dtype != x.dtype:
        raise ValueError(f"weight: expected x's dtype {x.dtype}, got {weight.dtype}")
    if weight.device != x.device:
        raise ValueError(f"weight: expected x's device {x.device}, got {weight.device}")
    if bias is not None and (
        not isinstance(bias, torch.Tensor)
        or tuple(bias.shape) != (n,)
        or bias.dtype != x.dtype
        or bias.device != x.device
    ):
        raise ValueError(
            f"bias: expected None or a [{n}] tensor of x's dtype and device, got "
            f"{getattr(bias, 'shape', type(bias).__name__)} {getattr(bias, 'dtype', '')}"
        )
    chosen = resolve_backend(backend, x.device)
    if chosen == "reference":
        return reference.linear_reference(x, weight, bias)
    rows = x.numel() // k if k else 0
    if chosen == "triton" and backend != "auto":
        if rows > MAX_SKINNY_ROWS or rows == 0 or n == 0:
            raise ValueError(
                f"x: the Triton path takes 1 to {MAX_SKINNY_ROWS} rows and N >= 1, got {rows} rows, N {n}"
            )
        if x.dtype not in FLOAT_DTYPES:
            raise ValueError(f"x: the Triton path takes fp32, bf16 or fp16, got {x.dtype}")
        if _needs_grad(x, weight, bias):
            raise ValueError(
                "x: the Triton path has no backward; call it under torch.no_grad() or use 'auto'"
            )
    if chosen == "torch" or rows > MAX_SKINNY_ROWS or rows == 0 or n == 0:
        return torch_impl.linear_torch(x, weight, bias)
    if backend == "auto" and (x.dtype not in _AUTO_DTYPES or _needs_grad(x, weight, bias)):
        return torch_impl.linear_torch(x, weight, bias)  # the kernels have no backward: autograd's GEMM
    from hyspec_kernels.linear import triton_kernel  # first use: TRITON_INTERPRET must be set before

    x2 = x.reshape(rows, k)
    x2 = x2 if x2.stride(-1) == 1 else x2.contiguous()
    w = weight if weight.stride(-1) == 1 else weight.contiguous()
    b = None if bias is None else bias.contiguous()
    return triton_kernel.linear_triton(x2, w, b).view(*x.shape[:-1], n)
