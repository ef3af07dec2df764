"""The torch path of `linear`: torch's own GEMM (cuBLAS on CUDA), what every row count above
`MAX_SKINNY_ROWS` and every other dtype runs."""

from __future__ import annotations

import torch
import torch.nn.functional as F


def linear_torch(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    return F.linear(x, weight, bias)
