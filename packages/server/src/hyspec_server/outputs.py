"""What `LLM.generate` and the engine return, shaped like vLLM's `RequestOutput`."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal

FinishReason = Literal["stop", "length", "abort"]


@dataclass(frozen=True, slots=True)
class Logprob:
    """One token's log probability under the model's raw distribution at one position (vLLM's type).

    `rank` is 1-based: the number of tokens at least as likely there, itself included (vLLM v1's).
    `decoded_token` is the token decoded on its own (special tokens kept), as the OpenAI responses show it.
    """

    logprob: float
    rank: int | None = None
    decoded_token: str | None = None


SampleLogprobs = list[dict[int, Logprob]]
"""Per generated token: the chosen token and the top-`logprobs` alternatives (vLLM's alias)."""
PromptLogprobs = list[dict[int, Logprob] | None]
"""Per prompt token: None for the first (nothing predicts it), then the token itself and the
top-`prompt_logprobs` alternatives (vLLM's alias)."""


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

    `logprobs[i]` maps token id -> `Logprob` for generated position i: the chosen token (first, with its true
    rank) and, when `SamplingParams.logprobs = k > 0`, the k most likely tokens (ranks 1..k), all under the
    model's raw distribution. `cumulative_logprob` is the sum of the chosen tokens' logprobs. Both are None
    when the request did not ask for logprobs.
    """

    index: int
    text: str
    token_ids: list[int]
    finish_reason: FinishReason | None = None
    stop_reason: int | str | None = None
    cumulative_logprob: float | None = None
    logprobs: SampleLogprobs | None = None

    def finished(self) -> bool:
        return self.finish_reason is not None


@dataclass(slots=True)
class RequestOutput:
    """The state of one request: its prompt, its completion(s) so far and whether it is finished.

    `prompt_logprobs` (when `SamplingParams.prompt_logprobs` is set): one entry per prompt token, complete
    in every output (the prompt is prefilled before the first output). `prompt_token_ids` and
    `prompt_logprobs` are the request's own, shared by its outputs (as vLLM's): read them, do not change them.
    """

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
    prompt_logprobs: PromptLogprobs | None = None
