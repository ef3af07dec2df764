"""What a speculative round sees and returns, and what it needs from the target (`round.py` runs it).

`RoundRow` is one decoding request in a round, `VerifiedTokens` its outcome, `VerifyTarget` the protocol a
target's runner satisfies (hyspec_runner's model runner with CUDA graphs, or an eager loop).
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import Protocol, overload

import torch
from hyspec_attn_backends import ForwardBatch

from hyspec_spec_workers.constraint import TokenConstraint
from hyspec_spec_workers.sampling import SampledToken, Sampler, SamplingRequest


class RoundRequest(SamplingRequest, Protocol):
    """A request as the round sees it: the sampler's view plus its id and its tokens (n-gram history)."""

    @property
    def request_id(self) -> str: ...

    def token_slice(self, start: int, end: int) -> list[int]: ...


class RequestTokens(Sequence[int]):
    """A request's first `length` tokens as a sequence that copies only what is sliced (`token_slice`): a
    round hands these to its drafter as histories, so a row costs the same at any history length."""

    __slots__ = ("_length", "_request")

    def __init__(self, request: RoundRequest, length: int) -> None:
        self._request, self._length = request, length

    def __len__(self) -> int:
        return self._length

    @overload
    def __getitem__(self, index: int) -> int: ...

    @overload
    def __getitem__(self, index: slice) -> list[int]: ...

    def __getitem__(self, index: int | slice) -> int | list[int]:
        if isinstance(index, slice):
            start, stop, step = index.indices(self._length)
            if step != 1:
                raise ValueError(f"index: expected a contiguous slice, got step {step}")
            return self._request.token_slice(start, max(start, stop))
        i = index + self._length if index < 0 else index
        if not 0 <= i < self._length:
            raise IndexError(f"index {index} out of range for {self._length} tokens")
        return self._request.token_slice(i, i + 1)[0]

    def tolist(self) -> list[int]:
        return self._request.token_slice(0, self._length)

    def __iter__(self) -> Iterator[int]:
        return iter(self.tolist())  # one slice, not a call per token


@dataclass(frozen=True, slots=True)
class RoundRow:
    """One decoding request in a round.

    Attributes:
        request: the request.
        prefix_len: tokens in its KV and state; its current (root) token sits at this position.
        root_token: the current token: the last one emitted, not yet in KV or state.
        max_drafts: drafts the caller reserved KV room for past the root (<= Dmax - 1).
        max_new_tokens: tokens it may still emit (>= 1): the round never emits more.
        stop_token_ids: EOS and stop token ids; the round stops a row after the first it emits.
        constraint: its structured-output constraint, or None (see `constraint.py`).
    """

    request: RoundRequest
    prefix_len: int
    root_token: int
    max_drafts: int
    max_new_tokens: int
    stop_token_ids: frozenset[int]
    constraint: TokenConstraint | None = None


@dataclass(frozen=True, slots=True)
class VerifiedTokens:
    """Outcome of a round for one request.

    Attributes:
        tokens: emitted tokens in order: the accepted drafts then the bonus (num_accepted + 1 of them, already
            cut at EOS, stop token ids and the token budget).
        num_drafts: drafts proposed for the request this round (0: a plain decode round).
        num_accepted: accepted drafts, bonus excluded; the request's KV and state now hold its verify block's
            root and these drafts.
    """

    tokens: tuple[SampledToken, ...]
    num_drafts: int
    num_accepted: int

    def __post_init__(self) -> None:
        if len(self.tokens) != self.num_accepted + 1:
            raise ValueError(
                f"tokens: expected num_accepted + 1 = {self.num_accepted + 1} tokens, got {len(self.tokens)}"
            )
        if not 0 <= self.num_accepted <= self.num_drafts:
            raise ValueError(f"num_accepted: expected in [0, {self.num_drafts}], got {self.num_accepted}")


class VerifyTarget(Protocol):
    """What a speculative round needs from the target's runner."""

    @property
    def device(self) -> torch.device: ...

    @property
    def sampler(self) -> Sampler:
        """The target's one sampler (plain decoding samples with it too)."""
        ...

    @property
    def graphed(self) -> bool:
        """Verify forwards replay captured graphs (a tree config keeps tree metadata for chains then)."""
        ...

    def verify_block_size(self, num_rows: int, block_size: int, *, tree: bool) -> int:
        """The block size the verify forward of `num_rows` blocks of `block_size` runs at (>= block_size)."""
        ...

    def forward_verify(
        self,
        *,
        req_ids: Sequence[str],
        block_tokens: torch.Tensor,
        prefix_lens: Sequence[int],
        tree_parents: torch.Tensor | None,
    ) -> tuple[ForwardBatch, torch.Tensor, tuple[torch.Tensor, ...]]:
        """TARGET_VERIFY over [N, D] blocks (KV room for prefix + D ensured): the batch, the final hidden
        states [N * D, H] and the drafter's capture layers, each [N * D, H] (read before the next forward)."""
        ...

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor: ...

    def commit_after_verify(
        self, *, batch: ForwardBatch, num_accepted: torch.Tensor, accept_paths: torch.Tensor | None
    ) -> torch.Tensor: ...

    def decode(self, rows: Sequence[RoundRow]) -> list[SampledToken]:
        """A plain decode step of these rows (their root tokens). Like every plain forward of the target it
        hands its tokens and features to the round's `feed_forward`."""
        ...
