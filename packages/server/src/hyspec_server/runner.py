"""The model-runner seam between the engine and a model.

Per step the engine hands the runner the scheduled chunks; the runner builds the batch tensors and backend
metadata once, runs the model, samples on device for every chunk whose `sample` is set, and returns the
chosen tokens as Python values (one host sync per step).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

import torch

from hyspec_server.memory import RequestMemory
from hyspec_server.sampler import PenaltyTensors, Sampler, SamplerOutput, SamplingTensors
from hyspec_server.scheduler import ScheduledChunk, SchedulerOutput


@dataclass(frozen=True, slots=True)
class SampledToken:
    token_id: int
    logprob: float | None
    top: dict[int, float] | None


@dataclass(frozen=True, slots=True)
class VerifiedTokens:
    """Outcome of a verify chunk (speculative decoding) for its request.

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


@dataclass(frozen=True, slots=True)
class RunnerOutput:
    """One entry per chunk of the step, in order; None for chunks that did not sample.

    `verified[i]` is set (and `tokens[i]` is its first token) for verify chunks; empty when none ran.
    """

    tokens: tuple[SampledToken | None, ...]
    verified: tuple[VerifiedTokens | None, ...] = ()


class ModelRunner(Protocol):
    @property
    def memory(self) -> RequestMemory:
        """The pool the runner's model reads and writes; the scheduler admits requests against it."""
        ...

    @property
    def device(self) -> torch.device: ...

    @property
    def max_model_len(self) -> int: ...

    def execute(self, step: SchedulerOutput) -> RunnerOutput: ...


def sampling_tensors(chunks: list[ScheduledChunk], device: torch.device) -> SamplingTensors:
    """Sampling knobs of the sampling chunks, in order."""
    ps = [c.request.params for c in chunks]
    want = [p.logprobs for p in ps if p.logprobs is not None]
    penalties: PenaltyTensors | None = None
    if any(p.has_penalties for p in ps):
        penalties = PenaltyTensors.build(
            presence=[p.presence_penalty for p in ps],
            frequency=[p.frequency_penalty for p in ps],
            repetition=[p.repetition_penalty for p in ps],
            output_tokens=[c.request.output_token_ids for c in chunks],
            prompt_tokens=[c.request.prompt_token_ids for c in chunks],
            device=device,
        )
    return SamplingTensors.build(
        temperature=[p.temperature for p in ps],
        top_k=[p.top_k for p in ps],
        top_p=[p.top_p for p in ps],
        min_p=[p.min_p for p in ps],
        generators=[c.request.generator for c in chunks],
        num_logprobs=max(want) if want else -1,
        device=device,
        penalties=penalties,
    )


def sample_chunks(
    sampler: Sampler, logits: torch.Tensor, chunks: list[ScheduledChunk], device: torch.device
) -> SamplerOutput:
    """The sampler over the sampling chunks' rows (logits [N, V], chunks in order).

    When every row is greedy without penalties or logprobs the result is each row's argmax: no per-row
    sampling tensors are built and copied to the device (the common greedy decode step).
    """
    ps = [c.request.params for c in chunks]
    if all(p.temperature == 0 and not p.has_penalties and p.logprobs is None for p in ps):
        return sampler.greedy(logits)
    return sampler(logits, sampling_tensors(chunks, device))


def to_runner_output(step: SchedulerOutput, out: SamplerOutput) -> RunnerOutput:
    """Spreads the sampler's rows (sampling chunks only, in order) back over all chunks of the step."""
    ids = out.token_ids.tolist()
    lps = out.logprobs.tolist() if out.logprobs is not None else None
    top_ids = out.top_ids.tolist() if out.top_ids is not None else None
    top_lps = out.top_logprobs.tolist() if out.top_logprobs is not None else None
    tokens: list[SampledToken | None] = []
    row = 0
    for c in step.chunks:
        if not c.sample:
            tokens.append(None)
            continue
        k = c.request.params.logprobs
        top: dict[int, float] | None = None
        if k and top_ids is not None and top_lps is not None:
            top = dict(zip(top_ids[row][:k], top_lps[row][:k]))
        lp = lps[row] if (lps is not None and k is not None) else None
        tokens.append(SampledToken(int(ids[row]), lp, top))
        row += 1
    return RunnerOutput(tuple(tokens))
