"""Adaptive draft length per request, with a cost model that can switch speculation off.

Length policy (EMA with hysteresis): after every verify round the request's accepted-draft count updates
`ema <- (1 - alpha) * ema + alpha * accepted` (initial `ema = steps - 1`). The EMA moves nothing during
the first `warmup_batches` rounds; afterwards every `update_interval` rounds the controller moves down one
candidate at a time while `ema <= prev - 0.5 + down_hysteresis`, otherwise up while `ema > current - 0.5 +
up_hysteresis`: the target is about round(ema) + 1, one draft beyond what is being accepted.

Acceptance model: each draft is accepted with probability a (per token) once the drafts before it were, so
E[accepted | k] = a + a^2 + ... + a^k, and a round at length k pays when (E[accepted | k] + 1) / round_s(k)
>= 1 / decode_s (expected tokens per second against plain decoding). Over rounds that accepted S drafts
in all, F of which ended at a rejection, the likelihood is a^S (1 - a)^F: its maximum is a = S / (S + F).
`best_length` is the candidate with the most expected tokens per second, or 0 when none pays.

Cost check (with a `CostModel` and `cost_aware`):
- Warm-up. Each round refits a to the warm-up's rounds. A request drops to 0 as soon as no length would pay
  even with `WARMUP_MARGIN` (3) more drafts accepted; the margin keeps good drafters from being dropped
  for a few unlucky rounds. It scales with what is at stake: when drafting needs a high a to pay, one
  empty round says a lot (at round(k) = 17 + 4k ms against 10.4 ms decoding a drafter that pays accepts
  the first draft >= 76% of the time, and one empty round drops it); when drafting is cheap, a few more
  rounds are needed (four at 13.8 + 1.5k ms, where a >= 0.46 pays: a drafter with a = 0.8 runs four empty
  rounds with probability 0.2^4). While the plain fit loses but the margin holds, the request measures at
  the smallest candidate, which costs less and tells as much (a round's first draft decides whether it
  accepts anything); once the plain fit pays again it returns to its initial length. A request still in
  doubt at the warm-up's last round drops unless some length would pay with `WARMUP_END_MARGIN` (2) more
  accepted: where drafting is cheap (a round with one draft 1.2 plain steps) a drafter that never pays
  stops after 10 rounds, not after two EMA evaluations and a confirming probe more.
- Later, every `update_interval` rounds the length the EMA chose must pay at a fitted to the EMA; if it
  does not, the best length at that a replaces it. If none pays, the EMA (a few rounds) may just have
  dipped: a confirming probe measures afresh before the request drops.
- Probes. After `probe_interval` rounds at 0 the request probes: it drafts at the smallest candidate and
  stops (back to 0) as soon as no length would pay even with `PROBE_MARGIN` (1) more drafts accepted, so
  a useless drafter costs one or two cheap rounds. After `update_interval` rounds it resumes drafting as
  soon as some length pays with `PROBE_MARGIN` more drafts rejected (the request's last measurement said
  drafting lost, so it has to show that it pays), at the best length for that cautious fit; the EMA
  restarts from E[accepted | length] at the plain fit. In doubt between the two it goes on measuring,
  for at most `MAX_PROBE_WINDOWS` x `update_interval` rounds, after which the plain fit decides. A probe
  that drops again doubles the wait before the next one (up to `MAX_PROBE_BACKOFF` x `probe_interval`),
  so a request whose drafts never pay spends a vanishing share of its rounds probing; a probe that keeps
  drafting resets the wait. A confirming probe works the same way but leaves the wait as it is.
- Probe budget. Whenever the evidence says drafting does not pay (a warm-up or a retry that drops, a
  request that starts at 0), the wait is also at least `probe_wait_floor`: the rounds at 0 whose plain
  decoding time the probe's cost is `probe_budget` (0.5%) of. A probe costs its first round's catch-up
  (the draft KV writes the tokens committed while the request did not draft: an eager forward, tens of
  ms on a GPU, measured by the engine, first at start-up) plus its rounds at the probe length instead of
  plain steps. So a drafter that never pays costs at most the budget on a long-running engine, however
  dear its probes are, and the wait is as short as that allows. A confirming probe that drops is not held
  to it: the drafter paid until lately, so probing it again soon is likely to pay for itself.

Across requests: each request above starts knowing nothing, so on a long-running engine whose drafter
never pays every request would pay the warm-up again. The requests of one `AdaptiveController` (one per
engine) therefore report their drafting rounds into its `SharedEvidence`: S and F decayed to about the
last `PRIOR_MEMORY` rounds of all of them, the wait the latest probe left, and the rounds spent at 0 since
a probe. A new request's warm-up starts from that evidence scaled down to at most `PRIOR_DRAFTS`
observations (same ratio), a prior that a few of its own rounds overrule. With costs
(`new_request(costs)`), when the pooled evidence at full weight already fails the warm-up's test (no
length pays with `WARMUP_MARGIN` more accepted) the request starts at 0: later requests skip the warm-up
the earlier ones paid. It probes after the engine's wait less the rounds other requests spent at 0 since
the last probe, so the engine probes about once per wait in all (not once per request, nor never when
requests are shorter than the wait), and a drafter that turns good is found again. Only one live request
starts from those rounds (`SharedEvidence.claimed`); others that start meanwhile wait the whole wait (a
batch of 8 arriving together all probed at once: 8 catch-ups, 0.86x plain on the 9B shape). Requests that
outlive the wait still probe together at its end: once per wait per batch, not per engine. Evidence is per
controller: another engine (model, drafter, hardware) learns its own.

Simulated with those two costs, a request whose drafts are never accepted takes at most 2.5% longer than
plain decoding over 128 tokens and 0.3% over 2048 (tests/test_spec_adaptive.py); drafting through a
10-round warm-up at length 3 and probing at the length left took 11% and 25% longer over 128 tokens.
Through one controller the requests after the first take at most 0.8% longer over 128 tokens (the few
that probe; the others none), where each took the first one's 2.4% / 1.4% before. With the costs the
engine measured on an H100 (9B-shaped target: 8.1 ms a plain step, a 25 ms catch-up per probe) the
requests after the first take 0.46% longer in all, within the 0.5% budget.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from enum import Enum

from hyspec_spec_workers.config import AdaptiveConfig
from hyspec_spec_workers.costs import CostModel

# the longest wait between probes, in multiples of `probe_interval`
MAX_PROBE_BACKOFF = 16
# warm-up gives up on drafting only if it would not pay even with this many more drafts accepted
WARMUP_MARGIN = 3.0
# and at its last round, a request still in doubt stops unless some length would pay with this many more
# accepted: ten empty rounds (2 / 12) rule out a drafter that needs a >= 0.17 to pay, while a fair one that
# accepted a few drafts through bad luck (4 of 10 rounds ending at a rejection at a = 0.7) goes on
WARMUP_END_MARGIN = 2.0
# a probe stops early if drafting would not pay with this many more drafts accepted, and resumes drafting
# only if it would still pay with this many more rejected (see the module docstring for both)
PROBE_MARGIN = 1.0
# a probe still in doubt after this many `update_interval` windows goes by the plain fit
MAX_PROBE_WINDOWS = 4
# a controller's pooled evidence weighs about this many of its requests' latest drafting rounds
PRIOR_MEMORY = 64
# and starts a new request's warm-up as at most this many observations (accepted drafts + rejections):
# enough to skip the warm-up of a drafter that never pays, little enough for a request's own rounds
# to overrule it within a few rounds
PRIOR_DRAFTS = 4.0


class _Probe(Enum):
    """Why a request drafts at the smallest length for a fresh measurement."""

    RETRY = "retry"  # after rounds at 0: does drafting pay again?
    CONFIRM = "confirm"  # before dropping from drafting: does it really lose?


def acceptance_rate(mean_accepted: float, num_drafts: int) -> float:
    """Per-token acceptance rate a with a + a^2 + ... + a^k = mean_accepted (k = num_drafts)."""
    target = min(max(mean_accepted, 0.0), float(num_drafts))
    lo, hi = 0.0, 1.0
    for _ in range(50):
        mid = 0.5 * (lo + hi)
        if sum(mid**i for i in range(1, num_drafts + 1)) < target:
            lo = mid
        else:
            hi = mid
    return 0.5 * (lo + hi)


def expected_accepted(rate: float, num_drafts: int) -> float:
    return sum(rate**i for i in range(1, num_drafts + 1))


def _pays(rate: float, num_drafts: int, costs: CostModel) -> bool:
    """Expected tokens per second of a `num_drafts` round at least those of plain decoding."""
    return (expected_accepted(rate, num_drafts) + 1.0) / costs.round_s(num_drafts) >= 1.0 / costs.decode_s()


def probe_wait_floor(costs: CostModel, *, budget: float, length: int, probe_rounds: int) -> int:
    """The fewest rounds at 0 (per request) before a probe that keep the probe's cost within `budget` of the
    plain decoding time those rounds take.

    A probe of a drafter that still does not pay costs its first round's catch-up (`catch_up_s`) and
    `probe_rounds` rounds at `length` drafts instead of plain steps. Rounds at 0 are counted per request,
    and a step decodes `rows_per_step` of them, so the wait grows with the batch.
    """
    decode = costs.decode_s()
    extra = costs.catch_up_s() + probe_rounds * max(0.0, costs.round_s(length) - decode)
    return math.ceil(extra * costs.rows_per_step() / (budget * decode))


def best_length(rate: float, candidates: tuple[int, ...], costs: CostModel) -> int:
    """The candidate with the most expected tokens per second at per-token acceptance `rate`, or 0 when
    plain decoding beats every candidate (a tie keeps drafting)."""
    best = max(candidates, key=lambda k: (expected_accepted(rate, k) + 1.0) / costs.round_s(k))
    return best if _pays(rate, best, costs) else 0


@dataclass(slots=True)
class _Evidence:
    """One measurement's drafting rounds: accepted drafts S and rounds that ended at a rejection F.

    Fractional counts come from the prior of `SharedEvidence` (pseudo-observations, not rounds).
    """

    accepted: float = 0.0
    rejections: float = 0.0
    rounds: int = 0

    def add(self, num_accepted: int, num_drafts: int) -> None:
        self.accepted += num_accepted
        self.rejections += num_accepted < num_drafts
        self.rounds += 1

    def rate(self, more_accepted: float = 0.0, more_rejected: float = 0.0) -> float:
        """Maximum-likelihood acceptance S / (S + F), with that many more drafts accepted or rejected."""
        accepted = self.accepted + more_accepted
        seen = accepted + self.rejections + more_rejected
        return accepted / seen if seen > 0.0 else 1.0


@dataclass(slots=True)
class SharedEvidence:
    """What one engine's requests have learnt about its drafter, for the requests that come next.

    `accepted` and `rejections` are S and F (as in `_Evidence`) over every drafting round reported by any
    request, decayed by `1 - 1 / PRIOR_MEMORY` per reported round, so they weigh roughly the last
    `PRIOR_MEMORY` rounds. `probe_wait` is the wait left by the most recent probe that resumed drafting or
    failed a retry (None before any did; a confirming probe that drops leaves it, as it leaves its own),
    `idle_rounds` counts the rounds at 0 of all requests since a retry probe last started or ended, and
    `claimed` is the live request that started from them (only one does: requests that start together, a
    batch, would otherwise all probe at once, each paying a catch-up).
    """

    accepted: float = 0.0
    rejections: float = 0.0
    probe_wait: int | None = None
    idle_rounds: int = 0
    claimed: AdaptiveDraftLength | None = None

    def add(self, num_accepted: int, num_drafts: int) -> None:
        keep = 1.0 - 1.0 / PRIOR_MEMORY
        self.accepted = keep * self.accepted + num_accepted
        self.rejections = keep * self.rejections + (num_accepted < num_drafts)

    def prior(self) -> _Evidence:
        """The pooled S and F scaled down to at most `PRIOR_DRAFTS` observations, same ratio."""
        seen = self.accepted + self.rejections
        scale = min(1.0, PRIOR_DRAFTS / seen) if seen > 0.0 else 0.0
        return _Evidence(accepted=self.accepted * scale, rejections=self.rejections * scale)

    def probe_ended(self, wait: int) -> None:
        self.probe_wait, self.idle_rounds, self.claimed = wait, 0, None


class AdaptiveDraftLength:
    """Draft-length state of one request; `steps` is the length for the next round (0 = no drafting)."""

    def __init__(
        self,
        config: AdaptiveConfig,
        initial_steps: int,
        *,
        shared: SharedEvidence | None = None,
        costs: CostModel | None = None,
    ) -> None:
        """`shared`: the engine's pooled evidence, reported into and read once here as this request's
        prior; `costs`: what the prior is weighed against to start at 0 (see the module docstring)."""
        if initial_steps not in config.candidate_steps:
            raise ValueError(f"initial_steps: expected one of {config.candidate_steps}, got {initial_steps}")
        self.config = config
        self.steps = self._initial = initial_steps
        self.ema = float(initial_steps - 1)
        self.rounds = 0
        self._warming_up = config.warmup_batches > 0
        self._since_eval = 0
        self._zero_rounds = 0
        # the warm-up's rounds (after the prior, if any), later the current probe's
        self._evidence = _Evidence() if shared is None else shared.prior()
        self._probe: _Probe | None = None
        self._probe_wait = config.probe_interval  # rounds at 0 before the next probe (backs off)
        self._shared = shared
        if shared is not None and costs is not None and config.cost_aware:
            self._start_from_history(shared, costs)

    def _start_from_history(self, shared: SharedEvidence, costs: CostModel) -> None:
        pooled = _Evidence(accepted=shared.accepted, rejections=shared.rejections)
        if pooled.accepted + pooled.rejections == 0.0:
            return  # nothing pooled yet: the request warms up as if it were the first
        # the pooled rounds at full weight (the prior is scaled down only so that a warming-up request's
        # own rounds can overrule it): many requests' rounds say more than the few the margin guards
        cands = self.config.candidate_steps
        if best_length(pooled.rate(more_accepted=WARMUP_MARGIN), cands, costs) > 0:
            if best_length(self._evidence.rate(), cands, costs) == 0:
                # the prior alone loses but the margin holds: the warm-up measures at the smallest length
                # from its first round, as it would after a round of its own said as much
                self.steps = cands[0]
            return
        # the earlier requests' drafts would not pay even with the warm-up's margin: skip the warm-up
        # they paid. Probe no sooner than the engine's backoff says, counting the rounds other requests
        # already spent at 0 since the last probe, so that short requests still probe now and then.
        self._warming_up = False
        self._drop(failed_probe=False, costs=None)
        self._probe_wait = max(shared.probe_wait or self.config.probe_interval, self._floor(costs, 1))
        if shared.claimed is None:
            self._zero_rounds = min(shared.idle_rounds, self._probe_wait - 1)
            shared.claimed = self

    def idle_round(self, rounds: int = 1) -> None:
        """Record `rounds` rounds at length 0 (nothing drafted): what `observe` does at 0, the probe's count
        (a probe starts once the wait is over)."""
        self._zero_rounds += rounds
        if self._shared is not None:
            self._shared.idle_rounds += rounds
        if self._zero_rounds >= self._probe_wait:
            self._start_probe(_Probe.RETRY)

    def rounds_to_probe(self) -> int:
        """At length 0: the rounds at 0 after which it probes (the last of them starts the probe)."""
        return self._probe_wait - self._zero_rounds

    def observe(self, num_accepted: int, costs: CostModel | None = None) -> int:
        """Record one verify round (accepted drafts, bonus excluded); returns the next round's length."""
        cfg = self.config
        if self.steps == 0:
            self.idle_round()
            return self.steps
        if not 0 <= num_accepted <= self.steps:
            raise ValueError(f"num_accepted: expected in [0, {self.steps}], got {num_accepted}")
        self.rounds += 1
        self._evidence.add(num_accepted, self.steps)
        if self._shared is not None:
            self._shared.add(num_accepted, self.steps)
        judge = costs if cfg.cost_aware else None  # what drafting is weighed against, if anything
        if self._probe is not None:
            self._probe_round(judge)
            return self.steps
        self.ema = (1.0 - cfg.ema_alpha) * self.ema + cfg.ema_alpha * num_accepted
        if self._warming_up:
            self._warming_up = self.rounds < cfg.warmup_batches
            if judge is not None:
                self._warmup_round(judge)
            return self.steps
        self._since_eval += 1
        if self._since_eval < cfg.update_interval:
            return self.steps
        self._since_eval = 0
        measured_at = self.steps
        self.steps = self._select(self.steps)
        if judge is not None:
            rate = acceptance_rate(self.ema, measured_at)
            if not _pays(rate, self.steps, judge):
                best = best_length(rate, cfg.candidate_steps, judge)
                if best > 0:
                    self.steps = best
                else:
                    # an EMA over a few rounds dips by chance: measure afresh before dropping
                    self._start_probe(_Probe.CONFIRM)
        return self.steps

    def _warmup_round(self, costs: CostModel) -> None:
        cands, ev = self.config.candidate_steps, self._evidence
        if best_length(ev.rate(more_accepted=WARMUP_MARGIN), cands, costs) == 0:
            self._warming_up = False
            self._drop(failed_probe=False, costs=costs)
        elif best_length(ev.rate(), cands, costs) == 0:
            if self._warming_up or best_length(ev.rate(more_accepted=WARMUP_END_MARGIN), cands, costs) > 0:
                # in doubt: go on measuring at the smallest length, which costs less and tells as much (a
                # round's first draft decides whether it accepts anything)
                self.steps = cands[0]
            else:
                # still in doubt at the warm-up's last round, and losing even with `WARMUP_END_MARGIN`
                # more accepted: left to the EMA, a drafter that never pays would draft through two
                # evaluations and a confirming probe more (19 rounds instead of 10 where a round with one
                # draft costs 1.2 plain steps: 2% of a 128-token request)
                self._drop(failed_probe=False, costs=costs)
        else:
            self.steps = self._initial

    def _start_probe(self, kind: _Probe) -> None:
        self.steps, self._zero_rounds = self.config.candidate_steps[0], 0
        self._probe, self._evidence = kind, _Evidence()
        if self._shared is not None and kind is _Probe.RETRY:
            # one probe per engine-wide wait (see `_start_from_history`)
            self._shared.idle_rounds, self._shared.claimed = 0, None

    def _probe_round(self, costs: CostModel | None) -> None:
        cfg, ev = self.config, self._evidence
        measured = ev.rounds >= cfg.update_interval
        if costs is None:
            # nothing to weigh the drafts against: resume at the probe length once the window is measured
            if measured:
                self._resume(self.steps, ev.rate())
            return
        cands = cfg.candidate_steps
        shown = best_length(ev.rate(more_rejected=PROBE_MARGIN), cands, costs) if measured else 0
        if best_length(ev.rate(more_accepted=PROBE_MARGIN), cands, costs) == 0:
            self._settle(0, costs)
        elif shown > 0:
            self._settle(shown, costs)
        elif ev.rounds >= MAX_PROBE_WINDOWS * cfg.update_interval:
            self._settle(best_length(ev.rate(), cands, costs), costs)  # still in doubt: the plain fit decides

    def _settle(self, steps: int, costs: CostModel) -> None:
        """Ends a probe: drafting at `steps`, or back to 0 (a failed retry doubles the wait)."""
        if steps > 0:
            self._resume(steps, self._evidence.rate())
        elif self._probe is _Probe.RETRY:
            self._drop(failed_probe=True, costs=costs)
        else:
            # a confirming probe drops a drafter that paid until lately: probing it again soon is likely
            # to pay for itself, so the wait is not held to the probes' budget (`_floor`)
            self._drop(failed_probe=False, costs=None)

    def _resume(self, steps: int, rate: float) -> None:
        # the EMA restarts from the model's expectation at the new length, not from the probe's mean
        self.steps, self.ema = steps, expected_accepted(rate, steps)
        self._probe, self._since_eval, self._probe_wait = None, 0, self.config.probe_interval
        if self._shared is not None:
            self._shared.probe_ended(self._probe_wait)

    def _drop(self, *, failed_probe: bool, costs: CostModel | None) -> None:
        probe_rounds = self._evidence.rounds if self._probe is not None else 1
        self.steps, self._zero_rounds, self._probe = 0, 0, None
        if failed_probe:
            cap = MAX_PROBE_BACKOFF * self.config.probe_interval
            self._probe_wait = min(2 * self._probe_wait, cap)
        # never sooner than the probes' measured cost allows, whatever the backoff says
        self._probe_wait = max(self._probe_wait, self._floor(costs, probe_rounds))
        if failed_probe and self._shared is not None:
            self._shared.probe_ended(self._probe_wait)

    def _floor(self, costs: CostModel | None, probe_rounds: int) -> int:
        """`probe_wait_floor` at this config's budget and probe length (0 without costs)."""
        cfg = self.config
        if costs is None or not cfg.cost_aware:
            return 0
        return probe_wait_floor(
            costs, budget=cfg.probe_budget, length=cfg.candidate_steps[0], probe_rounds=probe_rounds
        )

    def _select(self, steps: int) -> int:
        cands, cfg = self.config.candidate_steps, self.config
        idx = cands.index(steps)
        start = idx
        while idx > 0 and self.ema <= cands[idx - 1] - 0.5 + cfg.down_hysteresis:
            idx -= 1
        if idx == start:
            while idx + 1 < len(cands) and self.ema > cands[idx] - 0.5 + cfg.up_hysteresis:
                idx += 1
        return cands[idx]


class AdaptiveController:
    """Creates per-request draft-length states, keeps the live requests' ones and updates them after a
    verify round."""

    def __init__(self, config: AdaptiveConfig, initial_steps: int) -> None:
        if initial_steps not in config.candidate_steps:
            raise ValueError(f"initial_steps: expected one of {config.candidate_steps}, got {initial_steps}")
        self.config = config
        self.initial_steps = initial_steps
        # this engine's requests only: another engine (model, drafter, hardware) learns on its own
        self.shared = SharedEvidence()
        self._requests: dict[str, AdaptiveDraftLength] = {}  # live requests' states, by request id

    @property
    def max_steps(self) -> int:
        """Buffers are sized for the largest candidate (Dmax = max_steps + 1)."""
        return self.config.candidate_steps[-1]

    def new_request(self, costs: CostModel | None = None) -> AdaptiveDraftLength:
        """A request's state, starting from what this controller's earlier requests measured; with
        `costs` (and `cost_aware`) it starts at 0 when that alone says drafting does not pay."""
        return AdaptiveDraftLength(self.config, self.initial_steps, shared=self.shared, costs=costs)

    def length(self, request_id: str, costs: CostModel | None = None) -> AdaptiveDraftLength:
        """The request's state, made at its first round (`new_request(costs)`)."""
        st = self._requests.get(request_id)
        if st is None:
            st = self._requests[request_id] = self.new_request(costs)
        return st

    def observe_requests(
        self, request_ids: Sequence[str], num_accepted: Sequence[int], costs: CostModel | None = None
    ) -> None:
        """Each request's state sees its round: its accepted drafts, capped at its length."""
        for rid, k in zip(request_ids, num_accepted, strict=True):
            st = self._requests[rid]
            st.observe(min(k, st.steps), costs)

    def all_idle(self, request_ids: Sequence[str]) -> bool:
        """Every one of these requests has a state, at length 0 (a step for them drafts nothing). One pass
        over the states, no state made: a request without one yet is not idle (its first round makes it)."""
        reqs = self._requests
        for rid in request_ids:
            st = reqs.get(rid)
            if st is None or st.steps:
                return False
        return True

    def observe_idle(self, request_ids: Sequence[str], rounds: int = 1) -> None:
        """`rounds` rounds in which these requests, all at length 0 (`all_idle`), drafted nothing:
        `observe(0)` of each that many times, without its checks."""
        reqs = self._requests
        for rid in request_ids:
            reqs[rid].idle_round(rounds)

    def idle_window(self, request_ids: Sequence[str]) -> int:
        """For requests all at length 0 (`all_idle`): how many rounds at 0 they can all spend before any
        would start a probe (`observe_idle` of that many changes nothing but their counts), so that a caller
        may count them and report them at once."""
        reqs = self._requests
        return min((reqs[rid].rounds_to_probe() for rid in request_ids), default=1) - 1

    def forget(self, request_id: str) -> None:
        """Drops an ended request's state (and its claim on the engine's rounds at 0: the next new request
        starts from them)."""
        st = self._requests.pop(request_id, None)
        if st is not None and self.shared.claimed is st:
            self.shared.claimed = None

    @property
    def requests(self) -> frozenset[str]:
        """The requests with a state."""
        return frozenset(self._requests)

    def observe_batch(
        self, states: list[AdaptiveDraftLength], num_accepted: list[int], costs: CostModel | None = None
    ) -> list[int]:
        if len(states) != len(num_accepted):
            raise ValueError(f"num_accepted: expected {len(states)} entries, got {len(num_accepted)}")
        return [s.observe(a, costs) for s, a in zip(states, num_accepted, strict=True)]
