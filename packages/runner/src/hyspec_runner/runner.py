"""The model-runner seam between the engine and a model.

Per step the engine hands the runner the scheduled chunks; the runner builds the batch tensors and backend
metadata once, runs the model, samples on device for every chunk whose `sample` is set, and returns the
chosen tokens as Python values (one host sync per step; a second one in steps that score prompt tokens for
`prompt_logprobs`).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Protocol

import torch
from hyspec_spec_workers.round_types import VerifiedTokens
from hyspec_spec_workers.sampling import SampledToken, token_logprobs
from hyspec_statepool.transfer import to_device

from hyspec_runner.memory import RequestMemory
from hyspec_runner.schedule import RunnerRequest, ScheduledChunk, SchedulerOutput

PROMPT_LOGPROB_ROWS = 256
"""Prompt positions whose full-vocabulary logprobs exist at once ([rows, V] fp32): bounds what a long prefill
chunk of a `prompt_logprobs` request adds to the step's memory."""


@dataclass(frozen=True, slots=True)
class PromptLogprobRows:
    """Logprobs of prompt tokens `first, first + 1, ...` of one request, from one step's logits (token i is
    scored by the logits at position i - 1), under the model's raw distribution.

    Per token: its logprob, its 1-based rank, and the `k` most likely tokens there with their logprobs (k the
    request's `prompt_logprobs`; empty lists for 0).
    """

    first: int
    logprobs: list[float]
    ranks: list[int]
    top_ids: list[list[int]]
    top_logprobs: list[list[float]]


class RanAheadMismatch(RuntimeError):
    """A step holds requests whose next decode the runner queued ahead (`RunnerOutput.ran_ahead`), but not
    as that decode: their state already holds a token the step would compute again. Never expected; the
    engine recomputes the step's requests from scratch, also a lone one."""


@dataclass(frozen=True, slots=True)
class RunnerOutput:
    """One entry per chunk of the step, in order; None for chunks that did not sample.

    `verified[i]` is set (and `tokens[i]` is its first token) for verify chunks; empty when none ran.
    `prompt_logprobs[i]` is set for chunks that scored prompt tokens of a `prompt_logprobs` request; empty
    when no chunk did.
    """

    tokens: tuple[SampledToken | None, ...]
    verified: tuple[VerifiedTokens | None, ...] = ()
    prompt_logprobs: tuple[PromptLogprobRows | None, ...] = ()
    # the requests whose next decode the runner queued before reading this step's tokens, as the step's
    # `may_run_ahead` allowed: their KV and recurrent state hold one token more than they have computed
    ran_ahead: tuple[str, ...] = ()


class ModelRunner(Protocol):
    @property
    def memory(self) -> RequestMemory:
        """The pool the runner's model reads and writes; the scheduler admits requests against it."""
        ...

    @property
    def device(self) -> torch.device: ...

    @property
    def max_model_len(self) -> int: ...

    @property
    def vocab_size(self) -> int:
        """Token ids the model embeds: [0, vocab_size)."""
        ...

    def execute(
        self, step: SchedulerOutput[RunnerRequest], *, while_queued: Callable[[], None] | None = None
    ) -> RunnerOutput:
        """Runs the step. `while_queued`: the engine's host work for the step (prefix-cache saves) that may
        overlap the device: called once, after the step's forward is queued and before its outcome is
        read (or after the run, by a runner with nothing to overlap)."""
        ...


def spread_tokens(
    chunks: Sequence[ScheduledChunk[RunnerRequest]], sampled: Sequence[SampledToken]
) -> list[SampledToken | None]:
    """The sampled tokens (sampling chunks only, in order) spread over all chunks; None where none sampled."""
    it = iter(sampled)
    return [next(it) if c.sample else None for c in chunks]


def prompt_logprob_rows(
    chunks: Sequence[ScheduledChunk[RunnerRequest]],
    logits_at: Callable[[torch.Tensor], torch.Tensor],
    device: torch.device,
) -> tuple[PromptLogprobRows | None, ...]:
    """The prompt tokens this step's forward scores for requests that asked for prompt logprobs: one entry
    per chunk, or () when no chunk owes any (the common step: nothing computed, no device read).

    Args:
        chunks: the step's chunks, their tokens packed in this order.
        logits_at: packed token rows ([n] int64 on `device`) -> the step's logits there, [n, V] any float.
    """
    if all(c.request.params.prompt_logprobs is None for c in chunks):
        return ()  # the common step: a few microseconds for a full decode batch
    rows: list[int] = []  # packed rows whose logits score a prompt token
    targets: list[int] = []  # the prompt token each row scores (the one after its position)
    spans: list[tuple[int, int, int, int] | None] = []  # per chunk: first token, row offset, count, k
    packed = 0
    for c in chunks:
        req = c.request
        pos = req.prompt_logprob_positions(c.start, c.end)
        k = req.params.prompt_logprobs
        if len(pos) == 0 or k is None:
            spans.append(None)
        else:
            spans.append((pos.start + 1, len(rows), len(pos), k))
            rows += [packed + p - c.start for p in pos]
            targets += req.prompt_token_ids[pos.start + 1 : pos.stop + 1]
        packed += c.num_new
    if not rows:
        return ()
    k_max = max(s[3] for s in spans if s is not None)
    chosen_l: list[torch.Tensor] = []
    rank_l: list[torch.Tensor] = []
    top_v: list[torch.Tensor] = []
    top_i: list[torch.Tensor] = []
    for a in range(0, len(rows), PROMPT_LOGPROB_ROWS):
        idx = to_device(rows[a : a + PROMPT_LOGPROB_ROWS], dtype=torch.int64, device=device)  # [r]
        tgt = to_device(targets[a : a + PROMPT_LOGPROB_ROWS], dtype=torch.int64, device=device)  # [r]
        lp = token_logprobs(logits_at(idx), tgt, k_max)  # [r] fp32 / int64, [r, k] each
        chosen_l.append(lp.logprobs)
        rank_l.append(lp.ranks)
        if lp.top_logprobs is not None and lp.top_ids is not None:
            top_v.append(lp.top_logprobs)
            top_i.append(lp.top_ids)
    # one device read for the whole step
    lps = torch.cat(chosen_l).tolist()
    ranks = torch.cat(rank_l).tolist()
    tv = torch.cat(top_v).tolist() if top_v else [[] for _ in rows]
    ti = torch.cat(top_i).tolist() if top_i else [[] for _ in rows]
    out: list[PromptLogprobRows | None] = []
    for s in spans:
        if s is None:
            out.append(None)
            continue
        first, off, n, k = s
        end = off + n
        out.append(
            PromptLogprobRows(
                first=first,
                logprobs=lps[off:end],
                ranks=ranks[off:end],
                top_ids=[x[:k] for x in ti[off:end]],
                top_logprobs=[x[:k] for x in tv[off:end]],
            )
        )
    return tuple(out)
