"""`constraint.py` with a scripted constraint: drafts cut at the first forbidden token (chains), a tree row
cut to its root, and verify logits masked per position from one packed bitmask."""

from __future__ import annotations

from collections.abc import Sequence

import torch
from hyspec_spec_workers.constraint import constrain_draft, mask_block_logits
from hyspec_spec_workers.drafter import DraftOutput
from hyspec_spec_workers.tree import VerifyTree


class EvenOnly:
    """Allows even tokens only; after k accepted drafts also forbids tokens below 2 * k (so every position
    has its own mask)."""

    def __init__(self) -> None:
        self.calls = 0

    def allowed_drafts(self, drafts: Sequence[int]) -> int:
        n = 0
        for j, t in enumerate(drafts):
            if t % 2 or t < 2 * j:
                break
            n += 1
        return n

    def fill_block_masks(self, drafts: Sequence[int], bitmask: torch.Tensor) -> None:
        self.calls += 1
        words = bitmask.shape[-1]
        for j in range(len(drafts) + 1):
            allowed = [t for t in range(words * 32) if t % 2 == 0 and t >= 2 * j]
            row = torch.zeros(words, dtype=torch.int64)
            for t in allowed:
                row[t // 32] |= 1 << (t % 32)
            bitmask[j] = row.to(torch.int32)  # wraps to int32's bit pattern


def test_chain_drafts_are_cut_and_positions_masked() -> None:
    roots = torch.tensor([1, 3, 5])
    drafts = torch.tensor([[2, 4, 7], [2, 1, 6], [9, 9, 9]])
    draft = DraftOutput(VerifyTree.chain(roots, drafts, torch.tensor([3, 3, 2])))
    cons = [EvenOnly(), None, EvenOnly()]
    cut, kept = constrain_draft(draft, cons)
    assert cut.tree.node_counts() == [3, 4, 1]  # row 0 keeps 2, 4 (7 is odd); row 1 free; row 2 none
    assert kept == [[2, 4], [], []]
    v = 70
    logits = torch.randn(3, 4, v)
    before = logits.clone()
    mask_block_logits(logits, cons, kept)
    for j in range(3):
        want = [t % 2 == 0 and t >= 2 * j for t in range(v)]
        got = [bool(x) for x in torch.isfinite(logits[0, j])]
        assert got == want
    assert torch.equal(logits[1], before[1])  # unconstrained row untouched
    assert torch.equal(logits[0, 3], before[0, 3])  # past the kept drafts: never reached, left alone
    assert torch.isfinite(logits[2, 0]).tolist() == [t % 2 == 0 for t in range(v)]


def test_a_constrained_tree_row_keeps_its_root() -> None:
    tokens = torch.tensor([[1, 2, 4, 6], [1, 2, 4, 6]])
    parents = torch.tensor([[-1, 0, 0, 1], [-1, 0, 0, 1]])
    draft = DraftOutput(VerifyTree.from_parents(tokens, parents, torch.tensor([4, 4])))
    cut, kept = constrain_draft(draft, [EvenOnly(), None])
    assert cut.tree.node_counts() == [1, 4]
    assert kept == [[], []]
