"""Readable reference of the row argmax: torch.argmax's rule, spelled out."""

from __future__ import annotations

import torch


def argmax_rows_reference(x: torch.Tensor) -> torch.Tensor:
    """[..., V] -> [...] int64: the first index of each row's largest value, where NaN counts as larger than
    every number (the first NaN wins) and a row of -inf gives 0; torch.argmax's rule."""
    rows = x.reshape(-1, x.shape[-1]).double()  # exact for every float dtype (fp32 would round fp64)
    out = torch.empty(rows.shape[0], dtype=torch.int64, device=x.device)
    for r, row in enumerate(rows):
        nan = torch.isnan(row)
        if bool(nan.any()):
            out[r] = int(nan.nonzero()[0, 0])
        else:
            out[r] = int((row == row.max()).nonzero()[0, 0])
    return out.reshape(x.shape[:-1])
