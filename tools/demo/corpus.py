"""Python-source corpus for the tiny demo language models: file listing, split, tokenizer, encoding.

    python tools/demo/corpus.py --stats
    python tools/demo/corpus.py --tokenizer OUT [--vocab-size N] [--max-train-bytes N]

The corpus is every ``*.py`` file of the running interpreter's standard library and site-packages,
deduplicated by content. Everything here is deterministic (no randomness, only hashes and sorted orders)
and offline, so the same machine always yields the same split, tokenizer and token stream.

Bits per byte: ``validation_bytes`` is the one byte string both baselines are measured on. ``xz`` gives
``xz_bits_per_byte(validation_bytes(val))``; a model's bits per byte is the total negative log-likelihood
of the tokens covering those bytes, in nats, divided by ln 2 and by ``len(validation_bytes(val))``.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import lzma
import os
import site
import sys
import sysconfig
import time
from collections.abc import Iterator, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import numpy as np
from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers, trainers

SPECIAL_TOKENS: tuple[str, ...] = ("<|endoftext|>", "<|pad|>", "<|im_start|>", "<|im_end|>", "<|mask|>")
EOS = "<|endoftext|>"
PAD = "<|pad|>"
MASK = "<|mask|>"

# ChatML: '\n' is a jinja escape inside the jinja string literals, hence the doubled backslash here.
CHAT_TEMPLATE: str = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>' + '\\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)

# tools/demo/corpus.py -> the repository root; its own sources must never become training data.
REPO_ROOT: Path = Path(__file__).resolve().parents[2]

# Installed copies of site-packages live under these names; the stdlib walk must not count them again.
_SITE_DIR_NAMES = frozenset({"site-packages", "dist-packages"})
_SKIP_DIR_NAMES = frozenset({"__pycache__"}) | _SITE_DIR_NAMES


@dataclass(frozen=True)
class SourceFile:
    """One corpus file: ``prefix/relpath`` name, where it lies, and the sha256 hex of its bytes."""

    name: str
    path: Path
    digest: str


def default_roots() -> list[tuple[str, Path]]:
    """``("stdlib", dir)`` then ``("site", dir)``, ``("site1", dir)``, ... for each existing site dir."""
    stdlib = Path(sysconfig.get_paths()["stdlib"]).resolve()
    roots: list[tuple[str, Path]] = [("stdlib", stdlib)]
    paths = sysconfig.get_paths()
    candidates = [paths["purelib"], paths["platlib"], *site.getsitepackages()]
    seen: set[Path] = {stdlib}
    for cand in candidates:
        p = Path(cand).resolve()
        if p in seen or not p.is_dir():
            continue
        seen.add(p)
        n = len(roots) - 1
        roots.append(("site" if n == 0 else f"site{n}", p))
    return roots


def _excluded(path: Path, repo: Path = REPO_ROOT) -> bool:
    """Whether a resolved path is part of the repository's own sources.

    A virtual environment inside the repository (``.venv``) is not: its site-packages are third-party
    code, and excluding them would drop every package on a machine whose venv lives in the checkout.
    """
    try:
        rel = path.relative_to(repo)
    except ValueError:
        return False
    return not any(part in _SITE_DIR_NAMES for part in rel.parts)


def _is_own_install(top: str) -> bool:
    # a non-editable install copies hyspec's packages into site-packages, outside the repository
    return top.startswith(("hyspec", "__editable__"))


def _candidates(prefix: str, root: Path, max_bytes: int) -> Iterator[tuple[str, Path]]:
    root = root.resolve()
    if not root.is_dir() or _excluded(root):
        return
    # followlinks=False: a symlinked directory (possibly a loop) is never entered, so every dirpath is
    # root plus real directory names and lexical checks on it are checks on the real path
    for dirpath, dirnames, filenames in os.walk(root, followlinks=False):
        here = Path(dirpath)
        at_top = here == root
        dirnames[:] = [
            d
            for d in dirnames
            if d not in _SKIP_DIR_NAMES
            and not (at_top and prefix != "stdlib" and _is_own_install(d))
            and not _excluded(here / d)
        ]
        for fn in filenames:
            if not fn.endswith(".py") or (at_top and prefix != "stdlib" and _is_own_install(fn)):
                continue
            p = here / fn
            try:
                if p.is_symlink():
                    # a file link is kept only when it stays inside this root (dedup then drops one copy)
                    target = p.resolve()
                    if not target.is_relative_to(root) or _excluded(target) or not target.is_file():
                        continue
                if p.stat().st_size > max_bytes:
                    continue
            except OSError:
                continue
            yield f"{prefix}/{p.relative_to(root).as_posix()}", p


def _digest_if_utf8(path: Path) -> str | None:
    try:
        data = path.read_bytes()
        data.decode("utf-8")
    except (OSError, UnicodeDecodeError):
        return None
    return hashlib.sha256(data).hexdigest()


def list_sources(
    roots: Sequence[tuple[str, Path]] | None = None, *, max_bytes: int = 1_000_000
) -> list[SourceFile]:
    """Every UTF-8 ``*.py`` file of at most ``max_bytes`` under ``roots``, sorted by name, content-deduped."""
    if roots is None:
        roots = default_roots()
    named: dict[str, Path] = {}
    for prefix, root in roots:
        for name, path in _candidates(prefix, root, max_bytes):
            named.setdefault(name, path)
    names = sorted(named)
    # reading ~100k small files is bound by syscalls and hashing, both of which release the GIL
    with ThreadPoolExecutor(max_workers=min(32, (os.cpu_count() or 1) + 4)) as pool:
        digests = list(pool.map(_digest_if_utf8, (named[n] for n in names), chunksize=64))
    out: list[SourceFile] = []
    seen: set[str] = set()
    for name, digest in zip(names, digests):
        if digest is None or digest in seen:
            continue
        seen.add(digest)
        out.append(SourceFile(name=name, path=named[name], digest=digest))
    return out


def _hash_int(text: str) -> int:
    return int(hashlib.sha256(text.encode("utf-8")).hexdigest()[:8], 16)


def is_validation(name: str) -> bool:
    """About 1% of names, chosen by hash of the name so the split survives adding or removing files."""
    return _hash_int(name) % 100 == 0


def split_sources(files: Sequence[SourceFile]) -> tuple[list[SourceFile], list[SourceFile]]:
    """``(train, val)``, each in the input order."""
    train = [f for f in files if not is_validation(f.name)]
    val = [f for f in files if is_validation(f.name)]
    return train, val


def read_text(f: SourceFile) -> str:
    """The file's exact text (no newline translation, so ``\\r\\n`` survives)."""
    return f.path.read_bytes().decode("utf-8")


def chat_wrapped(name: str) -> bool:
    """About 4% of documents are rendered as a chat turn; hashed with a salt so it is independent of the
    validation split."""
    return _hash_int("chat:" + name) % 25 == 0


def document(f: SourceFile) -> str:
    """The text a file is trained on: its source, or a ChatML exchange asking for it."""
    text = read_text(f)
    if not chat_wrapped(f.name):
        return text
    module = "/".join(f.name.split("/")[-2:])
    return (
        f"<|im_start|>user\nWrite the Python module {module}.<|im_end|>\n"
        f"<|im_start|>assistant\n{text}<|im_end|>\n"
    )


def _training_texts(files: Sequence[SourceFile], max_train_bytes: int) -> Iterator[str]:
    # digest order is a deterministic shuffle: the sample spans the stdlib and many packages instead of
    # the first few packages in name order
    total = 0
    for f in sorted(files, key=lambda f: (f.digest, f.name)):
        if total >= max_train_bytes:
            return
        data = f.path.read_bytes()
        total += len(data)
        yield data.decode("utf-8")


def train_tokenizer(
    files: Sequence[SourceFile], *, vocab_size: int = 8192, max_train_bytes: int = 64_000_000
) -> Tokenizer:
    """Byte-level BPE with ``SPECIAL_TOKENS`` at ids 0..4, exactly ``vocab_size`` entries."""
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        min_frequency=2,
        show_progress=False,
        special_tokens=[AddedToken(t, special=True, normalized=False) for t in SPECIAL_TOKENS],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
    )
    tok.train_from_iterator(_training_texts(files, max_train_bytes), trainer=trainer)
    # the trainer silently stops short when the data has too few pairs; a model sized for vocab_size
    # would then have dead embedding rows, so fail instead
    got = tok.get_vocab_size(with_added_tokens=True)
    if got != vocab_size:
        raise ValueError(f"tokenizer has {got} tokens, not vocab_size={vocab_size} (too little data?)")
    for i, t in enumerate(SPECIAL_TOKENS):
        if tok.token_to_id(t) != i:
            raise AssertionError(f"special token {t!r} has id {tok.token_to_id(t)}, expected {i}")
    return tok


def save_tokenizer(tok: Tokenizer, out_dir: Path, *, model_max_length: int) -> None:
    """Write ``tokenizer.json``, ``tokenizer_config.json`` and ``special_tokens_map.json`` for
    ``transformers.AutoTokenizer``: EOS and PAD set, no BOS, ChatML template."""
    out_dir.mkdir(parents=True, exist_ok=True)
    tok.save(str(out_dir / "tokenizer.json"))
    added = {
        str(tok.token_to_id(t)): {
            "content": t,
            "lstrip": False,
            "normalized": False,
            "rstrip": False,
            "single_word": False,
            "special": True,
        }
        for t in SPECIAL_TOKENS
    }
    config = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "added_tokens_decoder": added,
        "bos_token": None,
        "eos_token": EOS,
        "pad_token": PAD,
        "mask_token": MASK,
        "unk_token": None,
        "add_bos_token": False,
        "add_eos_token": False,
        # cleanup would rewrite " ." to "." and break exact round trips of source code
        "clean_up_tokenization_spaces": False,
        "model_max_length": model_max_length,
        "chat_template": CHAT_TEMPLATE,
    }
    special_map = {"eos_token": EOS, "pad_token": PAD, "mask_token": MASK}
    for fname, obj in (("tokenizer_config.json", config), ("special_tokens_map.json", special_map)):
        (out_dir / fname).write_text(json.dumps(obj, indent=2, ensure_ascii=False) + "\n", encoding="utf-8")


def encode_files(tok: Tokenizer, files: Sequence[SourceFile], *, batch_docs: int = 512) -> np.ndarray:
    """Concatenated token ids (uint16) of each file's ``document`` followed by the EOS id."""
    if tok.get_vocab_size(with_added_tokens=True) > 1 << 16:
        raise ValueError("vocab does not fit in uint16")
    eos = tok.token_to_id(EOS)
    parts: list[np.ndarray] = []
    for start in range(0, len(files), batch_docs):
        texts = [document(f) for f in files[start : start + batch_docs]]
        ids: list[int] = []
        # encode_batch runs the batch on all cores in Rust; a source file that literally contains a
        # special token's text gets that special id, which is accepted
        for enc in tok.encode_batch(texts, add_special_tokens=False):
            ids.extend(enc.ids)
            ids.append(eos)
        parts.append(np.asarray(ids, dtype=np.uint16))
    return np.concatenate(parts) if parts else np.zeros(0, dtype=np.uint16)


def xz_bits_per_byte(data: bytes) -> float:
    """Bits per byte of ``xz -9`` (the .xz container overhead included)."""
    if not data:
        raise ValueError("empty data")
    return 8 * len(lzma.compress(data, preset=9)) / len(data)


def validation_bytes(files: Sequence[SourceFile]) -> bytes:
    """The validation files' UTF-8 contents joined with ``b"\\n"``, in order (see module doc)."""
    return b"\n".join(f.path.read_bytes() for f in files if is_validation(f.name))


def _size(files: Sequence[SourceFile]) -> int:
    return sum(f.path.stat().st_size for f in files)


def main(argv: Sequence[str] | None = None) -> int:
    """CLI: corpus statistics and/or a trained tokenizer."""
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--stats", action="store_true", help="print corpus and split sizes")
    ap.add_argument("--tokenizer", type=Path, metavar="OUT", help="train a tokenizer and save it to OUT")
    ap.add_argument("--vocab-size", type=int, default=8192)
    ap.add_argument("--max-train-bytes", type=int, default=64_000_000)
    ap.add_argument("--max-bytes", type=int, default=1_000_000, help="skip files larger than this")
    ap.add_argument("--model-max-length", type=int, default=2048)
    args = ap.parse_args(argv)
    if not args.stats and args.tokenizer is None:
        ap.error("nothing to do: pass --stats and/or --tokenizer OUT")

    t0 = time.perf_counter()
    files = list_sources(max_bytes=args.max_bytes)
    train, val = split_sources(files)
    t_list = time.perf_counter() - t0
    if args.stats:
        for prefix, root in default_roots():
            print(f"root {prefix}: {root}")
        print(f"files: {len(files)} ({_size(files) / 1e6:.1f} MB) listed in {t_list:.1f} s")
        print(f"train: {len(train)} files, {_size(train) / 1e6:.1f} MB")
        print(f"val:   {len(val)} files, {_size(val) / 1e6:.2f} MB")
        t1 = time.perf_counter()
        vb = validation_bytes(val)
        print(f"xz -9 on val: {xz_bits_per_byte(vb):.3f} bits/byte ({time.perf_counter() - t1:.1f} s)")
    if args.tokenizer is not None:
        t1 = time.perf_counter()
        tok = train_tokenizer(train, vocab_size=args.vocab_size, max_train_bytes=args.max_train_bytes)
        t_train = time.perf_counter() - t1
        save_tokenizer(tok, args.tokenizer, model_max_length=args.model_max_length)
        texts = [read_text(f) for f in val]
        n_tok = sum(len(e.ids) for e in tok.encode_batch(texts, add_special_tokens=False))
        n_bytes = sum(len(t.encode("utf-8")) for t in texts)
        print(f"tokenizer: vocab {tok.get_vocab_size()} in {t_train:.1f} s, saved to {args.tokenizer}")
        print(f"val: {n_tok} tokens / {n_bytes} bytes = {n_tok / max(n_bytes, 1):.4f} tokens per byte")
    print(f"total {time.perf_counter() - t0:.1f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
