"""How many tokens each request drafts in a round: the config's S, a forced warm-up length, or the request's
adaptive length (`adaptive.py`), with the plain rounds of requests at 0 counted at once (`idle_rounds.py`).

`SpeculativeRound` owns one and asks it before every round; the answers are capped by each row's room
(`RoundRow.max_drafts`) and budget here too, so a request never drafts more than it may still emit. A tree
drafts its whole depth or nothing.
"""

from __future__ import annotations

from collections.abc import Sequence

from hyspec_spec_workers.adaptive import AdaptiveController, AdaptiveDraftLength
from hyspec_spec_workers.config import AdaptiveConfig
from hyspec_spec_workers.costs import BatchCosts
from hyspec_spec_workers.idle_rounds import IdleRounds
from hyspec_spec_workers.round_types import RoundRow


class DraftLengths:
    """Draft lengths of one engine's requests.

    Args:
        num_speculative_tokens: S, the drafts per round (the most, with adaptive lengths).
        tree: rows draft all S steps or none.
        adaptive: per-request adaptive lengths, or None for S every round.

    `costs` below are the round's measured costs (its batch bucket's: `CostTracker.at`), `timing` whether
    its timer times a plain step this round.
    """

    def __init__(
        self,
        num_speculative_tokens: int,
        *,
        tree: bool,
        adaptive: AdaptiveConfig | None,
    ) -> None:
        self.num_speculative_tokens = num_speculative_tokens
        self.is_tree = tree
        self.config = adaptive
        self.forced: int | None = None  # `SpeculativeRound.forced_length`: every row drafts this
        self.reset()

    def reset(self) -> None:
        """Forgets the adaptive evidence and every request's length."""
        cfg = self.config
        self.adaptive = None if cfg is None else AdaptiveController(cfg, self.num_speculative_tokens)
        # plain rounds of idle requests, counted and reported at once (forgotten with the controller)
        self.idle = None if self.adaptive is None else IdleRounds(self.adaptive)

    def candidates(self) -> tuple[int, ...]:
        """Every draft length a round may run: the adaptive candidates, or S (a tree drafts all S or none)."""
        if self.adaptive is not None and not self.is_tree:
            return self.adaptive.config.candidate_steps
        return (self.num_speculative_tokens,)

    def length(self, request_id: str, costs: BatchCosts) -> AdaptiveDraftLength:
        """A request's adaptive length state (adaptive rounds), made at its first round."""
        assert self.adaptive is not None and self.idle is not None
        self.idle.report()  # a new request's state starts from the evidence up to now
        # with measured costs a request may start at 0: the engine's earlier requests showed that its drafts
        # do not pay (`AdaptiveController.shared`)
        known = costs if costs.ready and costs.has_decode else None
        return self.adaptive.length(request_id, known)

    def pays(self, request_id: str, costs: BatchCosts) -> bool:
        """Whether the request drafts at all now (always, without adaptive lengths)."""
        return self.adaptive is None or self.length(request_id, costs).steps > 0

    def held(self) -> set[str]:
        """The requests whose lengths are kept (for the leak check)."""
        return set() if self.adaptive is None else set(self.adaptive.requests)

    def forget(self, request_id: str) -> None:
        if self.adaptive is not None and self.idle is not None:
            self.idle.report()
            self.adaptive.forget(request_id)

    def drafts_nothing(self, request_ids: Sequence[str], costs: BatchCosts, *, timing: bool) -> bool:
        """`SpeculativeRound.drafts_nothing`."""
        if self.adaptive is None or self.is_tree or self.forced is not None:
            return False
        if self.idle is not None and self.idle.covers(request_ids):
            return True  # the same idle requests as the last plain round, none of them due to probe yet
        if timing or self.adaptive.all_idle(request_ids):
            return True  # (the common case of a drafter that does not pay: one pass, no state made)
        return all(self.length(rid, costs).steps == 0 for rid in request_ids)

    def plain_next(self, request_ids: Sequence[str], *, timing_next: bool = False) -> bool:
        """`SpeculativeRound.plain_next`; `timing_next`: the next round times a plain step."""
        if self.adaptive is None or self.idle is None or self.is_tree or self.forced is not None:
            return False
        if timing_next:
            return True  # nobody drafts in a timing round (`drafts_nothing`)
        if self.idle.covers(request_ids):
            return True  # one more of the counted rounds: nobody is due to probe in it
        self.idle.report()
        return self.adaptive.all_idle(request_ids) and self.adaptive.idle_window(request_ids) > 0

    def count_idle(self, request_ids: Sequence[str]) -> None:
        """A plain round of these requests, every one at length 0 (`drafts_nothing` said so)."""
        if self.idle is not None:
            self.idle.count(request_ids)

    def observe(self, request_ids: Sequence[str], num_accepted: Sequence[int], costs: BatchCosts) -> None:
        """Each request's adaptive length sees the round: its accepted drafts (capped at its length)."""
        if self.adaptive is None or self.idle is None:
            return
        self.idle.report()
        self.adaptive.observe_requests(request_ids, num_accepted, costs if costs.ready else None)

    def for_rows(self, rows: Sequence[RoundRow], costs: BatchCosts, *, timing: bool) -> list[int]:
        """Each row's drafts this round (0 for every row while the cost model times a plain step)."""
        if self.forced is not None:
            k = self.forced
            if self.is_tree:
                return [k if r.max_new_tokens > 1 and r.max_drafts > 0 else 0 for r in rows]
            return [max(0, min(k, r.max_drafts, r.max_new_tokens - 1)) for r in rows]
        out: list[int] = []
        for r in rows:
            if self.is_tree:
                # a tree drafts its whole depth or nothing; the budget cut happens after verification
                out.append(self.num_speculative_tokens if r.max_new_tokens > 1 and r.max_drafts > 0 else 0)
                continue
            want = self.num_speculative_tokens
            if self.adaptive is not None:
                want = self.length(r.request.request_id, costs).steps
            out.append(max(0, min(want, r.max_drafts, r.max_new_tokens - 1)))
        if timing:
            return [0] * len(out)
        return out
