"""Plain rounds of idle requests, counted and reported to the adaptive controller at once.

When drafting does not pay, every request sits at adaptive length 0 and each engine step is a plain round
(`SpeculativeRound.plain_round`); its only news for the controller is one more round at 0 per request, which
matters only for the probes (`AdaptiveDraftLength.idle_round`). While the same requests keep running plain
rounds and none of them is due to probe (`AdaptiveController.idle_window`), the rounds are only counted
here, with no per-request bookkeeping, and go to the controller in one `observe_idle` before anything reads
or changes it.
Each probe then starts in the very round it would start in with every round reported on its own.
"""

from __future__ import annotations

from collections.abc import Sequence

from hyspec_spec_workers.adaptive import AdaptiveController


class IdleRounds:
    """Counts plain rounds of the same idle requests for one controller.

    Args:
        controller: the adaptive controller the rounds are reported to.
    """

    def __init__(self, controller: AdaptiveController) -> None:
        self.controller = controller
        self._ids: list[str] = []  # the requests being counted, as `count` got them (compared whole)
        self._left = 0  # rounds more that may be counted before one of them is due to probe
        self._rounds = 0  # rounds counted, not yet reported

    def covers(self, request_ids: Sequence[str]) -> bool:
        """A round of these requests is one more of the counted ones: every one of them at length 0 and none
        due to probe in it (what `AdaptiveController.all_idle` would say, without a pass over them)."""
        return self._left > 0 and self._ids == request_ids

    def count(self, request_ids: Sequence[str]) -> None:
        """A plain round of these requests, every one at length 0 (`all_idle`)."""
        if self.covers(request_ids):
            self._left -= 1
            self._rounds += 1
            return
        self.report()
        left = self.controller.idle_window(request_ids)
        if left > 0:
            self._ids, self._left, self._rounds = list(request_ids), left - 1, 1
        else:
            self.controller.observe_idle(request_ids)  # this round starts a probe: reported at once

    def report(self) -> None:
        """The counted rounds go to the controller (call before anything else reads or changes it)."""
        if self._rounds:
            self.controller.observe_idle(self._ids, self._rounds)
        self._ids, self._left, self._rounds = [], 0, 0
