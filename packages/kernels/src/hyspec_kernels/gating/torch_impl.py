"""Vectorised torch path of the gating and norm ops: the same operations, in the same order and dtypes, as the
transformers modules they replace (see reference.py for the dtype steps)."""

from __future__ import annotations

import torch
import torch.nn.functional as F


def gdn_gating_torch(
    A_log: torch.Tensor, a: torch.Tensor, b: torch.Tensor, dt_bias: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    g = -A_log.float().exp() * F.softplus(a.float() + dt_bias.float())  # [T, HV] fp32
    beta = torch.sigmoid(b.float())  # [T, HV] fp32
    return g, beta


def _normalise(x: torch.Tensor, eps: float) -> torch.Tensor:
    xf = x.float()
    return xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)


def gated_rmsnorm_torch(x: torch.Tensor, z: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    scaled = weight * _normalise(x, eps).to(x.dtype)  # [T, HV, V], promoted dtype of weight and x
    return (scaled.float() * F.silu(z.float())).to(x.dtype)


def rms_norm_torch(x: torch.Tensor, weight: torch.Tensor, eps: float, *, offset: float = 0.0) -> torch.Tensor:
    xn = _normalise(x, eps)  # [..., H] fp32
    if offset == 0.0:
        return (weight * xn.to(x.dtype)).to(x.dtype)
    return (xn * (offset + weight.float())).to(x.dtype)


def add_rms_norm_torch(
    x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float, *, offset: float = 0.0
) -> tuple[torch.Tensor, torch.Tensor]:
    summed = x + residual  # [..., H] x's dtype
    return rms_norm_torch(summed, weight, eps, offset=offset), summed


def silu_and_mul_torch(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    return F.silu(gate) * up
