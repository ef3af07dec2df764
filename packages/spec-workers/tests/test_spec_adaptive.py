import itertools
import random
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import pytest
from hyspec_spec_workers import AdaptiveConfig, AdaptiveController, CostEstimate, CostTracker
from hyspec_spec_workers.adaptive import (
    MAX_PROBE_BACKOFF,
    MAX_PROBE_WINDOWS,
    PRIOR_DRAFTS,
    PRIOR_MEMORY,
    AdaptiveDraftLength,
    SharedEvidence,
    acceptance_rate,
    expected_accepted,
    probe_wait_floor,
)
from hyspec_spec_workers.costs import batch_bucket

CHEAP = CostEstimate(decode=1.0, draft_step=0.05, verify_base=1.05)
DEAR = CostEstimate(decode=1.0, draft_step=1.0, verify_base=1.0)


def _cfg(**kw: object) -> AdaptiveConfig:
    # a budget of 1 makes no probe wait longer than the backoff's (see test_probe_wait_floor_* for it)
    base: dict[str, object] = {
        "candidate_steps": (1, 3, 7),
        "warmup_batches": 0,
        "update_interval": 5,
        "probe_budget": 1.0,
    }
    base.update(kw)
    return AdaptiveConfig(**base)  # type: ignore[arg-type]


def test_warmup_then_interval() -> None:
    ctl = AdaptiveController(_cfg(warmup_batches=10), initial_steps=3)
    s = ctl.new_request()
    seen = [s.observe(s.steps) for _ in range(15)]
    # full acceptance pushes the length up, but only at the first evaluation: round warmup + interval
    assert seen[:14] == [3] * 14 and seen[14] == 7


def test_hysteresis_down_needs_a_clear_drop() -> None:
    s = AdaptiveController(_cfg(), initial_steps=3).new_request()
    # ema starts at 2: after 5 zero rounds ema = 2 * 0.8^5 = 0.66 > 1 - 0.5 - 0.25, so it stays at 3
    assert [s.observe(0) for _ in range(5)] == [3] * 5
    assert s.ema == pytest.approx(2 * 0.8**5)
    # after 10 rounds ema = 0.21 <= 0.25: down to 1
    assert [s.observe(0) for _ in range(5)] == [3] * 4 + [1]


def test_up_moves_and_no_flip_flop() -> None:
    s = AdaptiveController(_cfg(), initial_steps=1).new_request()
    assert [s.observe(1) for _ in range(5)][-1] == 3  # ema 0.67 > 0.5
    assert [s.observe(3) for _ in range(5)][-1] == 3  # ema 2.24 <= 2.5
    assert [s.observe(3) for _ in range(5)][-1] == 7  # ema 2.75 > 2.5
    steady = AdaptiveController(_cfg(), initial_steps=3).new_request()
    # accepting about one draft per round holds the length at 3 (neither 0.25 nor 2.5 is crossed)
    assert {steady.observe(1) for _ in range(60)} == {3}


def test_cost_model_drops_to_zero_and_probes_back() -> None:
    s = AdaptiveController(_cfg(probe_interval=20), initial_steps=3).new_request()
    # accepting ~1 of 3 drafts at 4 s a round loses against 1 token/s decoding: a confirming probe at the
    # smallest length measures afresh, and its first empty round drops the request
    out = [s.observe(1, DEAR) for _ in range(5)]
    assert out == [3, 3, 3, 3, 1]
    assert s.observe(0, DEAR) == 0
    # off: rows report 0 accepted; after probe_interval rounds the request probes at the smallest length
    off = [s.observe(0, DEAR) for _ in range(20)]
    assert off == [0] * 19 + [1]
    # the probe measures afresh; with cheap costs now and every draft accepted it stays on, at the best length
    probe = [s.observe(1, CHEAP) for _ in range(5)]
    assert probe == [1, 1, 1, 1, 7]
    assert s.ema == pytest.approx(7.0)  # the EMA restarts from E[accepted | 7] at the plain fit a = 1


def test_cheap_costs_never_disable_and_cost_unaware_ignores_costs() -> None:
    s = AdaptiveController(_cfg(), initial_steps=3).new_request()
    assert 0 not in {s.observe(1, CHEAP) for _ in range(50)}
    u = AdaptiveController(_cfg(cost_aware=False), initial_steps=3).new_request()
    assert 0 not in {u.observe(1, DEAR) for _ in range(50)}


def test_acceptance_model() -> None:
    a = acceptance_rate(1.5, 3)
    assert expected_accepted(a, 3) == pytest.approx(1.5, abs=1e-6)
    assert acceptance_rate(3.0, 3) == pytest.approx(1.0, abs=1e-6)
    assert acceptance_rate(0.0, 3) == pytest.approx(0.0, abs=1e-6)
    assert expected_accepted(a, 7) > expected_accepted(a, 3) > expected_accepted(a, 1)


def test_cost_tracker_measures_and_extrapolates() -> None:
    t = CostTracker(alpha=1.0)
    ready_before = t.ready
    t.record_verify(2, 1.2)
    t.record_verify(4, 1.6)
    t.record_draft(3, 0.3)
    one = t.at(1)
    assert not ready_before and t.ready and one.ready
    assert one.decode_s() == pytest.approx(1.2)  # no plain decode timed yet: smallest verify block
    t.record_decode(1.0)
    assert one.decode_s() == pytest.approx(1.0)
    assert one.round_s(3) == pytest.approx(3 * 0.1 + 1.6)
    assert one.round_s(7) == pytest.approx(7 * 0.1 + 1.6 + 0.2 * 4)
    assert one.round_s(0) == pytest.approx(1.0)


def test_cost_tracker_judges_rounds_by_warm_costs() -> None:
    """A bucket's first round is cold (several steady rounds' cost): after a few warm rounds the round cost
    is the warm one, not an average still carrying the cold one (an EMA from the first round, alpha 0.1,
    held 3.5 ms where warm rounds cost 2 ms, and a warm-up then dropped a drafter that paid); a stall among
    warm rounds moves nothing; a lasting change is followed within a few rounds."""
    t = CostTracker()
    t.record_draft(3, 3 * 1.0)  # cold: a fresh proposal, a built verify batch
    t.record_verify(4, 8.0)
    for _ in range(3):
        t.record_draft(3, 3 * 0.1)
        t.record_verify(4, 1.6)
    assert t.at(1).round_s(3) == pytest.approx(3 * 0.1 + 1.6)
    t.record_draft(3, 3 * 2.0)  # a stall
    t.record_verify(4, 20.0)
    assert t.at(1).round_s(3) == pytest.approx(3 * 0.1 + 1.6)
    for _ in range(3):  # the load doubles the verify for good
        t.record_draft(3, 3 * 0.1)
        t.record_verify(4, 3.2)
    assert t.at(1).round_s(3) == pytest.approx(3 * 0.1 + 3.2)
    assert t.at(1).round_s(1) == pytest.approx(0.1 + 3.2)  # one block size known: that one's cost


def test_cost_tracker_keeps_costs_per_batch_bucket() -> None:
    """Rounds and plain steps are judged against those of their own batch bucket (rows padded as the CUDA
    graphs pad them): a round measured while a batch ramped up (cheap, a few rows) must not judge the full
    batch's."""
    buckets = [batch_bucket(n) for n in (0, 1, 2, 3, 4, 5, 8, 9, 17, 24, 25, 32, 33)]
    assert buckets == [1, 1, 2, 4, 4, 8, 8, 16, 24, 24, 32, 32, 40]
    t = CostTracker(alpha=1.0)
    t.record_decode(5.0, rows=1)
    t.record_draft(1, 1.0, rows=1)
    t.record_verify(2, 5.5, rows=1)
    t.record_decode(11.0, rows=32)
    assert t.at(1).ready and t.at(1).round_s(1) == pytest.approx(6.5)
    assert t.at(1).decode_s() == pytest.approx(5.0) and t.at(25).decode_s() == pytest.approx(11.0)
    # batch 32 has a plain step but no round yet: not ready; batch 8 has nothing
    assert t.at(32).has_decode and not t.at(32).ready and not t.at(8).has_decode and not t.at(8).ready
    t.record_draft(1, 1.5, rows=30)
    t.record_verify(2, 10.5, rows=30)
    assert t.at(32).round_s(1) == pytest.approx(12.0) and t.at(1).round_s(1) == pytest.approx(6.5)
    # a catch-up round is weighed against its own bucket's round
    t.record_catch_up(20.0, 1, rows=32)
    assert t.catch_up_s() == pytest.approx(8.0) and t.at(1).catch_up_s() == pytest.approx(8.0)


def test_cost_tracker_catch_ups_and_rows() -> None:
    t = CostTracker(alpha=1.0)
    assert t.catch_up_s() == 0.0 and t.rows_per_step() == 1.0
    t.record_catch_up(5.0, 3)  # before any round was timed: all of it counts for now
    assert t.catch_up_s() == pytest.approx(5.0)
    t.record_verify(4, 1.6)
    t.record_draft(3, 0.3)
    # weighed against the round costs known now: 5 - (3 * 0.1 + 1.6)
    assert t.catch_up_s() == pytest.approx(3.1)
    t.record_catch_up(0.5)  # a bare draft extend (start-up): all of it is catch-up; EMA weight 1/2
    assert t.catch_up_s() == pytest.approx(0.5 * 3.1 + 0.5 * 0.5)
    t.record_catch_up(1.0, 3)  # cheaper than an ordinary round: no negative cost
    assert t.catch_up_s() == pytest.approx(0.5 * (0.5 * 3.1 + 0.5 * 0.5))
    t.record_decode(1.0, rows=4)
    assert t.rows_per_step() == 4.0 and t.at(4).decode_s() == 1.0
    for _ in range(20):
        t.record_catch_up(2.0, 0)
    assert t.catch_up_s() == pytest.approx(2.0, rel=1e-2)  # only the latest few count


def test_probe_wait_floor_holds_probes_to_their_budget() -> None:
    est = CostEstimate(decode=0.01, draft_step=0.0, verify_base=0.012, catch_up=0.02)
    # a probe: 20 ms of catch-up plus 2 ms more than a plain step per probe round; 0.5% of 10 ms a round
    assert probe_wait_floor(est, budget=0.005, length=1, probe_rounds=1) == 440
    assert probe_wait_floor(est, budget=0.005, length=1, probe_rounds=3) == 520
    assert probe_wait_floor(est, budget=0.01, length=1, probe_rounds=1) == 220
    # 4 requests a step: rounds at 0 are counted per request, so 4 times as many
    batch = CostEstimate(decode=0.01, draft_step=0.0, verify_base=0.012, catch_up=0.02, rows=4)
    assert probe_wait_floor(batch, budget=0.005, length=1, probe_rounds=1) == 1760
    with pytest.raises(ValueError, match="rows"):
        CostEstimate(decode=0.01, draft_step=0.0, verify_base=0.012, rows=0.5)
    with pytest.raises(ValueError, match="catch_up"):
        CostEstimate(decode=0.01, draft_step=0.0, verify_base=0.012, catch_up=-1.0)


def test_probe_budget_sets_the_waits_and_spares_confirming_probes() -> None:
    cfg = _cfg(probe_interval=4, probe_budget=0.005)
    dear = CostEstimate(decode=1.0, draft_step=1.0, verify_base=1.0, catch_up=3.0)
    floor1 = probe_wait_floor(dear, budget=0.005, length=1, probe_rounds=1)  # (3 + 1) / 0.005 = 800
    s = AdaptiveController(cfg, initial_steps=3).new_request()
    assert [s.observe(1, dear) for _ in range(5)][-1] == 1  # a confirming probe
    assert s.observe(0, dear) == 0
    # it dropped a drafter that paid until lately: the plain interval, not the budget
    assert [s.observe(0, dear) for _ in range(4)] == [0, 0, 0, 1]
    assert s.observe(0, dear) == 0  # that retry fails: now the budget holds (the backoff says 8)
    n = 1
    while s.observe(0, dear) == 0:
        n += 1
    assert n == floor1 == 800 > 4 * MAX_PROBE_BACKOFF
    # a request starting from this history waits as long, less the rounds spent at 0 meanwhile by requests
    # that ended; while one that started from them lives, a new one waits the whole wait (a batch that
    # starts together probes once, not once per request)
    s2 = AdaptiveController(cfg, initial_steps=3)
    s2.shared.add(0, 3)
    first = s2.length("first", dear)
    assert first.steps == 0 and [first.observe(0, dear) for _ in range(300)] == [0] * 300
    together = s2.length("together", dear)
    assert together.steps == 0 and together.rounds_to_probe() == floor1
    s2.forget("first")
    r = s2.length("r", dear)
    assert [r.observe(0, dear) for _ in range(floor1 - 300)] == [0] * (floor1 - 301) + [1]
    assert s2.shared.idle_rounds == 0 and s2.length("next", dear).rounds_to_probe() == floor1


# an H100 with a 9B target as measured by the engine (session 5): plain decode 8.1 ms, a round with one
# draft 13.4 ms, with three 18.7 ms, and a probe's catch-up draft extend about 25 ms
MEASURED = CostEstimate(decode=8.1e-3, draft_step=2.65e-3, verify_base=10.75e-3, catch_up=25e-3)


def test_useless_drafter_probes_within_the_budget_on_a_long_running_engine() -> None:
    ctl = AdaptiveController(AdaptiveConfig(), initial_steps=3)
    runs = [_request(0.0, 128, MEASURED, seed, ctl=ctl) for seed in range(100)]
    later = runs[1:]
    # one controller: after the first request (its warm-up: 3.9%) the probes, each 25 ms of catch-up and
    # a 13.4 ms round, come about once per 800 rounds at 0 and cost the budget, 0.5%, in all (measured:
    # 0.46%); a request that probes pays 2.9%, the others nothing
    total = sum(r.seconds for r in later) / sum(r.plain_s for r in later)
    assert total <= 1.005
    assert 10 <= sum(_probes(r) for r in later) <= 20
    assert max(r.ratio for r in later) <= 1.03
    # one long request: its warm-up and then probes under the same budget (measured: 0.52%)
    assert _request(0.0, 8192, MEASURED).ratio <= 1.006


def test_controller_validation() -> None:
    with pytest.raises(ValueError, match="initial_steps"):
        AdaptiveController(_cfg(), initial_steps=2)
    s = AdaptiveController(_cfg(), initial_steps=1).new_request()
    with pytest.raises(ValueError, match="num_accepted"):
        s.observe(2)
    with pytest.raises(ValueError, match="decode"):
        CostEstimate(decode=0.0, draft_step=0.0, verify_base=0.0)
    ctl = AdaptiveController(_cfg(), initial_steps=1)
    assert ctl.max_steps == 7
    with pytest.raises(ValueError, match="num_accepted"):
        ctl.observe_batch([ctl.new_request()], [0, 1])


def test_failed_probes_back_off_and_a_good_probe_resets_the_wait() -> None:
    from hyspec_spec_workers.adaptive import MAX_PROBE_BACKOFF

    s = AdaptiveController(_cfg(probe_interval=4), initial_steps=3).new_request()
    assert [s.observe(1, DEAR) for _ in range(5)][-1] == 1  # confirming probe
    assert s.observe(0, DEAR) == 0

    def wait_then_probe(accepted: int, costs: CostEstimate) -> tuple[int, list[int]]:
        """Rounds at 0 until the probe starts, then the probe's lengths until it drops or 5 rounds."""
        n = 1
        while s.observe(0, costs) == 0:
            n += 1
        assert s.steps == 1  # probes draft at the smallest candidate
        probe = [s.observe(min(accepted, s.steps), costs)]
        while probe[-1] > 0 and len(probe) < 5:
            probe.append(s.observe(min(accepted, s.steps), costs))
        return n, probe

    waits = []
    for _ in range(6):
        n, probe = wait_then_probe(0, DEAR)
        assert probe == [0]  # the probe finds drafting still too dear, after one round
        waits.append(n)
    assert waits == [4, 8, 16, 32, 64, 64] and 64 == 4 * MAX_PROBE_BACKOFF
    n, probe = wait_then_probe(1, CHEAP)
    assert n == 64 and probe == [1, 1, 1, 1, 7]  # drafting pays again: it stays on
    assert [s.observe(1, DEAR) for _ in range(5)][-1] == 1
    assert s.observe(0, DEAR) == 0
    assert wait_then_probe(0, DEAR)[0] == 4  # and the wait starts over


# ---------------------------------------------------------------- simulated requests

# an H100 with a 9B target: plain decode 10.4 ms, a round with k drafts 13.8 + 1.5 k ms
H100 = CostEstimate(decode=10.4e-3, draft_step=1.0e-3, verify_base=13.8e-3, verify_per_token=0.5e-3)
# dearer drafting: 17 + 4 k ms a round, where drafts must be accepted ~76% of the time to pay
SLOW = CostEstimate(decode=10.4e-3, draft_step=3.0e-3, verify_base=17.0e-3, verify_per_token=1.0e-3)
SEEDS = range(20)


@dataclass
class _Run:
    plain_s: float  # plain decoding of the same tokens
    seconds: float = 0.0
    lengths: list[int] = field(default_factory=list)  # the controller's draft length in each round
    emitted: list[int] = field(default_factory=list)  # tokens emitted before each round

    @property
    def ratio(self) -> float:
        return self.seconds / self.plain_s

    def rounds_from(self, token: int) -> list[int]:
        """The lengths of the rounds from the one that emits `token` on."""
        return self.lengths[next(i for i, e in enumerate(self.emitted) if e >= token) :]


def _request(
    accept: float | Callable[[int], float],
    num_tokens: int,
    costs: CostEstimate,
    seed: int = 0,
    fixed: int | None = None,
    ctl: AdaptiveController | None = None,
) -> _Run:
    """One request of `num_tokens` tokens under the default config (initial length 3), from a fresh
    controller or `ctl` (which then carries what its earlier requests measured).

    Each round drafts the controller's length (or `fixed`), fewer where the request would overshoot (as
    the engine caps it); drafts are accepted up to the first failing Bernoulli draw with the per-token rate
    `accept` (or `accept(tokens emitted so far)`); the round emits the accepted drafts plus one token and
    costs `costs.round_s(drafts made)`, plus `costs.catch_up_s()` when the request drafts for the first
    time or after rounds without drafts (the draft KV catches up on the tokens in between).
    """
    rng = random.Random(seed)
    ctl = AdaptiveController(AdaptiveConfig(), initial_steps=3) if ctl is None else ctl
    rid = f"request-{seed}"
    state = ctl.length(rid, costs)
    run = _Run(plain_s=num_tokens * costs.decode_s())
    done = 0
    while done < num_tokens:
        length = state.steps if fixed is None else fixed
        k = min(length, num_tokens - done - 1)
        rate = accept(done) if callable(accept) else accept
        accepted = 0
        while accepted < k and rng.random() < rate:
            accepted += 1
        run.seconds += costs.round_s(k)
        if k > 0 and not any(run.lengths[-1:]):
            run.seconds += costs.catch_up_s()
        run.lengths.append(length)
        run.emitted.append(done)
        done += accepted + 1
        if fixed is None:
            state.observe(accepted, costs)
    ctl.forget(rid)  # as the engine does when a request ends
    return run


def _mean(values: list[float]) -> float:
    return sum(values) / len(values)


@pytest.mark.parametrize(
    ("costs", "start", "gaps"),
    [
        # warm-up: the first empty round at length 3 leaves the plain fit losing, so the request measures
        # at length 1 until even 3 more accepted drafts would not pay: 3 / (3 + 4) < 0.46. A probe round
        # costs 4.9 ms more than a plain step, 0.5% of 95 plain steps: the first wait (not 50); a probe of
        # two rounds needs 189, and the backoff doubles from there
        (H100, [3, 1, 1, 1] + [0] * 95 + [1, 1] + [0] * 190 + [1, 1, 0], [190, 380, 760, 800, 800]),
        # drafting that needs a >= 0.76 to pay: 3 / (3 + 1) < 0.76 after one empty round; probes stop
        # after one round too (1 / (1 + 1) < 0.76); a probe round costs 10.6 ms more: 204 rounds
        (SLOW, [3] + [0] * 204 + [1] + [0] * 408 + [1, 0], [408, 800, 800, 800]),
    ],
)
def test_useless_drafter_drops_early_and_probes_cheaply(
    costs: CostEstimate, start: list[int], gaps: list[int]
) -> None:
    run = _request(0.0, 4096, costs)
    assert run.lengths[: len(start)] == start
    # every probe drafts at length 1 for as long as the first; the waits double up to 16 x probe_interval
    probe_rounds = 2 if costs is H100 else 1
    probes = [i for i in range(1, len(run.lengths)) if run.lengths[i] > 0 and run.lengths[i - 1] == 0]
    assert all(run.lengths[i : i + probe_rounds + 1] == [1] * probe_rounds + [0] for i in probes)
    got = [b - a - probe_rounds for a, b in itertools.pairwise(probes)]
    assert got[: len(gaps)] == gaps and 800 == MAX_PROBE_BACKOFF * 50


def test_warmup_measures_at_the_smallest_length_while_in_doubt() -> None:
    s = AdaptiveController(AdaptiveConfig(), initial_steps=3).new_request()
    assert s.observe(0, H100) == 1  # the plain fit a = 0 loses, with 3 more accepted it would pay
    assert s.observe(1, H100) == 3  # a = 1 / 2 pays: back to the initial length
    # S = 1 and F = 2, 3, 4, 5: (1 + 3) / (1 + F + 3) drops below 0.46 at F = 5
    assert [s.observe(0, H100) for _ in range(4)] == [1, 1, 1, 0]
    unaware = AdaptiveController(AdaptiveConfig(cost_aware=False), initial_steps=3).new_request()
    assert {unaware.observe(0, H100) for _ in range(10)} == {3}  # no cost check: warm-up keeps its length


# cheap drafting: a 9B-shaped target with graphs on an H100 (measured 2026-11-28): a plain step 6.7 ms, a
# round with k drafts 6.8 + 1.3 k ms, where a drafter pays from a >= 0.21
GRAPHS_9B = CostEstimate(decode=6.7e-3, draft_step=1.3e-3, verify_base=6.8e-3)


def test_warmup_still_in_doubt_at_its_last_round_drops_a_drafter_that_never_paid() -> None:
    run = _request(0.0, 128, GRAPHS_9B)
    # 3 / (3 + F) stays above 0.21 through the warm-up's ten rounds; at the last one 2 / (2 + 9) does
    # not: it drops there instead of drafting through two EMA evaluations and a confirming probe (19)
    assert run.lengths[:11] == [3] + [1] * 9 + [0]
    # measured 1.0259 (a probe of four rounds at 1 after 50 at 0 included); 1.0406 before
    assert run.ratio <= 1.03
    # a fair drafter unlucky in its warm-up goes on: S = 4, F = 6 at the last round, in doubt (4 / 10 <
    # 0.46), but (4 + 2) / (4 + 2 + 6) would pay (a margin of 1, a probe's, would drop it: 5 / 11 < 0.46)
    s = AdaptiveController(AdaptiveConfig(), initial_steps=3).new_request()
    got = [s.observe(k, H100) for k in [0, 1, 0, 1, 0, 1, 0, 1, 0, 0]]
    assert got == [1, 3, 1, 3, 1, 3, 1, 3, 1, 1] and s.rounds == 10


@pytest.mark.parametrize("costs", [H100, SLOW])
@pytest.mark.parametrize(("num_tokens", "bound"), [(128, 1.025), (2048, 1.004)])
def test_useless_drafter_costs_about_as_much_as_plain_decoding(
    costs: CostEstimate, num_tokens: int, bound: float
) -> None:
    # measured: 1.0243 (H100) and 1.0219 (SLOW) over 128 tokens, 1.0034 for both over 2048; the previous
    # policy (10 warm-up rounds at length 3, probes at the length left) took 1.107 / 1.249 and 1.011 / 1.026
    assert _request(0.0, num_tokens, costs).ratio <= bound


def test_good_drafter_is_never_dropped_and_keeps_its_speed_up() -> None:
    runs = [_request(0.8, 128, H100, seed) for seed in SEEDS]
    fixed = [_request(0.8, 128, H100, seed, fixed=3) for seed in SEEDS]
    assert all(0 not in r.lengths for r in runs)
    # measured 0.595 (drafting 3 every round: 0.599); plain decoding is 1
    assert _mean([r.ratio for r in runs]) <= 0.6
    assert all(r.ratio <= 1.05 * f.ratio for r, f in zip(runs, fixed, strict=True))


@pytest.mark.parametrize(
    ("rate", "costs", "bound"),
    [
        # a = 0.7 is dropped in 2 of these 20 requests (early noise), and probed back: measured 1.031
        (0.7, H100, 1.04),
        # dear drafting pays only a little at a = 0.9, an empty first round drops it (3 of 20): 1.003
        (0.9, SLOW, 1.02),
    ],
)
def test_fair_drafters_keep_most_of_their_speed_up(rate: float, costs: CostEstimate, bound: float) -> None:
    adaptive = _mean([_request(rate, 128, costs, seed).ratio for seed in SEEDS])
    fixed = _mean([_request(rate, 128, costs, seed, fixed=3).ratio for seed in SEEDS])
    assert fixed < 1.0 and adaptive <= bound * fixed


@pytest.mark.parametrize(("costs", "rate"), [(H100, 0.8), (SLOW, 0.9)])
def test_follows_a_drafter_that_turns_useless(costs: CostEstimate, rate: float) -> None:
    for seed in SEEDS:
        after = _request(lambda done: rate if done < 64 else 0.0, 256, costs, seed).rounds_from(64)
        # the EMA sees it within two evaluations (measured: at most 13 rounds), a confirming probe drops it
        assert 0 in after[:16]
        # from then on only probes draft (measured: at most 17 drafting rounds after the switch, in all)
        assert sum(n > 0 for n in after) <= 20


@pytest.mark.parametrize(("costs", "rate"), [(H100, 0.8), (SLOW, 0.95)])
def test_follows_a_drafter_that_turns_good(costs: CostEstimate, rate: float) -> None:
    waits = []
    for seed in SEEDS:
        after = _request(lambda done: 0.0 if done < 64 else rate, 1024, costs, seed).rounds_from(64)
        waits.append(next(i for i, n in enumerate(after) if n >= 3))
    # the switch comes during the wait before the first probe (95 rounds after the warm-up for H100, 204
    # for SLOW: the probes' budget); that probe finds the drafter good unless it is unlucky, and then one
    # of the next two does (measured: 40 rounds in 18 of 20 requests, at most 612 (H100); 146 to 149 in 18,
    # at most 558 (SLOW))
    first, second, third = (95, 190, 380) if costs is H100 else (204, 408, 800)
    assert sum(w <= first - 40 for w in waits) >= 16
    assert max(waits) <= first + second + third + 2 * MAX_PROBE_WINDOWS * 5


# ---------------------------------------------------------------- across requests


def _probes(run: _Run) -> int:
    return sum(b > 0 and a == 0 for a, b in itertools.pairwise(run.lengths))


@pytest.mark.parametrize("costs", [H100, SLOW])
def test_useless_drafter_later_requests_skip_the_warm_up(costs: CostEstimate) -> None:
    ctl = AdaptiveController(AdaptiveConfig(), initial_steps=3)
    runs = [_request(0.0, 128, costs, seed, ctl=ctl) for seed in range(10)]
    # the first request knows nothing yet: it pays the warm-up as before (1.0243 / 1.0140)
    assert runs[0].lengths == _request(0.0, 128, costs, 0).lengths
    assert runs[0].ratio > 1.01
    # the later ones start at 0; only a probe costs anything (measured: 1.0074 / 1.0080 in the 3 of 9
    # that probe, 1.0 in the others); with independent requests each took what the first did
    assert all(r.lengths[0] == 0 for r in runs[1:])
    assert max(r.ratio for r in runs[1:]) <= 1.01


def test_short_requests_still_probe_after_a_useless_history() -> None:
    ctl = AdaptiveController(AdaptiveConfig(), initial_steps=3)
    runs = [_request(0.0, 128, H100, seed, ctl=ctl) for seed in range(20)]
    assert ctl.shared.probe_wait == MAX_PROBE_BACKOFF * 50
    # a request is shorter than the engine's wait, but the rounds that earlier requests spent at 0 count:
    # about one probe per 800 rounds at 0 (measured: requests 6, 13 and 19 of 20), each of one probe
    later = [_probes(r) for r in runs[4:]]
    assert 1 <= sum(later) <= 3 and max(later) == 1


@pytest.mark.parametrize("costs", [H100, SLOW])
def test_good_drafter_later_requests_draft_from_the_first_round(costs: CostEstimate) -> None:
    rate = 0.8 if costs is H100 else 0.95
    ctl = AdaptiveController(AdaptiveConfig(), initial_steps=3)
    runs = [_request(rate, 128, costs, seed, ctl=ctl) for seed in SEEDS]
    fresh = [_request(rate, 128, costs, seed) for seed in SEEDS]
    assert all(r.lengths[0] == 3 for r in runs)
    assert sum(0 in r.lengths for r in runs) <= sum(0 in r.lengths for r in fresh)
    # measured 0.594 (H100, fresh requests 0.595) and 0.697 (SLOW, fresh 0.718, 2 of which dropped)
    assert _mean([r.ratio for r in runs]) <= _mean([r.ratio for r in fresh]) + 0.005


@pytest.mark.parametrize(("costs", "rate", "bound"), [(H100, 0.8, 0.6), (SLOW, 0.95, 0.735)])
def test_a_good_request_after_useless_ones_resumes_through_probes(
    costs: CostEstimate, rate: float, bound: float
) -> None:
    ratios = []
    for seed in SEEDS:
        ctl = AdaptiveController(AdaptiveConfig(), initial_steps=3)
        for history in range(5):
            _request(0.0, 128, costs, 100 * seed + history, ctl=ctl)
        run = _request(rate, 4096, costs, seed, ctl=ctl)
        assert run.lengths[0] == 0  # the history said drafting does not pay
        assert 0 < _probes(run) and 0 not in run.lengths[-100:]  # a probe found it good again
        ratios.append(run.ratio)
    # after 5 useless requests the engine waits 380 rounds (H100), 347 of them spent: the first probe
    # comes at round 33; SLOW's probes cost more, so it waits 800, 25 spent: round 775 (measured: means
    # 0.591 and 0.727, worst 0.659 and 0.791)
    assert _mean(ratios) <= bound and max(ratios) <= 0.8


def test_controllers_do_not_share_evidence() -> None:
    used, other = (AdaptiveController(AdaptiveConfig(), initial_steps=3) for _ in range(2))
    _request(0.0, 128, H100, ctl=used)
    assert used.new_request(H100).steps == 0
    assert other.new_request(H100).steps == 3
    assert (other.shared.accepted, other.shared.rejections) == (0.0, 0.0)


def test_without_costs_a_request_warms_up_with_the_prior_but_never_starts_at_0() -> None:
    ctl = AdaptiveController(AdaptiveConfig(), initial_steps=3)
    for seed in range(3):
        _request(0.0, 128, SLOW, seed, ctl=ctl)
    assert ctl.new_request(SLOW).steps == 0
    s = ctl.new_request()
    assert s.steps == 3
    # its warm-up starts from the prior (the 2 rejections pooled): at H100 costs it measures at length 1
    # and drops after its 2nd empty round; without the prior only after its 4th (see
    # test_warmup_measures_at_the_smallest_length_while_in_doubt)
    assert [s.observe(0, H100) for _ in range(2)] == [1, 0]
    unaware = AdaptiveController(AdaptiveConfig(cost_aware=False), initial_steps=3)
    _request(0.0, 128, SLOW, ctl=unaware)
    assert unaware.new_request(SLOW).steps == 3


def test_standalone_request_has_no_prior() -> None:
    s = AdaptiveDraftLength(AdaptiveConfig(), initial_steps=3)
    assert s.observe(0, H100) == 1 and s.observe(1, H100) == 3


def test_shared_evidence_decays_and_scales_the_prior() -> None:
    pool = SharedEvidence()
    pool.add(0, 3)
    pool.add(1, 3)
    prior = pool.prior()  # fewer than PRIOR_DRAFTS observations: taken as they are
    assert (prior.accepted, prior.rejections) == pytest.approx((1.0, (1 - 1 / PRIOR_MEMORY) + 1.0))
    for _ in range(2000):
        pool.add(1, 3)
    # the old rounds have decayed away: PRIOR_MEMORY rounds accepting 1 of 3 drafts each
    assert (pool.accepted, pool.rejections) == pytest.approx((PRIOR_MEMORY, PRIOR_MEMORY))
    prior = pool.prior()
    assert prior.accepted + prior.rejections == pytest.approx(PRIOR_DRAFTS)
    assert prior.rate() == pytest.approx(0.5) and prior.rounds == 0


def test_a_thin_useless_history_warms_up_at_the_smallest_length() -> None:
    thin = AdaptiveController(AdaptiveConfig(), initial_steps=3)
    thin.shared.add(0, 3)  # one empty round: too little to skip the warm-up (3 / (3 + 1) would pay)
    s = thin.new_request(H100)
    # but the prior alone loses, so the warm-up measures at length 1 from its first round (a round's first
    # draft decides whether it accepts anything), and returns to 3 once a draft is accepted
    assert s.steps == 1
    assert s.observe(1, H100) == 3
    good = AdaptiveController(AdaptiveConfig(), initial_steps=3)
    good.shared.add(3, 3)
    assert good.new_request(H100).steps == 3
    assert AdaptiveController(AdaptiveConfig(), initial_steps=3).new_request(H100).steps == 3


def test_cost_tracker_counts_only_steady_plain_steps() -> None:
    t = CostTracker(alpha=1.0)
    t.record_verify(2, 1.2, rows=3)
    t.record_decode(
        2.0, rows=3, steady=False
    )  # an isolated plain round: its batch built on the critical path
    assert not t.has_decode and t.at(3).decode_s() == pytest.approx(1.2) and t.rows_per_step() == 1.0
    t.record_decode(0.8, rows=3, steady=True)
    assert t.has_decode and t.at(3).decode_s() == pytest.approx(0.8) and t.rows_per_step() == 3.0
    # the fastest of the latest few steady steps: a cold or stalled one does not hold the estimate up
    t.record_decode(2.4, rows=3)
    assert t.at(3).decode_s() == pytest.approx(0.8)
    for _ in range(CostTracker.DECODE_SAMPLES):
        t.record_decode(1.0, rows=3)
    assert t.at(3).decode_s() == pytest.approx(1.0)


def test_rounds_time_plain_steps_in_a_row_at_start_and_every_timing_interval(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Cost-aware adaptive rounds weigh drafting against a steady plain step: the engine's first three rounds
    are plain and all but the first are recorded; after `TIMING_EVERY` drafting rounds three plain rounds
    time it again. Drafting rounds in between never touch the plain-step cost."""
    import torch
    from hyspec_spec_workers import DraftOutput, VerifyTree
    from hyspec_spec_workers import costs as costs_mod
    from hyspec_spec_workers import round as round_mod
    from hyspec_spec_workers.round import SpeculativeRound
    from hyspec_spec_workers.round_types import RoundRow, VerifiedTokens
    from hyspec_spec_workers.sampling import SampledToken

    monkeypatch.setattr(costs_mod, "TIMING_EVERY", 5)

    class Drafter:
        max_draft_tokens = 2

        def propose(self, batch: object) -> DraftOutput:
            roots = batch.root_tokens  # type: ignore[attr-defined]
            return DraftOutput(VerifyTree.chain(roots, torch.ones(roots.shape[0], 1, dtype=torch.int64)))

    @dataclass
    class Params:
        temperature: float = 0.0
        seed: int | None = None
        logprobs: int | None = None

    @dataclass
    class Req:
        request_id: str
        params: Params = field(default_factory=Params)

        def token_slice(self, start: int, end: int) -> list[int]:
            return [1] * (end - start)

    class Target:
        device = torch.device("cpu")

        def __init__(self) -> None:
            self.decodes: list[int] = []

        def decode(self, rows: list[RoundRow]) -> list[SampledToken]:
            self.decodes.append(len(rows))
            return [SampledToken(1, None, None) for _ in rows]

    spec = SpeculativeRound(Drafter(), num_speculative_tokens=1, adaptive=AdaptiveConfig(cost_aware=True))

    class Length:  # every request keeps drafting: this test follows the timing rounds, not the policy
        steps = 1

        def observe(self, accepted: int, costs: object) -> None:
            pass

    assert spec.adaptive is not None
    monkeypatch.setattr(spec.adaptive, "new_request", lambda known: Length())
    # drafting rounds accept their one draft; the plain-step cost is what this test follows
    monkeypatch.setattr(
        round_mod,
        "verify_round",
        lambda target, rows, draft, on_host, **kw: (
            [VerifiedTokens((SampledToken(1, None, None),) * 2, 1, 1)] * len(rows),
            2,
        ),
    )
    recorded: list[bool] = []
    record = spec.costs.record_decode
    monkeypatch.setattr(
        spec.costs,
        "record_decode",
        lambda seconds, rows=1, *, steady=True: (
            recorded.append(steady),
            record(seconds, rows, steady=steady),
        ),
    )
    target = Target()
    rows = [RoundRow(Req("a"), 10, 1, 1, 1000, frozenset()), RoundRow(Req("b"), 12, 1, 1, 1000, frozenset())]

    def step(batch: list[RoundRow], **kw: bool) -> str:
        before = len(target.decodes)
        spec.run(target, batch, **kw)  # type: ignore[arg-type]
        return "plain" if len(target.decodes) > before else "draft"

    kinds = [step(rows) for _ in range(12)]
    assert kinds[:3] == ["plain"] * 3 and recorded[:3] == [False, True, True]
    assert kinds[3:8] == ["draft"] * 5 and kinds[8:11] == ["plain"] * 3 and kinds[11:] == ["draft"]
    assert recorded == [False, True, True, False, True, True]
    # the batch grows into a bucket (9 rows: 16) without a plain step timed: its rounds time one first. While
    # the batch ramps up (prompt chunks in every step) a timing round may share its step's forward,
    # measuring nothing, `TIMING_DEFER` rounds in a row; then it runs alone, the other work before it
    wide = [RoundRow(Req(f"w{i}"), 10, 1, 1, 1000, frozenset()) for i in range(9)]
    kinds, recorded[:] = [], []
    for _ in range(costs_mod.TIMING_DEFER):
        assert spec.may_share_forward(len(wide))
        kinds.append(step(wide, shares_forward=True))
    assert recorded == [] and not spec.may_share_forward(len(wide)) and spec.may_share_forward(len(rows))
    with pytest.raises(ValueError, match="shares_forward"):
        spec.run(target, wide, shares_forward=True)  # type: ignore[arg-type]
    kinds += [step(wide, after_other_work=True), step(wide), step(wide)]
    # the first alone is not steady (after a step with other work in its forward), the second is
    assert kinds == ["plain"] * (costs_mod.TIMING_DEFER + 2) + ["draft"] and recorded == [False, True]
    assert spec.costs.at(9).has_decode and spec.costs.at(16).has_decode and not spec.costs.at(17).has_decode


def test_a_round_is_charged_the_engine_work_until_the_next_step(monkeypatch: pytest.MonkeyPatch) -> None:
    """A plain step's recorded cost is the round plus the engine's time until the next step begins
    (`begin_step`), unless that gap is longer than the round (an idle engine): then the round alone."""
    from hyspec_spec_workers.round import SpeculativeRound
    from hyspec_spec_workers.round_types import RoundRow

    now, Req, Target, Drafter = _clocked_round_parts(monkeypatch)
    spec = SpeculativeRound(Drafter(), num_speculative_tokens=1)
    rows = [RoundRow(Req("a"), 10, 1, 0, 1000, frozenset())]  # no KV room for drafts: plain steps
    recorded: list[float] = []
    monkeypatch.setattr(
        spec.costs, "record_decode", lambda seconds, rows=1, *, steady=True: recorded.append(seconds)
    )
    for gap in (0.25, 0.5, 3.0, 0.0):
        spec.run(Target(), rows)  # type: ignore[arg-type]
        now[0] += gap  # the engine emits the tokens and schedules the next step
        spec.begin_step()
    assert recorded == [1.25, 1.5, 1.0, 1.0]
    # one-off work in the gap that no round caused (prefix-cache saves) is left out of the charge
    spec.run(Target(), rows)  # type: ignore[arg-type]
    now[0] += 0.25
    now[0] += 0.5
    spec.timer.exclude(0.5)
    spec.begin_step()
    assert recorded[-1] == 1.25


def test_plain_round_counts_and_times_like_a_round_without_drafts(monkeypatch: pytest.MonkeyPatch) -> None:
    """`plain_round` (the engine's plain step when nobody drafts) must leave the same trace as `run` of a
    round without drafts: the same timing rounds and recorded plain-step costs, the same rounds at 0 for
    the adaptive lengths; and it refuses a round in which some request drafts, or other work in a timed
    step."""
    from hyspec_spec_workers import costs as costs_mod
    from hyspec_spec_workers.round import SpeculativeRound
    from hyspec_spec_workers.round_types import RoundRow
    from hyspec_spec_workers.sampling import SampledToken

    now, Req, Target, Drafter = _clocked_round_parts(monkeypatch)

    def engine() -> tuple[SpeculativeRound, list[float]]:
        spec = SpeculativeRound(Drafter(), num_speculative_tokens=1, adaptive=AdaptiveConfig())
        assert spec.adaptive is not None
        new_request = spec.adaptive.new_request

        def at_zero(known: object = None) -> object:
            st = new_request(None)
            st.steps, st._probe_wait = 0, 10**6
            return st

        monkeypatch.setattr(spec.adaptive, "new_request", at_zero)
        recorded: list[float] = []
        record = spec.costs.record_decode
        monkeypatch.setattr(
            spec.costs,
            "record_decode",
            lambda seconds, rows=1, *, steady=True: (
                recorded.append(seconds),
                record(seconds, rows, steady=steady),
            ),
        )
        return spec, recorded

    ids = ["a", "b"]
    rows = [RoundRow(Req(r), 10, 1, 1, 1000, frozenset()) for r in ids]  # type: ignore[arg-type]
    by_run, rec_run = engine()
    by_plain, rec_plain = engine()

    def plain_step() -> list[SampledToken]:
        now[0] += 1.0
        return [SampledToken(1, None, None)] * 2

    for _ in range(6):
        by_run.run(Target(), rows)  # type: ignore[arg-type]
        now[0] += 0.25
        by_run.begin_step()
        assert by_plain.drafts_nothing(ids)
        by_plain.plain_round(ids, plain_step, shares_forward=False)
        now[0] += 0.25
        by_plain.begin_step()
    assert rec_run == rec_plain and len(rec_run) >= 2
    assert by_run.adaptive is not None and by_plain.adaptive is not None
    assert by_plain.lengths.idle is not None
    by_plain.lengths.idle.report()  # rounds of the same idle requests are counted, then reported at once
    zero_run = [by_run.adaptive.length(r)._zero_rounds for r in ids]
    assert zero_run == [by_plain.adaptive.length(r)._zero_rounds for r in ids]
    assert by_plain.adaptive.length("a")._zero_rounds > 0

    fresh, _ = engine()
    assert fresh.timer.timing(len(ids))  # the first rounds time plain steps: they run alone, once they
    for _ in range(costs_mod.TIMING_DEFER):  # have shared their step's forward a few rounds in a row
        fresh.plain_round(ids, plain_step, shares_forward=True)
    assert fresh.timer.timing(len(ids))  # (which measured nothing)
    with pytest.raises(ValueError, match="shares_forward"):
        fresh.plain_round(ids, plain_step, shares_forward=True)
    by_plain.adaptive.length("b").steps = 1  # "b" drafts again
    assert not by_plain.drafts_nothing(ids)
    with pytest.raises(ValueError, match="request_ids"):
        by_plain.plain_round(ids, plain_step, shares_forward=False)


def test_counted_idle_rounds_start_every_probe_where_round_by_round_reports_do(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """`plain_round` counts the rounds of the same idle requests and reports them at once, up to the round
    before one of them is due to probe: each probe starts in the very round it starts in when every round is
    reported on its own, whatever requests join, leave or reorder, and the counts agree once reported."""
    from hyspec_spec_workers.round import SpeculativeRound
    from hyspec_spec_workers.sampling import SampledToken

    _, _, _, Drafter = _clocked_round_parts(monkeypatch)
    waits = {"a": 7, "b": 11, "c": 5, "d": 30}

    def engine(*, counted: bool) -> SpeculativeRound:
        spec = SpeculativeRound(Drafter(), num_speculative_tokens=1, adaptive=AdaptiveConfig())
        ctl = spec.adaptive
        assert ctl is not None
        if not counted:
            monkeypatch.setattr(ctl, "idle_window", lambda ids: 0)  # every round reported on its own
        return spec

    counted, each = engine(counted=True), engine(counted=False)
    timeline = [["a", "b"]] * 4 + [["a", "b", "c"]] * 3 + [["c", "a", "b"]] * 9 + [["a", "d"]] * 20
    probes: dict[str, list[tuple[int, str]]] = {"counted": [], "each": []}
    for spec, name in ((counted, "counted"), (each, "each")):
        ctl = spec.adaptive
        assert ctl is not None
        for i, ids in enumerate(timeline):
            for rid in ids:
                if rid not in ctl.requests:
                    st = spec.lengths.length(rid, spec.costs)
                    st.steps, st._probe_wait, st._zero_rounds = 0, waits[rid], 0
            spec.timer.cost_aware = False  # no timing rounds: every round counts
            for rid in ids:
                if ctl._requests[rid].steps > 0:  # probing: back to 0 (a probe that failed at once)
                    probes[name].append((i, rid))
                    st = ctl._requests[rid]
                    st.steps, st._probe, st._zero_rounds = 0, None, 0
            assert spec.drafts_nothing(ids)
            spec.plain_round(ids, lambda: [SampledToken(1, None, None)], shares_forward=False)
            if i == 15:
                spec.on_free(["c"])  # c ends: its counted rounds are reported before it is forgotten
        assert spec.lengths.idle is not None
        spec.lengths.idle.report()
    assert probes["counted"] == probes["each"] and len(probes["each"]) >= 4
    assert counted.adaptive is not None and each.adaptive is not None
    for rid in ("a", "b", "d"):
        assert counted.adaptive._requests[rid]._zero_rounds == each.adaptive._requests[rid]._zero_rounds
    assert counted.adaptive.shared.idle_rounds == each.adaptive.shared.idle_rounds > 0


def _clocked_round_parts(monkeypatch: pytest.MonkeyPatch) -> tuple[list[float], Any, Any, Any]:
    """A fake clock for the round module (`now[0]` seconds) and the least a round without drafts needs: a
    request type, a target whose plain decode takes 1 s of that clock, and a drafter."""
    import torch
    from hyspec_spec_workers import round as round_mod
    from hyspec_spec_workers.sampling import SampledToken

    now = [0.0]
    monkeypatch.setattr(round_mod.time, "perf_counter", lambda: now[0])

    @dataclass
    class Req:
        request_id: str

    class Target:
        device = torch.device("cpu")

        def decode(self, rows: list[Any]) -> list[SampledToken]:
            now[0] += 1.0  # the round's own work
            return [SampledToken(1, None, None) for _ in rows]

    class Drafter:
        max_draft_tokens = 2

    return now, Req, Target, Drafter


def test_idle_rounds_in_one_pass_equal_observing_zero() -> None:
    """`observe_idle` (a speculative engine's plain step, every request at 0) counts the rounds at 0 and
    starts each probe exactly where `observe(0)` does; `all_idle` makes no state and says False for a
    request without one or at a length > 0."""
    cfg = _cfg(probe_interval=7)
    by_observe, by_idle = AdaptiveController(cfg, 3), AdaptiveController(cfg, 3)
    ids = ["a", "b", "c"]
    for ctl in (by_observe, by_idle):
        assert not ctl.all_idle(ids) and ctl.requests == frozenset()  # no state yet, none made
        for i, rid in enumerate(ids):
            st = ctl.length(rid)
            st.steps, st._probe_wait = 0, 7 + i  # off, each with its own wait
    assert by_idle.all_idle(ids) and by_idle.all_idle([])
    trace_observe, trace_idle = [], []
    for _ in range(12):
        by_observe.observe_requests(ids, [0, 0, 0])
        if by_idle.all_idle(ids):
            by_idle.observe_idle(ids)
        else:
            by_idle.observe_requests(ids, [0, 0, 0])
        trace_observe.append([by_observe.length(r).steps for r in ids] + [by_observe.shared.idle_rounds])
        trace_idle.append([by_idle.length(r).steps for r in ids] + [by_idle.shared.idle_rounds])
    assert trace_idle == trace_observe
    assert [s[0] for s in trace_idle].count(0) == 6 and trace_idle[-1][:3] == [1, 1, 1]  # each probed in turn
    assert max(s[3] for s in trace_idle) > 0  # the engine's rounds at 0 were counted
    assert not by_idle.all_idle(ids)  # probing: drafting again


def test_a_drafting_round_knows_when_the_next_round_times_a_plain_step(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """`RoundTimer.next_is_timing` (a round queues no proposal for a next round that will not draft): true
    before the first timing and in exactly the drafting round after which a timing starts, and then the
    next round is indeed a timing round."""
    from hyspec_spec_workers import costs as costs_mod

    monkeypatch.setattr(costs_mod, "TIMING_EVERY", 4)
    timer = costs_mod.RoundTimer(costs_mod.CostTracker(), cost_aware=True)
    assert timer.timing(1) and timer.next_is_timing(1)  # nothing timed yet
    for _ in range(costs_mod.TIMING_ROUNDS):
        timer.begin_step()
        assert timer.timing(1)
        timer.plain(0.001, rows=1, timing=True)
        timer.end_round()
    for i in range(2 * costs_mod.TIMING_EVERY):
        timer.begin_step()
        if timer.timing(1):  # the second timing: its plain rounds
            timer.plain(0.001, rows=1, timing=True)
            timer.end_round()
            continue
        last = timer.next_is_timing(1)
        assert last == (i == costs_mod.TIMING_EVERY - 1)
        timer.drafted(1, 2, 0.001, 0.001, rows=1)
        timer.end_round()
        timer.begin_step()
        assert timer.timing(1) == last
        timer.end_round()
    assert not costs_mod.RoundTimer(costs_mod.CostTracker(), cost_aware=False).next_is_timing(1)


def test_a_plain_round_whose_forward_was_queued_ahead_is_charged_the_whole_step(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A plain round's step is charged the engine's time since the last round only while that gap is no
    longer than the step (else the engine idled). A round whose forward was queued during the last step
    (async scheduling) measures only what was left of the forward: it is charged the whole gap, or plain
    decoding looks cheaper than it is (here 1 ms of forward left after 3 ms of the engine's work: 4 ms a
    step, not 1)."""
    from hyspec_spec_workers import costs as costs_mod

    clock = {"t": 0.0}
    monkeypatch.setattr(costs_mod.time, "perf_counter", lambda: clock["t"])

    def decode_cost(queued_ahead: bool) -> float:
        costs = costs_mod.CostTracker()
        timer = costs_mod.RoundTimer(costs, cost_aware=True)
        for _ in range(3):  # steady plain rounds: 3 ms between rounds, then a 1 ms step
            clock["t"] += 0.003
            timer.begin_step()
            clock["t"] += 0.001
            timer.plain(0.001, rows=1, timing=False, queued_ahead=queued_ahead)
            timer.end_round()
        clock["t"] += 0.003
        timer.begin_step()  # the last round is recorded here, with the engine's 3 ms since it
        return costs.at(1).decode_s()

    assert decode_cost(queued_ahead=False) == pytest.approx(0.001)
    assert decode_cost(queued_ahead=True) == pytest.approx(0.004)
