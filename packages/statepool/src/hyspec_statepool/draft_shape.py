"""The speculative shape as statepool sees it, and the one function that turns it into a verify block size.

statepool sits below spec-workers, so it cannot read their config; spec-workers build a `DraftShape` from it.
Every buffer whose size depends on the draft length (request-table width, verify scratch, sizing) calls
`max_draft_tokens`, so an adaptive config can never leave one of them sized for a smaller block.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

DraftKind = Literal["chain", "tree"]


@dataclass(frozen=True, slots=True)
class DraftShape:
    """How large a verify block can be.

    Attributes:
        kind: "chain" (each draft token continues the previous one) or "tree" (several branches per step).
        num_steps: draft steps per round (chain: drafted tokens; tree: depth below the root).
        num_draft_tokens: tokens in the verify block including the root (the current token). A chain has
            `num_steps + 1`; leave it None for a chain to get exactly that. Required for a tree.
        adaptive_candidate_steps: the step counts an adaptive controller may switch between, or None. The
            pool is sized for the largest, so switching never outgrows a buffer.
    """

    kind: DraftKind
    num_steps: int
    num_draft_tokens: int | None = None
    adaptive_candidate_steps: tuple[int, ...] | None = None

    def __post_init__(self) -> None:
        if self.kind not in ("chain", "tree"):
            raise ValueError(f"kind: expected 'chain' or 'tree', got {self.kind!r}")
        if not isinstance(self.num_steps, int) or self.num_steps < 1:
            raise ValueError(f"num_steps: expected an int >= 1, got {self.num_steps!r}")
        if self.kind == "chain":
            if self.num_draft_tokens is not None and self.num_draft_tokens != self.num_steps + 1:
                raise ValueError(
                    f"num_draft_tokens: a chain verifies num_steps + 1 = {self.num_steps + 1} tokens, "
                    f"got {self.num_draft_tokens}; leave it None for a chain"
                )
        elif not isinstance(self.num_draft_tokens, int) or self.num_draft_tokens < self.num_steps + 1:
            raise ValueError(
                f"num_draft_tokens: a tree of depth {self.num_steps} needs an int >= {self.num_steps + 1} "
                f"(root plus at least one node per step), got {self.num_draft_tokens!r}"
            )
        cands = self.adaptive_candidate_steps
        if cands is not None:
            if not cands or any(not isinstance(c, int) or c < 1 for c in cands):
                raise ValueError(
                    f"adaptive_candidate_steps: expected a non-empty tuple of ints >= 1, got {cands!r}"
                )
            if list(cands) != sorted(set(cands)):
                raise ValueError(f"adaptive_candidate_steps: expected strictly increasing steps, got {cands}")
            if self.num_steps not in cands:
                raise ValueError(
                    f"adaptive_candidate_steps: expected to contain the initial "
                    f"num_steps={self.num_steps}, got {cands}"
                )


def max_draft_tokens(shape: DraftShape | None) -> int:
    """The largest verify block (root included) a round can use: `Dmax`.

    - None (no speculation): 1, the single decode token; no verify scratch is allocated then.
    - chain: `num_steps + 1`.
    - tree: `num_draft_tokens`.
    - adaptive: the largest candidate's block, `max(candidates) + 1` (for a tree, also at least
      `num_draft_tokens`).
    """
    if shape is None:
        return 1
    if shape.kind == "chain":
        block = shape.num_steps + 1
    else:
        assert shape.num_draft_tokens is not None  # checked in DraftShape.__post_init__
        block = shape.num_draft_tokens
    if shape.adaptive_candidate_steps is not None:
        block = max(block, max(shape.adaptive_candidate_steps) + 1)
    return block
