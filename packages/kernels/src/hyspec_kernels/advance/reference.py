"""Readable reference of `advance_verify`: a chain verify batch moved on by each row's committed tokens.

A chain TARGET_VERIFY batch of N rows (live, then padded) holds, per row i, D tokens at positions
`prefix[i] .. prefix[i] + D - 1`, their KV slots (-1 on padded rows), `prefix_lens` and
`kv_lens = prefix + D`.
After the round commits `steps[i]` tokens of row i, the next round's block of the same rows starts `steps[i]`
positions later: every position, both lengths and every KV slot (the new position's, from the batch's own
page table: `page * page_size + pos % page_size`) move on; rows with `steps[i] = 0` (padded ones) stay as
they are. The first rows' input tokens become the next block's tokens.
"""

from __future__ import annotations

import torch


def advance_verify_reference(
    *,
    positions: torch.Tensor,  # [N * D] int64, in place
    kv_slots: torch.Tensor,  # [N * D] int32, in place
    prefix_lens: torch.Tensor,  # [N] int32, in place
    kv_lens: torch.Tensor,  # [N] int32, in place
    page_table: torch.Tensor,  # [N, P] int32
    steps: torch.Tensor,  # [N] int32 >= 0
    input_ids: torch.Tensor,  # [N * D] int64, in place: its first M * D entries
    tokens: torch.Tensor,  # [M, D] int64, M <= N
    page_size: int,
) -> None:
    n = int(steps.shape[0])
    d = int(positions.shape[0]) // max(n, 1)
    for i in range(n):
        s = int(steps[i])
        if s > 0:
            for j in range(d):
                pos = int(positions[i * d + j]) + s
                positions[i * d + j] = pos
                kv_slots[i * d + j] = int(page_table[i, pos // page_size]) * page_size + pos % page_size
            prefix_lens[i] += s
            kv_lens[i] += s
    m = int(tokens.shape[0])
    input_ids[: m * d] = tokens.reshape(-1)
