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
    with pytest.raises(ValueError, match="history"):
        p.propose_one(torch.tensor([[1, 2, 3]]))
    with pytest.raises(ValueError, match=r"histories\[1\]"):
        p.propose([[1, 2], torch.tensor([[1, 2, 3]])])


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


def _reference(h: list[int], min_n: int, max_n: int, cap: int) -> list[int]:
    """Prompt lookup by brute force: longest n first, most recent earlier occurrence with a token after it."""
    for n in range(min(max_n, len(h) - 1), min_n - 1, -1):
        hits = [s for s in range(len(h) - n) if h[s : s + n] == h[len(h) - n :]]
        if hits:
            return h[hits[-1] + n : hits[-1] + n + cap]
    return []


@pytest.mark.parametrize(("min_n", "max_n"), [(1, 3), (2, 2), (1, 1), (2, 5)])
def test_kept_indexes_equal_brute_force_as_histories_grow(min_n: int, max_n: int) -> None:
    # three requests grow by 1-4 tokens a round (small vocabulary: many repeats), with caps that vary, a cap
    # of 0 (the row still indexes), a request replaced under the same id (its history is no extension: the
    # index restarts) and one forgotten half-way
    gen = torch.Generator().manual_seed(min_n * 10 + max_n)
    p = NgramProposer(min_n=min_n, max_n=max_n, num_speculative_tokens=4)

    def tokens(most: int) -> list[int]:
        return torch.randint(
            0, 5, (int(torch.randint(1, most, (1,), generator=gen)),), generator=gen
        ).tolist()

    hists = {rid: tokens(6) for rid in ("a", "b", "c")}
    for rnd in range(30):
        if rnd == 12:
            hists["b"] = [4, 4, 1]  # a new request reusing the id
        if rnd == 20:
            p.forget(["c"])
            assert "c" not in p.followed
        ids = list(hists)
        caps = [int(torch.randint(0, 5, (1,), generator=gen)) for _ in ids]
        drafts, num = p.propose([hists[r] for r in ids], caps, ids)
        for i, r in enumerate(ids):
            want = _reference(hists[r], min_n, max_n, min(caps[i], 4))
            assert drafts[i, : num[i]].tolist() == want, (rnd, r)
            assert drafts[i, num[i] :].eq(0).all()
            assert p.propose_one(torch.tensor(hists[r]), caps[i]).tolist() == want
        for r in ids:
            hists[r] += torch.randint(
                0, 5, (int(torch.randint(1, 5, (1,), generator=gen)),), generator=gen
            ).tolist()
    assert p.followed == {"a", "b", "c"}
    p.forget(["a", "b", "c", "unknown"])
    assert not p.followed


def test_request_tokens_view_slices_like_a_list() -> None:
    from hyspec_spec_workers.round_types import RequestTokens

    class Req:
        request_id = "r"

        def __init__(self) -> None:
            self.tokens = [5, 6, 7, 8, 9]
            self.sliced: list[tuple[int, int]] = []

        def token_slice(self, start: int, end: int) -> list[int]:
            self.sliced.append((start, end))
            return self.tokens[start:end]

    req = Req()
    view = RequestTokens(req, 4)  # type: ignore[arg-type]
    assert len(view) == 4 and view[-1] == 8 and view[0] == 5
    assert view[1:3] == [6, 7] and view[2:] == [7, 8] and view[-2:] == [7, 8] and view[3:1] == []
    assert view.tolist() == [5, 6, 7, 8] and list(view) == [5, 6, 7, 8]
    assert (1, 3) in req.sliced  # slices ask the request for just their range
    with pytest.raises(IndexError):
        view[4]
    with pytest.raises(ValueError, match="contiguous"):
        view[::2]
