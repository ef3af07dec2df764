"""Structured outputs: constraints compiled to token masks by xgrammar, applied before sampling.

Why xgrammar: it compiles JSON schemas, regexes and EBNF grammars into a pushdown automaton with a
precomputed per-state token mask cache (masks cost microseconds per token), keeps a compiled-grammar cache,
supports rollback (what speculative verification will need) and ships CPU and GPU mask kernels; vLLM and
SGLang use it by default. It is imported only when a request asks for a constraint, so an engine without
constrained requests runs where xgrammar is not installed.

Flow: `GrammarCompiler.compile` turns a `StructuredOutputsParams` into a compiled grammar (cached by the
constraint's text, so the HTTP server compiles on a worker thread before queueing and the engine thread then
finds it compiled); each request gets a `GrammarState` (a matcher; hyspec_runner's `grammar.py`). Before
sampling, the runner's `apply_grammar_masks` sets the logits of every token the constraint forbids to -inf
for the constrained rows; the engine advances the matcher by each appended token (`Request.append_tokens`)
and stops the request when the constraint is complete. With speculative decoding, a `GrammarState` is the
row's `TokenConstraint` in spec-workers' round (`constraint.py`): drafts are cut at the first forbidden
token and every kept verify position is masked (accept, then roll back), so verification never chooses
from an unmasked position.
"""

from __future__ import annotations

import json
import re
import threading
from collections.abc import Sequence
from typing import Any

import torch
from hyspec_runner.grammar import GrammarState

from hyspec_server.sampling_params import StructuredOutputsParams
from hyspec_server.tokenizer import Tokenizer


class GrammarCompiler:
    """Compiles constraints for one tokenizer, caching each compiled grammar by its constraint.

    Args:
        tokenizer: the engine's tokenizer: an HF tokenizer (`hf_tokenizer`) or a byte-level one that lists
            its tokens' bytes (`token_bytes`).
    """

    def __init__(self, tokenizer: Tokenizer) -> None:
        self.tokenizer = tokenizer
        self._compiler: Any = None
        self._lock = threading.Lock()  # first use builds the vocabulary tables once
        self.vocab_size = 0

    def _xgr(self) -> Any:
        with self._lock:
            if self._compiler is None:
                try:
                    import xgrammar as xgr
                except ImportError as e:
                    raise ValueError(
                        "structured outputs need the xgrammar package (pip install xgrammar)"
                    ) from e
                info = _tokenizer_info(xgr, self.tokenizer)
                self.vocab_size = int(info.vocab_size)
                self._compiler = xgr.GrammarCompiler(info, max_threads=1, cache_enabled=True)
            return self._compiler

    def compile(self, params: StructuredOutputsParams) -> Any:
        """The compiled grammar; ValueError naming the field when the constraint does not compile, or when
        no token can begin it."""
        compiler = self._xgr()
        kind, text = params.key
        if kind == "json":
            check_schema_supported(json.loads(text), "structured_outputs.json")
        try:
            if kind == "json":
                compiled = compiler.compile_json_schema(text)
            elif kind == "json_object":
                compiled = compiler.compile_json_schema(json.dumps({"type": "object"}))
            elif kind == "regex":
                compiled = compiler.compile_regex(text)
            elif kind == "choice":
                # the choices as a grammar of string literals (JSON escapes are the EBNF's)
                alts = " | ".join(json.dumps(c, ensure_ascii=False) for c in json.loads(text))
                compiled = compiler.compile_grammar(f"root ::= {alts}")
            else:
                compiled = compiler.compile_grammar(text)
        except (RuntimeError, UnicodeError) as e:
            # (a lone surrogate in a choice or pattern cannot go to xgrammar's UTF-8 at all)
            raise ValueError(f"structured_outputs.{kind}: does not compile: {xgrammar_error(e)}") from e
        self._check_startable(compiled, kind)
        return compiled

    def new_state(self, params: StructuredOutputsParams) -> GrammarState:
        import xgrammar as xgr

        compiled = self.compile(params)  # (sets vocab_size)
        return GrammarState(xgr.GrammarMatcher(compiled), vocab_size=self.vocab_size)

    def check_start_within(self, params: StructuredOutputsParams, allowed: Sequence[int]) -> None:
        """ValueError naming `allowed_token_ids` when none of `allowed` can begin the constraint: the
        request's first step would have no token left to sample (both masks apply)."""
        compiled = self.compile(params)  # (sets vocab_size: the tokenizer's, which ids past it are not)
        ids = torch.tensor([t for t in allowed if 0 <= t < self.vocab_size], dtype=torch.long)
        if not bool(self._starts(compiled, ids).any()):
            raise ValueError(
                "allowed_token_ids: none of these tokens can begin the request's structured-output "
                f"constraint ({params.key[0]}), so its first token would have nothing to sample"
            )

    def _starts(self, compiled: Any, ids: torch.Tensor) -> torch.Tensor:
        """[len(ids)] bool: which of these token ids the constraint allows as its first token."""
        import xgrammar as xgr

        bitmask = xgr.allocate_token_bitmask(1, self.vocab_size)  # [1, W] int32
        xgr.GrammarMatcher(compiled).fill_next_token_bitmask(bitmask, 0)
        return ((bitmask[0, ids // 32] >> (ids % 32)) & 1).bool()

    def _check_startable(self, compiled: Any, kind: str) -> None:
        """ValueError when no token can begin the constraint (it compiled to the empty language, such as an
        empty character class): its request would have nothing to sample."""
        if not bool(self._starts(compiled, torch.arange(self.vocab_size)).any()):
            raise ValueError(f"structured_outputs.{kind}: the constraint allows no token at its start")


# keywords xgrammar (0.2.9) compiles away without a word: a grammar from a schema using them allows output the
# schema refuses (an array with repeats under uniqueItems, anything under a remote $ref), so such a schema is
# refused, as vLLM's xgrammar backend refuses the features it lacks, rather than silently not enforced
_IGNORED = frozenset(
    {"not", "if", "contains", "minContains", "maxContains", "dependentRequired", "dependentSchemas"}
    | {"dependencies", "$dynamicRef", "$recursiveRef"}
)
# keywords whose values are schemas, lists of schemas, or maps of names to schemas (walked for the above);
# any other keyword's value is data or a name (a property named "not" is no keyword)
_SUBSCHEMA = frozenset(
    {"items", "additionalItems", "additionalProperties", "propertyNames", "unevaluatedItems"}
    | {"unevaluatedProperties", "anyOf", "oneOf", "allOf", "prefixItems", "then", "else"}
)
_SUBSCHEMA_MAPS = frozenset({"properties", "patternProperties", "$defs", "definitions"})


def check_schema_supported(schema: Any, field: str) -> None:
    """ValueError naming `field` and the keyword's place when `schema` uses a JSON-schema feature the
    backend would ignore (`_IGNORED`, `uniqueItems: true`, an `allOf` of several schemas, of which xgrammar
    keeps one, or a `$ref` outside the schema itself). Iterative: a deep schema is the compiler's to
    refuse."""
    todo: list[tuple[Any, str]] = [(schema, "")]
    while todo:
        node, at = todo.pop()
        if isinstance(node, list):
            todo += [(x, f"{at}[{i}]") for i, x in enumerate(node)]
            continue
        if not isinstance(node, dict):
            continue
        for k, v in node.items():
            bad = k in _IGNORED
            bad = bad or (k == "uniqueItems" and v is True)
            bad = bad or (k == "allOf" and isinstance(v, list) and len(v) > 1)
            bad = bad or (k == "$ref" and isinstance(v, str) and not v.startswith("#"))
            if bad:
                where = f" at {at.lstrip('.')}" if at else ""
                raise ValueError(
                    f"{field}: the keyword {k!r}{where} is not supported (xgrammar would not enforce it)"
                )
            if k in _SUBSCHEMA:
                todo.append((v, f"{at}.{k}"))
            elif k in _SUBSCHEMA_MAPS and isinstance(v, dict):
                todo += [(s, f"{at}.{k}.{name}") for name, s in v.items()]


def _tokenizer_info(xgr: Any, tokenizer: Tokenizer) -> Any:
    stop = sorted(tokenizer.eos_token_ids)
    hf = getattr(tokenizer, "hf_tokenizer", None)
    if hf is not None:
        size = getattr(tokenizer, "vocab_size", None)
        return xgr.TokenizerInfo.from_huggingface(hf, vocab_size=size, stop_token_ids=stop)
    raw = getattr(tokenizer, "token_bytes", None)
    if raw is not None:
        return xgr.TokenizerInfo(
            list(raw), vocab_type=xgr.VocabType.RAW, vocab_size=len(raw), stop_token_ids=stop
        )
    raise ValueError(
        "structured outputs need a Hugging Face tokenizer (this engine's tokenizer has no vocabulary)"
    )


# "/project/cpp/regex_converter.cc:94: " at the start of an xgrammar message
_SOURCE_PREFIX = re.compile(r"^\S+\.(?:cc|cpp|h|hpp|py):\d+: ")


def xgrammar_error(e: Exception) -> str:
    """The first line of an xgrammar error without its "[time] " and "path/file.cc:line: " prefixes (the
    library's C++ source is no part of a user's answer); the exception's type when it has no text (xgrammar
    raises a bare RuntimeError for some schemas, e.g. a bound of 1e400)."""
    lines = str(e).splitlines()
    if not lines:
        return type(e).__name__
    return _SOURCE_PREFIX.sub("", lines[0].split("] ", 1)[-1]) or type(e).__name__
