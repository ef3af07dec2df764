"""`advance_verify` as a few whole-tensor torch ops (the CPU path)."""

from __future__ import annotations

import torch


def advance_verify_torch(
    *,
    positions: torch.Tensor,
    kv_slots: torch.Tensor,
    prefix_lens: torch.Tensor,
    kv_lens: torch.Tensor,
    q_lens: torch.Tensor,
    cu_seqlens_q: torch.Tensor,
    has_initial_state: torch.Tensor,
    page_table: torch.Tensor,
    prefix: torch.Tensor,
    input_ids: torch.Tensor,
    tokens: torch.Tensor,
    page_size: int,
) -> None:
    """The reference's result (`reference.py`), arguments as there."""
    n = int(prefix.shape[0])
    d = int(positions.shape[0]) // max(n, 1)
    m = int(tokens.shape[0])
    dev = prefix.device
    live = (torch.arange(n, device=dev) < m) & (prefix >= 0)  # [N] bool
    p = torch.where(live, prefix, 0)  # [N] int32
    pos = p.long()[:, None] + torch.arange(d, device=dev)[None, :]  # [N, D]
    # a padded row may index anywhere: its KV slots are -1
    cols = (pos // page_size).clamp_(0, page_table.shape[1] - 1)
    slots = page_table.long().gather(1, cols) * page_size + pos % page_size  # [N, D]
    kv_slots.view(n, d).copy_(torch.where(live[:, None], slots, -1))
    positions.view(n, d).copy_(pos)
    prefix_lens.copy_(p)
    kv_lens.copy_(p + d)
    q_lens.fill_(d)
    has_initial_state.copy_(p > 0)
    cu_seqlens_q.copy_(torch.arange(n + 1, device=dev, dtype=torch.int32) * d)
    ids = input_ids.view(n, d)
    ids[:m].copy_(tokens)
    ids[m:].zero_()
    ids.masked_fill_(~live[:, None], 0)


def advance_one_token_torch(
    *,
    positions: torch.Tensor,
    kv_slots: torch.Tensor,
    prefix_lens: torch.Tensor,
    kv_lens: torch.Tensor,
    has_initial_state: torch.Tensor,
    page_table: torch.Tensor,
    page_size: int,
) -> None:
    """The reference's result (`reference.py`), arguments as there: about fifteen whole-tensor ops."""
    live = kv_slots >= 0  # [N] bool
    step = live.to(torch.int32)  # [N]
    prefix_lens.add_(step)
    kv_lens.add_(step)
    positions.add_(step)
    has_initial_state.copy_(prefix_lens > 0)
    pos = prefix_lens.long()  # [N] the new token's position
    col = (pos // page_size).clamp_(max=page_table.shape[1] - 1)  # padded rows: any column (not used)
    pages = page_table.gather(1, col[:, None])[:, 0].long()  # [N]
    kv_slots.copy_(torch.where(live, pages * page_size + pos % page_size, -1))
