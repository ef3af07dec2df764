import pytest
import torch
from hyspec_spec_workers import DraftBatch, NgramDrafter, NgramProposer, verify_greedy


def _t(xs: list[int]) -> torch.Tensor:
    return torch.tensor(xs)


def test_longest_ngram_first_then_most_recent() -> None:
    p2 = NgramProposer(min_n=1, max_n=2, num_speculative_tokens=3)
    p1 = NgramProposer(min_n=1, max_n=1, num_speculative_tokens=3)
    h = _t([3, 2, 9, 5, 2, 8, 3, 2])
    assert p2.propose_one(h).tolist() == [9, 5, 2]  # bigram (3, 2) at 0
    assert p1.propose_one(h).tolist() == [8, 3, 2]  # unigram 2, most recent earlier hit at 4
    assert p2.propose_one(_t([1, 2, 5, 1, 2, 6, 1, 2])).tolist() == [6, 1, 2]


def test_short_continuations_caps_and_no_match() -> None:
    p = NgramProposer(min_n=2, max_n=3, num_speculative_tokens=5)
    assert p.propose_one(_t([1, 2, 3, 1, 2])).tolist() == [3, 1, 2]
    assert p.propose_one(_t([1, 2, 3, 1, 2]), max_drafts=2).tolist() == [3, 1]
    assert p.propose_one(_t([1, 2, 3, 1, 2]), max_drafts=0).tolist() == []
    assert p.propose_one(_t([1, 2, 3, 4])).tolist() == []
    assert p.propose_one(_t([7])).tolist() == []
    with pytest.raises(ValueError, match="max_n"):
        NgramProposer(min_n=3, max_n=2, num_speculative_tokens=1)


def test_batched_padding_and_zero_draft_rows_verify() -> None:
    hist = [_t([1, 2, 3, 4, 1, 2]), _t([5, 6, 7]), _t([9, 9, 9, 9])]
    drafter = NgramDrafter(min_n=1, max_n=2, num_speculative_tokens=3)
    out = drafter.propose(DraftBatch(root_tokens=_t([2, 7, 9]), num_steps=[3, 3, 1], histories=hist))
    tree = out.tree
    assert tree.num_nodes.tolist() == [4, 1, 2]
    assert tree.tokens[0].tolist() == [2, 3, 4, 1]
    assert tree.tokens[2, :2].tolist() == [9, 9]
    assert drafter.max_draft_tokens == 4 and out.draft_probs is None
    # the target agrees with row 0's first two drafts; row 1 proposed nothing and decodes one token
    pred = torch.tensor([[3, 4, 8, 0], [8, 8, 8, 8], [9, 9, 0, 0]])
    r = verify_greedy(tree, pred)
    assert r.tolist() == [[3, 4, 8], [8], [9, 9]]
