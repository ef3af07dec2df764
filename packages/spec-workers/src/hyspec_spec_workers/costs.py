"""What speculation costs, measured: the numbers the adaptive draft length weighs against plain decoding.

`CostModel` is the seam (`adaptive.py` reads it); `CostEstimate` gives fixed costs (simulations, tests);
`CostTracker` keeps what the engine measures, per batch bucket: the fastest of the latest steady plain decode
steps, and the medians of the latest draft steps and verify forwards per block size; and an exponential
average of a catch-up draft extend. `CostTracker.at(rows)` is the `CostModel` a round over `rows` requests is
judged by. `DraftClock` times a round's drafting without making the host wait for it.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Protocol

import torch


class CostModel(Protocol):
    """Seconds per round for a batch; measured (`CostTracker`) or injected (`CostEstimate`)."""

    def decode_s(self) -> float: ...

    def round_s(self, num_drafts: int) -> float: ...

    def catch_up_s(self) -> float:
        """Extra seconds of a round whose draft extend first catches up on the tokens committed while the
        request did not draft (a probe's first round), beyond an ordinary round; 0 when unknown."""
        ...

    def rows_per_step(self) -> float:
        """Requests per decode step: a step's seconds over this many request-rounds."""
        ...


@dataclass(frozen=True, slots=True)
class CostEstimate:
    """Fixed costs: a round with k >= 1 drafts costs draft_base_s + k * draft_step_s + verify_s(k + 1)."""

    decode: float
    draft_step: float
    verify_base: float
    verify_per_token: float = 0.0
    draft_base: float = 0.0
    catch_up: float = 0.0
    rows: float = 1.0

    def __post_init__(self) -> None:
        for name in ("decode", "draft_step", "verify_base", "verify_per_token", "draft_base", "catch_up"):
            v = getattr(self, name)
            if not v >= 0.0:
                raise ValueError(f"{name}: expected seconds >= 0, got {v!r}")
        if self.decode <= 0.0:
            raise ValueError(f"decode: expected seconds > 0, got {self.decode!r}")
        if not self.rows >= 1.0:
            raise ValueError(f"rows: expected >= 1 requests per step, got {self.rows!r}")

    def decode_s(self) -> float:
        return self.decode

    def catch_up_s(self) -> float:
        return self.catch_up

    def rows_per_step(self) -> float:
        return self.rows

    def round_s(self, num_drafts: int) -> float:
        if num_drafts == 0:
            return self.decode
        return (
            self.draft_base
            + num_drafts * self.draft_step
            + self.verify_base
            + self.verify_per_token * num_drafts
        )


def batch_bucket(rows: int) -> int:
    """The cost bucket of a round over `rows` requests: `rows` padded as the engine's CUDA graphs pad a
    batch (1, 2, 4, 8, then multiples of 8: `hyspec_attn_backends.capture_sizes`), whose size a step's cost
    follows. (Power-of-two buckets were too coarse: 17 rows cost 30% less than 32 on the 9B shape.)"""
    if rows <= 4:
        return 1 << max(rows - 1, 0).bit_length()
    return -(-rows // 8) * 8


@dataclass(slots=True)
class _Bucket:
    """One batch bucket's measurements (`CostTracker`)."""

    decode_recent: list[float] = field(default_factory=list)  # the latest steady plain steps, oldest first
    draft_recent: list[float] = field(default_factory=list)  # the latest seconds per draft step
    verify_recent: dict[int, list[float]] = field(default_factory=dict)  # the latest verifies per block size


class CostTracker:
    """Measured costs, per batch bucket (`batch_bucket`): the fastest of the latest steady plain steps, the
    medians of the latest draft steps and verify forwards per block size; and EMAs of catch-up rounds and
    rows per step.

    A step's cost grows with its batch (9B shape on an H200: a plain step 5.2 ms at 1 row and 10.4 ms at
    32, a round with one draft 6.5 and 12.1 ms), so a round is judged by what rounds and plain steps of its
    own batch bucket cost (`at`). Pooled over every batch, rounds timed while a batch ramped up (a few rows
    at a time, cheap) judged the full batch's rounds: drafting that lost 38% at 32 rows looked free.

    Round costs are medians of the latest `ROUND_SAMPLES`, not averages from the first: a bucket's first
    round is cold (its proposal not queued behind a verify, its verify batch built, not moved on) and costs
    several steady rounds; an exponential average started there (alpha 0.1) still held a third of that
    excess after the ten rounds of a request's warm-up, so a warm-up judged drafting by a cost it no longer
    had (on an H200, adaptive MTP on the demo model held a round with 3 drafts at 3.5 ms at batch 1, where
    the fixed-length engine's steady rounds cost 1.95 ms, and stopped drafting). A median drops such a
    round, and a stall, as soon as a few warm ones follow, and follows a real change within a few rounds.

    Catch-up rounds (`record_catch_up`) are rare and their cost moves with the load, so their EMA weighs
    each new one by `CATCH_UP_ALPHA`; they are kept as (seconds, drafts, rows) and weighed against the round
    costs of their bucket known when asked, since the first ones often come before any ordinary round was
    timed.
    """

    CATCH_UP_ALPHA = 0.5
    DECODE_SAMPLES = 4  # steady plain steps the decode cost is the fastest of
    ROUND_SAMPLES = 5  # draft steps and verifies (per block size) their costs are the medians of

    def __init__(self, alpha: float = 0.1) -> None:
        if not 0.0 < alpha <= 1.0:
            raise ValueError(f"alpha: expected in (0, 1], got {alpha}")
        self.alpha = alpha
        self._buckets: dict[int, _Bucket] = {}
        self._rows: float | None = None
        self._catch_up: list[tuple[float, int, int]] = []  # the latest few (seconds, drafts, rows)

    def _ema(self, old: float | None, new: float) -> float:
        return new if old is None else (1.0 - self.alpha) * old + self.alpha * new

    def _bucket(self, rows: int) -> _Bucket:
        return self._buckets.setdefault(batch_bucket(rows), _Bucket())

    def at(self, rows: int) -> BatchCosts:
        """The costs of a round over `rows` requests: those measured in its batch bucket."""
        return BatchCosts(self, self._buckets.get(batch_bucket(rows), _Bucket()))

    def record_decode(self, seconds: float, rows: int = 1, *, steady: bool = True) -> None:
        """A plain decode step of `rows` requests took `seconds`; `steady`: it came right after another
        plain step. Only steady steps count: an isolated plain round among drafting ones prepares its batch
        on the critical path and costs up to twice a steady step, which would favour drafting."""
        if steady:
            # the fastest of the latest few: a plain step's first replay at a new batch size (a cold graph)
            # or a stall would otherwise hold the estimate up for many rounds, and a high plain cost makes
            # drafting look better than it is
            b = self._bucket(rows)
            b.decode_recent = [*b.decode_recent[-(self.DECODE_SAMPLES - 1) :], seconds]
            self._rows = self._ema(self._rows, float(max(rows, 1)))

    def record_catch_up(self, seconds: float, num_drafts: int = 0, rows: int = 1) -> None:
        """A round of `rows` requests (or a bare draft extend, `num_drafts` 0) that caught the draft KV up
        took `seconds`."""
        self._catch_up = [*self._catch_up[-7:], (seconds, num_drafts, rows)]

    def catch_up_s(self) -> float:
        excess: float | None = None
        a = self.CATCH_UP_ALPHA
        for seconds, k, rows in self._catch_up:
            round_costs = self.at(rows)
            extra = max(0.0, seconds - (round_costs.round_s(k) if k and round_costs.ready else 0.0))
            excess = extra if excess is None else (1.0 - a) * excess + a * extra
        return excess or 0.0

    def rows_per_step(self) -> float:
        return self._rows or 1.0

    def record_draft(self, num_steps: int, seconds: float, rows: int = 1) -> None:
        if num_steps >= 1:
            b = self._bucket(rows)
            b.draft_recent = [*b.draft_recent[-(self.ROUND_SAMPLES - 1) :], seconds / num_steps]

    def record_verify(self, block_size: int, seconds: float, rows: int = 1) -> None:
        b = self._bucket(rows)
        b.verify_recent[block_size] = [
            *b.verify_recent.get(block_size, [])[-(self.ROUND_SAMPLES - 1) :],
            seconds,
        ]

    @property
    def ready(self) -> bool:
        """Some batch bucket has its round costs (`BatchCosts.ready`)."""
        return any(BatchCosts(self, b).ready for b in self._buckets.values())

    @property
    def has_decode(self) -> bool:
        """Some batch bucket has a plain step timed (`BatchCosts.has_decode`)."""
        return any(b.decode_recent for b in self._buckets.values())


class BatchCosts:
    """The `CostModel` of one batch bucket of a `CostTracker` (`CostTracker.at`).

    Before a steady plain decode step has been timed in the bucket, decode cost is taken as the verify time
    of the smallest block seen (a D = 1 verify is a decode step); unmeasured block sizes are extrapolated
    linearly. Catch-ups and rows per step are the tracker's (every bucket's).
    """

    def __init__(self, tracker: CostTracker, bucket: _Bucket) -> None:
        self._tracker = tracker
        self._b = bucket

    @property
    def ready(self) -> bool:
        return bool(self._b.draft_recent) and bool(self._b.verify_recent)

    @property
    def has_decode(self) -> bool:
        """A plain decode step has been timed (before that, `decode_s` is a verify time: too high)."""
        return bool(self._b.decode_recent)

    def _verify_s(self, d: int) -> float:
        verify = {size: statistics.median(ts) for size, ts in self._b.verify_recent.items()}
        if d in verify:
            return verify[d]
        sizes = sorted(verify)
        if len(sizes) == 1:
            return verify[sizes[0]]
        lo, hi = (sizes[0], sizes[1]) if d < sizes[0] else (sizes[-2], sizes[-1])
        slope = (verify[hi] - verify[lo]) / (hi - lo)
        return max(verify[lo] + slope * (d - lo), 0.0)

    def decode_s(self) -> float:
        if self._b.decode_recent:
            return min(self._b.decode_recent)
        return self._verify_s(min(self._b.verify_recent)) if self._b.verify_recent else 1.0

    def round_s(self, num_drafts: int) -> float:
        if num_drafts == 0:
            return self.decode_s()
        draft = statistics.median(self._b.draft_recent) if self._b.draft_recent else 0.0
        return num_drafts * draft + self._verify_s(num_drafts + 1)

    def catch_up_s(self) -> float:
        return self._tracker.catch_up_s()

    def rows_per_step(self) -> float:
        return self._tracker.rows_per_step()


# drafting rounds between two timings of a steady plain decode step (`RoundTimer`), and the plain rounds of
# a timing (the first is not steady): three plain rounds in 256 cost about 1% of what drafting gains
TIMING_EVERY = 256
TIMING_ROUNDS = 3
# timing rounds in a row that may share their step's forward with other work (a batch ramping up as its
# prompts prefill), measuring nothing, before one runs alone (so that arrivals cannot starve a timing)
TIMING_DEFER = 8


class RoundTimer:
    """When a speculative engine's rounds are timed, and what each is charged, into a `CostTracker`.

    Plain-step timing (cost-aware adaptive lengths only): every cost decision compares drafting against a
    steady plain step, one right after another plain step, as when nobody drafts. An isolated plain round
    among drafting ones (or the engine's first) builds its batch on the critical path and can cost twice as
    much, which makes drafting look better than it is; so a timing runs `TIMING_ROUNDS` plain rounds in a
    row and records all but the first (`CostTracker.record_decode` keeps the fastest of the latest), at the
    start and again every `TIMING_EVERY` drafting rounds; and a round over a batch whose bucket has no plain
    step timed yet is a timing round too (costs are kept per batch bucket: `CostTracker.at`).
    Timing rounds cost nothing against plain decoding; the requests' length states do not observe them.
    A timing round's plain step runs alone, as it would in a plain engine; where its step has other work
    (prompt chunks) it may share their forward instead, measuring nothing, up to `TIMING_DEFER` times
    until a steady step is measured (`may_share`): a batch ramping up through several buckets would
    otherwise run two forwards a step. After that it runs alone, the other work in a forward of its own
    before it.

    What a round is charged: what the engine spends per step because of it, the round itself plus the
    engine's work around it (emitting its tokens, scheduling the next step), which grows with the tokens a
    round emits and can be a third of a step on a fast model. So a round's costs are recorded when the next
    step begins (`begin_step`, or the next round), with the time since the round ended added, unless that
    gap is longer than the round itself (an idle engine, or a step of other work in between).

    Args:
        costs: where the measurements go.
        cost_aware: the rounds' lengths weigh costs (adaptive lengths with `cost_aware`): timing rounds run.
    """

    def __init__(self, costs: CostTracker, *, cost_aware: bool) -> None:
        self.costs = costs
        self.cost_aware = cost_aware
        self._plain_before = False  # the last round was a plain decode step (the next one is steady)
        self._timing_left = TIMING_ROUNDS  # plain rounds still to run for the current timing
        self._deferred = 0  # timing rounds that shared their forward since a steady one (`may_share`)
        self._since_timing = 0  # drafting rounds since the last timing
        self._pending: Callable[[float], None] | None = None  # the last round's record, awaiting its gap
        self._last_end = 0.0

    def timing(self, rows: int) -> bool:
        """This round, over `rows` requests, is a timing round: nobody drafts."""
        return self.cost_aware and (self._timing_left > 0 or not self.costs.at(rows).has_decode)

    def may_share(self, rows: int) -> bool:
        """Whether this round, over `rows` requests, may run other work of its step in its forward: unless
        it times a plain step, or while timing rounds have shared their forward fewer than `TIMING_DEFER`
        times since the last steady one was measured (rounds alone in between are not steady after a
        shared one: with a prompt arriving every other step, they would never be)."""
        return not self.timing(rows) or self._deferred < TIMING_DEFER

    def timing_continues(self) -> bool:
        """Asked before a timing round's plain step: the round after it times a plain step too (nobody
        drafts in it), so its forward may be queued ahead and timed as a plain engine runs it. So it does
        while the timing has rounds left after this one. (Not for a bucket without a plain step timed: the
        next round's batch may be smaller, in a bucket that has one, and draft after its forward was queued
        ahead.)"""
        return self.cost_aware and self._timing_left >= 2

    def next_is_timing(self, rows: int) -> bool:
        """Called during a drafting round over `rows` requests: the next round (over as many) times a plain
        step (nobody drafts in it)."""
        return self.cost_aware and (
            self._since_timing + 1 >= TIMING_EVERY or not self.costs.at(rows).has_decode
        )

    def begin_step(self) -> None:
        """The engine starts a step (rounds or not): the last round is recorded with the gap since it."""
        record, self._pending = self._pending, None
        if record is not None:
            record(time.perf_counter() - self._last_end)

    def plain(
        self,
        seconds: float | None,
        *,
        rows: int,
        timing: bool,
        steady_next: bool = True,
        queued_ahead: bool = False,
    ) -> None:
        """The round was a plain decode step of `rows` requests taking `seconds` (None: not timed);
        `steady_next`: a plain step right after it is steady (False after a step that ran other work);
        `queued_ahead`: its forward was queued during the last step (async scheduling) and ran while the
        engine emitted and scheduled, so `seconds` holds only what was left of it: the step costs the whole
        time since the last round, however long the engine's part of it."""
        if seconds is not None:
            steady = self._plain_before

            def record(gap: float) -> None:
                charged = max(gap, 0.0) if queued_ahead else _share(gap, seconds)
                self.costs.record_decode(seconds + charged, rows=rows, steady=steady)

            self._pending = record
        if timing and seconds is None:
            self._deferred += 1  # it shared its forward (`may_share`): the timing goes on
        elif timing:
            self._timing_left = max(self._timing_left - 1, 0)
            if self._plain_before:
                self._deferred = 0  # a steady step is measured: the timing has its due
        self._plain_before = steady_next

    def drafted(
        self, num_drafts: int, block_size: int, drafting: float, rest: float | None, *, rows: int
    ) -> None:
        """The round over `rows` requests drafted `num_drafts` steps (`drafting` seconds on the device) and
        verified a block of `block_size` in `rest` more seconds (None: not timed, a catch-up round)."""
        self._plain_before, self._deferred = False, 0  # (a timing left unfinished owes nothing)
        self._since_timing += 1
        if self._since_timing >= TIMING_EVERY:
            self._since_timing, self._timing_left = 0, TIMING_ROUNDS
        if rest is not None:

            def record(gap: float) -> None:
                self.costs.record_draft(num_drafts, drafting, rows)
                self.costs.record_verify(block_size, rest + _share(gap, drafting + rest), rows)

            self._pending = record

    def catch_up(self, seconds: float, num_drafts: int, *, rows: int) -> None:
        """The round's draft extend caught up on more than a block: the round is timed as a catch-up."""
        self._pending = lambda gap: self.costs.record_catch_up(
            seconds + _share(gap, seconds), num_drafts, rows
        )

    def end_round(self) -> None:
        self._last_end = time.perf_counter()

    def exclude(self, seconds: float) -> None:
        """`seconds` of one-off engine work since the last round that no round caused (prefix-cache saves
        and the draft extend they run): left out of the gap the round is charged."""
        if self._pending is not None:
            self._last_end += seconds


def _share(gap: float, seconds: float) -> float:
    """The engine's time between a round and the next step that the round is charged: all of it, unless
    it is longer than the round itself (an idle engine, or other work in between)."""
    return gap if 0.0 <= gap <= seconds else 0.0


@dataclass(slots=True)
class DraftInterval:
    """One drafting interval on the device: two events on the device's stream around it, and the draft steps
    it ran."""

    start: torch.cuda.Event
    end: torch.cuda.Event
    steps: int


class DraftClock:
    """Times a round's drafting without making the host wait for it.

    On CUDA two events on the device's stream bracket each drafting interval (the proposal, and the next
    round's proposal queued right after the verify, `round_verify.py`), and `read` sums the finished ones: the
    host queues the verify forward while the device still drafts, and reads the round's outcome before the
    proposal queued behind it is done. An interval still running is left to the next round's clock
    (`unfinished`, passed on as `carried`): the proposal serves that round (its drafts are taken there), so
    its cost is that round's drafting, at the steps it ran. The verify cost is the rest of the round's wall
    time. On the CPU the proposals' wall time.
    """

    def __init__(self, device: torch.device, carried: Sequence[DraftInterval] = ()) -> None:
        self._device = device
        self._cuda = device.type == "cuda"
        self._stream: torch.cuda.Stream | None = None  # `stream`
        self._intervals: list[DraftInterval] = list(carried)
        self._t0 = self._wall = 0.0
        self._wall_steps = 0  # the most steps of an interval timed on the host (CPU)

    @property
    def stream(self) -> torch.cuda.Stream:
        """The device's current stream, looked up once per round (each lookup costs about 6 us of host time
        on a lent H200's host, as much as the event record itself): the round's work never switches
        streams. CUDA only."""
        if self._stream is None:
            self._stream = torch.cuda.current_stream(self._device)
        return self._stream

    def start(self, steps: int) -> None:
        """An interval of `steps` draft steps starts (`stop` ends it)."""
        if self._cuda:
            new = torch.cuda.Event
            span = DraftInterval(new(enable_timing=True), new(enable_timing=True), steps)  # type: ignore[no-untyped-call]
            self._intervals.append(span)
            span.start.record(self.stream)
        self._wall_steps = max(self._wall_steps, steps)
        self._t0 = time.perf_counter()

    def stop(self) -> None:
        if self._intervals:
            self._intervals[-1].end.record(self.stream)
        self._wall += time.perf_counter() - self._t0

    def read(self) -> tuple[float, int]:
        """(seconds, steps): every finished interval's seconds, summed, and the most steps one of them ran;
        each interval counted once (`unfinished` keeps the others)."""
        if not self._cuda:
            return self._wall, self._wall_steps
        # end done: start is too (one stream); both recorded (`stop` follows every `start`)
        finished = [span.end.query() for span in self._intervals]  # type: ignore[no-untyped-call]
        done = [span for span, f in zip(self._intervals, finished, strict=True) if f]
        self._intervals = [span for span, f in zip(self._intervals, finished, strict=True) if not f]
        seconds = sum(float(span.start.elapsed_time(span.end)) for span in done) / 1e3
        return seconds, max((span.steps for span in done), default=0)

    @property
    def unfinished(self) -> list[DraftInterval]:
        """The intervals `read` has not counted yet: for the next round's clock."""
        return list(self._intervals)
