"""Workloads of `hyspec bench serve` (bench_cli.py): prompts, their lengths and their arrival times.

Every dataset is a list of `Conversation`s. A single-turn dataset (random, shared-prefix, code) gives
one-turn conversations, one per request; multi-turn gives conversations whose turns are sent one after the
other, each with the whole history so far. The benchmark schedules conversations, so one code path drives
both.

Lengths are in tokens. With a tokenizer (`Lengths(tokenizer)`) a prompt has exactly the asked number of
tokens; without one it is approximate (a word of `WORDS` is about one token, code is cut at about
`CHARS_PER_TOKEN` characters a token), and the benchmark reports the counts of the server's `usage`.
"""

from __future__ import annotations

import importlib.util
import math
import random
import sys
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

DATASETS = ("random", "shared-prefix", "multi-turn", "code")

# Short, common words: one token each for nearly every BPE vocabulary (a leading space included), and short
# for byte-level ones.
WORDS: tuple[str, ...] = tuple(
    """the of and to in is it you that he was for on are as with his they at be this from have or by one
    had not but what all were when we there can an your which their said if do will each about how up out
    them then she many some so these would other into has more her two like him see time could no make than
    first been its who now people my made over did down only way find use may water long little very after
    words called just where most know get through back much before go good new write our used me man too any
    day same right look think also around another came come work three word must because does part even place
    well such here take why things help put years different away again off went old number great tell men
    say small every found still between name should home big give air line set own under read last never us
    left end along while might next sound below saw something thought both few those always looked show large
    often together asked house world going want school important until form food keep children feet land side
    without boy once animals life enough took sometimes four head above kind began almost live page got earth
    need far hand high year mother light parts country father let night following picture being study second
    eyes soon times story boys since white days ever paper hard near sentence better best across during today
    others sure means knew its try told young miles sun ways thing whole hear example heard several change
    answer room sea against top turned learn point city play toward five using himself usually""".split()
)

CHARS_PER_TOKEN = 4
"""Characters of Python source per token, for cutting code without a tokenizer (BPE vocabularies of 30k+
tokens average 3-4 on code)."""

CODE_PACKAGES = (
    "hyspec_server",
    "hyspec_models",
    "hyspec_spec_workers",
    "hyspec_statepool",
    "hyspec_attn_backends",
    "hyspec_kernels",
)
"""Whose Python sources the `code` dataset cuts its prompts from. No held-out split of the demo models'
corpus ships with hyspec (tools/demo/corpus.py rebuilds it from the training machine's site-packages), and
the corpus excludes hyspec's own sources, so they are code the demo models never trained on."""


@dataclass(frozen=True, slots=True)
class Turn:
    """One request: the new text (the whole prompt, or the user's message of a chat turn) and its lengths."""

    text: str
    input_len: int
    output_len: int


@dataclass(frozen=True, slots=True)
class Conversation:
    turns: tuple[Turn, ...]


class Lengths:
    """Makes and measures text in tokens: exact with a transformers tokenizer, approximate without."""

    def __init__(self, tokenizer: Any = None) -> None:
        self.tokenizer = tokenizer

    def words(self, rng: random.Random, n: int) -> str:
        """Random words, `n` tokens long."""
        text = " ".join(rng.choice(WORDS) for _ in range(n))
        # every word is at least one token, so n words are enough to cut n tokens from
        return self.cut(text, n)

    def count(self, text: str) -> int:
        if self.tokenizer is None:
            return math.ceil(len(text) / CHARS_PER_TOKEN)
        return len(self._encode(text))

    def cut(self, text: str, n: int) -> str:
        """The first `n` tokens of `text` (without a tokenizer: unchanged, a word is taken as a token)."""
        if self.tokenizer is None:
            return text
        return str(self.tokenizer.decode(self._encode(text)[:n]))

    def _encode(self, text: str) -> list[int]:
        return list(self.tokenizer.encode(text, add_special_tokens=False))


def load_tokenizer(path: str) -> Any:
    """A transformers tokenizer from a local directory; nothing is downloaded. ValueError naming
    --tokenizer when there is none there (or no transformers to load it)."""
    try:
        from transformers import AutoTokenizer
    except ImportError as e:
        raise ValueError(f"--tokenizer needs transformers ({e})") from e
    try:
        tok = AutoTokenizer.from_pretrained(path, local_files_only=True)
    except (OSError, ValueError) as e:
        raise ValueError(f"--tokenizer: no tokenizer can be loaded from {path!r} ({e})") from e
    # it only counts and cuts text: a whole source file may be longer than the model's context, no warning
    tok.model_max_length = sys.maxsize
    return tok


def sample_len(rng: random.Random, mean: int, range_ratio: float) -> int:
    """A length uniform in [mean * (1 - r), mean * (1 + r)] (vLLM's `--random-range-ratio`), at least 1."""
    low = max(1, math.floor(mean * (1 - range_ratio)))
    high = max(low, math.ceil(mean * (1 + range_ratio)))
    return rng.randint(low, high)


def random_dataset(
    n: int, input_len: int, output_len: int, range_ratio: float, lengths: Lengths, seed: int
) -> list[Conversation]:
    """`n` prompts of random words."""
    rng = random.Random(seed)
    out = []
    for _ in range(n):
        k = sample_len(rng, input_len, range_ratio)
        out.append(_one(lengths.words(rng, k), k, sample_len(rng, output_len, range_ratio)))
    return out


def shared_prefix_dataset(
    n: int,
    prefix_len: int,
    num_groups: int,
    input_len: int,
    output_len: int,
    range_ratio: float,
    lengths: Lengths,
    seed: int,
) -> list[Conversation]:
    """`n` prompts in `num_groups` groups: a group's prompts start with the same `prefix_len`-token prefix
    (what a system prompt or a shared document is), then a random suffix of about `input_len` tokens.
    Shuffled, so a group's requests arrive among the others'."""
    rng = random.Random(seed)
    prefixes = [lengths.words(rng, prefix_len) for _ in range(num_groups)]
    out = []
    for i in range(n):
        k = sample_len(rng, input_len, range_ratio)
        # cut as a whole: a suffix tokenized on its own starts without its leading space, and its first word
        # then splits into other tokens than after the prefix (the prefix's own tokens stay as they were)
        suffix = " ".join(rng.choice(WORDS) for _ in range(k))
        text = lengths.cut(prefixes[i % num_groups] + " " + suffix, prefix_len + k)
        out.append(_one(text, prefix_len + k, sample_len(rng, output_len, range_ratio)))
    rng.shuffle(out)
    return out


def multi_turn_dataset(
    n: int, num_turns: int, input_len: int, output_len: int, range_ratio: float, lengths: Lengths, seed: int
) -> list[Conversation]:
    """`n` turns in conversations of `num_turns` (the last one shorter when they do not divide): each user
    message is about `input_len` tokens of random words; each turn resends the history."""
    rng = random.Random(seed)
    out = []
    for start in range(0, n, num_turns):
        turns = []
        for _ in range(min(num_turns, n - start)):
            k = sample_len(rng, input_len, range_ratio)
            turns.append(Turn(lengths.words(rng, k), k, sample_len(rng, output_len, range_ratio)))
        out.append(Conversation(tuple(turns)))
    return out


def code_dataset(
    n: int,
    input_len: int,
    output_len: int,
    range_ratio: float,
    lengths: Lengths,
    seed: int,
    files: Sequence[Path] | None = None,
) -> list[Conversation]:
    """`n` Python snippets to complete: each starts at a random line of a random source file of
    `CODE_PACKAGES` (or of `files`) and runs on for about `input_len` tokens."""
    sources = [_read(p) for p in (code_files() if files is None else files)]
    sources = [s for s in sources if s.strip()]
    if not sources:
        raise ValueError("code: no Python source files found")
    rng = random.Random(seed)
    out = []
    for _ in range(n):
        k = sample_len(rng, input_len, range_ratio)
        text = _snippet(rng.choice(sources), rng, k, lengths)
        out.append(_one(text, lengths.count(text), sample_len(rng, output_len, range_ratio)))
    return out


def code_files() -> list[Path]:
    """The `*.py` files of the installed `CODE_PACKAGES`, sorted (found without importing them)."""
    out: list[Path] = []
    for name in CODE_PACKAGES:
        spec = importlib.util.find_spec(name)
        for root in (spec.submodule_search_locations or []) if spec is not None else []:
            out.extend(p for p in Path(root).rglob("*.py") if "__pycache__" not in p.parts)
    return sorted(set(out))


def _read(path: Path) -> str:
    return path.read_text(encoding="utf-8", errors="replace")


def _snippet(source: str, rng: random.Random, n: int, lengths: Lengths) -> str:
    """Whole lines from a random one on until `n` tokens are reached (then cut to `n` with a tokenizer);
    a file too short for `n` is taken from its start, and repeated when even that is not enough."""
    lines = source.splitlines(keepends=True)
    first = rng.randrange(len(lines))
    if lengths.count("".join(lines[first:])) < n:
        first = 0
    picked: list[str] = []
    i, total = first, 0
    # counted line by line (one encode of each), then checked whole: tokens can merge across line breaks
    while total < n:
        picked.append(lines[i % len(lines)])
        total += lengths.count(picked[-1])
        i += 1
    text = "".join(picked)
    while lengths.count(text) < n:
        text += lines[i % len(lines)]
        i += 1
    return lengths.cut(text, n)


def _one(text: str, input_len: int, output_len: int) -> Conversation:
    return Conversation((Turn(text, input_len, output_len),))


def arrival_times(n: int, request_rate: float, burstiness: float, seed: int) -> list[float]:
    """Seconds from the start at which each of `n` conversations begins.

    `request_rate` inf sends all at once. Otherwise the gaps are gamma distributed with mean 1 / rate and
    shape `burstiness` (vLLM's `--burstiness`): 1 is a Poisson process (exponential gaps), below 1 burstier,
    above 1 more even. The first request goes at 0. The same seed gives the same schedule.
    """
    if request_rate <= 0 or burstiness <= 0:
        raise ValueError("request rate and burstiness must be > 0")
    if math.isinf(request_rate):
        return [0.0] * n
    rng = random.Random(seed)
    scale = 1.0 / (request_rate * burstiness)
    out = [0.0]
    for _ in range(n - 1):
        out.append(out[-1] + rng.gammavariate(burstiness, scale))
    return out[:n]
