"""A request inside the engine: its tokens, progress, memory handle and stop state.

There is no prefill or decode phase: a request has `num_computed_tokens` (tokens whose KV and recurrent
state are in memory) and `num_tokens` (prompt + generated). The scheduler gives it up to
`num_tokens - num_computed_tokens` tokens of work per step; when a step covers all of them, the model
samples the next token.
"""

from __future__ import annotations

import enum
from collections.abc import Sequence
from dataclasses import dataclass, field

from hyspec_runner.grammar import GrammarState

from hyspec_server.detokenizer import IncrementalDetokenizer, find_stop
from hyspec_server.outputs import (
    CompletionOutput,
    FinishReason,
    Logprob,
    PromptLogprobs,
    RequestMetrics,
    RequestOutput,
    SampleLogprobs,
    SpecDecodeStats,
)
from hyspec_server.sampling_params import RequestOutputKind, SamplingParams
from hyspec_server.tokenizer import Tokenizer

# a request's output text: pieces kept apart before they are joined into one chunk (`Request._add_text`)
_PIECES_PER_CHUNK = 64


class DeadEndError(ValueError):
    """A request's own parameters left it nothing to sample part-way through (they were accepted when it was
    added): it ends alone, and the server answers 400 naming `param`, the field at fault."""

    def __init__(self, message: str, *, param: str) -> None:
        super().__init__(message)
        self.param = param


class RequestStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


def bad_words_token_ids(words: Sequence[str], tokenizer: Tokenizer) -> tuple[tuple[int, ...], ...]:
    """Each bad word's token sequences, as vLLM forms them: the word as written (leading spaces dropped), and
    with one leading space where that is a different first token over as many tokens (a word inside text)."""
    out: list[tuple[int, ...]] = []
    for word in words:
        bare = tuple(tokenizer.encode(word.lstrip(), add_special_tokens=False))
        spaced = tuple(tokenizer.encode(" " + word.lstrip(), add_special_tokens=False))
        out += [bare] if bare else []
        if spaced and (not bare or (spaced[0] != bare[0] and len(spaced) == len(bare))):
            out.append(spaced)
    return tuple(out)


@dataclass(slots=True, eq=False)
class Request:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    params: SamplingParams
    metrics: RequestMetrics
    detok: IncrementalDetokenizer
    eos_token_ids: frozenset[int]
    # most tokens to generate: params.max_tokens, at most the room the prompt leaves in the context (the
    # engine resolves it when it takes the request; None in params means that room)
    max_tokens: int
    # the token sequences of params.bad_words (`bad_words_token_ids`)
    bad_words_token_ids: tuple[tuple[int, ...], ...] = ()
    # the EOS ids a request names as its stop_reason when one ends it (`Tokenizer.stop_eos_token_ids`)
    stop_eos_token_ids: frozenset[int] = frozenset()
    output_token_ids: list[int] = field(default_factory=list)
    num_computed_tokens: int = 0
    status: RequestStatus = RequestStatus.WAITING
    # the output text in chunks, joined only when read whole (`text`): a string grown token by token is
    # copied whole at every token (tens of microseconds a token past 100k characters); `_num_chars` in all
    _chunks: list[str] = field(default_factory=list)
    _num_chars: int = 0
    _pieces: int = 0  # pieces appended as chunks of their own since the last merge (`_add_text`)
    # text and tokens already handed out in a RequestOutput (streaming deltas start here)
    num_sent_chars: int = 0
    num_sent_tokens: int = 0
    finish_reason: FinishReason | None = None
    stop_reason: int | str | None = None
    logprobs: SampleLogprobs | None = None
    cumulative_logprob: float | None = None
    # entry i for prompt token i (None for token 0), appended as prefill scores the positions before them;
    # None when the request did not ask for prompt logprobs
    prompt_logprobs: PromptLogprobs | None = None
    spec_stats: SpecDecodeStats | None = None
    # prefix caching: requests with different salts share no cached prefix; prompt tokens found cached at the
    # first admission
    cache_salt: str | None = None
    num_cached_tokens: int = 0
    # structured outputs: where the request is in its constraint (None: unconstrained)
    grammar: GrammarState | None = None
    # time.monotonic of the last step that gave this request tokens (inter-token latency for /metrics)
    last_token_time: float | None = None
    # in a model step that failed: it runs alone until it samples once (fails alone: aborted, the blame is
    # its own), so one bad request never takes the others down
    suspect: bool = False

    @staticmethod
    def create(
        *,
        request_id: str,
        prompt: str | None,
        prompt_token_ids: list[int],
        params: SamplingParams,
        tokenizer: Tokenizer,
        arrival_time: float,
        max_tokens: int | None = None,
    ) -> Request:
        """`max_tokens`: the request's resolved budget (default: `params.max_tokens`, which must then be
        set)."""
        budget = params.max_tokens if max_tokens is None else max_tokens
        if budget is None or budget < 1:
            raise ValueError(f"max_tokens: expected an int >= 1 (resolved for the context), got {budget!r}")
        want_lp = params.logprobs is not None
        return Request(
            request_id=request_id,
            prompt=prompt,
            prompt_token_ids=prompt_token_ids,
            params=params,
            metrics=RequestMetrics(arrival_time=arrival_time),
            detok=IncrementalDetokenizer(tokenizer, skip_special_tokens=params.skip_special_tokens),
            eos_token_ids=frozenset() if params.ignore_eos else tokenizer.eos_token_ids,
            stop_eos_token_ids=frozenset() if params.ignore_eos else tokenizer.stop_eos_token_ids,
            max_tokens=budget,
            bad_words_token_ids=bad_words_token_ids(params.bad_words or (), tokenizer),
            logprobs=[] if want_lp else None,
            cumulative_logprob=0.0 if want_lp else None,
            prompt_logprobs=None if params.prompt_logprobs is None else [None],
        )

    @property
    def text(self) -> str:
        """The output text so far (joins the chunks once)."""
        chunks = self._chunks
        if len(chunks) > 1:
            chunks[:] = ["".join(chunks)]
            self._pieces = 0
        return chunks[0] if chunks else ""

    @text.setter
    def text(self, value: str) -> None:
        self._chunks[:] = [value] if value else []
        self._num_chars = len(value)
        self._pieces = 0

    def _add_text(self, piece: str) -> None:
        if piece:
            chunks = self._chunks
            chunks.append(piece)
            self._num_chars += len(piece)
            self._pieces += 1
            if self._pieces == _PIECES_PER_CHUNK:
                # a token's piece is a few characters in a ~50-byte object: every so many become one chunk
                # (each character copied once more, and a long output holds few objects)
                chunks[-_PIECES_PER_CHUNK:] = ["".join(chunks[-_PIECES_PER_CHUNK:])]
                self._pieces = 0

    def _text_from(self, start: int) -> str:
        """`text[start:]`, joining only the chunks it takes (a stream's delta, a stop string's window)."""
        need = self._num_chars - max(0, start)
        if need <= 0:
            return ""
        parts: list[str] = []
        got = 0
        for chunk in reversed(self._chunks):
            parts.append(chunk)
            got += len(chunk)
            if got >= need:
                break
        return "".join(reversed(parts))[got - need :]

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_token_ids) + len(self.output_token_ids)

    @property
    def all_stop_token_ids(self) -> frozenset[int]:
        """EOS (unless ignored) and the stop token ids: what `min_tokens` holds back. The tokens that end a
        structured-output constraint too (EOS, even with `ignore_eos`): a complete constraint that could go
        on ("a+" after "a") continues until `min_tokens`, as vLLM's; one whose end is all it allows still
        ends there, since a row the held-back tokens would leave with nothing keeps them (the penalties'
        rule: the constraint wins)."""
        ids = self.eos_token_ids | self.params.stop_token_set
        return ids | self.grammar.stop_token_ids if self.grammar is not None else ids

    @property
    def finished(self) -> bool:
        return self.status is RequestStatus.FINISHED

    def prompt_logprob_positions(self, start: int, end: int) -> range:
        """Positions in [start, end) whose logits score a prompt token still without its logprobs (position
        p scores token p + 1); empty unless the request asked for prompt logprobs. A recompute after
        preemption scores nothing twice."""
        if self.prompt_logprobs is None:
            return range(0)
        return range(max(start, len(self.prompt_logprobs) - 1), min(end, len(self.prompt_token_ids) - 1))

    def add_prompt_logprobs(self, first: int, entries: list[dict[int, Logprob]]) -> None:
        """Records the logprobs of prompt tokens first, first + 1, ... (the next ones it lacks)."""
        if self.prompt_logprobs is None or first != len(self.prompt_logprobs):
            have = None if self.prompt_logprobs is None else len(self.prompt_logprobs)
            raise ValueError(f"request {self.request_id}: prompt logprobs for token {first}, expected {have}")
        self.prompt_logprobs.extend(entries)

    @property
    def prefix_cache_limit(self) -> int:
        """Most leading tokens the prefix cache may supply: never the last one (its logits give the next
        token), nor any whose position still owes a prompt token its logprobs (those logits must be
        computed, so a fresh `prompt_logprobs` request takes nothing from the cache)."""
        limit = self.num_tokens - 1
        lp = self.prompt_logprobs
        if lp is not None and len(lp) < len(self.prompt_token_ids):
            limit = min(limit, len(lp) - 1)
        return limit

    @property
    def owes_prompt_logprobs(self) -> bool:
        """The request asked for prompt logprobs and some prompt token is still without them."""
        lp = self.prompt_logprobs
        return lp is not None and len(lp) < len(self.prompt_token_ids)

    def token_slice(self, start: int, end: int) -> list[int]:
        """All tokens (prompt then output) in [start, end)."""
        p = len(self.prompt_token_ids)
        if end <= p:
            return self.prompt_token_ids[start:end]
        if start >= p:
            return self.output_token_ids[start - p : end - p]
        return self.prompt_token_ids[start:] + self.output_token_ids[: end - p]

    def append_token(
        self,
        token_id: int,
        *,
        max_model_len: int,
        now: float,
        logprobs: dict[int, Logprob] | None = None,
    ) -> bool:
        """Records one generated token and checks every stop condition; returns True when finished.

        `logprobs`: the token's entry (it and its alternatives), recorded when the request asked for them.
        """
        return self.append_tokens(
            (token_id,),
            max_model_len=max_model_len,
            now=now,
            logprobs=None if logprobs is None else (logprobs,),
        )

    def append_tokens(
        self,
        token_ids: Sequence[int],
        *,
        max_model_len: int,
        now: float,
        logprobs: Sequence[dict[int, Logprob]] | None = None,
    ) -> bool:
        """Records generated tokens in order (a speculative round's), checking every stop condition after
        each; returns True when one finished the request (the tokens after it are dropped).

        `logprobs`: each token's entry, recorded when the request asked for them. The text grows once per
        call, not once per token (a string grown token by token is copied whole each time)."""
        if self.status is RequestStatus.FINISHED:
            what = f"token {token_ids[0]}" if token_ids else "tokens"
            raise ValueError(f"request {self.request_id} is finished; cannot append {what}")
        if logprobs is not None and len(logprobs) != len(token_ids):
            raise ValueError(
                f"logprobs: expected {len(token_ids)} entries (one per token), got {len(logprobs)}"
            )
        if self.metrics.first_token_time is None and token_ids:
            self.metrics.first_token_time = now
        p, grammar, out, eos = self.params, self.grammar, self.output_token_ids, self.eos_token_ids
        stops, stop_ids, push = p.stop_strings, p.stop_token_set, self.detok.push
        keep_lp = self.logprobs is not None and logprobs is not None
        first = len(out)  # the call's first token's index in the output
        room = min(self.max_tokens, max_model_len - len(self.prompt_token_ids))
        new = ""  # this call's new text (a local string grows in place), added to the text once
        try:
            for token_id in token_ids:
                out.append(token_id)
                if keep_lp:
                    assert self.logprobs is not None and logprobs is not None
                    entry = logprobs[len(out) - 1 - first]
                    self.logprobs.append(entry)
                    self.cumulative_logprob = (self.cumulative_logprob or 0.0) + entry[token_id].logprob
                if grammar is not None:
                    if p.allowed_token_ids is not None and not grammar.allows_any(p.allowed_token_ids):
                        # this step's allowed ids and the constraint's next tokens did not meet: every logit
                        # was -inf, and whatever was sampled breaks one of them
                        raise DeadEndError(
                            f"allowed_token_ids: after {len(out) - 1} generated tokens none of these tokens "
                            "continues the request's structured-output constraint, so nothing was left to "
                            "sample",
                            param="allowed_token_ids",
                        )
                    grammar.accept(token_id)
                # stop tokens and EOS end generation without entering the text, unless
                # include_stop_str_in_output (vLLM's: then the stop token is decoded as any other; a special
                # one is still skipped by skip_special_tokens)
                ends = token_id in eos or (grammar is not None and grammar.done)
                if ends or token_id in stop_ids:
                    if p.include_stop_str_in_output:
                        new += push(token_id) + self.detok.flush()
                    # the tokenizer's own EOS and a constraint's end name no stop; a stop token id and an EOS
                    # id of the checkpoint's configs name themselves (vLLM's stop_reason)
                    named = not ends or token_id in self.stop_eos_token_ids
                    self._finish("stop", token_id if named else None)
                    return True
                if not stops:
                    new += push(token_id)
                else:  # the text token by token: a stop string is looked for in what each token completes
                    old_len = self._num_chars
                    self._add_text(push(token_id))
                    # as in vLLM, stop strings are looked for only once the output is longer than min_tokens
                    # (a stop string completed before that is passed over, like EOS and the stop token ids);
                    # in the text's tail only: a match ends after old_len, so it starts past `base`
                    hit = None
                    if len(out) > p.min_tokens:
                        base = max(0, old_len - max(len(s) for s in stops) + 1)
                        hit = find_stop(self._text_from(base), old_len - base, stops)
                    if hit is not None:
                        pos, s = hit
                        pos += base
                        keep = pos + len(s) if p.include_stop_str_in_output else pos
                        self.text = self.text[:keep]
                        self._finish("stop", s)
                        return True
                if len(out) >= room:
                    new += self.detok.flush()
                    self._finish("length", None)
                    return True
            return False
        finally:
            # on every exit, an exception's included: the text of the tokens already taken (the detokenizer
            # has moved past them) goes in, as it did token by token (with stop strings it is in already)
            self._add_text(new)

    def abort(self) -> None:
        if not self.finished:
            self._finish("abort", None)

    def _finish(self, reason: FinishReason, stop_reason: int | str | None) -> None:
        self.status = RequestStatus.FINISHED
        self.finish_reason = reason
        self.stop_reason = stop_reason

    def make_output(self) -> RequestOutput:
        """A snapshot of this request, with the text and tokens not yet handed out as the delta; with
        `RequestOutputKind.DELTA` the completion itself holds only the delta (no copy of what came before).

        While stop strings are set, the last `max(len(stop)) - 1` characters are held back from the delta:
        they could be the start of a stop string that the next token completes.
        """
        visible = self._num_chars
        stops = self.params.stop_strings
        if stops and not self.finished:
            visible = max(self.num_sent_chars, self._num_chars - (max(len(s) for s in stops) - 1))
        first_token = self.num_sent_tokens
        delta_text = self._text_from(self.num_sent_chars)[: visible - self.num_sent_chars]
        delta_ids = self.output_token_ids[first_token:]
        self.num_sent_chars = visible
        self.num_sent_tokens = len(self.output_token_ids)
        lps = self.logprobs
        if self.params.output_kind is RequestOutputKind.DELTA:
            text, ids, lps = delta_text, delta_ids, None if lps is None else lps[first_token:]
        else:
            text, ids, lps = self.text, list(self.output_token_ids), None if lps is None else list(lps)
        completion = CompletionOutput(
            index=0,
            text=text,
            token_ids=ids,
            finish_reason=self.finish_reason,
            stop_reason=self.stop_reason,
            cumulative_logprob=self.cumulative_logprob,
            logprobs=lps,
        )
        return RequestOutput(
            request_id=self.request_id,
            prompt=self.prompt,
            # the request's own list, not a copy per step (a long prompt in a large batch made that a large
            # share of a decode step's host time); the prompt never changes: read-only for consumers
            prompt_token_ids=self.prompt_token_ids,
            outputs=[completion],
            finished=self.finished,
            metrics=self.metrics,
            num_cached_tokens=self.num_cached_tokens,
            spec_stats=self.spec_stats,
            delta_text=delta_text,
            delta_token_ids=delta_ids,
            # complete once the request has an output (prefill ends before the first token); shared, not
            # copied per step: nothing appends to it after that
            prompt_logprobs=self.prompt_logprobs,
        )
