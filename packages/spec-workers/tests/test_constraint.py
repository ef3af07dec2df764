"""`constraint.py` with a scripted constraint: chain blocks end at the first forbidden draft, every reachable
node of a chain or a tree masked for its own path, forbidden subtrees left alone, all from one packed
bitmask; `TokenBitmask` against a per-token reference."""

from __future__ import annotations

import itertools
from collections.abc import Sequence

import pytest
import torch
from hyspec_spec_workers.constraint import DraftOnHost, TokenBitmask, draft_blocks, mask_block_logits
from hyspec_spec_workers.drafter import DraftOutput
from hyspec_spec_workers.tree import VerifyTree

V = 70


def allowed_after(depth: int) -> list[int]:
    """The scripted constraint: even tokens >= 2 * depth after `depth` tokens past the root."""
    return [t for t in range(V) if t % 2 == 0 and t >= 2 * depth]


class EvenRising:
    def allowed_drafts(self, drafts: Sequence[int]) -> int:
        n = 0
        for j, t in enumerate(drafts):
            if t not in allowed_after(j):
                break
            n += 1
        return n

    def fill_tree_masks(self, tokens: Sequence[int], parents: Sequence[int], bitmask: torch.Tensor) -> None:
        depth = [0] * len(tokens)
        ok = [True] * len(tokens)
        for j in range(1, len(tokens)):
            p = parents[j]
            depth[j] = depth[p] + 1
            ok[j] = ok[p] and tokens[j] in allowed_after(depth[p])
        for j in range(len(tokens)):
            if ok[j]:
                row = torch.zeros(bitmask.shape[-1], dtype=torch.int64)
                for t in allowed_after(depth[j]):
                    row[t // 32] |= 1 << (t % 32)
                bitmask[j] = row.to(torch.int32)  # wraps to int32's bit pattern


def _finite(logits: torch.Tensor) -> list[bool]:
    return [bool(x) for x in torch.isfinite(logits)]


def test_chain_blocks_end_at_the_first_forbidden_draft_and_positions_are_masked() -> None:
    roots = torch.tensor([1, 3, 5])
    drafts = torch.tensor([[2, 4, 7], [2, 1, 6], [9, 9, 9]])
    draft = DraftOutput(VerifyTree.chain(roots, drafts, torch.tensor([3, 3, 2])))
    cons = [EvenRising(), None, EvenRising()]
    blocks = draft_blocks(DraftOnHost(draft.tree), cons)
    # row 0 masks root, 2, 4 (7 is odd: rejected at 4's masked logits); row 1 free; row 2 only its root
    assert blocks == [([1, 2, 4], [-1, 0, 1]), None, ([5], [-1])]
    logits = torch.randn(3, 4, V)
    before = logits.clone()
    mask_block_logits(logits, cons, blocks, TokenBitmask())
    for j in range(3):
        assert _finite(logits[0, j]) == [t in allowed_after(j) for t in range(V)]
    assert torch.equal(logits[1], before[1])  # unconstrained row untouched
    assert torch.equal(logits[0, 3], before[0, 3])  # past the kept drafts: never reached, left alone
    assert _finite(logits[2, 0]) == [t in allowed_after(0) for t in range(V)]


def test_tree_nodes_are_masked_along_their_own_paths() -> None:
    # node: 0 root, 1 (4) and 2 (3, forbidden) under the root, 3 (6) under 1, 4 (8) under 2
    tokens = torch.tensor([[1, 4, 3, 6, 8]])
    parents = torch.tensor([[-1, 0, 0, 1, 2]])
    draft = DraftOutput(VerifyTree.from_parents(tokens, parents, torch.tensor([5])))
    # forbidden nodes can never be accepted: no mask of theirs
    blocks = draft_blocks(DraftOnHost(draft.tree), [EvenRising()])
    logits = torch.randn(1, 5, V)
    before = logits.clone()
    mask_block_logits(logits, [EvenRising()], blocks, TokenBitmask())
    assert _finite(logits[0, 0]) == [t in allowed_after(0) for t in range(V)]
    assert _finite(logits[0, 1]) == [t in allowed_after(1) for t in range(V)]
    assert _finite(logits[0, 3]) == [t in allowed_after(2) for t in range(V)]
    assert torch.equal(logits[0, 2], before[0, 2]) and torch.equal(logits[0, 4], before[0, 4])
    # the root's mask gives the forbidden child 3 probability 0: verification can never take it
    assert logits[0, 0, 3] == float("-inf")


@pytest.mark.parametrize("vocab", [1, 31, 32, 33, 100])
def test_token_bitmask_matches_a_per_token_reference(vocab: int) -> None:
    g = torch.Generator().manual_seed(vocab)
    masks = TokenBitmask()
    for shape in ((3,), (2, 4)):  # plain rows, verify blocks
        bitmask = masks.host(shape, vocab, pinned=False)
        assert bitmask.shape == (*shape, -(-vocab // 32)) and bool((bitmask == -1).all())
        bitmask.copy_(
            torch.randint(-(2**31), 2**31, bitmask.shape, generator=g, dtype=torch.int64).to(torch.int32)
        )
        logits = torch.randn(*shape, vocab, generator=g)
        want = logits.clone()
        for idx in itertools.product(*(range(n) for n in shape)):
            for t in range(vocab):
                if not (int(bitmask[idx][t // 32]) >> (t % 32)) & 1:  # bit 31 is the sign bit
                    want[idx][t] = float("-inf")
        masks.apply(logits, bitmask)
        assert torch.equal(logits, want)
