"""A request's structured-output state as the runner uses it: the matcher that masks a row's logits before
sampling (`apply_grammar_masks`) and, with speculative decoding, spec-workers' `TokenConstraint` of its row.

The server compiles constraints (`hyspec_server.structured.GrammarCompiler`, xgrammar) and gives each
request a `GrammarState` around its xgrammar matcher; xgrammar is imported here only when a row has one.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, Protocol

import torch
from hyspec_spec_workers.constraint import TokenBitmask


class _Constrained(Protocol):
    @property
    def grammar(self) -> GrammarState | None: ...


class GrammarState:
    """One request's position in its constraint."""

    def __init__(self, matcher: Any, *, vocab_size: int = 0) -> None:
        self.matcher = matcher
        self.vocab_size = vocab_size  # the tokenizer's (xgrammar's bitmask width); 0: unknown
        # tokens that complete the constrained text (the tokenizer's EOS): they end the request even with
        # ignore_eos, so a verify round cuts there like at any stop token
        self.stop_token_ids = frozenset(int(t) for t in matcher.stop_token_ids)

    def accept(self, token_id: int) -> None:
        """Advances by one generated token; a token the constraint forbids is a bug upstream: it raises."""
        if not self.matcher.accept_token(token_id):
            raise RuntimeError(f"token {token_id} violates the request's structured-output constraint")

    def allows_any(self, token_ids: Sequence[int]) -> bool:
        """Whether the constraint takes any of these tokens next (state unchanged; needs `vocab_size`)."""
        import xgrammar as xgr

        if self.vocab_size < 1:
            raise ValueError("allows_any: this state was made without the vocabulary size")
        ids = torch.tensor([t for t in token_ids if 0 <= t < self.vocab_size], dtype=torch.long)
        bitmask = xgr.allocate_token_bitmask(1, self.vocab_size)  # [1, ceil(V / 32)] int32
        self.matcher.fill_next_token_bitmask(bitmask, 0)
        return bool(((bitmask[0, ids // 32] >> (ids % 32)) & 1).any())

    def allowed_drafts(self, drafts: Sequence[int]) -> int:
        """How many leading drafts the constraint takes (spec-workers' `TokenConstraint`; state unchanged)."""
        n = 0
        for t in drafts:
            if not self.matcher.accept_token(t):
                break
            n += 1
            if self.matcher.is_terminated():
                break  # a stop token ends the constrained text: nothing after it is allowed
        if n:
            self.matcher.rollback(n)
        return n

    def fill_tree_masks(self, tokens: Sequence[int], parents: Sequence[int], bitmask: torch.Tensor) -> None:
        """Row j of `bitmask` [len(tokens), W] int32 (host) after the path to node j, for every node the
        constraint allows (spec-workers' `TokenConstraint`; a depth-first walk that accepts each node's token
        and rolls it back: the state ends as it started)."""
        children: list[list[int]] = [[] for _ in tokens]
        for j in range(1, len(tokens)):
            children[parents[j]].append(j)

        def visit(j: int) -> None:
            if self.matcher.is_terminated():
                return  # after the stop token: the round stops there, the row stays all-allowed
            self.matcher.fill_next_token_bitmask(bitmask, j)
            for c in children[j]:
                if self.matcher.accept_token(tokens[c]):
                    visit(c)
                    self.matcher.rollback(1)

        visit(0)

    @property
    def done(self) -> bool:
        """The constrained text is complete (its stop token was accepted)."""
        return bool(self.matcher.is_terminated())


def apply_grammar_masks(
    logits: torch.Tensor, requests: Sequence[_Constrained], masks: TokenBitmask | None = None
) -> None:
    """Sets the logits of forbidden tokens to -inf in place for constrained rows ([N, V], row i is
    `requests[i]`); rows without a constraint are untouched, and nothing runs when none has one. `masks`:
    the engine's `TokenBitmask` (it keeps the vocabulary's bit tables; a fresh one builds them)."""
    rows = [i for i, r in enumerate(requests) if r.grammar is not None]
    if not rows:
        return
    import xgrammar as xgr

    masks = masks or TokenBitmask()
    bitmask = masks.host((len(requests),), int(logits.shape[-1]), pinned=logits.is_cuda)  # [N, W]
    matchers = [g.matcher for g in (requests[i].grammar for i in rows) if g is not None]
    # one call fills every row (the matchers' own loop; threads would cost more than 32 rows' fill)
    xgr.BatchGrammarMatcher(max_threads=1).batch_fill_next_token_bitmask(matchers, bitmask, rows)
    masks.apply(logits, bitmask)
