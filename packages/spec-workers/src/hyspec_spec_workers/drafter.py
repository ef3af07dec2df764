"""The seam between the speculative step loop and the drafters.

A drafter turns the batch's current state into N verify blocks (`VerifyTree`, root = current token) plus,
when its draft tokens were sampled rather than chosen deterministically, the draft distributions the
sampling verifier needs. Rows may propose fewer drafts than others (or none): `tree.num_nodes` says how
many block nodes are real.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol

import torch

from hyspec_spec_workers.config import Method
from hyspec_spec_workers.ngram import NgramProposer
from hyspec_spec_workers.tree import VerifyTree


@dataclass(frozen=True, slots=True)
class DraftBatch:
    """What every drafter may read about the batch (model drafters add their forward context later).

    Attributes:
        root_tokens: [N] int64 current tokens (last round's bonus or the prefill's first token).
        num_steps: per-row draft lengths for this round (adaptive), each in [0, S]; 0 = no drafts.
        histories: per-row token ids so far (prompt + generated), each [L_n] ending with the root; ngram
            reads them.
        hidden_states: [N, H] target hidden state at the root position (MTP/EAGLE input), or None.
    """

    root_tokens: torch.Tensor
    num_steps: Sequence[int]
    histories: Sequence[torch.Tensor] = ()
    hidden_states: torch.Tensor | None = None

    def __post_init__(self) -> None:
        if self.root_tokens.dim() != 1:
            raise ValueError(f"root_tokens: expected shape [N], got {list(self.root_tokens.shape)}")
        n = self.root_tokens.shape[0]
        if len(self.num_steps) != n or any(s < 0 for s in self.num_steps):
            raise ValueError(f"num_steps: expected {n} values >= 0, got {list(self.num_steps)}")
        if self.histories and len(self.histories) != n:
            raise ValueError(f"histories: expected {n} entries, got {len(self.histories)}")
        if self.hidden_states is not None and (
            self.hidden_states.dim() != 2 or self.hidden_states.shape[0] != n
        ):
            raise ValueError(
                f"hidden_states: expected shape [N, H] = [{n}, H], got {list(self.hidden_states.shape)}"
            )


@dataclass(frozen=True, slots=True)
class DraftOutput:
    """Verify blocks and, for sampled drafts, the draft distribution of each node ([N, D, V] fp32)."""

    tree: VerifyTree
    draft_probs: torch.Tensor | None = None


class Drafter(Protocol):
    """Proposes verify blocks; implemented per method (mtp, multi_layer_mtp, eagle3, dflash, ngram)."""

    @property
    def method(self) -> Method: ...

    @property
    def max_draft_tokens(self) -> int:
        """Dmax: the largest verify block `propose` can return."""
        ...

    def propose(self, batch: DraftBatch) -> DraftOutput: ...


class NgramDrafter:
    """Prompt-lookup drafter: chains of up to S tokens copied from the row's history; zero-draft rows ok."""

    def __init__(self, *, min_n: int, max_n: int, num_speculative_tokens: int) -> None:
        self._proposer = NgramProposer(
            min_n=min_n, max_n=max_n, num_speculative_tokens=num_speculative_tokens
        )

    @property
    def method(self) -> Method:
        return "ngram"

    @property
    def max_draft_tokens(self) -> int:
        return self._proposer.num_speculative_tokens + 1

    def propose(self, batch: DraftBatch) -> DraftOutput:
        if len(batch.histories) != batch.root_tokens.shape[0]:
            raise ValueError("batch.histories: the ngram drafter needs one history per row")
        drafts, num = self._proposer.propose(batch.histories, batch.num_steps)
        root = batch.root_tokens.to(drafts.device)
        return DraftOutput(VerifyTree.chain(root, drafts, num))
