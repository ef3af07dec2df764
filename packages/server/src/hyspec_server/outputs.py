"""What `LLM.generate` and the engine return, shaped like vLLM's `RequestOutput`."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal

FinishReason = Literal["stop", "length", "abort"]


@dataclass(slots=True)
class SpecDecodeStats:
    """Speculative-decoding counters of one request (all zero while no drafter is on)."""

    num_drafts: int = 0
    num_draft_tokens: int = 0
    num_accepted_tokens: int = 0

    @property
    def mean_accept_length(self) -> float:
        # tokens committed per verify round = accepted drafts + the bonus token
        if self.num_drafts == 0:
            return 0.0
        return 1.0 + self.num_accepted_tokens / self.num_drafts


@dataclass(slots=True)
class RequestMetrics:
    """Wall-clock times (time.monotonic seconds) of one request."""

    arrival_time: float
    first_token_time: float | None = None
    finished_time: float | None = None
    num_preemptions: int = 0


@dataclass(slots=True)
class CompletionOutput:
    """One completion of a prompt.

    `logprobs[i]` maps token id -> logprob for generated position i: the chosen token and, when
    `SamplingParams.logprobs = k > 0`, the k most likely tokens (logprobs of the model's raw distribution).
    """

    index: int
    text: str
    token_ids: list[int]
    finish_reason: FinishReason | None = None
    stop_reason: int | str | None = None
    cumulative_logprob: float | None = None
    logprobs: list[dict[int, float]] | None = None

    def finished(self) -> bool:
        return self.finish_reason is not None


@dataclass(slots=True)
class RequestOutput:
    """The state of one request: its prompt, its completion(s) so far and whether it is finished."""

    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput]
    finished: bool
    metrics: RequestMetrics
    spec_stats: SpecDecodeStats | None = None
    # prompt tokens taken from the prefix cache instead of computed (vLLM's name)
    num_cached_tokens: int = 0
    # incremental text since the previous output of this request (streaming)
    delta_text: str = ""
    delta_token_ids: list[int] = field(default_factory=list)
