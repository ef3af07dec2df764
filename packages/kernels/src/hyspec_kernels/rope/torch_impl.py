"""Rotary embedding as transformers computes it (vectorised torch ops, the same roundings)."""

from __future__ import annotations

import torch


def apply_rotary_torch(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    rot = cos.shape[-1]
    x_rot, x_pass = x[..., :rot], x[..., rot:]
    half = rot // 2
    rotated = torch.cat((-x_rot[..., half:], x_rot[..., :half]), dim=-1)  # [T, H, R]
    out = x_rot * cos[:, None, :] + rotated * sin[:, None, :]
    return torch.cat((out, x_pass), dim=-1) if x_pass.shape[-1] else out


def norm_rotary_torch(
    x: torch.Tensor, weight: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, *, eps: float, offset: float
) -> torch.Tensor:
    from hyspec_kernels.gating.torch_impl import rms_norm_torch

    return apply_rotary_torch(rms_norm_torch(x, weight, eps, offset=offset), cos, sin)
