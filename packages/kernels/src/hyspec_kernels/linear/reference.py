"""Readable reference of `linear`: the product in fp32, rounded once to x's dtype."""

from __future__ import annotations

import torch


def linear_reference(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """x [.., K], weight [N, K], bias [N] or None -> [.., N] in x's dtype (fp32 sums, one rounding)."""
    y = x.float() @ weight.float().T  # [.., N] fp32
    if bias is not None:
        y = y + bias.float()
    return y.to(x.dtype)
