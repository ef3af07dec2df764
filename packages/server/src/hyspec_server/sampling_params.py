"""Per-request sampling parameters, with vLLM's names and defaults."""

from __future__ import annotations

import copy
import enum
import json
import math
from dataclasses import dataclass
from typing import Any


def _is_int(x: object) -> bool:
    # bool is an int subclass; `max_tokens=True` is a type error, not 1
    return isinstance(x, int) and not isinstance(x, bool)


def _is_real(x: object) -> bool:
    return (isinstance(x, int | float)) and not isinstance(x, bool)


def _short(x: object) -> str:
    """`x`'s repr for an error message, cut: a refused list can hold a million entries."""
    r = repr(x)
    return r if len(r) <= 200 else f"{r[:200]}... ({len(r)} characters)"


# most completions per prompt (`n`), as OpenAI's API caps it; the HTTP server uses the same cap
MAX_N = 128
GREEDY_BELOW = 1e-5
"""Temperatures below this decode greedily (dividing logits by a tinier one overflows to NaN)."""
MAX_TEMPERATURE = 1e6
"""Largest `temperature` accepted. The sampler divides fp32 logits by it: past fp32's range (3.4e38) it is
inf, every logit becomes 0 (a masked one NaN) and top-k / top-p keep arbitrary tokens; already at 1e6 the
distribution over the kept tokens is uniform to within 1e-4 for logits spread over less than 100."""
MAX_ID = 2**31 - 1
"""Largest `top_k` and stop token id accepted, so both fit the integer tensors they go into (no vocabulary
is larger; a top_k above the vocabulary keeps every token). The engine further bounds token ids by its
model's vocabulary (`SamplingParams.check_vocab`)."""
MAX_STOP_STRINGS = 64
MAX_STOP_CHARS = 1024
"""Bounds of `stop` (OpenAI allows 4 strings): every generated token is checked against each stop string,
so an unbounded list slows every co-batched request."""
MAX_TOKEN_ID_ENTRIES = 1024
"""Most entries of `stop_token_ids` and of `logit_bias` each: every step of the request builds tensors and
stop sets from them (for every verify node with speculation), so an unbounded list slows every co-batched
request. Far above what a real request uses."""
MAX_ALLOWED_TOKEN_IDS = 16384
"""Most entries of `allowed_token_ids` (a whitelist: digits, a label set, a small alphabet); a step of the
request builds its mask from them, so an unbounded list slows every co-batched request."""
# most alternatives reported per token (OpenAI's cap for chat, vLLM's default max_logprobs)
MAX_LOGPROBS = 20
REPETITION_PENALTY_RANGE = (1e-2, 1e2)
"""`repetition_penalty` bounds: logits divided or multiplied by it stay finite in fp32."""


def derived_seed(seed: int | None, sample: int) -> int | None:
    """The seed of sample `sample` of a request with `seed`: the seed itself for sample 0 (so n=1 matches a
    single request), a splitmix64 mix of (seed, sample) for the others. Deterministic across runs.

    `LLM.generate` and the HTTP server both fan `n` out with it, so they give the same samples for a seed.
    """
    if seed is None or sample == 0:
        return seed
    z = (seed + sample * 0x9E3779B97F4A7C15) & 0xFFFFFFFFFFFFFFFF
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & 0xFFFFFFFFFFFFFFFF
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & 0xFFFFFFFFFFFFFFFF
    return (z ^ (z >> 31)) & 0x7FFFFFFFFFFFFFFF


class RequestOutputKind(enum.Enum):
    """Which outputs a request gets from the engine (vLLM's names).

    CUMULATIVE: one per step that gave it tokens, with the whole completion so far (text, token ids,
    logprobs) and the delta since the previous one (`RequestOutput.delta_text` / `delta_token_ids`).
    DELTA: one per such step, whose completion holds only what is new since the previous output (the text,
    token ids and logprobs of that step; `cumulative_logprob` stays cumulative).
    FINAL_ONLY: one output, when the request finishes, with the whole completion (what `LLM.generate` and a
    non-streaming HTTP request read: the engine builds no output for the steps before).
    """

    CUMULATIVE = 0
    DELTA = 1
    FINAL_ONLY = 2


@dataclass(frozen=True, slots=True)
class StructuredOutputsParams:
    """A constraint on the generated text (vLLM's names); exactly one field is set.

    Args:
        json: a JSON schema (a dict or its JSON text): the output is one JSON value that validates.
        regex: the output matches this regular expression.
        choice: the output is one of these strings.
        grammar: a context-free grammar in EBNF (xgrammar's GBNF dialect, `root ::= ...`).
        json_object: the output is any JSON object (OpenAI's `response_format: {"type": "json_object"}`).
    """

    json: str | dict[str, Any] | None = None
    regex: str | None = None
    choice: list[str] | tuple[str, ...] | None = None
    grammar: str | None = None
    json_object: bool = False

    def __post_init__(self) -> None:
        given = [n for n in ("json", "regex", "choice", "grammar") if getattr(self, n) is not None]
        if self.json_object is not False:
            if self.json_object is not True:
                raise ValueError(f"json_object must be a bool, got {self.json_object!r}")
            given.append("json_object")
        if len(given) != 1:
            raise ValueError(
                "structured_outputs: expected exactly one of json, regex, choice, grammar, json_object; got "
                f"{given or 'none'}"
            )
        if isinstance(self.json, str):
            try:
                json.loads(self.json)
            except RecursionError as e:  # (a RuntimeError: the HTTP server's 400s catch ValueError)
                raise ValueError("structured_outputs.json: the schema is nested too deeply") from e
            except ValueError as e:
                raise ValueError(f"structured_outputs.json: not valid JSON: {e}") from e
        elif self.json is not None and not isinstance(self.json, dict):
            raise ValueError(f"structured_outputs.json: expected a dict or a JSON string, got {self.json!r}")
        for name in ("regex", "grammar"):
            v = getattr(self, name)
            if v is not None and (not isinstance(v, str) or not v):
                raise ValueError(f"structured_outputs.{name}: expected a non-empty string, got {v!r}")
        c = self.choice
        if c is not None and (
            not isinstance(c, list | tuple) or not c or not all(isinstance(x, str) and x for x in c)
        ):
            raise ValueError(f"structured_outputs.choice: expected a list of non-empty strings, got {c!r}")
        # copies of the caller's containers: a list or schema changed after validation would otherwise
        # change (or invalidate) the constraint of a request already made from these params
        if c is not None:
            object.__setattr__(self, "choice", tuple(c))
        if isinstance(self.json, dict):
            try:
                object.__setattr__(self, "json", copy.deepcopy(self.json))
            except RecursionError as e:  # (a schema the request body's own check let through)
                raise ValueError("structured_outputs.json: the schema is nested too deeply") from e

    @property
    def key(self) -> tuple[str, str]:
        """(kind, canonical text): equal keys compile to the same grammar. A schema's keys keep their order:
        the output's properties follow the order of `properties` (as OpenAI's and vLLM's), so two schemas that
        differ only in that order are different constraints."""
        if self.json is not None:
            text = self.json if isinstance(self.json, str) else json.dumps(self.json)
            return ("json", text)
        if self.regex is not None:
            return ("regex", self.regex)
        if self.choice is not None:
            return ("choice", json.dumps(list(self.choice)))
        if self.grammar is not None:
            return ("grammar", self.grammar)
        return ("json_object", "")


@dataclass(frozen=True, slots=True)
class SamplingParams:
    """How to choose tokens and when to stop, for one request.

    Args:
        max_tokens: most tokens to generate (>= 1); None: until the context ends (vLLM's), the room the
            prompt leaves in `max_model_len`. `LLM` lets a request whose max_tokens runs past the context stop
            at its end (finish_reason "length"), as vLLM's does; the HTTP server refuses it (400).
        temperature: 0 (or below GREEDY_BELOW, stored as 0) is greedy; otherwise logits are divided by it
            (at most MAX_TEMPERATURE).
        top_p: nucleus mass in (0, 1]; 1 is off.
        top_k: keep the k most likely tokens; -1 or 0 is off.
        min_p: drop tokens whose probability is below `min_p` times the top token's; 0 is off.
        seed: per-request seed; the same seed gives the same tokens whatever else is in the batch.
        stop: string(s) that end generation; the text is cut before the match. At most MAX_STOP_STRINGS of
            at most MAX_STOP_CHARS characters; a list is stored as a tuple.
        stop_token_ids: token ids that end generation (kept in `token_ids`, not in the text); at most
            MAX_TOKEN_ID_ENTRIES, stored as a tuple.
        ignore_eos: keep generating past the EOS token.
        logprobs: None, or the number of top alternatives to report besides the chosen token's logprob.
        prompt_logprobs: None, or the number of top alternatives to report besides each prompt token's own
            logprob (`RequestOutput.prompt_logprobs`). Such a request computes its whole prompt: it takes
            nothing from the prefix cache.
        n: completions per prompt, in [1, MAX_N]. `LLM.generate` runs n engine requests, sample i seeded with
            `derived_seed(seed, i)` (as the HTTP server does); the engine itself runs one completion per
            request whatever `n` says.
        include_stop_str_in_output: keep the matched stop string in the text.
        skip_special_tokens: drop special tokens when detokenizing.
        presence_penalty: in [-2, 2]; subtracted once from the logit of every token generated so far (OpenAI).
        frequency_penalty: in [-2, 2]; subtracted from a token's logit once per time it was generated.
        repetition_penalty: divides positive (multiplies negative) logits of every token in the prompt or
            the output (CTRL / transformers / vLLM); 1 is off, must be > 0.
        min_tokens: EOS, the stop token ids and the stop strings cannot end a request before this many
            tokens (vLLM's; <= max_tokens).
        logit_bias: None, or token id -> value in [-100, 100] added to that token's logit before any choice
            (OpenAI's), at every verify position with speculative decoding too; at most MAX_TOKEN_ID_ENTRIES
            entries, stored as a copy.
        allowed_token_ids: None, or the only token ids the request may generate (vLLM's): every other logit
            is -inf before any choice, at every verify position with speculative decoding too; 1 to
            MAX_ALLOWED_TOKEN_IDS ids in the model's vocabulary, stored as a sorted tuple without repeats.
            With `structured_outputs` the constraint's stop tokens stay allowed (they end a completed
            constraint), and ids none of which can begin the constraint are a ValueError when the request
            is added.
        bad_words: None, or words the request may not generate (vLLM's): each is tokenized as written and
            with a leading space, and a token that would complete one of those token sequences right after
            the output's last tokens is forbidden. At most MAX_STOP_STRINGS words of at most MAX_STOP_CHARS
            characters, stored as a tuple. A request with bad words decodes without drafts under speculative
            decoding (its bans follow each node's own path, which the drafts would change).
        structured_outputs: None, or a constraint every generated token keeps (`StructuredOutputsParams`);
            the request stops when the constrained text is complete.
        output_kind: which outputs the engine returns for the request (`RequestOutputKind`; vLLM's).
            `LLM.generate` runs its requests as FINAL_ONLY whatever this says (it returns final outputs).
        truncate_prompt_tokens: None, or keep only the prompt's last k tokens (vLLM's; -1: the last
            max_model_len), applied when the engine takes the request (`truncate`).

    Token ids of `logit_bias` must be in the model's vocabulary too, which the engine checks when it takes
    the request (`check_vocab`).
    """

    max_tokens: int | None = 16
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1
    min_p: float = 0.0
    seed: int | None = None
    stop: str | list[str] | tuple[str, ...] | None = None
    stop_token_ids: list[int] | tuple[int, ...] | None = None
    ignore_eos: bool = False
    logprobs: int | None = None
    prompt_logprobs: int | None = None
    n: int = 1
    include_stop_str_in_output: bool = False
    skip_special_tokens: bool = True
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    min_tokens: int = 0
    logit_bias: dict[int, float] | None = None
    allowed_token_ids: list[int] | tuple[int, ...] | None = None
    bad_words: list[str] | tuple[str, ...] | None = None
    structured_outputs: StructuredOutputsParams | None = None
    output_kind: RequestOutputKind = RequestOutputKind.CUMULATIVE
    truncate_prompt_tokens: int | None = None

    def __post_init__(self) -> None:
        if self.max_tokens is not None and (not _is_int(self.max_tokens) or self.max_tokens < 1):
            raise ValueError(f"max_tokens must be None or an int >= 1, got {self.max_tokens!r}")
        t = self.temperature
        if not _is_real(t) or not 0 <= t <= MAX_TEMPERATURE:  # NaN fails the comparison too
            raise ValueError(f"temperature must be a number in [0, {MAX_TEMPERATURE:g}], got {t!r}")
        if self.temperature < GREEDY_BELOW:
            object.__setattr__(self, "temperature", 0.0)
        if not _is_real(self.top_p) or not (0.0 < self.top_p <= 1.0):
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p!r}")
        if not _is_int(self.top_k) or not -1 <= self.top_k <= MAX_ID:
            raise ValueError(f"top_k must be -1 or 0 (off) or an int in [1, {MAX_ID}], got {self.top_k!r}")
        if not _is_real(self.min_p) or not (0.0 <= self.min_p <= 1.0):
            raise ValueError(f"min_p must be in [0, 1], got {self.min_p!r}")
        if self.seed is not None and (not _is_int(self.seed) or not -(2**63) <= self.seed < 2**64):
            # torch.Generator.manual_seed's range
            raise ValueError(f"seed must be None or an int in [-2**63, 2**64), got {self.seed!r}")
        # lists and dicts are copied into the params (tuples, a fresh dict) once validated: the engine reads
        # them at every step, so a caller changing its own list afterwards must not change the request
        if self.stop is not None:
            items = [self.stop] if isinstance(self.stop, str) else self.stop
            if not isinstance(items, list | tuple) or not all(isinstance(s, str) and s for s in items):
                raise ValueError(
                    f"stop must be a non-empty string or a list of them, got {_short(self.stop)}"
                )
            if len(items) > MAX_STOP_STRINGS or any(len(s) > MAX_STOP_CHARS for s in items):
                raise ValueError(
                    f"stop: at most {MAX_STOP_STRINGS} strings of at most {MAX_STOP_CHARS} characters, got "
                    f"{len(items)} strings, the longest {max(len(s) for s in items)} characters"
                )
            if not isinstance(self.stop, str):
                object.__setattr__(self, "stop", tuple(self.stop))
        if self.stop_token_ids is not None:
            ids = self.stop_token_ids
            if not isinstance(ids, list | tuple) or not all(_is_int(t) and 0 <= t <= MAX_ID for t in ids):
                raise ValueError(f"stop_token_ids must be a list of ints in [0, {MAX_ID}], got {_short(ids)}")
            if len(ids) > MAX_TOKEN_ID_ENTRIES:
                raise ValueError(f"stop_token_ids: at most {MAX_TOKEN_ID_ENTRIES} token ids, got {len(ids)}")
            object.__setattr__(self, "stop_token_ids", tuple(int(t) for t in ids))
        if not isinstance(self.ignore_eos, bool):
            raise ValueError(f"ignore_eos must be a bool, got {self.ignore_eos!r}")
        for name in ("logprobs", "prompt_logprobs"):
            v = getattr(self, name)
            if v is not None and (not _is_int(v) or not 0 <= v <= MAX_LOGPROBS):
                # vLLM's engine refuses more than its max_logprobs (20 by default) too
                raise ValueError(f"{name} must be None or an int in [0, {MAX_LOGPROBS}], got {v!r}")
        if not _is_int(self.n) or not 1 <= self.n <= MAX_N:
            raise ValueError(f"n must be an int in [1, {MAX_N}], got {self.n!r}")
        if not isinstance(self.include_stop_str_in_output, bool):
            raise ValueError("include_stop_str_in_output must be a bool")
        if not isinstance(self.skip_special_tokens, bool):
            raise ValueError("skip_special_tokens must be a bool")
        for name in ("presence_penalty", "frequency_penalty"):
            v = getattr(self, name)
            if not _is_real(v) or not -2.0 <= v <= 2.0:
                raise ValueError(f"{name} must be a number in [-2, 2], got {v!r}")
        r = self.repetition_penalty
        lo, hi = REPETITION_PENALTY_RANGE
        if not _is_real(r) or not lo <= r <= hi:
            raise ValueError(f"repetition_penalty must be a number in [{lo}, {hi}], got {r!r}")
        most = MAX_ID if self.max_tokens is None else self.max_tokens
        if not _is_int(self.min_tokens) or not 0 <= self.min_tokens <= most:
            raise ValueError(f"min_tokens must be an int in [0, max_tokens={most}], got {self.min_tokens!r}")
        lb = self.logit_bias
        if lb is not None:
            if not isinstance(lb, dict) or not all(
                _is_int(k) and 0 <= k <= MAX_ID and _is_real(v) and math.isfinite(v) and -100 <= v <= 100
                for k, v in lb.items()
            ):
                raise ValueError(f"logit_bias must map token ids to numbers in [-100, 100], got {_short(lb)}")
            if len(lb) > MAX_TOKEN_ID_ENTRIES:
                raise ValueError(f"logit_bias: at most {MAX_TOKEN_ID_ENTRIES} token ids, got {len(lb)}")
            object.__setattr__(self, "logit_bias", {int(k): float(v) for k, v in lb.items()})
        allowed = self.allowed_token_ids
        if allowed is not None:
            if (
                not isinstance(allowed, list | tuple)
                or not allowed
                or not all(_is_int(t) and 0 <= t <= MAX_ID for t in allowed)
            ):
                raise ValueError(
                    f"allowed_token_ids must be a non-empty list of ints in [0, {MAX_ID}], "
                    f"got {_short(allowed)}"
                )
            if len(allowed) > MAX_ALLOWED_TOKEN_IDS:
                raise ValueError(
                    f"allowed_token_ids: at most {MAX_ALLOWED_TOKEN_IDS} token ids, got {len(allowed)}"
                )
            object.__setattr__(self, "allowed_token_ids", tuple(sorted({int(t) for t in allowed})))
        words = self.bad_words
        if words is not None:
            if not isinstance(words, list | tuple) or not all(
                isinstance(w, str) and w.strip() for w in words
            ):
                raise ValueError(f"bad_words must be a list of non-blank strings, got {_short(words)}")
            if len(words) > MAX_STOP_STRINGS or any(len(w) > MAX_STOP_CHARS for w in words):
                raise ValueError(
                    f"bad_words: at most {MAX_STOP_STRINGS} words of at most {MAX_STOP_CHARS} characters"
                )
            object.__setattr__(self, "bad_words", tuple(words) or None)
        so = self.structured_outputs
        if so is not None and not isinstance(so, StructuredOutputsParams):
            raise ValueError(f"structured_outputs must be a StructuredOutputsParams, got {so!r}")
        if not isinstance(self.output_kind, RequestOutputKind):
            raise ValueError(f"output_kind must be a RequestOutputKind, got {_short(self.output_kind)}")
        k = self.truncate_prompt_tokens
        if k is not None and (not _is_int(k) or not (k == -1 or 1 <= k <= MAX_ID)):
            raise ValueError(f"truncate_prompt_tokens must be None, -1 or an int >= 1, got {_short(k)}")

    def truncate(self, prompt_token_ids: list[int], max_model_len: int) -> list[int]:
        """The prompt as the request runs it: its last `truncate_prompt_tokens` tokens (-1: the last
        max_model_len); ValueError when that is more than the model's context, as in vLLM."""
        k = self.truncate_prompt_tokens
        if k is None:
            return prompt_token_ids
        k = max_model_len if k == -1 else k
        if k > max_model_len:
            raise ValueError(
                f"truncate_prompt_tokens ({k}) is over the model's context length "
                f"max_model_len={max_model_len}"
            )
        return prompt_token_ids[-k:] if len(prompt_token_ids) > k else prompt_token_ids

    def check_vocab(self, vocab_size: int) -> None:
        """Raises ValueError when a token id of `logit_bias` or `allowed_token_ids` is outside the model's
        vocabulary [0, vocab_size) (as vLLM: a bias has no logit to go to); the engine calls it for every
        request, as it knows the vocabulary and the params do not. Stop token ids outside it are allowed, as
        in vLLM: they can never be generated, and clients send the same list to models of one family with
        different vocabularies."""
        for name, ids in (
            ("logit_bias", self.logit_bias or ()),
            ("allowed_token_ids", self.allowed_token_ids or ()),
        ):
            bad = sorted(t for t in ids if t >= vocab_size)
            if bad:
                more = f" (and {len(bad) - 8} more)" if len(bad) > 8 else ""
                raise ValueError(
                    f"{name}: token ids must be in [0, {vocab_size}) for this model, got {bad[:8]}{more}"
                )

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0

    @property
    def has_penalties(self) -> bool:
        return (
            self.presence_penalty != 0
            or self.frequency_penalty != 0
            or self.repetition_penalty != 1
            or bool(self.logit_bias)
            or self.allowed_token_ids is not None
            or bool(self.bad_words)
            or self.min_tokens > 0
        )

    @property
    def stop_strings(self) -> tuple[str, ...]:
        if self.stop is None:
            return ()
        return (self.stop,) if isinstance(self.stop, str) else tuple(self.stop)

    @property
    def stop_token_set(self) -> frozenset[int]:
        return frozenset(self.stop_token_ids or ())
