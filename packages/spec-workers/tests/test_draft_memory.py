"""The drafter's per-request memory follows the engine's: a request-keyed drafter of any kind forgets an
ended request, adaptive lengths are dropped with it, and the leak check names whatever is still held."""

from __future__ import annotations

from collections.abc import Hashable, Sequence

import pytest
import torch
from hyspec_spec_workers import AdaptiveConfig, DraftBatch, DraftOutput, SpeculativeRound, VerifyTree
from hyspec_spec_workers.config import Method
from hyspec_spec_workers.drafter import RequestKeyedDrafter


class _Keyed:
    """A caller's own drafter that remembers every request it proposed for (like a benchmark's oracle)."""

    method: Method = "ngram"
    max_draft_tokens = 4

    def __init__(self, *, forgets: bool = True) -> None:
        self.seen: set[Hashable] = set()
        self.forgets = forgets

    def propose(self, batch: DraftBatch) -> DraftOutput:
        self.seen.update(batch.req_ids)
        n = batch.root_tokens.shape[0]
        drafts = torch.zeros(n, 3, dtype=torch.int64)
        return DraftOutput(VerifyTree.chain(batch.root_tokens, drafts, torch.zeros(n, dtype=torch.int64)))

    def forget(self, request_ids: Sequence[Hashable]) -> None:
        if self.forgets:
            self.seen.difference_update(request_ids)

    @property
    def followed(self) -> frozenset[Hashable]:
        return frozenset(self.seen)


class _Stateless:
    method: Method = "ngram"
    max_draft_tokens = 4

    def propose(self, batch: DraftBatch) -> DraftOutput:
        raise AssertionError("not called")


def test_a_request_keyed_drafter_forgets_ended_requests() -> None:
    drafter = _Keyed()
    assert isinstance(drafter, RequestKeyedDrafter) and not isinstance(_Stateless(), RequestKeyedDrafter)
    rnd = SpeculativeRound(drafter, num_speculative_tokens=3)
    drafter.propose(DraftBatch(root_tokens=torch.tensor([1, 2]), num_steps=[3, 3], req_ids=["a", "b"]))
    with pytest.raises(RuntimeError, match=r"still follows requests \['a', 'b'\]"):
        rnd.leak_check()
    with pytest.raises(ValueError, match="request_ids: expected a sequence of request ids, got the str 'ab'"):
        rnd.on_free("ab")  # (not requests "a" and "b")
    rnd.on_free(["a", "b"])  # a step's finished requests together
    assert drafter.followed == frozenset()
    rnd.leak_check()


def test_what_a_drafter_keeps_after_free_is_a_leak() -> None:
    drafter = _Keyed(forgets=False)
    rnd = SpeculativeRound(drafter, num_speculative_tokens=3)
    drafter.seen.add("r7")
    rnd.on_free(["r7"])
    with pytest.raises(RuntimeError, match=r"\['r7'\]"):
        rnd.leak_check()


def test_adaptive_lengths_are_dropped_with_their_request() -> None:
    rnd = SpeculativeRound(_Stateless(), num_speculative_tokens=3, adaptive=AdaptiveConfig())
    rnd.on_alloc("x")  # a drafter without per-request memory: nothing to allocate
    assert rnd.adaptive is not None
    rnd.adaptive.length("x")  # x's state, as its first round makes it
    assert rnd.adaptive.requests == {"x"}
    with pytest.raises(RuntimeError, match=r"\['x'\]"):
        rnd.leak_check()
    rnd.on_free(["x"])
    assert rnd.adaptive.requests == frozenset()
    rnd.leak_check()


def test_feed_takes_a_forward_as_host_lists_like_committed_tokens() -> None:
    """`DraftFeed.add_forward` (a plain step's feed, counts as host lists) keeps what `add` of the same
    tokens as `CommittedTokens` keeps, and checks its counts."""
    import pytest
    import torch
    from hyspec_spec_workers.draft_feed import DraftFeed
    from hyspec_spec_workers.drafter import CommittedTokens

    class Sink:
        def __init__(self) -> None:
            self.got: list[CommittedTokens] = []

        def commit(self, c: CommittedTokens) -> None:
            self.got.append(c)

    hidden = torch.arange(10.0).reshape(5, 2)
    tokens = torch.tensor([7, 8, 9, 10, 11])
    sinks = []
    for use_lists in (False, True):
        sink = Sink()
        feed = DraftFeed(sink)  # type: ignore[arg-type]
        if use_lists:
            feed.add_forward(["a", "b"], [3, 0], [2, 3], tokens, hidden, ())
        else:
            c = CommittedTokens(["a", "b"], torch.tensor([3, 0]), torch.tensor([2, 3]), tokens, hidden, ())
            feed.add(c)
        assert feed.waiting == {"a", "b"}
        assert feed.flush(["b", "a"]) == 3
        sinks.append(sink)
    (x,), (y,) = (s.got for s in sinks)
    assert x.req_ids == y.req_ids == ["b", "a"]
    for name in ("start_positions", "num_tokens", "tokens", "hidden_states"):
        assert torch.equal(getattr(x, name), getattr(y, name)), name
    feed = DraftFeed(Sink())  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="num_tokens"):
        feed.add_forward(["a"], [0], [4], tokens, hidden, ())
    with pytest.raises(ValueError, match="expected one per request"):
        feed.add_forward(["a", "b"], [0], [5], tokens, hidden, ())
    with pytest.raises(ValueError, match=">= 0"):
        feed.add_forward(["a", "b"], [0, -1], [5, 0], tokens, hidden, ())


def test_feed_copies_a_forwards_outputs_and_keeps_an_accepted_paths_own_tensors() -> None:
    """`add_forward` copies the features (a CUDA graph's outputs are overwritten by its next replay): what it
    hands the drafter is what the forward gave, whatever the buffer holds later; `add` keeps a round's
    accepted path (the caller's own gathered tensors) without a copy."""
    import torch
    from hyspec_spec_workers.draft_feed import DraftFeed
    from hyspec_spec_workers.drafter import CommittedTokens

    class Sink:
        def __init__(self) -> None:
            self.got: list[CommittedTokens] = []

        def commit(self, c: CommittedTokens) -> None:
            self.got.append(c)

    sink = Sink()
    feed = DraftFeed(sink)  # type: ignore[arg-type]
    buffer = torch.arange(6.0).reshape(3, 2)  # a graph's output buffer
    feed.add_forward(["a"], [0], [3], torch.tensor([1, 2, 3]), buffer, ())
    buffer.fill_(-1.0)  # the next replay overwrites it
    feed.flush(["a"])
    assert torch.equal(sink.got[-1].hidden_states, torch.arange(6.0).reshape(3, 2))
    own = torch.ones(2, 2)
    feed.add(CommittedTokens(["b"], torch.tensor([4]), torch.tensor([2]), torch.tensor([5, 6]), own, ()))
    feed.flush(["b"])
    assert sink.got[-1].hidden_states.data_ptr() == own.data_ptr()  # no copy of the caller's own tensor


def test_pending_pairs_taken_whole_and_in_order_are_not_gathered() -> None:
    """`gather_pending`: every pair of a commit, in its order (a chain drafter's steady round), comes back as
    the commit's own tensors; any other selection or order is gathered, request by request."""
    import torch
    from hyspec_spec_workers.draft_pairs import Piece, gather_pending

    tok = torch.tensor([10, 11, 12, 13, 14])
    feat = torch.arange(10.0).reshape(5, 2)
    a, b = Piece(tok, feat, 0, 2), Piece(tok, feat, 2, 3)  # request a: pairs 0-1, b: pairs 2-4
    got = gather_pending([[a], [b]])
    assert got is not None and got[0] is tok and got[1] is feat and got[2] == [2, 3]
    got = gather_pending([[b], [a]])  # the other order: gathered
    assert got is not None and got[0].tolist() == [12, 13, 14, 10, 11] and got[2] == [3, 2]
    assert torch.equal(got[1], feat[[2, 3, 4, 0, 1]])
    got = gather_pending([[b]])  # part of the commit
    assert got is not None and got[0].tolist() == [12, 13, 14] and torch.equal(got[1], feat[2:])
    assert gather_pending([[], []]) is None


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_feed_uploads_plain_forwards_host_tokens_once_at_flush() -> None:
    """Plain forwards hand the feed their tokens on the host (no copy per step); `flush` gives the drafter
    device tokens equal to what was fed, request by request in position order: host records alone (one
    upload of the rows wanted, a subset of requests included), and host records mixed with an accepted
    path's device tokens."""
    from hyspec_spec_workers.draft_feed import DraftFeed
    from hyspec_spec_workers.drafter import CommittedTokens

    class Sink:
        def __init__(self) -> None:
            self.got: list[CommittedTokens] = []

        def commit(self, c: CommittedTokens) -> None:
            self.got.append(c)

    dev = torch.device("cuda")
    sink = Sink()
    feed = DraftFeed(sink)  # type: ignore[arg-type]
    hid = torch.arange(8.0, device=dev).reshape(4, 2)
    # two plain steps of requests a, b (host tokens), then a prompt chunk of c
    feed.add_forward(["a", "b"], [5, 9], [1, 1], torch.tensor([11, 21]), hid[:2], ())
    feed.add_forward(["a", "b"], [6, 10], [1, 1], torch.tensor([12, 22]), hid[2:], ())
    feed.add_forward(["c"], [0], [3], torch.tensor([31, 32, 33]), hid[:3], ())
    feed.flush(["b", "a"])  # host records only, a subset of the rows: gathered on the host, one upload
    got = sink.got[-1]
    assert got.tokens.device.type == "cuda" and got.tokens.tolist() == [21, 22, 11, 12]
    assert got.hidden_states.tolist() == [[2.0, 3.0], [6.0, 7.0], [0.0, 1.0], [4.0, 5.0]]
    # c: its host prompt tokens, then an accepted path whose tokens are on the device
    path = CommittedTokens(
        ["c"], torch.tensor([3]), torch.tensor([2]), torch.tensor([34, 35], device=dev), hid[:2], ()
    )
    feed.add(path)
    assert feed.flush(["c"]) == 5
    got = sink.got[-1]
    assert got.tokens.device.type == "cuda" and got.tokens.tolist() == [31, 32, 33, 34, 35]
    # a request whose only piece holds no token: an empty selection of host records
    feed.add_forward(["d", "e"], [4, 0], [0, 2], torch.tensor([41, 42]), hid[:2], ())
    assert feed.flush(["d"]) == 0
    got = sink.got[-1]
    assert got.tokens.device.type == "cuda" and got.tokens.shape == (0,)
