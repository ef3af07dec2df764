"""Advancing a one-token-per-row batch to its next position in place (`BatchBuilder.advance_one_token`): a
chained drafter's steps each add one token per request, and their batch is moved on with a few device ops
on its own buffers instead of being prepared again. No host reads, so it can run inside a CUDA graph (a
replay then advances the very buffers the next replay reads).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from hyspec_attn_backends.batch import ForwardBatch
from hyspec_attn_backends.layers import MixerKind
from hyspec_attn_backends.modes import ForwardMode


def check_advance(batch: ForwardBatch, kinds: Sequence[MixerKind]) -> None:
    """Raise unless `batch` can be advanced on a backend of these layer kinds: one token per row and KV
    slots, in DECODE, or in TARGET_VERIFY (D = 1) with attention layers only (a verify forward writes
    recurrent state to scratch, so a next position would not see it)."""
    if batch.num_tokens != batch.num_seqs or batch.is_tree:
        raise ValueError(
            f"batch: expected one token per row, got {batch.num_tokens} tokens for {batch.num_seqs} rows"
        )
    if batch.mode is ForwardMode.TARGET_VERIFY:
        if any(k is not MixerKind.ATTENTION for k in kinds):
            raise ValueError(
                "batch: advancing a TARGET_VERIFY batch needs an attention-only backend (verify leaves "
                "recurrent state in scratch)"
            )
    elif batch.mode is not ForwardMode.DECODE:
        raise ValueError(f"batch: expected a DECODE or TARGET_VERIFY batch, got {batch.mode}")
    if batch.kv_slots is None:
        raise ValueError("batch: expected KV slots")


def advance_in_place(batch: ForwardBatch, *, page_size: int) -> None:
    """Positions, prefix and KV lengths of each live row + 1, and its KV slot that of the new position, read
    from the batch's own page table; padded rows (KV slot -1) stay padding. `batch` passed `check_advance`."""
    assert batch.kv_slots is not None
    slots = batch.kv_slots.tensor  # [N] int32, -1 on padded rows
    live = slots >= 0  # [N] bool
    step = live.to(torch.int32)  # [N]
    batch.prefix_lens.add_(step)
    batch.kv_lens.add_(step)
    batch.positions.add_(step)
    batch.has_initial_state.copy_(batch.prefix_lens > 0)
    pos = batch.prefix_lens.long()  # [N] the new token's position
    pages = batch.page_table.gather(1, (pos // page_size)[:, None])[:, 0].long()  # [N]
    slots.copy_(torch.where(live, pages * page_size + pos % page_size, -1))
    # cu_seqlens, q_lens, page table, state slots and batch rows are those of the next position already
