"""Speculative-decoding configuration: the vLLM-style dict, validated once.

`SpeculativeConfig.from_dict` accepts the dict that `LLM(speculative_config=...)` and `--speculative-config`
take. Every invalid field or combination raises a `ValueError` whose message starts with the field name
(`speculative_config.<field>: ...`), so a user learns which key to fix.

Defaults: `num_speculative_tokens` 3; `topk` 1 (a chain); `num_draft_tokens` `S + 1` for a chain and
`1 + S * topk` (every candidate) for a tree; `chain_hidden_states` False; `prompt_lookup_min`/`max` 1/3 for
ngram; `adaptive` off (`true` means the `AdaptiveConfig` defaults).
"""

from __future__ import annotations

import math
import os
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any, Literal

from hyspec_statepool.draft_shape import DraftShape

Method = Literal["mtp", "multi_layer_mtp", "eagle3", "dflash", "ngram"]
METHODS: tuple[str, ...] = ("mtp", "multi_layer_mtp", "eagle3", "dflash", "ngram")

# vLLM's method names for the same drafters (a vLLM config runs unchanged)
METHOD_ALIASES: dict[str, str] = {"qwen3_next_mtp": "mtp", "qwen3_5_mtp": "mtp", "eagle": "eagle3"}

# methods that draft a tree when topk > 1; the others propose a single chain per step
TREE_METHODS: tuple[str, ...] = ("mtp", "eagle3")
# methods that read a separate draft checkpoint
MODEL_METHODS: tuple[str, ...] = ("eagle3", "dflash")

DEFAULT_NUM_SPECULATIVE_TOKENS = 3
DEFAULT_PROMPT_LOOKUP_MIN = 1
DEFAULT_PROMPT_LOOKUP_MAX = 3
DEFAULT_CANDIDATE_STEPS = (1, 3, 7)


def _err(name: str, msg: str) -> ValueError:
    return ValueError(f"speculative_config.{name}: {msg}")


def _int_field(d: Mapping[str, Any], name: str, prefix: str = "") -> int | None:
    if name not in d or d[name] is None:
        return None
    v = d[name]
    if isinstance(v, bool) or not isinstance(v, int):
        raise _err(prefix + name, f"expected an integer, got {v!r}")
    return v


@dataclass(frozen=True, slots=True)
class AdaptiveConfig:
    """Adaptive draft length (per request), see `AdaptiveController`.

    `candidate_steps` are the draft lengths the controller may pick (the initial `num_speculative_tokens`
    is inserted by `SpeculativeConfig`, then sorted and deduplicated). The EMA of accepted drafts
    (`ema_alpha`) drives moves one candidate at a time with hysteresis after `warmup_batches` rounds, every
    `update_interval` rounds. With `cost_aware`, the controller drops to 0 drafts (plain decoding) when the
    expected tokens per second fall below plain decoding (during warm-up too, once the evidence is clear)
    and probes back up at the smallest candidate after `probe_interval` rounds (doubling the wait after
    each probe that drops again, see `hyspec_spec_workers.adaptive`), and never sooner than lets the probes
    cost at most `probe_budget` of the plain decoding time between them (by measured costs).
    """

    candidate_steps: tuple[int, ...] = DEFAULT_CANDIDATE_STEPS
    ema_alpha: float = 0.2
    warmup_batches: int = 10
    update_interval: int = 5
    down_hysteresis: float = -0.25
    up_hysteresis: float = 0.0
    cost_aware: bool = True
    probe_interval: int = 50
    probe_budget: float = 0.005

    def __post_init__(self) -> None:
        steps = self.candidate_steps
        if not isinstance(steps, tuple) or not steps:
            raise _err(
                "adaptive.candidate_steps", f"expected a non-empty tuple of integers >= 1, got {steps!r}"
            )
        for s in steps:
            if isinstance(s, bool) or not isinstance(s, int) or s < 1:
                raise _err("adaptive.candidate_steps", f"expected integers >= 1, got {steps!r}")
        if tuple(sorted(set(steps))) != steps:
            raise _err("adaptive.candidate_steps", f"expected sorted, unique values, got {steps!r}")
        if not (isinstance(self.ema_alpha, int | float) and 0.0 < float(self.ema_alpha) <= 1.0):
            raise _err("adaptive.ema_alpha", f"expected a number in (0, 1], got {self.ema_alpha!r}")
        for name in ("warmup_batches", "update_interval", "probe_interval"):
            v = getattr(self, name)
            lo = 0 if name == "warmup_batches" else 1
            if isinstance(v, bool) or not isinstance(v, int) or v < lo:
                raise _err(f"adaptive.{name}", f"expected an integer >= {lo}, got {v!r}")
        for name in ("down_hysteresis", "up_hysteresis"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, int | float) or not math.isfinite(v):
                raise _err(f"adaptive.{name}", f"expected a finite number, got {v!r}")
        if not isinstance(self.cost_aware, bool):
            raise _err("adaptive.cost_aware", f"expected a bool, got {self.cost_aware!r}")
        b = self.probe_budget
        if isinstance(b, bool) or not isinstance(b, int | float) or not 0.0 < float(b) <= 1.0:
            raise _err("adaptive.probe_budget", f"expected a number in (0, 1], got {b!r}")

    @staticmethod
    def from_value(
        value: object, *, initial_steps: int, max_default_steps: int | None = None
    ) -> AdaptiveConfig | None:
        """`False`/None -> None, `True` -> defaults, a dict -> those fields; `initial_steps` is inserted.
        `max_default_steps`: default candidates above it are left out (a drafter that cannot draft more)."""
        if value is None or value is False:
            return None
        if value is True:
            d: dict[str, Any] = {}
        elif isinstance(value, Mapping):
            d = dict(value)
        else:
            raise _err("adaptive", f"expected false, true or a dict, got {value!r}")
        known = {f for f in AdaptiveConfig.__dataclass_fields__}
        for k in d:
            if k not in known:
                raise _err(f"adaptive.{k}", f"unknown key; expected one of {sorted(known)}")
        default = tuple(
            s for s in DEFAULT_CANDIDATE_STEPS if max_default_steps is None or s <= max_default_steps
        )
        raw = d.pop("candidate_steps", default)
        if isinstance(raw, str) or not hasattr(raw, "__iter__"):
            raise _err("adaptive.candidate_steps", f"expected a list of integers, got {raw!r}")
        steps: list[Any] = list(raw)
        if not steps:  # (the initial step count joins them below: an empty list would pass unseen)
            raise _err(
                "adaptive.candidate_steps", f"expected a non-empty list of integers >= 1, got {steps!r}"
            )
        for s in steps:
            if isinstance(s, bool) or not isinstance(s, int) or s < 1:
                raise _err("adaptive.candidate_steps", f"expected integers >= 1, got {steps!r}")
        # the initial step count is always a candidate so the initial runtime shape is one of them
        resolved = tuple(sorted({*steps, initial_steps}))
        return AdaptiveConfig(candidate_steps=resolved, **d)


@dataclass(frozen=True, slots=True)
class SpeculativeConfig:
    """Validated speculative-decoding settings (see the module docstring for the defaults).

    Attributes:
        method: drafter; "mtp", "multi_layer_mtp", "eagle3", "dflash" or "ngram".
        num_speculative_tokens: S, draft steps (chain length; tree depth).
        topk: children per expanded node; 1 is a chain. Trees only for mtp and eagle3.
        num_draft_tokens: D, the verify block size (current token plus D - 1 drafts).
        model: draft checkpoint directory (required for eagle3 and dflash, rejected otherwise).
        chain_hidden_states: multi_layer_mtp only: step i + 1 consumes step i's output hidden state.
        prompt_lookup_min, prompt_lookup_max: ngram only: n-gram sizes tried, longest first.
        adaptive: per-request draft length, or None.
        draft_vocab: a draft vocabulary (a file path or token ids, draft_vocab.py): model drafters propose
            from these tokens only, computing logits for them alone. None: the whole vocabulary.
    """

    method: Method
    num_speculative_tokens: int = DEFAULT_NUM_SPECULATIVE_TOKENS
    topk: int = 1
    num_draft_tokens: int = 0
    model: str | None = None
    chain_hidden_states: bool = False
    prompt_lookup_min: int = 0
    prompt_lookup_max: int = 0
    adaptive: AdaptiveConfig | None = field(default=None)
    # kept out of the repr: a list of 32k ids would fill a log line
    draft_vocab: str | tuple[int, ...] | None = field(default=None, repr=False)

    def __post_init__(self) -> None:
        if self.method not in METHODS:
            raise _err("method", f"expected one of {METHODS}, got {self.method!r}")
        s, k = self.num_speculative_tokens, self.topk
        if isinstance(s, bool) or not isinstance(s, int) or s < 1:
            raise _err("num_speculative_tokens", f"expected an integer >= 1, got {s!r}")
        if isinstance(k, bool) or not isinstance(k, int) or k < 1:
            raise _err("topk", f"expected an integer >= 1, got {k!r}")
        if k > 1 and self.method not in TREE_METHODS:
            raise _err(
                "topk", f"topk > 1 (tree drafting) needs method in {TREE_METHODS}, got {self.method!r}"
            )
        d = self.num_draft_tokens
        if d == 0:
            object.__setattr__(self, "num_draft_tokens", s + 1 if k == 1 else 1 + s * k)
        elif isinstance(d, bool) or not isinstance(d, int) or d < 2:
            raise _err("num_draft_tokens", f"expected an integer >= 2, got {d!r}")
        elif k == 1 and d != s + 1:
            raise _err("num_draft_tokens", f"a chain (topk 1) verifies S + 1 = {s + 1} tokens, got {d}")
        elif d < s + 1:
            raise _err(
                "num_draft_tokens",
                f"a tree of depth {s} needs >= num_speculative_tokens + 1 = {s + 1}, got {d}",
            )
        elif d > 1 + s * k:
            raise _err(
                "num_draft_tokens", f"expected <= 1 + num_speculative_tokens * topk = {1 + s * k}, got {d}"
            )
        if self.method in MODEL_METHODS:
            if not isinstance(self.model, str) or not self.model:
                raise _err("model", f"method {self.method!r} needs a draft checkpoint directory")
        elif self.model is not None:
            raise _err("model", f"method {self.method!r} takes no separate draft model, got {self.model!r}")
        if not isinstance(self.chain_hidden_states, bool):
            raise _err("chain_hidden_states", f"expected a bool, got {self.chain_hidden_states!r}")
        if self.chain_hidden_states and self.method != "multi_layer_mtp":
            raise _err(
                "chain_hidden_states", f"only valid with method 'multi_layer_mtp', got {self.method!r}"
            )
        self._check_ngram()
        self._check_draft_vocab()
        if self.adaptive is not None:
            if not isinstance(self.adaptive, AdaptiveConfig):
                raise _err("adaptive", f"expected an AdaptiveConfig or None, got {self.adaptive!r}")
            if k > 1:
                raise _err("adaptive", "adaptive draft length needs a chain (topk 1)")
            if s not in self.adaptive.candidate_steps:
                raise _err("adaptive.candidate_steps", f"must contain num_speculative_tokens {s}")

    def _check_draft_vocab(self) -> None:
        v: object = self.draft_vocab  # the dataclass may be built with a list or a path: normalised here
        if v is None:
            return
        if isinstance(v, os.PathLike):
            v = os.fspath(v)
            object.__setattr__(self, "draft_vocab", v)
        elif isinstance(v, list):
            v = tuple(v)
            object.__setattr__(self, "draft_vocab", v)
        if self.method == "ngram":
            raise _err("draft_vocab", "a draft vocabulary needs a model drafter, not method 'ngram'")
        if isinstance(v, str):
            if not v:
                raise _err("draft_vocab", "expected a file path, got an empty string")
        elif not isinstance(v, tuple) or not v:
            raise _err("draft_vocab", f"expected a file path or a non-empty list of token ids, got {v!r}")
        elif any(isinstance(t, bool) or not isinstance(t, int) or t < 0 for t in v):
            raise _err("draft_vocab", "expected integer token ids >= 0")

    def _check_ngram(self) -> None:
        lo, hi = self.prompt_lookup_min, self.prompt_lookup_max
        if self.method != "ngram":
            if lo:
                raise _err("prompt_lookup_min", f"only valid with method 'ngram', got {self.method!r}")
            if hi:
                raise _err("prompt_lookup_max", f"only valid with method 'ngram', got {self.method!r}")
            return
        if lo == 0:
            lo = DEFAULT_PROMPT_LOOKUP_MIN
            object.__setattr__(self, "prompt_lookup_min", lo)
        if hi == 0:
            hi = max(DEFAULT_PROMPT_LOOKUP_MAX, lo)
            object.__setattr__(self, "prompt_lookup_max", hi)
        if isinstance(lo, bool) or not isinstance(lo, int) or lo < 1:
            raise _err("prompt_lookup_min", f"expected an integer >= 1, got {lo!r}")
        if isinstance(hi, bool) or not isinstance(hi, int) or hi < lo:
            raise _err("prompt_lookup_max", f"expected an integer >= prompt_lookup_min ({lo}), got {hi!r}")

    @property
    def is_tree(self) -> bool:
        return self.topk > 1

    @property
    def max_num_speculative_tokens(self) -> int:
        """The largest draft length any request may use (adaptive: the largest candidate)."""
        if self.adaptive is None:
            return self.num_speculative_tokens
        return self.adaptive.candidate_steps[-1]

    @property
    def max_draft_tokens(self) -> int:
        """Dmax: the verify block size every D-dependent buffer must be allocated for."""
        if self.adaptive is None:
            return self.num_draft_tokens
        return self.adaptive.candidate_steps[-1] + 1

    def draft_shape(self) -> DraftShape:
        """statepool's view: `max_draft_tokens(cfg.draft_shape()) == cfg.max_draft_tokens`."""
        if self.is_tree:
            return DraftShape("tree", self.num_speculative_tokens, self.num_draft_tokens)
        cands = None if self.adaptive is None else self.adaptive.candidate_steps
        return DraftShape("chain", self.num_speculative_tokens, adaptive_candidate_steps=cands)

    def verify_shapes(self) -> tuple[tuple[int, bool], ...]:
        """(D, tree) of every verify block shape the config produces, ascending in D (what a runner captures
        graphs for).

        A tree verifies `num_draft_tokens` nodes. A chain verifies 1 + s tokens for its draft length s: S, or
        any adaptive candidate; shorter blocks (budget caps, an n-gram finding fewer tokens) pad up to one of
        these.
        """
        if self.is_tree:
            return ((self.num_draft_tokens, True),)
        steps = (self.num_speculative_tokens,) if self.adaptive is None else self.adaptive.candidate_steps
        return tuple((1 + s, False) for s in sorted(set(steps)))

    @staticmethod
    def from_dict(d: Mapping[str, Any]) -> SpeculativeConfig:
        """Build from the vLLM-style dict; unknown keys and wrong types are a ValueError naming the key."""
        if not isinstance(d, Mapping):
            raise ValueError(f"speculative_config: expected a dict, got {type(d).__name__}")
        known = {f for f in SpeculativeConfig.__dataclass_fields__}
        for key in d:
            if key not in known:
                raise _err(str(key), f"unknown key; expected one of {sorted(known)}")
        if "method" not in d:
            raise _err("method", f"required; expected one of {METHODS}")
        s = _int_field(d, "num_speculative_tokens")
        s = DEFAULT_NUM_SPECULATIVE_TOKENS if s is None else s
        model = d.get("model")
        if model is not None and not isinstance(model, str):
            raise _err("model", f"expected a directory path string, got {model!r}")
        chain = d.get("chain_hidden_states", False)
        if not isinstance(chain, bool):
            raise _err("chain_hidden_states", f"expected a bool, got {chain!r}")
        topk = _int_field(d, "topk")
        ndt = _int_field(d, "num_draft_tokens")
        lo = _int_field(d, "prompt_lookup_min")
        hi = _int_field(d, "prompt_lookup_max")
        if ndt is not None and ndt < 2:
            raise _err("num_draft_tokens", f"expected an integer >= 2, got {ndt}")
        if lo is not None and lo < 1:
            raise _err("prompt_lookup_min", f"expected an integer >= 1, got {lo}")
        if hi is not None and hi < 1:
            raise _err("prompt_lookup_max", f"expected an integer >= 1, got {hi}")
        if s < 1:
            raise _err("num_speculative_tokens", f"expected an integer >= 1, got {s}")
        method = d["method"]
        vocab = d.get("draft_vocab")
        if isinstance(vocab, list | tuple):
            vocab = tuple(vocab)
        elif isinstance(vocab, os.PathLike):
            vocab = os.fspath(vocab)
        elif vocab is not None and not isinstance(vocab, str):
            raise _err("draft_vocab", f"expected a file path or a list of token ids, got {vocab!r}")
        return SpeculativeConfig(
            method=METHOD_ALIASES.get(method, method) if isinstance(method, str) else method,  # type: ignore[arg-type]
            num_speculative_tokens=s,
            topk=1 if topk is None else topk,
            num_draft_tokens=0 if ndt is None else ndt,
            model=model,
            chain_hidden_states=chain,
            prompt_lookup_min=0 if lo is None else lo,
            prompt_lookup_max=0 if hi is None else hi,
            # multi_layer_mtp runs layer j at step j: the default candidates stop at the steps asked for (a
            # checkpoint's MTP layers, which the config cannot see; candidates given explicitly are checked
            # against them when the drafter is built)
            adaptive=AdaptiveConfig.from_value(
                d.get("adaptive"),
                initial_steps=s,
                max_default_steps=s if method == "multi_layer_mtp" else None,
            ),
            draft_vocab=vocab,
        )
