"""Drafting under a structured-output constraint (a JSON schema, a regex, a grammar).

Every verify node a constrained row can reach gets the constraint's mask (forbidden tokens' logits set to
-inf) before tokens are chosen: node j's mask is the constraint's state after the tokens on the path from the
root to j. Greedy and sampled choices on masked logits are then exactly plain masked decoding's (the target
distribution at each node is the masked one given its path), so speculation stays lossless under a
constraint. A draft the constraint forbids can never be accepted (its parent's masked distribution gives it
probability 0), so it needs no mask of its own, nor does anything below it: nothing is cut before the
forward, which therefore never waits for the draft's tokens to reach the host (a constraint's stop tokens
are among the row's stop tokens, so a run that completes the constrained text ends there). The constraint
itself advances only by the tokens the round emits (the engine does that), never by drafts: both calls below
leave its state as they found it.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol

import torch

from hyspec_spec_workers.tree import VerifyTree

# one row's block for the masks: node tokens (the root first) and parents (-1 for the root)
Block = tuple[list[int], list[int]]


class TokenConstraint(Protocol):
    """One request's matcher (the runner's `grammar.GrammarState`)."""

    def allowed_drafts(self, drafts: Sequence[int]) -> int:
        """How many leading drafts the constraint accepts from its current state (state unchanged)."""
        ...

    def fill_tree_masks(self, tokens: Sequence[int], parents: Sequence[int], bitmask: torch.Tensor) -> None:
        """Writes the mask of every node the constraint allows into `bitmask` [len(tokens), ceil(V / 32)]
        int32 (host, all bits set on entry; bit t % 32 of word t // 32 is token t): node j's after the path
        to j (node 0, the root, is the current state). Forbidden nodes and those below them stay as they
        were. State unchanged."""
        ...


class DraftOnHost:
    """A draft tree's tokens, parents and node counts on their way to the host: on CUDA the copies are queued
    right after the proposal (pinned, non-blocking) with an event, so reading them after the verify forward is
    queued waits for the draft only, not for the forward queued behind it."""

    def __init__(self, tree: VerifyTree) -> None:
        self.is_chain = tree.is_chain
        self._event: torch.cuda.Event | None = None
        src = (tree.tokens, tree.parents, tree.num_nodes)
        self._parts: tuple[torch.Tensor, ...] = src
        if tree.tokens.device.type != "cuda":
            return
        self._parts = tuple(torch.empty(x.shape, dtype=x.dtype, pin_memory=True) for x in src)
        for dst, x in zip(self._parts, src, strict=True):
            dst.copy_(x, non_blocking=True)
        self._event = torch.cuda.Event()  # type: ignore[no-untyped-call]
        self._event.record(torch.cuda.current_stream(tree.tokens.device))

    def read(self) -> tuple[list[list[int]], list[list[int]], list[int]]:
        """(tokens [N][D], parents [N][D], real nodes per row) as Python lists, once the copies landed."""
        if self._event is not None:
            self._event.synchronize()
        tokens, parents, nodes = (x.tolist() for x in self._parts)
        return tokens, parents, nodes


def draft_blocks(draft: DraftOnHost, constraints: Sequence[TokenConstraint | None]) -> list[Block | None]:
    """Each constrained row's block to mask (None for unconstrained rows): a chain up to its first forbidden
    draft, a tree whole. Nothing is cut from the draft itself: a forbidden draft is rejected at its parent,
    whose masked logits give it no chance, so the positions after it never commit. The round calls it after
    the verify forward is queued, so the masks fill on the host while the device runs the forward."""
    blocks: list[Block | None] = [None] * len(constraints)
    rows = [i for i, c in enumerate(constraints) if c is not None]
    if not rows:
        return blocks
    tokens, parents, nodes = draft.read()
    for i in rows:
        c = constraints[i]
        assert c is not None
        toks, n = tokens[i], int(nodes[i])
        if draft.is_chain:
            k = c.allowed_drafts(toks[1:n])
            blocks[i] = (toks[: k + 1], list(range(-1, k)))
        else:
            blocks[i] = (toks[:n], parents[i][:n])
    return blocks


class TokenBitmask:
    """Applies packed token masks to logits: xgrammar's layout, bit t % 32 of int32 word t // 32 allows token
    t. One instance per engine keeps, per vocabulary size and device, each token's word index and bit, so an
    application is one upload, one gather, an and, a compare and a fill (a few launches of host time, whatever
    the batch; xgrammar's own kernel costs more host time per call than the mask fill of a small batch)."""

    def __init__(self) -> None:
        self._bits: tuple[int, torch.device, torch.Tensor, torch.Tensor] | None = None

    @staticmethod
    def host(shape: tuple[int, ...], vocab_size: int, *, pinned: bool) -> torch.Tensor:
        """A host bitmask [*shape, ceil(V / 32)] int32 allowing every token; `pinned` (CUDA logits) lets the
        upload queue behind the running forward instead of waiting for it."""
        return torch.full((*shape, -(-vocab_size // 32)), -1, dtype=torch.int32, pin_memory=pinned)

    def apply(self, logits: torch.Tensor, bitmask: torch.Tensor) -> None:
        """Sets the logits [..., V] of tokens the host `bitmask` [..., W] forbids to -inf, in place."""
        v = int(logits.shape[-1])
        word, bit = self._vocab_bits(v, logits.device)
        packed = bitmask.to(logits.device, non_blocking=True)  # [..., W] int32
        blocked = (packed.index_select(-1, word) & bit) == 0  # [..., V] bool
        logits.masked_fill_(blocked, float("-inf"))

    def _vocab_bits(self, v: int, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
        if self._bits is None or self._bits[0] != v or self._bits[1] != device:
            t = torch.arange(v, dtype=torch.int64, device=device)  # [V]
            bit = torch.bitwise_left_shift(torch.ones_like(t), t % 32).to(torch.int32)  # [V] (1 << 31 wraps)
            self._bits = (v, device, t // 32, bit)
        return self._bits[2], self._bits[3]


def mask_block_logits(
    logits: torch.Tensor,
    constraints: Sequence[TokenConstraint | None],
    blocks: Sequence[Block | None],
    masks: TokenBitmask | None = None,
) -> None:
    """Masks the verify logits [N, D, V] in place at every node of each constrained row: the constraints
    fill one host bitmask, which goes to the device in one copy and applies in one pass."""
    n, d, v = logits.shape
    masks = masks or TokenBitmask()  # the round passes its own, which keeps the vocabulary's bit tables
    bitmask = masks.host((n, d), v, pinned=logits.is_cuda)  # [N, D, W] every token allowed
    for i, (c, block) in enumerate(zip(constraints, blocks, strict=True)):
        if c is not None and block is not None:
            toks, par = block
            c.fill_tree_masks(toks, par, bitmask[i, : len(toks)])
    masks.apply(logits, bitmask)
