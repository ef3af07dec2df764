"""Drafting under a structured-output constraint (a JSON schema, a regex, a grammar).

Every verify node a constrained row can reach gets the constraint's mask (forbidden tokens' logits set to
-inf) before tokens are chosen: node j's mask is the constraint's state after the tokens on the path from the
root to j. Greedy and sampled choices on masked logits are then exactly plain masked decoding's (the target
distribution at each node is the masked one given its path), so speculation stays lossless under a
constraint. A draft the constraint forbids can never be accepted (its parent's masked distribution gives it
probability 0), so it needs no mask of its own, nor does anything below it; a chain is also cut at its first
forbidden draft before the forward, so the block does not carry positions that can never commit. The
constraint itself advances only by the tokens the round emits (the engine does that), never by drafts: both
calls below leave its state as they found it.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol

import torch

from hyspec_spec_workers.drafter import DraftOutput
from hyspec_spec_workers.tree import VerifyTree

# one row's block for the masks: node tokens (the root first) and parents (-1 for the root)
Block = tuple[list[int], list[int]]


class TokenConstraint(Protocol):
    """One request's matcher (the server's `structured.GrammarState`)."""

    def allowed_drafts(self, drafts: Sequence[int]) -> int:
        """How many leading drafts the constraint accepts from its current state (state unchanged)."""
        ...

    def fill_tree_masks(self, tokens: Sequence[int], parents: Sequence[int], bitmask: torch.Tensor) -> None:
        """Writes the mask of every node the constraint allows into `bitmask` [len(tokens), ceil(V / 32)]
        int32 (host, all bits set on entry; bit t % 32 of word t // 32 is token t): node j's after the path
        to j (node 0, the root, is the current state). Forbidden nodes and those below them stay as they
        were. State unchanged."""
        ...


def constrain_draft(
    draft: DraftOutput, constraints: Sequence[TokenConstraint | None]
) -> tuple[DraftOutput, list[Block | None]]:
    """Cuts each constrained chain row at its first forbidden draft; returns the draft and each constrained
    row's block (None for unconstrained rows). Reads those rows' tokens to the host (a sync when the drafter
    left them on the device)."""
    tree = draft.tree
    nodes = tree.node_counts()
    blocks: list[Block | None] = [None] * len(nodes)
    rows = [i for i, c in enumerate(constraints) if c is not None]
    if not rows:
        return draft, blocks
    tokens = tree.tokens[rows].tolist()
    parents = tree.parents[rows].tolist()
    counts = [k - 1 for k in nodes]  # drafts per row
    for i, toks, par in zip(rows, tokens, parents, strict=True):
        c = constraints[i]
        assert c is not None
        if tree.is_chain:
            counts[i] = c.allowed_drafts(toks[1 : nodes[i]])
            blocks[i] = (toks[: counts[i] + 1], list(range(-1, counts[i])))
        else:
            blocks[i] = (toks[: nodes[i]], par[: nodes[i]])
    if not tree.is_chain or counts == [k - 1 for k in nodes]:
        return draft, blocks
    cut = VerifyTree.chain(tree.tokens[:, 0], tree.tokens[:, 1:], torch.tensor(counts, dtype=torch.int64))
    return DraftOutput(cut, draft.draft_probs), blocks


def mask_block_logits(
    logits: torch.Tensor, constraints: Sequence[TokenConstraint | None], blocks: Sequence[Block | None]
) -> None:
    """Masks the verify logits [N, D, V] in place at every node of each constrained row: the constraints
    fill one host bitmask, which goes to the device in one copy and applies in one pass."""
    n, d, v = logits.shape
    words = -(-v // 32)
    # [N, D, W] every token allowed; pinned on CUDA so the upload does not wait for the device
    bitmask = torch.full((n, d, words), -1, dtype=torch.int32, pin_memory=logits.is_cuda)
    for i, (c, block) in enumerate(zip(constraints, blocks, strict=True)):
        if c is not None and block is not None:
            toks, par = block
            c.fill_tree_masks(toks, par, bitmask[i, : len(toks)])
    bits = torch.arange(32, dtype=torch.int32, device=logits.device)  # [32]
    packed = bitmask.to(logits.device, non_blocking=True)
    allowed = ((packed[..., None] >> bits) & 1).bool().reshape(n, d, words * 32)[..., :v]  # [N, D, V]
    logits.masked_fill_(~allowed, float("-inf"))
