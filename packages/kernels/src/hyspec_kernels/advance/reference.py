"""Readable reference of `advance_verify`: a chain verify batch moved on to its rows' next prefixes.

A chain TARGET_VERIFY batch of N rows (M live, then padded; a row whose new prefix is negative is padded
too, so that a CUDA graph captured for all N rows can pad any of them) holds, per live row i, D tokens at
positions `prefix[i] .. prefix[i] + D - 1`, their KV slots (the position's page from the batch's own page
table: `page * page_size + pos % page_size`), `prefix_lens = prefix`, `kv_lens = prefix + D`, `q_lens = D`,
`has_initial_state = prefix > 0` and its block's tokens; a padded row sits at prefix 0 with KV slots -1 and
token 0; `cu_seqlens_q[i] = i * D`. After a round commits, the next round's block of the same rows starts at
the new prefixes: every one of those fields is written from the prefixes and the page table alone, so
whatever the buffers held in between (a drafter's graph steps them on in place) does not matter.
"""

from __future__ import annotations

import torch


def advance_verify_reference(
    *,
    positions: torch.Tensor,  # [N * D] int64, written
    kv_slots: torch.Tensor,  # [N * D] int32, written
    prefix_lens: torch.Tensor,  # [N] int32, written
    kv_lens: torch.Tensor,  # [N] int32, written
    q_lens: torch.Tensor,  # [N] int32, written
    cu_seqlens_q: torch.Tensor,  # [N + 1] int32, written
    has_initial_state: torch.Tensor,  # [N] bool, written
    page_table: torch.Tensor,  # [N, P] int32
    prefix: torch.Tensor,  # [N] int32, the new prefixes (< 0: a padded row; rows >= M: ignored)
    input_ids: torch.Tensor,  # [N * D] int64, written
    tokens: torch.Tensor,  # [M, D] int64, M <= N: the live rows' blocks
    page_size: int,
) -> None:
    n = int(prefix.shape[0])
    d = int(positions.shape[0]) // max(n, 1)
    m = int(tokens.shape[0])
    for i in range(n):
        live = i < m and int(prefix[i]) >= 0
        p = int(prefix[i]) if live else 0
        for j in range(d):
            pos = p + j
            positions[i * d + j] = pos
            kv_slots[i * d + j] = (
                int(page_table[i, pos // page_size]) * page_size + pos % page_size if live else -1
            )
            input_ids[i * d + j] = int(tokens[i, j]) if live else 0
        prefix_lens[i] = p
        kv_lens[i] = p + d
        q_lens[i] = d
        has_initial_state[i] = p > 0
        cu_seqlens_q[i + 1] = (i + 1) * d
    cu_seqlens_q[0] = 0


def advance_one_token_reference(
    *,
    positions: torch.Tensor,  # [N] int64, written
    kv_slots: torch.Tensor,  # [N] int32 (-1: a padded row), written
    prefix_lens: torch.Tensor,  # [N] int32, written
    kv_lens: torch.Tensor,  # [N] int32, written
    has_initial_state: torch.Tensor,  # [N] bool, written
    page_table: torch.Tensor,  # [N, P] int32
    page_size: int,
) -> None:
    """A one-token-per-row batch moved one position on: each live row (KV slot >= 0) one token further,
    its KV slot that of the new position (from its page table row); padded rows stay padding."""
    for i in range(int(kv_slots.shape[0])):
        if int(kv_slots[i]) >= 0:
            p = int(prefix_lens[i]) + 1
            prefix_lens[i] = p
            kv_lens[i] = int(kv_lens[i]) + 1
            positions[i] = int(positions[i]) + 1
            kv_slots[i] = int(page_table[i, p // page_size]) * page_size + p % page_size
        has_initial_state[i] = int(prefix_lens[i]) > 0
