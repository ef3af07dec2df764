"""Drafting under a structured-output constraint (a JSON schema, a regex, a grammar).

A constrained row's drafts are cut at the first token its constraint forbids before the verify forward, and
every verify position the row keeps gets the constraint's mask (forbidden tokens' logits set to -inf) before
tokens are chosen: position j's mask is the constraint's state after the root and drafts 0..j-1. Greedy and
sampled choices on masked logits are then exactly plain masked decoding's (the target distribution at each
position is the masked one), so speculation stays lossless under a constraint. Tree rows keep only their root
under a constraint for now (one mask per node would need the matcher walked along every branch). The
constraint itself advances only by the tokens the round emits (the engine does that), never by drafts: both
calls below leave its state as they found it.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol

import torch

from hyspec_spec_workers.drafter import DraftOutput
from hyspec_spec_workers.tree import VerifyTree


class TokenConstraint(Protocol):
    """One request's matcher (the server's `structured.GrammarState`)."""

    def allowed_drafts(self, drafts: Sequence[int]) -> int:
        """How many leading drafts the constraint accepts from its current state (state unchanged)."""
        ...

    def fill_block_masks(self, drafts: Sequence[int], bitmask: torch.Tensor) -> None:
        """Clears the bits of forbidden tokens in `bitmask` [len(drafts) + 1, ceil(V / 32)] int32 (host, all
        bits set on entry; bit t % 32 of word t // 32 is token t): row j after the current state plus
        drafts[:j] (every draft allowed; state unchanged)."""
        ...


def constrain_draft(
    draft: DraftOutput, constraints: Sequence[TokenConstraint | None]
) -> tuple[DraftOutput, list[list[int]]]:
    """Cuts each constrained row's drafts to the prefix its constraint allows (a tree row to its root).

    Returns the draft and each row's kept drafts (empty for unconstrained rows: they are not needed).
    Reads the constrained rows' tokens to the host (a sync when the drafter left them on the device).
    """
    tree = draft.tree
    counts = [k - 1 for k in tree.node_counts()]  # drafts per row
    kept: list[list[int]] = [[] for _ in counts]
    rows = [i for i, c in enumerate(constraints) if c is not None and counts[i] > 0]
    if not rows:
        return draft, kept
    tokens = tree.tokens[rows].tolist()
    new_counts = list(counts)
    for i, toks in zip(rows, tokens, strict=True):
        c = constraints[i]
        assert c is not None
        if not tree.is_chain:
            new_counts[i] = 0  # see the module docstring
            continue
        drafts = toks[1 : 1 + counts[i]]
        new_counts[i] = c.allowed_drafts(drafts)
        kept[i] = drafts[: new_counts[i]]
    if new_counts == counts:
        return draft, kept
    num_drafts = torch.tensor(new_counts, dtype=torch.int64)
    if tree.is_chain:
        cut = VerifyTree.chain(tree.tokens[:, 0], tree.tokens[:, 1:], num_drafts)
    else:
        cut = VerifyTree.from_parents(tree.tokens, tree.parents, num_drafts + 1)
    return DraftOutput(cut, draft.draft_probs), kept


def mask_block_logits(
    logits: torch.Tensor, constraints: Sequence[TokenConstraint | None], kept: Sequence[Sequence[int]]
) -> None:
    """Masks the verify logits [N, D, V] in place at each constrained row's root and kept drafts: the
    constraints fill one host bitmask, which goes to the device in one copy and applies in one pass."""
    n, d, v = logits.shape
    words = -(-v // 32)
    # [N, D, W] every token allowed; pinned on CUDA so the upload does not wait for the device
    bitmask = torch.full((n, d, words), -1, dtype=torch.int32, pin_memory=logits.is_cuda)
    for i, c in enumerate(constraints):
        if c is not None:
            c.fill_block_masks(kept[i], bitmask[i, : len(kept[i]) + 1])
    bits = torch.arange(32, dtype=torch.int32, device=logits.device)  # [32]
    packed = bitmask.to(logits.device, non_blocking=True)
    allowed = ((packed[..., None] >> bits) & 1).bool().reshape(n, d, words * 32)[..., :v]  # [N, D, V]
    logits.masked_fill_(~allowed, float("-inf"))
