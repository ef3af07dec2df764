"""The engine core: requests in, one scheduled model step at a time, outputs out. Single-threaded.

`LLM` drives it in a loop; the HTTP server drives it from a background thread (`async_engine.py`).
"""

from __future__ import annotations

import itertools
import logging
import time
from collections import deque
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field, replace
from types import MappingProxyType
from typing import Any

from hyspec_runner.memory import MemoryUsage
from hyspec_runner.runner import ModelRunner, PromptLogprobRows, RanAheadMismatch
from hyspec_spec_workers.round_types import VerifiedTokens
from hyspec_spec_workers.sampling import SampledToken
from hyspec_statepool.prefix_cache import PrefixCacheStats

from hyspec_server.outputs import Logprob, RequestOutput, SpecDecodeStats
from hyspec_server.request import DeadEndError, Request
from hyspec_server.sampling_params import RequestOutputKind, SamplingParams
from hyspec_server.scheduler import Scheduler, SchedulerConfig
from hyspec_server.structured import GrammarCompiler
from hyspec_server.tokenizer import Tokenizer


@dataclass(frozen=True, slots=True)
class TokensPrompt:
    """A prompt tokenized by the caller: its text (None: given as token ids), its token ids (the HTTP server
    tokenizes on a worker thread, so a long prompt never holds the engine thread) and its prefix-cache
    salt."""

    text: str | None
    token_ids: list[int]
    cache_salt: str | None = None


PROMPT_KEYS = ("prompt", "prompt_token_ids", "cache_salt")
"""The keys of a prompt dict (vLLM's `TextPrompt` / `TokensPrompt`) that hyspec implements; vLLM's others
(`multi_modal_data`, `mm_processor_kwargs`, `multi_modal_uuids`, `token_type_ids`) serve multimodal and
pooling models, which hyspec does not run."""


def parse_prompt(item: str | Mapping[str, Any]) -> tuple[str | list[int] | TokensPrompt, str | None]:
    """A prompt as `LLM.generate` and `LLMEngine.add_request` take it (a string, or a dict with `prompt`
    and / or `prompt_token_ids` and an optional `cache_salt`) -> (what the engine tokenizes or takes as
    ids, the salt). ValueError naming the key for anything else: a misspelt key would otherwise be
    ignored silently (a `"promt"` beside `prompt_token_ids`, or a `cache_salt` that never applies)."""
    if isinstance(item, str):
        return item, None
    if not isinstance(item, Mapping):
        raise ValueError(
            "a prompt must be a string or a dict with 'prompt' or 'prompt_token_ids', got "
            f"{type(item).__name__}"
        )
    unknown = [k for k in item if k not in PROMPT_KEYS]
    if unknown:
        raise ValueError(
            f"unknown key {unknown[0]!r} in a prompt dict; the accepted keys are "
            f"{', '.join(PROMPT_KEYS)} (hyspec runs text-only models)"
        )
    salt = item.get("cache_salt")
    if salt is not None and (not isinstance(salt, str) or not salt):
        raise ValueError(f"cache_salt: expected a non-empty string, got {salt!r}")
    text = item.get("prompt")
    if text is not None and not isinstance(text, str):
        raise ValueError(f"prompt: expected a string, got {type(text).__name__}")
    if "prompt_token_ids" not in item:
        if text is None:
            raise ValueError("a prompt dict needs 'prompt' (text) or 'prompt_token_ids'")
        return text, salt
    ids = item["prompt_token_ids"]
    if not isinstance(ids, list) or not all(isinstance(t, int) and not isinstance(t, bool) for t in ids):
        raise ValueError("prompt_token_ids must be a list of ints")
    # with both, as vLLM's TokensPrompt: the ids are the prompt, the text is what outputs report
    return (list(ids) if text is None else TokensPrompt(text, list(ids))), salt


class EngineStepError(RuntimeError):
    """A step failed for these requests; they were aborted and freed (`outputs`: theirs). `step_outputs`: the
    step's outputs of every other request, which it served normally (deliver them too). `dead_ends`: those
    of the failed requests whose own parameters left them nothing to sample (`DeadEndError`), by id."""

    def __init__(
        self,
        request_ids: list[str],
        outputs: list[RequestOutput],
        step_outputs: Sequence[RequestOutput] = (),
        dead_ends: dict[str, DeadEndError] | None = None,
    ) -> None:
        why = "".join(f"; {rid}: {e}" for rid, e in (dead_ends or {}).items())
        super().__init__(f"model step failed; aborted requests {request_ids}{why}")
        self.request_ids = request_ids
        self.outputs = outputs
        self.step_outputs = list(step_outputs)
        self.dead_ends = dict(dead_ends or {})


log = logging.getLogger("hyspec.engine")

# The server's metrics drain the observation queues below after every step; an engine nobody drains (the
# offline `LLM`) keeps only the newest this many of each instead of growing with every token it generates.
MAX_UNREAD_OBSERVATIONS = 1 << 16


def _observations() -> deque[float]:
    return deque(maxlen=MAX_UNREAD_OBSERVATIONS)


@dataclass(slots=True)
class EngineStats:
    """Counters since start, read by /metrics."""

    num_steps: int = 0
    num_generated_tokens: int = 0
    num_prompt_tokens: int = 0
    num_finished: int = 0
    num_aborted: int = 0
    num_preemptions: int = 0
    # requests ended since start by finish reason ("stop", "length", "abort")
    finished_reasons: dict[str, int] = field(default_factory=dict)
    # seconds, drained by the reader: time to first token, time per output token after the first and
    # end-to-end latency of finished requests; inter-token latency per step that gave a running request tokens
    ttft: deque[float] = field(default_factory=_observations)
    tpot: deque[float] = field(default_factory=_observations)
    e2e: deque[float] = field(default_factory=_observations)
    itl: deque[float] = field(default_factory=_observations)
    # tokens committed per verify round with drafts (accepted drafts + bonus); drained by the reader
    accept_lengths: deque[int] = field(default_factory=lambda: deque(maxlen=MAX_UNREAD_OBSERVATIONS))
    # speculative decoding since start: verify rounds with at least one draft, drafts, accepted drafts, and
    # accepted drafts by their position in the draft (entry i: rounds that accepted more than i drafts)
    spec_num_drafts: int = 0
    spec_num_draft_tokens: int = 0
    spec_num_accepted_tokens: int = 0
    spec_accepted_per_pos: list[int] = field(default_factory=list)


class LLMEngine:
    def __init__(self, runner: ModelRunner, tokenizer: Tokenizer, config: SchedulerConfig) -> None:
        self.runner = runner
        self.tokenizer = tokenizer
        self.max_model_len = runner.max_model_len
        if runner.memory.max_num_tokens_per_request < self.max_model_len:
            raise ValueError(
                f"max_model_len={self.max_model_len} does not fit in the KV pool, which holds "
                f"{runner.memory.max_num_tokens_per_request} tokens per request; lower max_model_len"
            )
        self.scheduler = Scheduler(config, runner.memory)
        self.grammars = GrammarCompiler(tokenizer)
        # SamplingParams arguments for fields a request leaves unset (the checkpoint's generation config)
        self.default_sampling: Mapping[str, Any] = MappingProxyType({})
        self.requests: dict[str, Request] = {}
        self.stats = EngineStats()
        self._ids = itertools.count()
        # token id -> its text alone, for `Logprob.decoded_token` (at most the vocabulary)
        self._token_texts: dict[int, str] = {}

    def new_request_id(self) -> str:
        return f"req-{next(self._ids)}"

    def add_request(
        self,
        prompt: str | Sequence[int] | TokensPrompt | Mapping[str, Any],
        params: SamplingParams,
        *,
        request_id: str | None = None,
        cache_salt: str | None = None,
        bounded: bool = True,
        stop_at_context_end: bool = False,
    ) -> str:
        """Tokenizes and queues a request. Raises ValueError if it cannot fit, QueueFullError if full.

        `cache_salt`: requests with different salts share no prefix-cache entry (tenants that must not
        learn from each other's timing). `bounded=False` queues past `max_waiting` (the bound protects a
        server from its clients; an offline `LLM.generate` call queues all of its prompts). A prompt plus
        `params.max_tokens` over `max_model_len` is a ValueError, unless `stop_at_context_end` (the offline
        API's, as vLLM's `LLM`): then the request stops at the context's end, finish_reason "length";
        `max_tokens=None` always means that end. A dict prompt is read by `parse_prompt`."""
        if isinstance(prompt, Mapping):
            prompt, salt = parse_prompt(prompt)
            cache_salt = salt if cache_salt is None else cache_salt
        if isinstance(prompt, TokensPrompt):
            text: str | None = prompt.text
            ids = [int(t) for t in prompt.token_ids]
            cache_salt = prompt.cache_salt if cache_salt is None else cache_salt
        elif isinstance(prompt, str):
            text = prompt
            ids = self.tokenizer.encode(prompt)
        else:
            text, ids = None, [int(t) for t in prompt]
        ids = params.truncate(ids, self.max_model_len)
        if not ids:
            raise ValueError("prompt must have at least one token")
        vocab = self.runner.vocab_size
        bad = next((t for t in ids if not 0 <= t < vocab), None)
        if bad is not None:
            # checked here, not in the model: an id past the embedding fails the whole step (on a GPU, a
            # device-side assert that can end the process)
            raise ValueError(
                f"prompt_token_ids: expected token ids in [0, {vocab}) for this model, got {bad}"
            )
        params.check_vocab(vocab)
        room = self.max_model_len - len(ids)
        max_tokens = params.max_tokens
        if room < 1:
            # first: a prompt that fills the context alone is the prompt's fault, whatever max_tokens asks
            raise ValueError(
                f"prompt ({len(ids)} tokens) leaves no room to generate in the model's context length "
                f"max_model_len={self.max_model_len}"
            )
        if max_tokens is not None and max_tokens > room and not stop_at_context_end:
            raise ValueError(
                f"prompt ({len(ids)} tokens) plus max_tokens ({max_tokens}) is over the model's "
                f"context length max_model_len={self.max_model_len}"
            )
        max_tokens = room if max_tokens is None else min(max_tokens, room)
        rid = request_id if request_id is not None else self.new_request_id()
        if rid in self.requests:
            raise ValueError(f"request_id {rid!r} is already in use")
        req = Request.create(
            request_id=rid,
            prompt=text,
            prompt_token_ids=ids,
            params=params,
            tokenizer=self.tokenizer,
            arrival_time=time.monotonic(),
            max_tokens=max_tokens,
        )
        req.cache_salt = cache_salt
        if params.structured_outputs is not None:
            req.grammar = self.grammars.new_state(params.structured_outputs)
            if params.allowed_token_ids is not None:
                # the constraint's stop tokens end it even with ignore_eos: allowed_token_ids never bans
                # them (a completed constraint would have nothing left to sample)
                allowed = tuple(sorted(set(params.allowed_token_ids) | req.grammar.stop_token_ids))
                self.grammars.check_start_within(params.structured_outputs, allowed)
                req.params = replace(params, allowed_token_ids=allowed)
        if self.speculative:
            req.spec_stats = SpecDecodeStats()
        self.scheduler.add(req, bounded=bounded)
        self.requests[rid] = req
        self.stats.num_prompt_tokens += len(ids)
        return rid

    def abort(self, request_id: str) -> RequestOutput | None:
        """Aborts a live request and frees its memory; None when it is unknown or already finished."""
        req = self.requests.pop(request_id, None)
        if req is None:
            return None
        req.abort()
        self.scheduler.finish([req])
        self.stats.num_aborted += 1
        self._count_finish_reason("abort")
        return req.make_output()

    def has_unfinished(self) -> bool:
        return self.scheduler.has_unfinished()

    def reset_prefix_cache(self) -> bool:
        """Forgets every cached prefix; False when prefix caching is off."""
        return self.runner.memory.reset_prefix_cache()

    def prefix_cache_stats(self) -> PrefixCacheStats | None:
        return self.runner.memory.prefix_cache_stats()

    @property
    def speculative(self) -> bool:
        """Decoding requests verify drafted blocks (the scheduler reserves room for them)."""
        return self.scheduler.config.num_lookahead_tokens > 0

    @property
    def num_waiting(self) -> int:
        return len(self.scheduler.waiting)

    @property
    def num_running(self) -> int:
        return len(self.scheduler.running)

    def step(self) -> list[RequestOutput]:
        """Schedules and runs one model step; returns an output for every request that made progress
        (a `RequestOutputKind.FINAL_ONLY` request's only when it finished)."""
        sched = self.scheduler.schedule()
        self.stats.num_preemptions += len(sched.preempted)
        if not sched.chunks:
            return []
        saved = False

        def save_snapshots() -> None:
            # the prefix-cache saves of the step's prefill chunks, while the device runs its forward
            nonlocal saved
            if not saved:
                saved = True
                self.scheduler.save_snapshots(sched.chunks)

        try:
            result = self.runner.execute(sched, while_queued=save_snapshots)
            save_snapshots()  # a runner with nothing to overlap may not call it; before the appends below
        except Exception as e:
            self.scheduler.ran_ahead = frozenset()  # a runner that fails forgets what it queued ahead
            if saved or sched.reserved_snapshots:
                # the step's snapshots were saved, or reserved for its forward to write (pages included, with
                # or without a new snapshot slot), before it failed: keep nothing a failed step may have
                # half-written (rare; the cache refills)
                log.warning("model step failed after saving prefix-cache snapshots; resetting the cache")
                self.runner.memory.reset_prefix_cache()
            reqs = list(dict.fromkeys(c.request for c in sched.chunks))
            if len(reqs) > 1 or isinstance(e, RanAheadMismatch):
                # not attributable yet: each request is recomputed alone; one that fails alone is the cause
                # (a decode that ran ahead and did not fit the step is no request's fault: recomputed too)
                log.warning("model step of %d requests failed (%s); retrying each alone", len(reqs), e)
                self.scheduler.quarantine(reqs)
                return []
            outs = [out for r in reqs if (out := self.abort(r.request_id)) is not None]
            raise EngineStepError([r.request_id for r in reqs], outs) from e
        # before the appends: a request ending in this step caches the state its next decode left
        self.scheduler.ran_ahead = frozenset(result.ran_ahead)
        for c in sched.chunks:
            if c.sample:
                c.request.suspect = False  # it ran alone to a sample: cleared
        self.stats.num_steps += 1
        now = time.monotonic()
        outputs: list[RequestOutput] = []
        done: list[Request] = []
        failed: list[Request] = []  # requests whose own bookkeeping failed: aborted alone, the rest go on
        dead_ends: dict[str, DeadEndError] = {}
        verified = result.verified or (None,) * len(sched.chunks)
        for chunk, rows in zip(sched.chunks, result.prompt_logprobs):
            if rows is not None:
                self._add_prompt_logprobs(chunk.request, rows)
        for chunk, tok, ver in zip(sched.chunks, result.tokens, verified, strict=True):
            req = chunk.request
            req.num_computed_tokens = chunk.end
            if tok is None:
                continue
            if req.last_token_time is not None:
                self.stats.itl.append(now - req.last_token_time)
            req.last_token_time = now
            try:
                if ver is None:
                    finished = self._append(req, tok, now)
                else:
                    # the block's root and the accepted drafts are in memory now; the bonus is the next root
                    req.num_computed_tokens = chunk.start + ver.num_accepted + 1
                    finished = self._append_verified(req, ver, now)
            except DeadEndError as e:
                log.warning("request %s: %s; aborting it", req.request_id, e)
                failed.append(req)
                dead_ends[req.request_id] = e
                continue
            except Exception:
                log.exception("request %s failed after its model step; aborting it", req.request_id)
                failed.append(req)
                continue
            if finished:
                done.append(req)
                self._record_finished(req, now)
            if finished or req.params.output_kind is not RequestOutputKind.FINAL_ONLY:
                outputs.append(req.make_output())
        self.scheduler.finish(done, cache=True)
        for req in done:
            self.requests.pop(req.request_id, None)
        if failed:
            outs = [out for r in failed if (out := self.abort(r.request_id)) is not None]
            raise EngineStepError([r.request_id for r in failed], outs, outputs, dead_ends)
        return outputs

    def _append(self, req: Request, tok: SampledToken, now: float) -> bool:
        self.stats.num_generated_tokens += 1
        entry: dict[int, Logprob] | None = None
        if req.logprobs is not None and tok.logprob is not None:
            top = tok.top or {}  # most likely first
            entry = self._logprob_entry(tok.token_id, tok.logprob, tok.rank, list(top), list(top.values()))
        return req.append_tokens(
            (tok.token_id,),
            max_model_len=self.max_model_len,
            now=now,
            logprobs=None if entry is None else (entry,),
        )

    def _token_text(self, token_id: int) -> str:
        text = self._token_texts.get(token_id)
        if text is None:
            text = self.tokenizer.decode([token_id], skip_special_tokens=False)
            self._token_texts[token_id] = text
        return text

    def _logprob_entry(
        self,
        token_id: int,
        logprob: float,
        rank: int | None,
        top_ids: Sequence[int],
        top_lps: Sequence[float],
    ) -> dict[int, Logprob]:
        """`token_id`'s logprob entry: the token first (its true rank), then the top tokens (most likely
        first, ranks 1, 2, ...); the token keeps its own entry when it is among them."""
        text = self._token_text
        entry = {token_id: Logprob(logprob, rank, text(token_id))}
        for r, (t, v) in enumerate(zip(top_ids, top_lps, strict=True), start=1):
            if t != token_id:
                entry[t] = Logprob(v, r, text(t))
        return entry

    def _add_prompt_logprobs(self, req: Request, rows: PromptLogprobRows) -> None:
        prompt = req.prompt_token_ids
        entries = [
            self._logprob_entry(prompt[rows.first + i], lp, rank, ids, vals)
            for i, (lp, rank, ids, vals) in enumerate(
                zip(rows.logprobs, rows.ranks, rows.top_ids, rows.top_logprobs, strict=True)
            )
        ]
        req.add_prompt_logprobs(rows.first, entries)

    def _append_verified(self, req: Request, ver: VerifiedTokens, now: float) -> bool:
        """Appends a verify round's tokens in order; a stop found by the detokenizer (a stop string) drops
        the rest. Token-level stops (EOS, stop ids, budgets) were already cut by the runner."""
        if ver.num_drafts > 0:
            s = self.stats
            s.spec_num_drafts += 1
            s.spec_num_draft_tokens += ver.num_drafts
            s.spec_num_accepted_tokens += ver.num_accepted
            s.accept_lengths.append(ver.num_accepted + 1)
            per_pos = s.spec_accepted_per_pos
            if len(per_pos) < ver.num_drafts:
                per_pos.extend([0] * (ver.num_drafts - len(per_pos)))
            for i in range(ver.num_accepted):
                per_pos[i] += 1
            if req.spec_stats is None:
                req.spec_stats = SpecDecodeStats()
            st = req.spec_stats
            st.num_drafts += 1
            st.num_draft_tokens += ver.num_drafts
            st.num_accepted_tokens += ver.num_accepted
        if req.logprobs is not None:
            for tok in ver.tokens:
                if self._append(req, tok, now):
                    return True
            return False
        # no logprobs to build: the round's tokens in one call (per-token host work at batch 32 was a sixth
        # of a demo round)
        before = len(req.output_token_ids)
        try:
            return req.append_tokens(
                [t.token_id for t in ver.tokens], max_model_len=self.max_model_len, now=now
            )
        finally:
            self.stats.num_generated_tokens += len(req.output_token_ids) - before

    def _record_finished(self, req: Request, now: float) -> None:
        m = req.metrics
        m.finished_time = now
        self.stats.num_finished += 1
        self._count_finish_reason(req.finish_reason or "stop")
        self.stats.e2e.append(now - m.arrival_time)
        if m.first_token_time is not None:
            self.stats.ttft.append(m.first_token_time - m.arrival_time)
            n = len(req.output_token_ids)
            if n > 1:
                self.stats.tpot.append((now - m.first_token_time) / (n - 1))

    def _count_finish_reason(self, reason: str) -> None:
        reasons = self.stats.finished_reasons
        reasons[reason] = reasons.get(reason, 0) + 1

    def memory_usage(self) -> MemoryUsage:
        return self.runner.memory.usage()

    def leak_check(self) -> None:
        """Raises when the pool holds memory while no request is live, or the engine lost track of one."""
        if self.has_unfinished() or self.requests:
            raise RuntimeError(
                f"leak_check needs an idle engine; {len(self.requests)} requests are live "
                f"({self.num_waiting} waiting, {self.num_running} running)"
            )
        self.runner.memory.leak_check()
