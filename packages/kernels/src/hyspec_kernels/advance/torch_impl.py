"""`advance_verify` as a few whole-tensor torch ops (the CPU path)."""

from __future__ import annotations

import torch


def advance_verify_torch(
    *,
    positions: torch.Tensor,
    kv_slots: torch.Tensor,
    prefix_lens: torch.Tensor,
    kv_lens: torch.Tensor,
    page_table: torch.Tensor,
    steps: torch.Tensor,
    input_ids: torch.Tensor,
    tokens: torch.Tensor,
    page_size: int,
) -> None:
    """The reference's result (`reference.py`), arguments as there."""
    n = int(steps.shape[0])
    d = int(positions.shape[0]) // max(n, 1)
    moved = steps > 0  # [N] bool
    pos = positions.view(n, d) + steps.long()[:, None]  # [N, D]
    # a row that stays (padded) may index anywhere: its pages are never used
    cols = (pos // page_size).clamp_(0, page_table.shape[1] - 1)
    slots = page_table.long().gather(1, cols) * page_size + pos % page_size  # [N, D]
    kv = kv_slots.view(n, d)
    kv.copy_(torch.where(moved[:, None], slots, kv.long()))
    positions.view(n, d).copy_(pos)
    prefix_lens.add_(steps)
    kv_lens.add_(steps)
    m = int(tokens.shape[0])
    input_ids[: m * d].copy_(tokens.reshape(-1))
