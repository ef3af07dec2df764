"""Validated wrappers of the rotary embedding: x [T, H, Dh] rotated by cos / sin [T, R] (R even, <= Dh) in x's
dtype; x may be strided (a query is often a slice of a wider projection). `norm_rotary` is the per-head
RMSNorm (a query / key norm) and the rotation after it in one launch."""

from __future__ import annotations

from types import ModuleType

import torch

from hyspec_kernels._checks import FLOAT_DTYPES, Backend, check_tensor, implementation
from hyspec_kernels.rope import reference, torch_impl


def _triton() -> ModuleType:
    # Imported on first use: under TRITON_INTERPRET the variable must be set before any @triton.jit runs.
    from hyspec_kernels.rope import triton_kernel

    return triton_kernel


def apply_rotary(
    x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, *, backend: Backend = "auto"
) -> torch.Tensor:
    """Rotate the first R dims of every head of x [T, H, Dh] by cos, sin [T, R] (rotate-half form, as
    transformers' `apply_rotary_pos_emb`); the other dims pass through. cos and sin have x's dtype (the
    products round to it, as the torch form's do; the Triton path agrees with the torch form within two
    units in the last place on a GPU); the result is a new [T, H, Dh] tensor in x's dtype."""
    x = check_tensor("x", x, ("T", "H", "Dh"), dtypes=FLOAT_DTYPES)
    cos, sin = _check_cos_sin(x, cos, sin)
    fn = implementation(
        backend,
        x.device,
        reference=reference.apply_rotary_reference,
        torch_path=torch_impl.apply_rotary_torch,
        triton=lambda: _apply_rotary_triton,
    )
    return fn(x, cos, sin)


def norm_rotary(
    x: torch.Tensor,
    weight: torch.Tensor,
    cos: torch.Tensor,
    sin: torch.Tensor,
    *,
    eps: float,
    offset: float = 0.0,
    backend: Backend = "auto",
) -> torch.Tensor:
    """`apply_rotary(rms_norm(x, weight, eps, offset=offset), cos, sin)` for x [T, H, Dh], weight [Dh] (a
    query or key norm over each head), in one launch on a GPU: the norm's output (rounded to x's dtype, as it
    stores it) is what rotates. offset as `gating.rms_norm` (1 for Qwen3-Next / Qwen3.5, 0 for LFM2)."""
    from hyspec_kernels.gating.op import _check_norm

    x = check_tensor("x", x, ("T", "H", "Dh"), dtypes=FLOAT_DTYPES)
    x, weight, eps, offset = _check_norm(x, weight, eps, offset)
    cos, sin = _check_cos_sin(x, cos, sin)
    fn = implementation(
        backend,
        x.device,
        reference=reference.norm_rotary_reference,
        torch_path=torch_impl.norm_rotary_torch,
        triton=lambda: _norm_rotary_triton,
    )
    out: torch.Tensor = fn(x, weight, cos, sin, eps=eps, offset=offset)
    return out


def _check_cos_sin(x: torch.Tensor, cos: object, sin: object) -> tuple[torch.Tensor, torch.Tensor]:
    num_tokens, head_dim = x.shape[0], x.shape[-1]
    cos = check_tensor("cos", cos, (num_tokens, "R"), dtypes=(x.dtype,), device=x.device)
    rot = cos.shape[1]
    if rot % 2 or rot > head_dim:
        raise ValueError(f"cos: expected an even rotary dim R <= Dh = {head_dim}, got R = {rot}")
    sin = check_tensor("sin", sin, (num_tokens, rot), dtypes=(x.dtype,), device=x.device)
    return cos, sin


def _apply_rotary_triton(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    # the kernel reads every head and cos / sin row as one contiguous run
    x = x if x.stride(2) == 1 else x.contiguous()
    cos = cos if cos.stride(1) == 1 else cos.contiguous()
    sin = sin if sin.stride(1) == 1 else sin.contiguous()
    out: torch.Tensor = _triton().apply_rotary_triton(x, cos, sin)
    return out


def _norm_rotary_triton(
    x: torch.Tensor, weight: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, *, eps: float, offset: float
) -> torch.Tensor:
    # the kernel reads every head and cos / sin row as one contiguous run
    x = x if x.stride(2) == 1 else x.contiguous()
    cos = cos if cos.stride(1) == 1 else cos.contiguous()
    sin = sin if sin.stride(1) == 1 else sin.contiguous()
    out: torch.Tensor = _triton().norm_rotary_triton(x, weight, cos, sin, eps=eps, offset=offset)
    return out
