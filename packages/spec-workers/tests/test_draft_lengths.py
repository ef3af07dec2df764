"""DraftLengths: each row's drafts capped by its KV room and token budget, trees all or nothing, a forced
warm-up length over adaptive lengths and timing rounds, and the lengths it keeps per request."""

from __future__ import annotations

from typing import Any

from hyspec_spec_workers.config import AdaptiveConfig
from hyspec_spec_workers.costs import CostTracker
from hyspec_spec_workers.draft_lengths import DraftLengths
from hyspec_spec_workers.round_types import RoundRow


class _Req:
    def __init__(self, rid: str) -> None:
        self.request_id = rid


def _row(rid: str, max_drafts: int, max_new_tokens: int) -> RoundRow:
    req: Any = _Req(rid)
    return RoundRow(req, 10, 1, max_drafts, max_new_tokens, frozenset())


# room for 3, room for 1, 2 tokens left (1 draft + the bonus), 1 token left, no room
ROWS = [_row("a", 3, 100), _row("b", 1, 100), _row("c", 3, 2), _row("d", 3, 1), _row("e", 0, 100)]


def test_chain_lengths_are_capped_by_room_and_budget_and_zero_in_a_timing_round() -> None:
    lengths = DraftLengths(3, tree=False, adaptive=None)
    assert lengths.for_rows(ROWS, CostTracker(), timing=False) == [3, 1, 1, 0, 0]
    assert lengths.for_rows(ROWS, CostTracker(), timing=True) == [0] * 5
    assert lengths.candidates() == (3,)
    # without adaptive lengths nobody is idle and nothing is kept per request
    assert not lengths.drafts_nothing(["a"], CostTracker(), timing=True)
    assert not lengths.plain_next(["a"]) and lengths.held() == set() and lengths.pays("a", CostTracker())


def test_a_tree_drafts_its_whole_depth_or_nothing() -> None:
    lengths = DraftLengths(3, tree=True, adaptive=AdaptiveConfig(candidate_steps=(1, 3)))
    # room for 1 is enough: a tree's budget cut happens after verification; one token left drafts nothing
    assert lengths.for_rows(ROWS, CostTracker(), timing=False) == [3, 3, 3, 0, 0]
    assert lengths.candidates() == (3,)  # a tree never runs the adaptive candidates
    assert not lengths.drafts_nothing(["a"], CostTracker(), timing=True)


def test_a_forced_length_overrides_adaptive_lengths_and_timing() -> None:
    lengths = DraftLengths(3, tree=False, adaptive=AdaptiveConfig(candidate_steps=(1, 2, 3)))
    assert lengths.candidates() == (1, 2, 3)
    lengths.forced = 2
    assert lengths.for_rows(ROWS, CostTracker(), timing=True) == [2, 1, 1, 0, 0]
    assert not lengths.drafts_nothing(["a", "b"], CostTracker(), timing=True)
    assert not lengths.plain_next(["a", "b"])
    assert lengths.held() == set()  # a forced round makes no adaptive state
    lengths.forced = None
    # adaptive again: every request starts at the largest candidate before any evidence (capped as always)
    assert lengths.for_rows(ROWS, CostTracker(), timing=False) == [3, 1, 1, 0, 0]
    assert lengths.held() == {"a", "b", "c", "d", "e"}
    assert lengths.drafts_nothing(["a"], CostTracker(), timing=True)  # a timing round drafts nothing
    lengths.forget("a")
    assert lengths.held() == {"b", "c", "d", "e"}
    lengths.reset()
    assert lengths.held() == set()
