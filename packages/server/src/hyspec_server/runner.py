"""The model-runner seam between the engine and a model.

Per step the engine hands the runner the scheduled chunks; the runner builds the batch tensors and backend
metadata once, runs the model, samples on device for every chunk whose `sample` is set, and returns the
chosen tokens as Python values (one host sync per step).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol

import torch
from hyspec_spec_workers.round import VerifiedTokens
from hyspec_spec_workers.sampling import SampledToken

from hyspec_server.memory import RequestMemory
from hyspec_server.scheduler import ScheduledChunk, SchedulerOutput


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


def spread_tokens(
    chunks: Sequence[ScheduledChunk], sampled: Sequence[SampledToken]
) -> list[SampledToken | None]:
    """The sampled tokens (sampling chunks only, in order) spread over all chunks; None where none sampled."""
    it = iter(sampled)
    return [next(it) if c.sample else None for c in chunks]
