"""What the scheduler hands the runner each step, and the request as the runner reads it.

The engine's scheduler (hyspec_server) owns requests and decides the step; the runner sees a request only
through `RunnerRequest`: its id, tokens and sampling knobs (spec-workers' `RoundRequest`), its token budget,
stop tokens and structured-output state. `ScheduledChunk` and `SchedulerOutput` are generic in the request
type, so the scheduler's chunks keep its own `Request` while the runner reads them as `RunnerRequest`s.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Generic, Protocol, TypeVar

from hyspec_spec_workers.round_types import RoundRequest
from hyspec_spec_workers.sampling import SamplingKnobs

from hyspec_runner.grammar import GrammarState


class RunnerParams(SamplingKnobs, Protocol):
    """A request's sampling parameters as the runner reads them: the sampler's knobs and its limits."""

    @property
    def stop_token_set(self) -> frozenset[int]:
        """The request's stop token ids (vLLM's `stop_token_ids`) as a set."""
        ...

    @property
    def prompt_logprobs(self) -> int | None:
        """None, or how many top alternatives to report besides each prompt token's own logprob."""
        ...


class RunnerRequest(RoundRequest, Protocol):
    """A request as the runner reads it (the server's `Request`)."""

    @property
    def params(self) -> RunnerParams: ...
    @property
    def max_tokens(self) -> int:
        """Most tokens the request generates: its `max_tokens`, at most the room its prompt leaves in the
        context (vLLM's request's)."""
        ...

    @property
    def bad_words_token_ids(self) -> Sequence[Sequence[int]]:
        """The token sequences of the request's bad words (empty: none)."""
        ...

    @property
    def num_tokens(self) -> int:
        """Prompt and generated tokens."""
        ...

    @property
    def eos_token_ids(self) -> frozenset[int]:
        """The tokenizer's EOS ids, empty with `ignore_eos`."""
        ...

    @property
    def grammar(self) -> GrammarState | None: ...

    def prompt_logprob_positions(self, start: int, end: int) -> range:
        """The prompt tokens whose logprobs the positions start..end-1 of a chunk score."""
        ...


R_co = TypeVar("R_co", bound=RunnerRequest, covariant=True)


@dataclass(frozen=True, slots=True)
class ScheduledChunk(Generic[R_co]):
    """`num_new` tokens of `request` starting at absolute position `start`, computed in this step.

    A `verify` chunk (speculative decoding) is a decoding request's current token (`num_new == 1`, the last
    token) plus up to `num_lookahead` drafts the runner proposes; KV room for all of them is reserved.
    """

    request: R_co
    start: int
    num_new: int
    verify: bool = False
    num_lookahead: int = 0
    # prefix-cache snapshots inside a prefill chunk: (position, state slot) pairs, start < position < end;
    # the forward writes the request's state after `position` tokens into the slot
    state_saves: tuple[tuple[int, int], ...] = ()

    @property
    def end(self) -> int:
        return self.start + self.num_new

    @property
    def sample(self) -> bool:
        # the chunk reaches the last known token, so its logits give the next one
        return self.end == self.request.num_tokens


@dataclass(frozen=True, slots=True)
class SchedulerOutput(Generic[R_co]):
    chunks: tuple[ScheduledChunk[R_co], ...]
    preempted: tuple[R_co, ...]
    # every running request decodes one token and nobody waits for a free seat: unless some end, the next
    # step is these requests' next decode, which the runner may queue before this step's tokens are read
    may_run_ahead: bool = False
    # the step reserved prefix-cache snapshots inside its prefill chunks: the cache now lists pages (and maybe
    # snapshot slots) that only its forward fills, even where no chunk got a slot (`PrefixCache.reserve`
    # caches the pages before a point already cached), so a step that fails must reset the cache
    reserved_snapshots: bool = False

    @property
    def num_tokens(self) -> int:
        return sum(c.num_new for c in self.chunks)
