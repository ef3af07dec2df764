"""Rotary embedding token by token and head by head: the definition the fast paths are tested against.

The rotate-half form of transformers' `apply_rotary_pos_emb` on the first R dims of a head (R = cos's last
dim, even), with its roundings: `x * cos` and `rotate_half(x) * sin` each rounded to x's dtype, then their sum
rounded once more; the dims from R on pass through.
"""

from __future__ import annotations

import torch


def apply_rotary_reference(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    num_tokens, num_heads, _ = x.shape
    rot = cos.shape[-1]
    half = rot // 2
    out = x.clone()  # [T, H, Dh]
    for t in range(num_tokens):
        c, s = cos[t].float(), sin[t].float()  # [R]
        for h in range(num_heads):
            v = x[t, h, :rot].float()
            rotated = torch.cat((-v[half:], v[:half]))
            a = (v * c).to(x.dtype).float()
            b = (rotated * s).to(x.dtype).float()
            out[t, h, :rot] = (a + b).to(x.dtype)
    return out


def norm_rotary_reference(
    x: torch.Tensor, weight: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, *, eps: float, offset: float
) -> torch.Tensor:
    """The per-head RMSNorm (`gating`'s reference), then the rotation of its output."""
    from hyspec_kernels.gating.reference import rms_norm_reference

    return apply_rotary_reference(rms_norm_reference(x, weight, eps, offset=offset), cos, sin)
