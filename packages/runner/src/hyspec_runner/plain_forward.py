"""The target's plain forwards: prompt chunks and one-token decodes, and their sampling.

`PlainForwards.run` is a plain engine step: one forward (DECODE when every chunk brings one token, replayed
from a CUDA graph when one fits, else EXTEND), the drafter's feed, prompt logprobs, the sampler queued on
the device, then one read of the tokens. The model runner also uses the parts: `forward` for a speculative
step whose round decodes its rows beside the step's prompt chunks, `queue_sampling` for the prompt chunks
of a MIXED forward (their tokens read after the round's).
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch
from hyspec_attn_backends import CudaGraphRunner, HybridBackend
from hyspec_kernels import StateSave
from hyspec_spec_workers.constraint import TokenBitmask
from hyspec_spec_workers.round import SpeculativeRound
from hyspec_spec_workers.sampling import (
    PendingSample,
    SampledToken,
    Sampler,
    SamplerOutput,
    sample_rows,
    to_sampled_tokens,
)
from hyspec_statepool.pool import HybridStatePool
from hyspec_statepool.transfer import to_device

from hyspec_runner.decode_ahead import DecodeAhead
from hyspec_runner.grammar import apply_grammar_masks
from hyspec_runner.runner import (
    PromptLogprobRows,
    RanAheadMismatch,
    prompt_logprob_rows,
    spread_tokens,
)
from hyspec_runner.schedule import RunnerRequest, ScheduledChunk


@dataclass(frozen=True, slots=True)
class PlainInputs:
    """The host inputs of a forward over plain chunks."""

    chunks: Sequence[ScheduledChunk[RunnerRequest]]
    ids: list[str]
    tokens: list[int]  # packed chunk by chunk
    q_lens: list[int]
    prefix: list[int]
    input_ids: torch.Tensor  # [T] int64, on the host
    state_saves: tuple[StateSave, ...]  # the chunks' inner prefix-cache snapshots, in packed tokens

    @staticmethod
    def of(chunks: Sequence[ScheduledChunk[RunnerRequest]]) -> PlainInputs:
        tokens = [t for c in chunks for t in c.request.token_slice(c.start, c.start + c.num_new)]
        q_lens = [c.num_new for c in chunks]
        offsets = itertools.accumulate(q_lens, initial=0)  # packed start of each chunk
        saves = tuple(
            StateSave(i, off + pos - c.start, slot)
            for i, (c, off) in enumerate(zip(chunks, offsets, strict=False))
            for pos, slot in c.state_saves
        )
        return PlainInputs(
            chunks=chunks,
            ids=[c.request.request_id for c in chunks],
            tokens=tokens,
            q_lens=q_lens,
            prefix=[c.start for c in chunks],
            input_ids=torch.tensor(tokens, dtype=torch.int64),
            state_saves=saves,
        )


@dataclass(frozen=True, slots=True)
class QueuedTokens:
    """A plain forward's sampling, queued on the device: `read` reads the tokens.

    `out` holds one row per sampling chunk of `chunks`, in order, and possibly more rows after them (a
    forward shared with other chunks puts these first); None when no chunk samples.
    """

    chunks: Sequence[ScheduledChunk[RunnerRequest]]
    out: SamplerOutput | None
    prompt_logprobs: tuple[PromptLogprobRows | None, ...]
    host: PendingSample | None = None  # `out`'s copy to the host, queued right after the sampler

    def read(self) -> list[SampledToken | None]:
        """The sampled tokens spread over the chunks (one device read)."""
        if self.out is None:
            return [None] * len(self.chunks)
        reqs = [c.request for c in self.chunks if c.sample]
        out = self.out if self.host is None else self.host.wait()
        return spread_tokens(self.chunks, to_sampled_tokens(out, reqs))


@dataclass(slots=True)
class _RanAhead:
    """A decode forward queued before the tokens it feeds were read (`PlainForwards.run_ahead`)."""

    chunks: Sequence[ScheduledChunk[RunnerRequest]]  # of the step that queued it
    requests: tuple[RunnerRequest, ...]  # its rows' requests, in order
    prefix_lens: tuple[int, ...]  # the position each row decodes
    hidden: torch.Tensor  # [n, H] the forward's output (a graph's buffer: valid until its next replay)
    aux: tuple[torch.Tensor, ...]  # [n, H] each: the layers a model drafter reads
    keep: tuple[int, ...]  # the queuing step's rows it holds
    tokens: tuple[int, ...] | None = None  # the tokens it feeds, once the host read them

    def rows_of(self, inp: PlainInputs) -> list[int] | None:
        """Its rows that decode `inp`'s chunks, in order (the next step: these requests less the ones that
        ended), or None when `inp` is not such a step."""
        rows: list[int] = []
        j = 0
        for c, token in zip(inp.chunks, inp.tokens, strict=False):
            while j < len(self.requests) and self.requests[j] is not c.request:
                j += 1
            if (
                j == len(self.requests)
                or c.num_new != 1
                or c.start != self.prefix_lens[j]
                or self.tokens is None
                or token != self.tokens[j]
            ):
                return None
            rows.append(j)
            j += 1
        return rows if len(inp.tokens) == len(inp.chunks) else None


class PlainForwards:
    """Plain forwards of one target model through its graphs, backend and pool.

    Args:
        model: the target (`compute_logits`).
        graphs: the target's forwards, replayed from CUDA graphs where captured.
        backend, pool: where its batches are built.
        ahead: the decode batch built one step early (`decode_ahead.py`).
        sampler: the target's one sampler.
        spec: the speculative round whose drafter is fed every plain forward's tokens, or None.
    """

    def __init__(
        self,
        *,
        model: Any,
        graphs: CudaGraphRunner,
        backend: HybridBackend,
        pool: HybridStatePool,
        ahead: DecodeAhead,
        sampler: Sampler,
        spec: SpeculativeRound | None,
    ) -> None:
        self.model, self.graphs, self.backend, self.pool = model, graphs, backend, pool
        self.ahead, self.sampler, self.spec = ahead, sampler, spec
        self._masks = TokenBitmask()  # structured outputs' masks
        self._ran: _RanAhead | None = None  # the next step's decode, queued ahead (`run_ahead`)
        self.num_ran_ahead = 0  # decode forwards queued before the tokens they feed were read

    def run(
        self, chunks: Sequence[ScheduledChunk[RunnerRequest]]
    ) -> tuple[list[SampledToken | None], tuple[PromptLogprobRows | None, ...]]:
        """One forward of these chunks: a token for every chunk that samples (None for the others), and the
        prompt logprobs it scored (`prompt_logprob_rows`)."""
        queued = self.forward(PlainInputs.of(chunks))
        return self.read(queued), queued.prompt_logprobs

    def read(self, queued: QueuedTokens) -> list[SampledToken | None]:
        """The tokens of a `forward` (one device read), told to the decode batch built ahead on them."""
        out = queued.read()
        tokens = [0 if t is None else t.token_id for t in out]
        self.ahead.sampled(tokens)
        if self._ran is not None and self._ran.chunks is queued.chunks:
            self._ran.tokens = tuple(tokens[i] for i in self._ran.keep)
        return out

    def run_ahead(self, queued: QueuedTokens) -> tuple[str, ...]:
        """Queues the forward of the decode batch this step built ahead (`decode_ahead.py`) now, before the
        step's tokens are read, so that the device runs it while the host reads them, emits them and
        schedules (vLLM's async scheduling). Its requests' KV and recurrent state then hold one more token
        than the host has read: the next step must be their decode (any that ended drop out), which
        `forward` takes instead of running one (a step that holds any of them otherwise raises). Returns
        the requests it decodes (none when there was no batch or it no longer matches)."""
        built = self.ahead.take_built()
        if built is None:
            return ()
        requests = tuple(queued.chunks[i].request for i in built.keep)
        if built.req_ids != tuple(r.request_id for r in requests) or self._ran is not None:
            raise RuntimeError("the decode batch built ahead is not this step's")
        hidden, *aux = self.graphs.run(built.batch)  # [n, H]
        self._ran = _RanAhead(queued.chunks, requests, built.prefix_lens, hidden, tuple(aux), built.keep)
        self.num_ran_ahead += 1
        return built.req_ids

    def drop_ran_ahead(self) -> None:
        """Forget a decode that ran ahead (the engine recomputes its requests: a failed step)."""
        self._ran = None

    def holds_ran_ahead(self, chunks: Sequence[ScheduledChunk[RunnerRequest]]) -> bool:
        """Some of these chunks' requests had their next decode queued ahead (`run_ahead`)."""
        ran = self._ran
        return ran is not None and any(r is c.request for r in ran.requests for c in chunks)

    def ran_ahead_rows(self) -> int | None:
        """The rows of the decode queued ahead (requests may have ended since), or None without one."""
        return None if self._ran is None else len(self._ran.requests)

    def _take_ran(self, inp: PlainInputs) -> tuple[torch.Tensor, tuple[torch.Tensor, ...]] | None:
        """The hidden states [T, H] (and a drafter's layers) of `inp`'s decode if it ran ahead, else None."""
        if self._ran is None:
            return None
        rows = self._ran.rows_of(inp)
        if rows is None and self.holds_ran_ahead(inp.chunks):
            # their state already holds the token this step would feed again: never compute it twice
            raise RanAheadMismatch("a step holds requests whose next decode ran ahead, not as that decode")
        ran, self._ran = self._ran, None
        if rows is None:
            return None  # its requests all ended
        if rows == list(range(len(ran.requests))):
            return ran.hidden, ran.aux
        index = to_device(rows, dtype=torch.int64, device=ran.hidden.device)
        return ran.hidden[index], tuple(a[index] for a in ran.aux)

    def forward(self, inp: PlainInputs) -> QueuedTokens:
        """One forward of plain chunks (EXTEND, or DECODE when each brings one token), sampling queued."""
        rows = self.pool.req_rows(inp.ids)
        decode = all(q == 1 for q in inp.q_lens)
        ran = self._take_ran(inp)  # queued during the last step, before its tokens were read
        if ran is not None:
            queued = self.queue_sampling(inp, *ran)
        else:
            # prepared during the previous step when it decoded these very requests (else None)
            batch = self.ahead.take(req_ids=inp.ids, prefix_lens=inp.prefix, tokens=inp.tokens)
            if batch is None and decode:
                # one token per request: recurrent decode kernels, replayed from a graph when one fits
                batch = self.graphs.prepare_decode(
                    req_rows=rows, input_ids=inp.input_ids, prefix_lens=inp.prefix
                )
            elif batch is None:
                batch = self.backend.prepare_extend(
                    req_rows=rows,
                    input_ids=inp.input_ids,
                    q_lens=inp.q_lens,
                    prefix_lens=inp.prefix,
                    state_saves=inp.state_saves,
                )
            hidden, *aux = self.graphs.run(batch)  # [T, H] of the live tokens (graph outputs: read them now)
            queued = self.queue_sampling(inp, hidden, tuple(aux))
        if decode and queued.out is not None and all(c.sample for c in inp.chunks):
            # the device is still busy with this step: build the next one's batch now (decode_ahead.py),
            # without the requests this step's token ends by their budget
            keep = [i for i, c in enumerate(inp.chunks) if not _last_token(c.request)]
            if keep:
                whole = len(keep) == len(inp.chunks)
                ids = [inp.ids[i] for i in keep]
                nxt = queued.out.token_ids[: len(inp.chunks)]  # [N] int64 on the device
                self.ahead.build(
                    req_ids=ids,
                    req_rows=rows if whole else self.pool.req_rows(ids),
                    prefix_lens=[inp.prefix[i] + 1 for i in keep],
                    next_tokens=nxt if whole else nxt[to_device(keep, dtype=torch.int64, device=nxt.device)],
                    keep=keep,
                )
        return queued

    def queue_sampling(
        self, inp: PlainInputs, hidden: torch.Tensor, aux: tuple[torch.Tensor, ...]
    ) -> QueuedTokens:
        """After a forward of plain chunks ([T, H] hidden, the drafter's layers [T, H] each): the drafter's
        feed, prompt logprobs, and a token for every sampling chunk, queued on the device."""
        chunks = inp.chunks
        if self.spec is not None and self.spec.feed is not None:
            # the tokens stay on the host: the feed uploads them once, when the drafter next needs them
            self.spec.feed_forward(
                req_ids=inp.ids,
                start_positions=inp.prefix,
                num_tokens=inp.q_lens,
                tokens=inp.input_ids,  # [T] int64 on the host
                hidden=hidden,
                aux=aux,
            )
        # read now: `hidden` may be a graph's output buffer, valid until the next replay
        prompt_lp = prompt_logprob_rows(
            chunks, lambda rows: self.model.compute_logits(hidden[rows]), hidden.device
        )  # () unless a chunk scores prompt tokens
        sample = [i for i, c in enumerate(chunks) if c.sample]
        if not sample:
            return QueuedTokens(chunks, None, prompt_lp)
        ends = list(itertools.accumulate(inp.q_lens))  # packed end of each chunk
        last = [ends[i] - 1 for i in sample]  # last packed token of each sampling chunk
        if last == list(range(len(inp.tokens))):
            picked = hidden  # every token samples (a decode step): the rows are already in order
        else:
            picked = hidden[to_device(last, dtype=torch.int64, device=hidden.device)]
        logits = self.model.compute_logits(picked)  # [n_sample, V]
        reqs = [chunks[i].request for i in sample]
        apply_grammar_masks(logits, reqs, self._masks)
        out = sample_rows(self.sampler, logits, reqs)
        return QueuedTokens(chunks, out, prompt_lp, out.start_read())


def _last_token(req: RunnerRequest) -> bool:
    """The token this step samples for `req` is its last: its `max_tokens` budget ends there."""
    return len(req.output_token_ids) + 1 >= req.max_tokens
