"""Continuous batching with a per-step token budget (vLLM v1 style).

There is no prefill or decode phase. Each step, running requests (oldest first) get up to
`num_tokens - num_computed_tokens` tokens each, then waiting requests are admitted while the budget, the
sequence limit and free memory allow. A long prompt is chunked across steps. When a running request cannot
grow its KV, the youngest running request is preempted: its memory is freed and it goes back to the front of
the waiting queue, to be recomputed from its prompt and generated tokens. No other request is touched.

Prefix caching: an admitted request resumes from the longest cached prefix of its tokens (never its last
token, whose logits give the next one). Snapshots of the committed state are saved at multiples of the
memory's snapshot interval: where a prefill chunk ends as soon as the step's forward is queued
(`save_snapshots`: the host work overlaps the device's), and, when the memory has `inner_snapshots`, at the
positions a chunk passes, whose states its forward writes into slots reserved once the step is scheduled
(`_with_inner_saves`); otherwise chunks end at every such position. Also at the end of each prefill and of
each finished request (`finish`), so later requests with the same prefix skip it.
"""

from __future__ import annotations

import logging
from collections import deque
from collections.abc import Iterable
from dataclasses import dataclass, replace

from hyspec_runner.memory import RequestMemory
from hyspec_runner.schedule import ScheduledChunk, SchedulerOutput
from hyspec_statepool.prefix_cache import PrefixSave

from hyspec_server.request import Request, RequestStatus

log = logging.getLogger("hyspec.scheduler")


class QueueFullError(RuntimeError):
    """The waiting queue is at `max_waiting`; retry later."""


class RanAheadBroken(RuntimeError):
    """The decode that ran ahead cannot be the next step (an invariant broke): `schedule` recomputes its
    requests rather than failing at every later step."""


@dataclass(frozen=True, slots=True)
class SchedulerConfig:
    """No defaults of its own: `build_engine` fills it from `EngineArgs`, where each default is set.

    Args:
    max_num_seqs: most running requests.
    max_num_batched_tokens: token budget of one step (prefill chunks + decodes).
    max_waiting: bound of the waiting queue; beyond it `add` raises QueueFullError.
    num_lookahead_tokens: speculative decoding: draft tokens a verify block may add after the current
        token (Dmax - 1); 0 without speculation. A decoding request then gets a verify chunk with KV room
        for its whole block and costs Dmax tokens of the budget.
    async_scheduling: a decode step whose next step is surely the same requests' decode lets the runner
        queue that decode before its tokens are read (`SchedulerOutput.may_run_ahead`).
    """

    max_num_seqs: int
    max_num_batched_tokens: int
    max_waiting: int
    num_lookahead_tokens: int = 0
    async_scheduling: bool = False

    def __post_init__(self) -> None:
        for name in ("max_num_seqs", "max_num_batched_tokens", "max_waiting"):
            v = getattr(self, name)
            if not isinstance(v, int) or isinstance(v, bool) or v < 1:
                raise ValueError(f"{name} must be an int >= 1, got {v!r}")
        v = self.num_lookahead_tokens
        if not isinstance(v, int) or isinstance(v, bool) or v < 0:
            raise ValueError(f"num_lookahead_tokens must be an int >= 0, got {v!r}")
        if not isinstance(self.async_scheduling, bool):
            raise ValueError(f"async_scheduling must be a bool, got {self.async_scheduling!r}")


class Scheduler:
    def __init__(self, config: SchedulerConfig, memory: RequestMemory) -> None:
        self.config = config
        self.memory = memory
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []  # admission order: the last one is the youngest
        self.num_preemptions = 0
        # requests whose next decode the runner queued ahead in the last step (the engine sets it after each
        # step): their state holds one token more than they computed, so the next step is that decode
        self.ran_ahead: frozenset[str] = frozenset()

    def add(self, request: Request, *, bounded: bool = True) -> None:
        if bounded and len(self.waiting) >= self.config.max_waiting:
            raise QueueFullError(f"the waiting queue is full ({self.config.max_waiting} requests)")
        self.waiting.append(request)

    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running)

    def schedule(self) -> SchedulerOutput[Request]:
        if self.ran_ahead and any(r.request_id in self.ran_ahead for r in self.running):
            try:
                return self._decode_ran_ahead()
            except RanAheadBroken as e:
                # recomputed from scratch, as after a failed step (the runner drops what it queued when it
                # meets them again): the engine goes on instead of failing at every later step
                log.warning("%s; recomputing its requests", e)
                held = self.ran_ahead
                self.quarantine([r for r in self.running if r.request_id in held])
                return SchedulerOutput((), ())
        out = self._schedule()
        if self.memory.inner_snapshots:
            # after every lookup of the step: none may resume from a snapshot its forward has yet to write
            chunks = self._with_inner_saves(out.chunks)
            if chunks is not None:
                out = SchedulerOutput(chunks, out.preempted, reserved_snapshots=True)
        return replace(out, may_run_ahead=self._may_run_ahead(out))

    def _may_run_ahead(self, out: SchedulerOutput[Request]) -> bool:
        """The next step is surely `out`'s requests' next decode, less the ones that end: every running
        request decodes one token in `out`, nothing was preempted, and nobody waits to be admitted unless
        every seat is taken (a seat that frees admits the next request one step later than it would)."""
        return (
            self.config.async_scheduling
            and (not self.waiting or len(self.running) >= self.config.max_num_seqs)
            and not out.preempted
            and 0 < len(out.chunks) == len(self.running)
            and all(c.num_new == 1 and c.sample and not c.request.suspect for c in out.chunks)
        )

    def _decode_ran_ahead(self) -> SchedulerOutput[Request]:
        """The step after one whose next decode ran ahead: that decode, of its requests still running (in
        order; the runner checks that they are its rows; with speculation, verify chunks of their current
        token, which the round runs as a plain step). Nobody is admitted or preempted in it: their KV room
        was reserved when it was queued."""
        chunks = tuple(self._plan_running(self.config.max_num_batched_tokens))
        ends = [c.end + c.num_lookahead for c in chunks]
        if len(chunks) != len(self.running) or any(c.num_new != 1 for c in chunks):
            raise RanAheadBroken("a decode that ran ahead is not its requests' next step")
        if not self.memory.grow([c.request.request_id for c in chunks], ends):
            raise RanAheadBroken(
                "no KV room for a decode that ran ahead (its pages were reserved when queued)"
            )
        out = SchedulerOutput(chunks, ())
        return replace(out, may_run_ahead=self._may_run_ahead(out))

    def _schedule(self) -> SchedulerOutput[Request]:
        suspect = next((r for r in self.running if r.suspect), None)
        if suspect is None and self.waiting and self.waiting[0].suspect:
            suspect = self.waiting[0]
        if suspect is not None:
            return self._schedule_alone(suspect)
        budget = self.config.max_num_batched_tokens
        chunks: list[ScheduledChunk[Request]] = []
        preempted: list[Request] = []
        i = 0
        # the running requests' chunks as planned without preemption; when memory holds all of them at
        # once (the common case) they grow in one call, else request by request below, preempting the newest
        planned = self._plan_running(budget)
        if planned and self.memory.grow(
            [c.request.request_id for c in planned], [c.end + c.num_lookahead for c in planned]
        ):
            chunks, i = list(planned), len(planned)
            budget -= sum(c.num_new + c.num_lookahead for c in planned)
        while i < len(self.running) and budget > 0:
            req = self.running[i]
            c = self._running_chunk(req, budget)
            while not self.memory.grow([req.request_id], [c.end + c.num_lookahead]):
                victim = self.running.pop()
                self._preempt(victim)
                preempted.append(victim)
                if victim is req:
                    break
            else:
                chunks.append(c)
                budget -= c.num_new + c.num_lookahead
                i += 1
        # admitting right after a preemption would just take the memory back
        while (
            not preempted
            and self.waiting
            and budget > 0
            and len(self.running) < self.config.max_num_seqs
            and self.memory.can_alloc()
        ):
            req = self.waiting[0]
            self.memory.alloc(req.request_id)
            # a request that still owes prompt logprobs computes the positions that score them (a fresh one:
            # its whole prompt, with no lookup counted in the cache's hit rate)
            limit = req.prefix_cache_limit
            cached = 0
            if limit > 0 or not req.owes_prompt_logprobs:
                cached = self.memory.attach_prefix(
                    req.request_id, req.token_slice(0, req.num_tokens), salt=req.cache_salt, max_tokens=limit
                )
            req.num_computed_tokens = cached
            n = self._chunk_len(req, budget)
            if not self.memory.grow([req.request_id], [cached + n]):
                self.memory.free([req.request_id])
                req.num_computed_tokens = 0
                break
            self.waiting.popleft()
            if req.metrics.num_preemptions == 0:
                req.num_cached_tokens = cached
            req.status = RequestStatus.RUNNING
            self.running.append(req)
            chunks.append(ScheduledChunk(req, cached, n))
            budget -= n
        return SchedulerOutput(tuple(chunks), tuple(preempted))

    def _plan_running(self, budget: int) -> list[ScheduledChunk[Request]]:
        """The running requests' chunks in order within the token budget, as `schedule` makes them when
        nobody is preempted."""
        out: list[ScheduledChunk[Request]] = []
        for req in self.running:
            if budget <= 0:
                break
            out.append(c := self._running_chunk(req, budget))
            budget -= c.num_new + c.num_lookahead
        return out

    def _running_chunk(self, req: Request, budget: int) -> ScheduledChunk[Request]:
        """A running request's chunk this step, within `budget` tokens."""
        look = self.config.num_lookahead_tokens
        n = self._chunk_len(req, budget)
        # a decoding request verifies a block: its current token plus up to `look` drafts
        verify = look > 0 and self._is_decoding(req) and budget >= 1 + look
        return ScheduledChunk(req, req.num_computed_tokens, n, verify, look if verify else 0)

    def quarantine(self, requests: Iterable[Request]) -> None:
        """The requests of a failed step go back to the front of the queue, memory freed, to be recomputed
        one at a time. Nothing of theirs is cached: the failed step may have half-written their state (the
        engine resets the prefix cache when the step's snapshots were already saved)."""
        reqs = [r for r in requests if r in self.running]
        self.ran_ahead = frozenset()  # (the runner forgot it too: a failed step) recomputed from scratch
        for req in reversed(reqs):
            self.running.remove(req)
            self.memory.free([req.request_id])
            req.num_computed_tokens = 0
            req.status = RequestStatus.WAITING
            req.suspect = True
            self.waiting.appendleft(req)

    def _schedule_alone(self, req: Request) -> SchedulerOutput[Request]:
        """A step of one suspect request (a plain chunk, no verify block), preempting the youngest others when
        it needs their memory; the other running requests wait (lossless: they only pause)."""
        preempted: list[Request] = []
        if req not in self.running:
            while self.running and (
                len(self.running) >= self.config.max_num_seqs or not self.memory.can_alloc()
            ):
                victim = self.running.pop()
                self._preempt(victim)
                preempted.append(victim)
            self.waiting.remove(req)
            if not self.memory.can_alloc():
                self.waiting.appendleft(req)
                return SchedulerOutput((), tuple(preempted))
            self.memory.alloc(req.request_id)
            req.status = RequestStatus.RUNNING
            self.running.append(req)
        n = self._chunk_len(req, self.config.max_num_batched_tokens)
        while not self.memory.grow([req.request_id], [req.num_computed_tokens + n]):
            other = next((r for r in reversed(self.running) if r is not req), None)
            if other is None:
                break  # alone and still no room: its next step tries again, as any request's would
            self.running.remove(other)
            self._preempt(other)
            preempted.append(other)
        else:
            return SchedulerOutput((ScheduledChunk(req, req.num_computed_tokens, n),), tuple(preempted))
        return SchedulerOutput((), tuple(preempted))

    def _chunk_len(self, req: Request, budget: int) -> int:
        """Tokens of `req` this step: what is left, within the budget, ending at a snapshot position.

        A recurrent state exists only where a forward ends, or where it writes one (`inner_snapshots`): a
        chunk that starts at a snapshot position runs on past the next ones and ends at the last it reaches
        (or at the end of the tokens); any other ends at the next snapshot position, so that the next chunk
        starts at one."""
        start = req.num_computed_tokens
        n = min(req.num_tokens - start, budget)
        every = self.memory.snapshot_interval
        if every and n > 1:
            boundary = (start // every + 1) * every
            if self.memory.inner_snapshots and start % every == 0 and start + n > boundary:
                if start + n < req.num_tokens:
                    n = (start + n) // every * every - start
            else:
                n = min(n, boundary - start)
        return n

    def _with_inner_saves(
        self, chunks: tuple[ScheduledChunk[Request], ...]
    ) -> tuple[ScheduledChunk[Request], ...] | None:
        """The chunks with the snapshots inside them reserved (`state_saves`, all of the step's in one call):
        the positions at multiples of the snapshot interval strictly between a prefill chunk's start and end
        (its end is saved by `save_snapshots`); None when the chunks hold no such position (none reserved)."""
        every = self.memory.snapshot_interval
        points = [
            range((c.start // every + 1) * every, c.end, every)
            if not c.verify and c.num_new > 1
            else range(0)
            for c in chunks
        ]
        wanted = [self._save(c.request, p) for c, pts in zip(chunks, points, strict=True) for p in pts]
        if not wanted:
            return None
        slots = iter(self.memory.reserve_snapshots(wanted))
        out = []
        for c, pts in zip(chunks, points, strict=True):
            saves = tuple((p, s) for p in pts if (s := next(slots)) is not None)
            out.append(replace(c, state_saves=saves) if saves else c)
        return tuple(out)

    def save_snapshots(self, chunks: Iterable[ScheduledChunk[Request]]) -> None:
        """Saves prefix-cache snapshots where this step's prefill chunks end: at a snapshot interval and at
        the end of a prefill. Call it once the step's forward is queued and before its tokens are appended
        (the engine does it while the device runs the forward): the copies queue behind the forward that
        computes the state, the tokens they hold are known before it runs, and the host work of the saves
        overlaps the device's instead of adding to the step."""
        every = self.memory.snapshot_interval
        if not every:
            return
        saves: list[PrefixSave] = []
        inner: list[PrefixSave] = []  # the points the forward saved inside the chunks: the followers' to save
        for c in chunks:
            req = c.request
            if c.verify or req.finished:
                continue
            inner += [self._save(req, p) for p, _ in c.state_saves]
            # a prefill chunk that samples ends the prompt (or a recompute); a decode chunk saves only at an
            # interval
            prefill_end = c.sample and (c.num_new > 1 or c.start < req.num_prompt_tokens)
            if c.end % every == 0 or prefill_end:
                saves.append(self._save(req, c.end))
        if saves or inner:
            self.memory.save_prefixes(saves, inner=inner)

    @staticmethod
    def _save(req: Request, num_tokens: int) -> PrefixSave:
        """What caches `req`'s committed state, which holds exactly its first `num_tokens` tokens."""
        return PrefixSave(req.request_id, req.token_slice(0, num_tokens), req.cache_salt)

    @staticmethod
    def _is_decoding(req: Request) -> bool:
        # everything but the last generated token is in memory: the next step is a decode (or a verify)
        return bool(req.output_token_ids) and req.num_tokens - req.num_computed_tokens == 1

    def _preempt(self, req: Request) -> None:
        n = req.num_computed_tokens
        if 0 < n < req.num_tokens and req.request_id not in self.ran_ahead:
            # its recompute resumes from here (unless the pages it frees are reclaimed first)
            self.memory.save_prefixes([self._save(req, n)])
        self.memory.free([req.request_id])
        req.num_computed_tokens = 0
        req.status = RequestStatus.WAITING
        req.metrics.num_preemptions += 1
        self.num_preemptions += 1
        self.waiting.appendleft(req)

    def finish(self, requests: Iterable[Request], *, cache: bool = False) -> None:
        """Frees finished or aborted requests wherever they are (running or waiting).

        `cache`: first save each running request's committed state for the prefix cache (finished requests,
        so the next turn of a chat resumes after this one's output; not aborted ones).
        """
        done = {id(r) for r in requests}
        if not done:
            return
        ending = [req for req in self.running if id(req) in done]
        # the state holds exactly the first num_computed_tokens tokens (all of them when the next decode
        # ran ahead) unless a stop string cut tokens the state had already seen
        saves = [
            self._save(req, req.num_computed_tokens + (req.request_id in self.ran_ahead))
            for req in ending
            if req.num_computed_tokens and req.num_tokens == req.num_computed_tokens + 1
        ]
        if cache and saves and self.memory.snapshot_interval:
            self.memory.save_prefixes(saves)
        self.memory.free([req.request_id for req in ending])
        self.running = [r for r in self.running if id(r) not in done]
        self.waiting = deque(r for r in self.waiting if id(r) not in done)
