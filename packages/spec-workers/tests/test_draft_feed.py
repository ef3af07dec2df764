"""`DraftFeed` keeps every committed token of a request, in position order, until its draft extend: checked
against a plain per-request list under random mixes of decode steps (which extend the open run of decode
forwards with no per-request bookkeeping), prompt chunks, accepted paths, reorders, flushes and drops."""

from __future__ import annotations

import random

import pytest
import torch
from hyspec_spec_workers import draft_feed
from hyspec_spec_workers.draft_feed import MAX_PENDING, DraftFeed
from hyspec_spec_workers.drafter import CommittedTokens


class _Sink:
    """A drafter that records what each draft extend got."""

    def __init__(self) -> None:
        self.got: list[CommittedTokens] = []

    def commit(self, c: CommittedTokens) -> None:
        self.got.append(c)


def _rows(c: CommittedTokens) -> dict[str, list[tuple[int, int, float, float]]]:
    """Each request's (position, token, feature, aux feature) in a commit, in its order."""
    out: dict[str, list[tuple[int, int, float, float]]] = {}
    off = 0
    for rid, s, q in zip(c.req_ids, c.start_positions.tolist(), c.num_tokens.tolist(), strict=True):
        toks = c.tokens[off : off + q].tolist()
        feats = c.hidden_states[off : off + q, 0].tolist()
        aux = c.aux_hidden_states[0][off : off + q, 0].tolist()
        out[str(rid)] = [(s + i, toks[i], feats[i], aux[i]) for i in range(q)]
        off += q
    return out


def _forward(
    feed: DraftFeed,
    ids: list[str],
    pos: dict[str, int],
    counts: list[int],
    want: dict[str, list[tuple[int, int, float, float]]],
) -> None:
    """A plain forward of these requests (`counts[i]` tokens each from its position), into the feed and the
    expected lists; the features passed are a buffer the test overwrites afterwards (a graph's outputs)."""
    tokens: list[int] = []
    feats: list[float] = []
    for rid, q in zip(ids, counts, strict=True):
        for i in range(q):
            p = pos[rid] + i
            tok, f = 1000 * ord(rid[0]) + p, float(100 * ord(rid[0]) + p)
            tokens.append(tok)
            feats.append(f)
            want.setdefault(rid, []).append((p, tok, f, -f))
    hidden = torch.tensor(feats).reshape(-1, 1).repeat(1, 2)  # [T, 2]
    aux = -hidden
    feed.add_forward(
        ids, [pos[r] for r in ids], counts, torch.tensor(tokens, dtype=torch.int64), hidden, (aux,)
    )
    hidden.fill_(float("nan"))  # the next replay overwrites the outputs: the feed copied them
    aux.fill_(float("nan"))
    for rid, q in zip(ids, counts, strict=True):
        pos[rid] += q


@pytest.mark.parametrize("seed", range(6))
def test_feed_gives_each_request_its_tokens_in_order_under_random_steps(
    seed: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Random engine histories (a small `MAX_PENDING`, so that runs fill up and flush themselves): every draft
    extend gets exactly the tokens, features and positions fed since the request's last one, request by
    request in the order asked, and nothing is lost or given twice."""
    monkeypatch.setattr(draft_feed, "MAX_PENDING", 12)
    rng = random.Random(seed)
    sink = _Sink()
    feed = DraftFeed(sink)  # type: ignore[arg-type]
    names = ["a", "b", "c", "d", "e"]
    pos = {r: 0 for r in names}
    live: list[str] = []
    want: dict[str, list[tuple[int, int, float, float]]] = {}
    seen = 0

    def check_new_commits() -> None:
        nonlocal seen
        for c in sink.got[seen:]:
            for rid, got in _rows(c).items():
                assert got == want[rid][: len(got)], rid  # the oldest waiting tokens, in order
                assert len(got) == len(want[rid]), rid  # and all of them
                del want[rid]
        seen = len(sink.got)
        for rid, rows in want.items():
            assert len(rows) < draft_feed.MAX_PENDING, rid  # a full request was flushed at once

    for _ in range(300):
        op = rng.random()
        if op < 0.08 and len(live) < len(names):  # a request joins with a prompt chunk
            rid = rng.choice([r for r in names if r not in live])
            live.append(rid)
            _forward(feed, [rid], pos, [rng.randint(1, 5)], want)
        elif op < 0.62 and live:  # a decode step of the live requests (mostly in the same order)
            if rng.random() < 0.1:
                rng.shuffle(live)
            _forward(feed, list(live), pos, [1] * len(live), want)
        elif op < 0.70 and live:  # a mixed step: one request's prompt chunk beside the others' tokens
            counts = [1] * len(live)
            counts[rng.randrange(len(live))] = rng.choice([0, 2, 3])
            _forward(feed, list(live), pos, counts, want)
        elif op < 0.78 and live:  # a round's accepted path (the caller's own tensors)
            rid = rng.choice(live)
            q = rng.randint(1, 4)
            toks = [1000 * ord(rid[0]) + pos[rid] + i for i in range(q)]
            f = (
                torch.tensor([float(100 * ord(rid[0]) + pos[rid] + i) for i in range(q)])
                .reshape(-1, 1)
                .repeat(1, 2)
            )
            want.setdefault(rid, []).extend(
                (pos[rid] + i, toks[i], f[i, 0].item(), -f[i, 0].item()) for i in range(q)
            )
            feed.add(
                CommittedTokens(
                    [rid], torch.tensor([pos[rid]]), torch.tensor([q]), torch.tensor(toks), f, (-f,)
                )
            )
            pos[rid] += q
        elif op < 0.92 and live:  # a proposal flushes some requests, in any order
            ids = rng.sample(live, rng.randint(1, len(live)))
            feed.flush(ids)
            for rid in ids:
                assert rid not in feed.waiting
        elif live:  # a request ends (freed): its waiting tokens are forgotten
            rid = live.pop(rng.randrange(len(live)))
            feed.drop(rid)
            want.pop(rid, None)
            pos[rid] = 0
        check_new_commits()
    feed.flush(list(live))
    check_new_commits()
    assert not want and not feed.waiting


def test_a_full_run_flushes_its_members_together_and_keeps_no_work_per_request() -> None:
    """Decode steps of the same requests extend one run; when its fullest member reaches `MAX_PENDING`, one
    draft extend takes it and every member holding at least half as many, and a member with fewer waits on."""
    sink = _Sink()
    feed = DraftFeed(sink)  # type: ignore[arg-type]
    pos = {"a": 0, "b": 0, "c": 0}
    want: dict[str, list[tuple[int, int, float, float]]] = {}
    _forward(feed, ["a"], pos, [3], want)  # a's prompt
    for _ in range(MAX_PENDING // 2 - 4):
        _forward(feed, ["a"], pos, [1], want)
    _forward(feed, ["b", "c"], pos, [2, 1], want)  # b's and c's prompts, beside nothing else
    _forward(feed, ["c"], pos, [1], want)
    assert not sink.got
    steps = 0
    while not sink.got:
        _forward(feed, ["a", "b", "c"], pos, [1, 1, 1], want)
        steps += 1
    run = feed._run
    assert run is None  # the flush closed it
    (c,) = sink.got
    got = _rows(c)
    # a reached MAX_PENDING first; b and c (joined later) held at least half as many
    assert set(got) == {"a", "b", "c"} and len(got["a"]) == MAX_PENDING
    for rid in got:
        assert got[rid] == want[rid]
    assert steps == MAX_PENDING - (MAX_PENDING // 2 - 1)


def test_decode_steps_extend_the_run_only_at_each_requests_next_position() -> None:
    """A decode step of the same requests at other positions (a request that went back and came again, a
    reorder) starts a new run; each request's tokens still come out in position order."""
    sink = _Sink()
    feed = DraftFeed(sink)  # type: ignore[arg-type]
    pos = {"a": 5, "b": 9}
    want: dict[str, list[tuple[int, int, float, float]]] = {}
    _forward(feed, ["a", "b"], pos, [1, 1], want)
    first = feed._run
    _forward(feed, ["a", "b"], pos, [1, 1], want)
    assert feed._run is first and first is not None and len(first.records) == 2
    _forward(feed, ["b", "a"], pos, [1, 1], want)  # reordered: a new run
    assert feed._run is not first
    pos["a"] += 1  # a position skipped (not fed): no run goes on from a gap
    _forward(feed, ["b", "a"], pos, [1, 1], want)
    assert feed._run is not None and len(feed._run.records) == 1
    feed.flush(["b", "a"])
    (c,) = sink.got
    assert c.req_ids == ["b", "a"]
    got = _rows(c)
    assert got["b"] == want["b"]
    # in the order fed (positions are counted from the first: the gap is the caller's to avoid)
    assert [t for _, t, _, _ in got["a"]] == [t for _, t, _, _ in want["a"]]


def test_counts_summing_to_the_rows_extend_no_run_unless_each_is_one() -> None:
    """A forward whose counts sum to its number of requests without each being 1 (`[2, 0]`), or that names a
    request twice, is no decode step: its tokens go to their own requests, in order."""
    sink = _Sink()
    feed = DraftFeed(sink)  # type: ignore[arg-type]
    pos = {"a": 0, "b": 0}
    want: dict[str, list[tuple[int, int, float, float]]] = {}
    _forward(feed, ["a", "b"], pos, [1, 1], want)
    _forward(feed, ["a", "b"], pos, [2, 0], want)  # a's two tokens at its next position, none for b
    _forward(feed, ["a", "b"], pos, [1, 1], want)
    feed.flush(["a", "b"])
    got = _rows(sink.got[-1])
    assert got == want and len(got["a"]) == 4 and len(got["b"]) == 2
    feed.add_forward(
        [1, "1"], [0, 1], [1, 1], torch.tensor([10, 11]), torch.zeros(2, 2), (torch.zeros(2, 2),)
    )
    feed.flush(["1"])  # one request named twice (1 and "1" are the same key): both tokens kept, in order
    assert sink.got[-1].tokens.tolist() == [10, 11]
