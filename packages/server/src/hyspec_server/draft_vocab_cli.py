"""`hyspec draft-vocab`: a draft vocabulary of a model's most frequent tokens in a text corpus.

    hyspec draft-vocab --model DIR --corpus a.txt b.jsonl --size 32768 --output vocab.json

Counts the tokens of every corpus file (`.jsonl`: the "text" field of each line, or its "prompt" and
"completion"; any other file: its lines) with the model's tokenizer, keeps the `--size` most frequent
(ties by token id), adds every special token, and writes the sorted ids as a JSON list: the file
`speculative_config.draft_vocab` takes (`hyspec_spec_workers.draft_vocab`).
"""

from __future__ import annotations

import argparse
import json
import sys
from collections import Counter
from collections.abc import Iterator, Sequence
from pathlib import Path

from hyspec_server.tokenizer import HFTokenizer, Tokenizer


def add_draft_vocab_command(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    """Adds the "draft-vocab" subcommand to `sub` (the top-level parser's subparsers)."""
    p = sub.add_parser(
        "draft-vocab",
        help="write a draft vocabulary (the most frequent tokens of a corpus) for speculative_config",
        description=__doc__.split("\n\n")[2] if __doc__ else None,
    )
    p.add_argument("--model", required=True, help="model directory whose tokenizer counts the corpus")
    p.add_argument("--corpus", nargs="+", type=Path, required=True, help="text or .jsonl files")
    p.add_argument("--size", type=int, default=32768, help="tokens kept, before special tokens (32768)")
    p.add_argument("--output", type=Path, required=True, help="the JSON file to write")


def _texts(path: Path) -> Iterator[str]:
    """The texts of a corpus file; ValueError naming the file and line for a malformed .jsonl line."""
    with path.open(encoding="utf-8") as f:
        for number, line in enumerate(f, 1):
            if path.suffix != ".jsonl":
                yield line
                continue
            if not line.strip():
                continue
            try:
                row = json.loads(line)
            except ValueError as e:
                raise ValueError(f"{path}:{number} is not valid JSON ({e})") from None
            if isinstance(row, dict):
                yield from (str(row[k]) for k in ("text", "prompt", "completion") if k in row)


def _error(flag: str, msg: str) -> int:
    print(f"hyspec draft-vocab: error: {flag}: {msg}", file=sys.stderr)
    return 2


def count_tokens(tok: Tokenizer, corpus: Sequence[Path]) -> Counter[int]:
    """Token counts of the corpus files (`_texts`), special tokens not added."""
    counts: Counter[int] = Counter()
    for path in corpus:
        for text in _texts(path):
            counts.update(tok.encode(text, add_special_tokens=False))
    return counts


def draft_vocab_ids(tok: HFTokenizer, counts: Counter[int], size: int) -> tuple[list[int], list[int]]:
    """(the draft vocabulary: sorted ids of the `size` most frequent tokens, ties by id, and every special
    token; those most frequent tokens in frequency order)."""
    kept = [t for t, _ in sorted(counts.items(), key=lambda kv: (-kv[1], kv[0]))[:size]]
    special = [int(t) for t in tok.hf_tokenizer.all_special_ids] + sorted(tok.eos_token_ids)
    return sorted({*kept, *special}), kept


def run_draft_vocab(ns: argparse.Namespace) -> int:
    """Counts, keeps and writes (module docstring); an error message and 2 for a bad argument."""
    if ns.size < 1:
        return _error("--size", f"expected an integer >= 1, got {ns.size}")
    missing = [str(p) for p in ns.corpus if not p.is_file()]
    if missing:
        return _error("--corpus", f"no such file: {', '.join(missing)}")
    if not ns.output.parent.is_dir():
        return _error("--output", f"no such directory: {ns.output.parent}")
    try:
        tok = HFTokenizer(ns.model)
    except (OSError, ValueError) as e:
        return _error("--model", f"cannot load a tokenizer from {ns.model}: {e}")
    try:
        counts = count_tokens(tok, ns.corpus)
    except (ValueError, UnicodeDecodeError) as e:
        return _error("--corpus", str(e))
    if not counts:
        return _error(
            "--corpus", "no text found (a .jsonl line needs a 'text', 'prompt' or 'completion' field)"
        )
    ids, kept = draft_vocab_ids(tok, counts, ns.size)
    ns.output.write_text(json.dumps(ids))
    covered = sum(counts[t] for t in kept) / max(1, sum(counts.values()))
    print(
        f"wrote {len(ids)} token ids to {ns.output} ({len(kept)} of {len(counts)} distinct corpus tokens, "
        f"covering {covered:.1%} of its {sum(counts.values())} tokens, plus special tokens)"
    )
    return 0
