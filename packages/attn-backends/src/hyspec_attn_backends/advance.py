"""Moving a batch on in place, on the device: a chained drafter's steps each add one token per request, and
their batch is made from the last one with a few device ops on its own buffers instead of being prepared
again. No host reads, so both run inside a CUDA graph (a replay then moves on the very buffers the next
forward of the same graph reads).

- `advance_in_place` (`BatchBuilder.advance_one_token`): a one-token-per-row batch to the next position.
- `chain_after_block` (`BatchBuilder.start_chain`): a chain verify block to the one-token batch right after
  one chosen token of each row's block (a drafter's first block, then its one-token steps, in one graph).
- `tree_after_block` (`BatchBuilder.start_tree`): a chain verify block to a tree block rooted at one chosen
  token of each row's block (a tree drafter's first block, then its later steps, in one graph).
- `retree_in_place` (`BatchBuilder.retree`): a tree verify batch to other trees of the same size at the same
  prefixes (a tree drafter's later steps over one block).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import replace

import torch
from hyspec_kernels import advance_one_token, tree_grids
from torch import Tensor

from hyspec_attn_backends.batch import ForwardBatch, check_tree_parents
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
    from the batch's own page table; padded rows (KV slot -1) stay padding: `hyspec_kernels.advance_one_token`
    (one launch on CUDA). `batch` passed `check_advance`."""
    assert batch.kv_slots is not None
    advance_one_token(
        positions=batch.positions,
        kv_slots=batch.kv_slots.tensor,
        prefix_lens=batch.prefix_lens,
        kv_lens=batch.kv_lens,
        has_initial_state=batch.has_initial_state,
        page_table=batch.page_table,
        page_size=page_size,
        # a proposal's last step moves its rows past the positions it mapped, which no forward reads (the
        # next round's batch is written afresh): no value check that each next position has a page
        check_values=False,
    )
    # cu_seqlens, q_lens, page table, state slots and batch rows are those of the next position already


def check_chain_start(batch: ForwardBatch, at: Tensor, kinds: Sequence[MixerKind]) -> None:
    """Raise unless `chain_after_block(batch, at)` applies: a chain TARGET_VERIFY batch with KV slots on an
    attention-only backend (as for advancing a verify batch), and `at` one int index per row."""
    if batch.mode is not ForwardMode.TARGET_VERIFY or batch.is_tree:
        kind = "tree " if batch.is_tree else ""
        raise ValueError(f"batch: expected a chain TARGET_VERIFY batch, got a {kind}{batch.mode} batch")
    if any(k is not MixerKind.ATTENTION for k in kinds):
        raise ValueError(
            "batch: starting a chain from a verify block needs an attention-only backend (verify leaves "
            "recurrent state in scratch)"
        )
    if batch.kv_slots is None:
        raise ValueError("batch: expected KV slots")
    if at.dtype not in (torch.int32, torch.int64) or tuple(at.shape) != (batch.num_seqs,):
        raise ValueError(
            f"at: expected an int tensor of shape [{batch.num_seqs}], got {at.dtype} {list(at.shape)}"
        )


def chain_after_block(batch: ForwardBatch, at: Tensor, *, page_size: int) -> ForwardBatch:
    """The one-token-per-row TARGET_VERIFY batch (D = 1) at position `prefix + at[i] + 1` of each live row
    of the chain verify batch `batch`, written in place into the leading entries of the same buffers.

    It equals `prepare_verify` of one token per row at those positions with the same rows and padding, input
    tokens excepted (the caller writes them into the returned batch's `input_ids`). Padded rows (their block
    KV slots -1) stay padding: prefix 0, KV slot -1. `at`: [N] int, in [0, D) for every row, padded ones
    included (on the device; not checked there). `batch` passed `check_chain_start`; it is stale afterwards.
    """
    assert batch.kv_slots is not None
    n, d = batch.num_seqs, batch.verify_len
    slots = batch.kv_slots.tensor  # [N * D] int32, -1 on padded rows
    rows = torch.arange(n, device=slots.device)
    live = slots.view(n, d)[rows, at.long()] >= 0  # [N] bool: the chosen token has a KV slot
    # every new value is computed before the first write: the step's entries overlap the block's
    prefix = torch.where(live, batch.prefix_lens + at.to(torch.int32) + 1, 0)  # [N] int32
    pos = prefix.long()  # [N] the new token's position
    pages = batch.page_table.gather(1, (pos // page_size)[:, None])[:, 0].long()  # [N]
    new_slots = torch.where(live, pages * page_size + pos % page_size, -1).to(torch.int32)  # [N]
    batch.prefix_lens.copy_(prefix)
    batch.kv_lens.copy_(prefix + 1)
    batch.q_lens.fill_(1)
    batch.cu_seqlens_q.copy_(torch.arange(n + 1, dtype=torch.int32, device=slots.device))
    batch.has_initial_state.copy_(prefix > 0)
    positions = batch.positions[:n]
    positions.copy_(pos)
    kv_slots = batch.kv_slots.head(n)
    kv_slots.tensor.copy_(new_slots)
    # rows, slots, page table and the lens rows are the same buffers, rewritten above
    return replace(batch, input_ids=batch.input_ids[:n], positions=positions, kv_slots=kv_slots, verify_len=1)


def check_tree_start(batch: ForwardBatch, at: Tensor, size: int, kinds: Sequence[MixerKind]) -> None:
    """Raise unless `tree_after_block(batch, at, size=size)` applies: what `start_chain` needs, and a tree of
    1 <= size <= D nodes (it takes the block's own entries)."""
    check_chain_start(batch, at, kinds)
    if not 1 <= size <= batch.verify_len:
        raise ValueError(f"size: expected 1 <= size <= the block's {batch.verify_len} tokens, got {size}")


def tree_after_block(
    batch: ForwardBatch, at: Tensor, *, size: int, parents: Tensor, mask: Tensor, page_size: int
) -> ForwardBatch:
    """The tree TARGET_VERIFY batch of `size` nodes per row rooted at block token `at[i]` of each live row
    of the chain verify batch `batch` (prefix `prefix + at[i]`: the root re-runs at that token's position),
    written in place into the leading entries of the same buffers, its tree a star (every node a child of
    the root; `retree` gives it others).

    On its live rows it equals `prepare_verify` of those rows at those prefixes with star parents, input
    tokens excepted (the caller's, as for `retree`). Padded rows (their block KV slots -1) stay padding:
    prefix 0, KV slots -1 (their tree a star too, where `prepare_verify` pads with chains: they write
    nothing either way). `parents` [max_num_seqs, Dmax] int32 and `mask` [max_num_seqs, Dmax, Dmax] bool:
    the builder's tree buffers. `batch` passed `check_tree_start`; it is stale afterwards.
    """
    assert batch.kv_slots is not None
    n, d = batch.num_seqs, batch.verify_len
    slots = batch.kv_slots.tensor  # [N * D] int32, -1 on padded rows
    dev = slots.device
    rows = torch.arange(n, device=dev)
    live = slots.view(n, d)[rows, at.long()] >= 0  # [N] bool: the chosen token has a KV slot
    # every new value is computed before the first write: the tree's entries overlap the block's
    prefix = torch.where(live, batch.prefix_lens + at.to(torch.int32), 0)  # [N] int32
    node = torch.arange(size, device=dev)  # [size]
    pos = prefix.long()[:, None] + node  # [N, size] each node's KV position (block index, not depth)
    pages = batch.page_table.gather(1, pos // page_size).long()  # [N, size]
    new_slots = torch.where(live[:, None], pages * page_size + pos % page_size, -1).to(torch.int32)
    batch.prefix_lens.copy_(prefix)
    batch.kv_lens.copy_(prefix + size)
    batch.q_lens.fill_(size)
    batch.cu_seqlens_q.copy_(torch.arange(0, (n + 1) * size, size, dtype=torch.int32, device=dev))
    batch.has_initial_state.copy_(prefix > 0)
    positions = batch.positions[: n * size]
    positions.copy_((prefix.long()[:, None] + (node > 0).long()).reshape(-1))  # prefix + depth
    kv_slots = batch.kv_slots.head(n * size)
    kv_slots.tensor.copy_(new_slots.reshape(-1))
    tree_parents = parents[:n, :size]
    tree_parents.fill_(0)
    tree_parents[:, 0] = -1
    tree_mask = mask[:n, :size, :size]
    star = torch.eye(size, dtype=torch.bool, device=dev) | (node == 0)[None, :]  # [size, size] self or root
    tree_mask.copy_(star.expand(n, size, size))
    return replace(
        batch,
        input_ids=batch.input_ids[: n * size],
        positions=positions,
        kv_slots=kv_slots,
        verify_len=size,
        tree_parents=tree_parents,
        tree_mask=tree_mask,
    )


def check_retree(batch: ForwardBatch, tokens: Tensor, parents: Tensor, *, check_values: bool | None) -> None:
    """Raise unless `retree_in_place(batch, tokens, parents)` applies: a tree TARGET_VERIFY batch, and a
    block of tokens and well-formed parents (values read where `value_checks` says) per live row, or per row
    with the padded ones (a CUDA graph's forward, captured on an all-padding batch, rewrites every row)."""
    if batch.mode is not ForwardMode.TARGET_VERIFY or not batch.is_tree:
        raise ValueError(f"batch: expected a tree TARGET_VERIFY batch, got a {batch.mode} one")
    n, d = tokens.shape[0] if tokens.dim() == 2 else -1, batch.verify_len
    if n not in (batch.num_live, batch.num_seqs) or tuple(tokens.shape) != (n, d):
        raise ValueError(
            f"block_tokens: expected shape [{batch.num_live} live rows or {batch.num_seqs} rows, {d}], got "
            f"{list(tokens.shape)}"
        )
    check_tree_parents(parents, num_seqs=n, verify_len=d, check_values=check_values)


def retree_in_place(batch: ForwardBatch, tokens: Tensor, parents: Tensor) -> None:
    """The first N rows' tokens, parents, ancestor masks and node positions (prefix + depth) of the trees
    `parents` [N, D] with `tokens` [N, D] (N: the live rows, or every row), written into `batch`'s own
    buffers by a few device ops (one `tree_grids` launch), no host read: rows, prefixes, KV slots and lengths
    stay (the blocks occupy the same positions; a padded row keeps its KV slots -1, so it still writes
    nothing). `batch` passed `check_retree`."""
    assert batch.tree_parents is not None and batch.tree_mask is not None
    n, d = tokens.shape[0], batch.verify_len
    g = tree_grids(parents=parents, check_values=False)  # [N, D] / [N, D, D] where the parents are
    batch.input_ids[: n * d].copy_(tokens.reshape(-1), non_blocking=True)
    batch.tree_parents[:n].copy_(g.parents, non_blocking=True)
    batch.tree_mask[:n].copy_(g.mask, non_blocking=True)
    depth = g.depth.to(batch.positions.device, non_blocking=True)
    batch.positions[: n * d].copy_((batch.prefix_lens[:n].long()[:, None] + depth).reshape(-1))
