"""A round's outcome read without waiting for the proposal queued behind it, and the drafting clock that
leaves a still-running proposal to the next round (`choose.HostRound.start`, `costs.DraftClock`).

CUDA events are replaced by host fakes (recorded at a settable time, finished when told), so the clock's
accounting runs on a CPU: an unfinished interval is carried once and counted once, at its own steps."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import pytest
import torch
from hyspec_spec_workers import round as round_mod
from hyspec_spec_workers.choose import HostRound
from hyspec_spec_workers.costs import DraftClock
from hyspec_spec_workers.drafter import DraftOutput
from hyspec_spec_workers.round import SpeculativeRound
from hyspec_spec_workers.round_types import RoundRow, VerifiedTokens
from hyspec_spec_workers.sampling import SampledToken
from hyspec_spec_workers.tree import VerifyTree
from hyspec_spec_workers.verify import VerifyResult

CUDA = torch.device("cuda")


class _Events:
    """Fake `torch.cuda.Event`s: each records the current fake time; `finish` marks the recorded ones done."""

    def __init__(self) -> None:
        self.now = 0.0
        self.made: list[Any] = []
        events = self

        class Event:
            def __init__(self, enable_timing: bool = False) -> None:
                self.at: float | None = None
                self.done = False
                events.made.append(self)

            def record(self, stream: object = None) -> None:
                self.at = events.now

            def query(self) -> bool:
                return self.done

            def elapsed_time(self, end: Any) -> float:
                assert self.at is not None and end.at is not None, "an unrecorded event"
                return (end.at - self.at) * 1e3

        self.Event = Event

    def finish(self) -> None:
        for e in self.made:
            e.done = e.at is not None


@pytest.fixture
def events(monkeypatch: pytest.MonkeyPatch) -> _Events:
    ev = _Events()
    monkeypatch.setattr(torch.cuda, "Event", ev.Event)
    monkeypatch.setattr(torch.cuda, "current_stream", lambda device=None: None)
    return ev


def test_an_unfinished_interval_is_carried_once_and_counted_once(events: _Events) -> None:
    clock = DraftClock(CUDA)
    clock.start(3)  # the round's proposal: 1 s
    clock.stop()
    events.now = 1.0
    clock._intervals[-1].end.record()
    events.finish()
    events.now = 5.0
    clock.start(2)  # queued after the verify, still running at the read
    events.now = 7.0
    clock.stop()
    assert clock.read() == (pytest.approx(1.0), 3)
    assert clock.read() == (0.0, 0)  # counted once
    carried = clock.unfinished
    assert len(carried) == 1 and carried[0].steps == 2
    nxt = DraftClock(CUDA, carried)
    events.now = 10.0
    nxt.start(1)  # the next round's own proposal (drafts taken: next to nothing)
    events.now = 10.5
    nxt.stop()
    events.finish()
    # the carried proposal counts in the next round, at its own steps (it served that round)
    assert nxt.read() == (pytest.approx(2.5), 2)
    assert nxt.unfinished == [] and nxt.read() == (0.0, 0)


def test_on_the_cpu_the_clock_is_the_proposals_wall_time() -> None:
    clock = DraftClock(torch.device("cpu"))
    clock.start(3)
    clock.stop()
    seconds, steps = clock.read()
    assert 0.0 <= seconds < 1.0 and steps == 3 and clock.unfinished == []


class _Drafter:
    max_draft_tokens = 4

    def propose(self, batch: Any) -> DraftOutput:
        roots = batch.root_tokens
        return DraftOutput(VerifyTree.chain(roots, torch.ones(roots.shape[0], 3, dtype=torch.int64)))


@dataclass
class _Params:
    temperature: float = 0.0
    seed: int | None = None
    logprobs: int | None = None


@dataclass
class _Req:
    request_id: str
    params: _Params = field(default_factory=_Params)


class _Target:
    device = CUDA  # the clock's events are the fakes

    def decode(self, rows: list[RoundRow]) -> list[SampledToken]:
        return [SampledToken(1, None, None) for _ in rows]


def _carried(events: _Events, steps: int) -> list[Any]:
    """One interval of `steps` that ran 2 s and is still unfinished (a proposal queued after a verify)."""
    clock = DraftClock(CUDA)
    events.now = 100.0
    clock.start(steps)
    events.now = 102.0
    clock.stop()
    return clock.unfinished


def _row(max_drafts: int) -> RoundRow:
    req: Any = _Req("a")
    return RoundRow(req, 10, 5, max_drafts=max_drafts, max_new_tokens=50, stop_token_ids=frozenset())


def test_reset_measurements_forgets_a_carried_interval(events: _Events) -> None:
    spec = SpeculativeRound(_Drafter(), num_speculative_tokens=3)  # type: ignore[arg-type]
    spec._draft_carry = _carried(events, 3)
    spec.reset_measurements()
    assert spec._draft_carry == []


def test_a_round_counts_a_carried_interval_at_its_steps_or_drops_it_when_it_drafts_nothing(
    events: _Events, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A drafted round charges a carried proposal's seconds as drafting at the proposal's own steps (the most
    steps of what it counts); a round that drafts nothing (no queued drafts taken) charges it to none."""
    spec = SpeculativeRound(_Drafter(), num_speculative_tokens=3)  # type: ignore[arg-type]
    drafted: list[tuple[int, float]] = []
    monkeypatch.setattr(spec.costs, "record_draft", lambda k, sec, *a: drafted.append((k, sec)))
    monkeypatch.setattr(
        round_mod,
        "verify_round",
        lambda target, rows, draft, on_host, **kw: (
            [VerifiedTokens((SampledToken(1, None, None),) * 4, 3, 3)] * len(rows),
            4,
        ),
    )
    target: Any = _Target()
    spec._draft_carry = _carried(events, 5)
    events.finish()
    spec.run(target, [_row(3)])
    spec.begin_step()  # the timer records the round at the next step
    # the carried 2 s, at its 5 steps; the round's own proposal has not finished (its fake events are not
    # done): it is carried on, once
    assert drafted == [(5, pytest.approx(2.0))]
    assert [i.steps for i in spec._draft_carry] == [3]
    # no drafts this round (no room): the carried interval is dropped, not charged to a later round
    spec._draft_carry = _carried(events, 2)
    spec.run(target, [_row(0)])
    assert spec._draft_carry == []


@pytest.mark.parametrize("with_paths", [False, True])
def test_the_outcome_started_early_reads_what_a_read_reads(with_paths: bool) -> None:
    g = torch.Generator().manual_seed(0)
    n, d = 5, 4
    acc = torch.randint(0, d, (n,), generator=g)
    res = VerifyResult(
        num_accepted=acc,
        accept_index=torch.randint(-1, d, (n, d), generator=g),
        output_tokens=torch.randint(0, 100, (n, d), generator=g),
        bonus=torch.randint(0, 100, (n,), generator=g),
        commit_steps=acc.clone(),
        finished=torch.zeros(n, dtype=torch.bool),
    )
    pending = HostRound.start(res, with_paths=with_paths)
    got, want = pending.wait(), HostRound.read(res, with_paths=with_paths)
    assert got == want
    assert got.num_accepted == acc.tolist()
    assert got.tokens == [res.output_tokens[i, : int(acc[i]) + 1].tolist() for i in range(n)]
    assert (got.paths is not None) == with_paths
    if got.paths is not None:
        assert got.paths == res.accept_index.tolist()


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_on_cuda_the_outcome_is_read_while_later_work_runs() -> None:
    """The copy lands before work queued after it: the read is right while a long matmul chain still runs."""
    n, d = 8, 4
    acc = torch.arange(n, device="cuda") % d
    out = torch.arange(n * d, device="cuda").view(n, d)
    res = VerifyResult(acc, out.clone(), out, acc, acc, torch.zeros(n, dtype=torch.bool, device="cuda"))
    pending = HostRound.start(res, with_paths=True)
    x = torch.randn(2048, 2048, device="cuda")
    for _ in range(50):
        x = x @ x / 2048  # queued behind the copy
    got = pending.wait()
    assert got.num_accepted == acc.tolist() and got.paths == out.tolist()
    assert got.tokens == [out[i, : int(acc[i]) + 1].tolist() for i in range(n)]


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_on_cuda_kept_outcome_buffers_read_what_a_fresh_copy_reads() -> None:
    """`OutcomeBuffers`: rounds of any batch size read their own outcome through buffers kept across rounds
    (a buffer taken and not yet read back is never handed to another copy), equal to torch's own copy."""
    from hyspec_spec_workers.choose import OutcomeBuffers, PendingRound

    buffers = OutcomeBuffers()
    d = 4
    seen: set[int] = set()
    for n in (3, 8, 1, 8, 12, 2):
        packed = torch.randint(0, d, (n, 1 + d), device="cuda")
        first = PendingRound(packed, d, with_paths=False, buffers=buffers)
        second = PendingRound(packed + 1, d, with_paths=False, buffers=buffers)  # not read yet: another one
        assert first._packed.data_ptr() != second._packed.data_ptr()
        seen.add(first._packed.data_ptr())
        x = torch.randn(1024, 1024, device="cuda")
        for _ in range(20):
            x = x @ x / 1024  # queued behind both copies
        assert second.wait() == PendingRound(packed + 1, d, with_paths=False).wait()
        assert first.wait() == PendingRound(packed, d, with_paths=False).wait()
    assert len(seen) <= 3  # kept and reused, grown only for a larger batch


def test_a_clock_looks_the_stream_up_once_per_round(monkeypatch: pytest.MonkeyPatch, events: _Events) -> None:
    """Each lookup of the current stream costs as much host time as the event record itself."""
    calls: list[object] = []
    stream = object()

    def current_stream(device: object = None) -> object:
        calls.append(device)
        return stream

    monkeypatch.setattr(torch.cuda, "current_stream", current_stream)
    clock = DraftClock(CUDA)
    for steps in (3, 2):
        clock.start(steps)
        clock.stop()
    assert clock.stream is stream and len(calls) == 1
