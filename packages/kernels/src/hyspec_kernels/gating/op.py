"""Validated wrappers: fused GDN gating, gated RMSNorm (Qwen3-Next / Qwen3.5 `RMSNormGated`), RMSNorm, a
residual add fused with the RMSNorm after it, and SwiGLU's silu(gate) * up.

Inputs may be fp32, bf16 or fp16 and strided (a and b are often column slices of one projection). Gating
returns fp32; the norms and the SwiGLU product return their input's dtype. The fused ops exist for decode
steps, where each kernel launch costs about as much as the arithmetic: they round where the torch ops they
replace round.
"""

from __future__ import annotations

import math
from types import ModuleType

import torch

from hyspec_kernels._checks import FLOAT_DTYPES, Backend, check_tensor, dim, implementation
from hyspec_kernels.gating import reference, torch_impl


def _triton() -> ModuleType:
    # Imported on first use: under TRITON_INTERPRET the variable must be set before any @triton.jit runs.
    from hyspec_kernels.gating import triton_kernel

    return triton_kernel


def _check_scalar(name: str, value: object, *, low: float) -> float:
    if (
        isinstance(value, bool)
        or not isinstance(value, int | float)
        or not math.isfinite(value)
        or value < low
    ):
        raise ValueError(f"{name}: expected a finite float >= {low}, got {value!r}")
    return float(value)


def gdn_gating(
    A_log: torch.Tensor,
    a: torch.Tensor,
    b: torch.Tensor,
    dt_bias: torch.Tensor,
    *,
    backend: Backend = "auto",
) -> tuple[torch.Tensor, torch.Tensor]:
    """(g, beta), both [T, HV] fp32: g = -exp(A_log) * softplus(a + dt_bias) (the log-decay, <= 0) and
    beta = sigmoid(b). A_log [HV], a [T, HV], b [T, HV], dt_bias [HV]; softplus is torch's (threshold 20)."""
    a = check_tensor("a", a, ("T", "HV"), dtypes=FLOAT_DTYPES)
    num_tokens, num_heads = a.shape
    device = a.device
    b = check_tensor("b", b, (num_tokens, num_heads), dtypes=FLOAT_DTYPES, device=device)
    A_log = check_tensor("A_log", A_log, (num_heads,), dtypes=FLOAT_DTYPES, device=device)
    dt_bias = check_tensor("dt_bias", dt_bias, (num_heads,), dtypes=FLOAT_DTYPES, device=device)
    fn = implementation(
        backend,
        device,
        reference=reference.gdn_gating_reference,
        torch_path=torch_impl.gdn_gating_torch,
        triton=lambda: _triton().gdn_gating_triton,
    )
    return fn(A_log, a, b, dt_bias)


def gated_rmsnorm(
    x: torch.Tensor,
    z: torch.Tensor,
    weight: torch.Tensor,
    eps: float,
    *,
    backend: Backend = "auto",
) -> torch.Tensor:
    """weight * rmsnorm(x) * silu(z) over the last dim, norm before gate; [T, HV, V] in x's dtype.

    x [T, HV, V]; z [T, HV, V] (any float dtype); weight [V]. Follows transformers' Qwen3NextRMSNormGated:
    normalise in fp32, round to x's dtype, multiply by weight, multiply by silu(z) in fp32, round to x's
    dtype.
    """
    x = check_tensor("x", x, ("T", "HV", "V"), dtypes=FLOAT_DTYPES)
    device = x.device
    z = check_tensor("z", z, tuple(x.shape), dtypes=FLOAT_DTYPES, device=device)
    weight = check_tensor("weight", weight, (x.shape[2],), dtypes=FLOAT_DTYPES, device=device)
    eps = _check_scalar("eps", eps, low=0.0)
    fn = implementation(
        backend,
        device,
        reference=reference.gated_rmsnorm_reference,
        torch_path=torch_impl.gated_rmsnorm_torch,
        triton=lambda: _triton().gated_rmsnorm_triton,
    )
    return fn(x, z, weight, eps)


def rms_norm(
    x: torch.Tensor,
    weight: torch.Tensor,
    eps: float,
    *,
    offset: float = 0.0,
    backend: Backend = "auto",
) -> torch.Tensor:
    """RMSNorm over the last dim of x [..., H] with weight [H]; returns x's dtype.

    offset = 0 is Llama / LFM2's norm: weight * round_to_x_dtype(x * rsqrt(mean(x^2) + eps)).
    offset != 0 is the zero-centred norm of Qwen3-Next / Qwen3.5 (offset = 1): x_normed * (offset + weight),
    all in fp32 with one rounding at the end. Each matches its transformers module in every dtype.
    """
    x, weight, eps, offset = _check_norm(x, weight, eps, offset)
    fn = implementation(
        backend,
        x.device,
        reference=reference.rms_norm_reference,
        torch_path=torch_impl.rms_norm_torch,
        triton=lambda: _triton().rms_norm_triton,
    )
    return fn(x, weight, eps, offset=offset)


def _check_norm(
    x: object, weight: object, eps: object, offset: object
) -> tuple[torch.Tensor, torch.Tensor, float, float]:
    """The checks `rms_norm` and `add_rms_norm` share: x [..., H], weight [H], eps >= 0, a finite offset."""
    x = _check_rows("x", x)
    weight = check_tensor("weight", weight, ("H",), dtypes=FLOAT_DTYPES, device=x.device)
    dim("weight", weight, 0, x.shape[-1], "H, the last dim of x")
    if isinstance(offset, bool) or not isinstance(offset, int | float) or not math.isfinite(offset):
        raise ValueError(f"offset: expected a finite float, got {offset!r}")
    return x, weight, _check_scalar("eps", eps, low=0.0), float(offset)


def _check_rows(name: str, x: object) -> torch.Tensor:
    if not isinstance(x, torch.Tensor) or x.dim() < 1:
        raise ValueError(
            f"{name}: expected a tensor of shape [..., H], got {getattr(x, 'shape', type(x).__name__)}"
        )
    return check_tensor(name, x, (None,) * x.dim(), dtypes=FLOAT_DTYPES)


def add_rms_norm(
    x: torch.Tensor,
    residual: torch.Tensor,
    weight: torch.Tensor,
    eps: float,
    *,
    offset: float = 0.0,
    backend: Backend = "auto",
) -> tuple[torch.Tensor, torch.Tensor]:
    """(rms_norm(x + residual), x + residual): a residual add and the RMSNorm after it in one pass.

    x and residual [..., H] of one dtype; the sum is rounded to it (as `x + residual` in torch) and the norm,
    as `rms_norm` with the same `offset`, reads the rounded sum. Both results have x's shape and dtype.
    """
    x, weight, eps, offset = _check_norm(x, weight, eps, offset)
    residual = check_tensor("residual", residual, tuple(x.shape), dtypes=(x.dtype,), device=x.device)
    fn = implementation(
        backend,
        x.device,
        reference=reference.add_rms_norm_reference,
        torch_path=torch_impl.add_rms_norm_torch,
        triton=lambda: _triton().add_rms_norm_triton,
    )
    return fn(x, residual, weight, eps, offset=offset)


def silu_and_mul(gate: torch.Tensor, up: torch.Tensor, *, backend: Backend = "auto") -> torch.Tensor:
    """silu(gate) * up in gate's dtype, rounded where the two torch ops round (silu to gate's dtype, then the
    product; the Triton path's exp may differ from torch's in the last fp32 bit, so a bf16 result can be one
    rounding away); gate and up [..., I], one dtype (rows may be strided, the last dim is made contiguous)."""
    gate = _check_rows("gate", gate)
    up = check_tensor("up", up, tuple(gate.shape), dtypes=(gate.dtype,), device=gate.device)
    fn = implementation(
        backend,
        gate.device,
        reference=reference.silu_and_mul_reference,
        torch_path=torch_impl.silu_and_mul_torch,
        triton=lambda: _silu_and_mul_triton,
    )
    return fn(gate, up)


def _silu_and_mul_triton(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    # the kernel reads each row as one contiguous run
    gate = gate if gate.stride(-1) == 1 else gate.contiguous()
    up = up if up.stride(-1) == 1 else up.contiguous()
    out: torch.Tensor = _triton().silu_and_mul_triton(gate, up)
    return out
