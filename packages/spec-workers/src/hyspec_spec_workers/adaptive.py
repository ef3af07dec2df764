"""Adaptive draft length per request, with a cost model that can switch speculation off.

Length policy (EMA with hysteresis): after every verify round the request's accepted-draft count updates
`ema <- (1 - alpha) * ema + alpha * accepted` (initial `ema = steps - 1`). No switching during the first
`warmup_batches` rounds; afterwards every `update_interval` rounds the controller moves down one candidate
at a time while `ema <= prev - 0.5 + down_hysteresis`, otherwise up while `ema > current - 0.5 +
up_hysteresis`: the target is about round(ema) + 1, one draft beyond what is being accepted.

Cost check: with a `CostModel`, the chosen length k is kept only if the expected tokens per second of a
k-draft round beat plain decoding; otherwise the request drops to 0 drafts. After `probe_interval` rounds
at 0 it probes back at the length it left, measures `update_interval` rounds afresh (the EMA restarts from
their mean) and decides again. A probe that drops again doubles the wait before the next one (up to
`MAX_PROBE_BACKOFF` x `probe_interval`), so a request whose drafts never pay spends a vanishing share of
its rounds probing; a probe that keeps drafting resets the wait. Expected accepted drafts at length k come
from a per-token acceptance rate a fitted to the EMA: E[accepted | k] = a + a^2 + ... + a^k.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

from hyspec_spec_workers.config import AdaptiveConfig

# the longest wait between probes, in multiples of `probe_interval`
MAX_PROBE_BACKOFF = 16


class CostModel(Protocol):
    """Seconds per round for a batch; measured (`CostTracker`) or injected (`CostEstimate`)."""

    def decode_s(self) -> float: ...

    def round_s(self, num_drafts: int) -> float: ...


@dataclass(frozen=True, slots=True)
class CostEstimate:
    """Fixed costs: a round with k >= 1 drafts costs draft_base_s + k * draft_step_s + verify_s(k + 1)."""

    decode: float
    draft_step: float
    verify_base: float
    verify_per_token: float = 0.0
    draft_base: float = 0.0

    def __post_init__(self) -> None:
        for name in ("decode", "draft_step", "verify_base", "verify_per_token", "draft_base"):
            v = getattr(self, name)
            if not v >= 0.0:
                raise ValueError(f"{name}: expected seconds >= 0, got {v!r}")
        if self.decode <= 0.0:
            raise ValueError(f"decode: expected seconds > 0, got {self.decode!r}")

    def decode_s(self) -> float:
        return self.decode

    def round_s(self, num_drafts: int) -> float:
        if num_drafts == 0:
            return self.decode
        return (
            self.draft_base
            + num_drafts * self.draft_step
            + self.verify_base
            + self.verify_per_token * num_drafts
        )


class CostTracker:
    """Measured costs: EMAs of plain-decode, per-draft-step and per-block-size verify times.

    Before a plain decode step has been timed, decode cost is taken as the verify time of the smallest block
    seen (a D = 1 verify is a decode step); unmeasured block sizes are extrapolated linearly.
    """

    def __init__(self, alpha: float = 0.1) -> None:
        if not 0.0 < alpha <= 1.0:
            raise ValueError(f"alpha: expected in (0, 1], got {alpha}")
        self.alpha = alpha
        self._decode: float | None = None
        self._draft_step: float | None = None
        self._verify: dict[int, float] = {}

    def _ema(self, old: float | None, new: float) -> float:
        return new if old is None else (1.0 - self.alpha) * old + self.alpha * new

    def record_decode(self, seconds: float) -> None:
        self._decode = self._ema(self._decode, seconds)

    def record_draft(self, num_steps: int, seconds: float) -> None:
        if num_steps >= 1:
            self._draft_step = self._ema(self._draft_step, seconds / num_steps)

    def record_verify(self, block_size: int, seconds: float) -> None:
        self._verify[block_size] = self._ema(self._verify.get(block_size), seconds)

    @property
    def ready(self) -> bool:
        return self._draft_step is not None and bool(self._verify)

    def _verify_s(self, d: int) -> float:
        if d in self._verify:
            return self._verify[d]
        sizes = sorted(self._verify)
        if len(sizes) == 1:
            return self._verify[sizes[0]]
        lo, hi = (sizes[0], sizes[1]) if d < sizes[0] else (sizes[-2], sizes[-1])
        slope = (self._verify[hi] - self._verify[lo]) / (hi - lo)
        return max(self._verify[lo] + slope * (d - lo), 0.0)

    def decode_s(self) -> float:
        if self._decode is not None:
            return self._decode
        return self._verify_s(min(self._verify)) if self._verify else 1.0

    def round_s(self, num_drafts: int) -> float:
        if num_drafts == 0:
            return self.decode_s()
        return num_drafts * (self._draft_step or 0.0) + self._verify_s(num_drafts + 1)


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


class AdaptiveDraftLength:
    """Draft-length state of one request; `steps` is the length for the next round (0 = no drafting)."""

    def __init__(self, config: AdaptiveConfig, initial_steps: int) -> None:
        if initial_steps not in config.candidate_steps:
            raise ValueError(f"initial_steps: expected one of {config.candidate_steps}, got {initial_steps}")
        self.config = config
        self.steps = initial_steps
        self.ema = float(initial_steps - 1)
        self.rounds = 0
        self._since_eval = 0
        self._zero_rounds = 0
        self._resume_steps = initial_steps
        self._probe_sum: float | None = None
        self._probe_wait = config.probe_interval  # rounds at 0 before the next probe (backs off)

    def observe(self, num_accepted: int, costs: CostModel | None = None) -> int:
        """Record one verify round (accepted drafts, bonus excluded); returns the next round's length."""
        cfg = self.config
        if self.steps == 0:
            self._zero_rounds += 1
            if self._zero_rounds >= self._probe_wait:
                self.steps, self._zero_rounds, self._since_eval = self._resume_steps, 0, 0
                self._probe_sum = 0.0
            return self.steps
        if not 0 <= num_accepted <= self.steps:
            raise ValueError(f"num_accepted: expected in [0, {self.steps}], got {num_accepted}")
        self.rounds += 1
        if self._probe_sum is not None:
            self._probe_sum += num_accepted
        else:
            self.ema = (1.0 - cfg.ema_alpha) * self.ema + cfg.ema_alpha * num_accepted
        self._since_eval += 1
        if self.rounds <= cfg.warmup_batches:
            self._since_eval = 0
            return self.steps
        if self._since_eval < cfg.update_interval:
            return self.steps
        self._since_eval = 0
        measured_at = self.steps
        probed = self._probe_sum is not None
        if self._probe_sum is not None:
            self.ema = self._probe_sum / cfg.update_interval
            self._probe_sum = None
        self.steps = self._select(self.steps)
        if cfg.cost_aware and costs is not None and not self._worth_it(self.steps, measured_at, costs):
            self._resume_steps, self.steps, self._zero_rounds = self.steps, 0, 0
            if probed:
                self._probe_wait = min(2 * self._probe_wait, MAX_PROBE_BACKOFF * cfg.probe_interval)
        elif probed:
            self._probe_wait = cfg.probe_interval
        return self.steps

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

    def _worth_it(self, steps: int, measured_at: int, costs: CostModel) -> bool:
        rate = acceptance_rate(self.ema, measured_at)
        spec_tps = (expected_accepted(rate, steps) + 1.0) / costs.round_s(steps)
        return spec_tps >= 1.0 / costs.decode_s()


class AdaptiveController:
    """Creates per-request draft-length states and updates a batch of them after a verify round."""

    def __init__(self, config: AdaptiveConfig, initial_steps: int) -> None:
        if initial_steps not in config.candidate_steps:
            raise ValueError(f"initial_steps: expected one of {config.candidate_steps}, got {initial_steps}")
        self.config = config
        self.initial_steps = initial_steps

    @property
    def max_steps(self) -> int:
        """Buffers are sized for the largest candidate (Dmax = max_steps + 1)."""
        return self.config.candidate_steps[-1]

    def new_request(self) -> AdaptiveDraftLength:
        return AdaptiveDraftLength(self.config, self.initial_steps)

    def observe_batch(
        self, states: list[AdaptiveDraftLength], num_accepted: list[int], costs: CostModel | None = None
    ) -> list[int]:
        if len(states) != len(num_accepted):
            raise ValueError(f"num_accepted: expected {len(states)} entries, got {len(num_accepted)}")
        return [s.observe(a, costs) for s, a in zip(states, num_accepted, strict=True)]
