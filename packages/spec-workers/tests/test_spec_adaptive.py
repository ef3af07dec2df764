import pytest
from hyspec_spec_workers import AdaptiveConfig, AdaptiveController, CostEstimate, CostTracker
from hyspec_spec_workers.adaptive import acceptance_rate, expected_accepted

CHEAP = CostEstimate(decode=1.0, draft_step=0.05, verify_base=1.05)
DEAR = CostEstimate(decode=1.0, draft_step=1.0, verify_base=1.0)


def _cfg(**kw: object) -> AdaptiveConfig:
    base: dict[str, object] = {"candidate_steps": (1, 3, 7), "warmup_batches": 0, "update_interval": 5}
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
    # accepting ~1 of 3 drafts at 4 s a round loses against 1 token/s decoding
    out = [s.observe(1, DEAR) for _ in range(5)]
    assert out == [3, 3, 3, 3, 0]
    # off: rows report 0 accepted; after probe_interval rounds the request probes at its old length
    off = [s.observe(0, DEAR) for _ in range(20)]
    assert off == [0] * 19 + [3]
    # probe window measures afresh; with cheap costs now and good acceptance it stays on (and grows)
    probe = [s.observe(3, CHEAP) for _ in range(5)]
    assert probe[:4] == [3] * 4 and probe[4] == 7
    assert s.ema == pytest.approx(3.0)


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
    assert not ready_before and t.ready
    assert t.decode_s() == pytest.approx(1.2)  # no plain decode timed yet: smallest verify block
    t.record_decode(1.0)
    assert t.decode_s() == pytest.approx(1.0)
    assert t.round_s(3) == pytest.approx(3 * 0.1 + 1.6)
    assert t.round_s(7) == pytest.approx(7 * 0.1 + 1.6 + 0.2 * 4)
    assert t.round_s(0) == pytest.approx(1.0)


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
    assert [s.observe(1, DEAR) for _ in range(5)][-1] == 0

    def wait_then_probe(accepted: int, costs: CostEstimate) -> tuple[int, list[int]]:
        """Rounds at 0 until the probe starts, then the probe window's lengths."""
        n = 1
        while s.observe(0, costs) == 0:
            n += 1
        return n, [s.observe(accepted, costs) for _ in range(5)]

    waits = []
    for _ in range(6):
        n, probe = wait_then_probe(1, DEAR)
        assert probe[-1] == 0  # the probe finds drafting still too dear
        waits.append(n)
    assert waits == [4, 8, 16, 32, 64, 64] and 64 == 4 * MAX_PROBE_BACKOFF
    n, probe = wait_then_probe(3, CHEAP)
    assert n == 64 and probe[-1] > 0  # drafting pays again: it stays on
    assert [s.observe(1, DEAR) for _ in range(5)][-1] == 0
    assert wait_then_probe(1, DEAR)[0] == 4  # and the wait starts over
