"""tools/demo/corpus.py: source listing, split, tokenizer training and saving, encoding, xz baseline; the
shipped tokenizer round-trips the validation split."""

from __future__ import annotations

import hashlib
import importlib.util
import os
import sys
from pathlib import Path
from types import ModuleType
from typing import Any

import numpy as np
import pytest

REPO = Path(__file__).resolve().parents[3]


def _load() -> ModuleType:
    # tools/ is not a package on the path under --import-mode=importlib, so load the file directly;
    # registering it first lets dataclasses resolve the module's string annotations
    name = "hyspec_demo_corpus_under_test"
    if name in sys.modules:
        return sys.modules[name]
    spec = importlib.util.spec_from_file_location(name, REPO / "tools" / "demo" / "corpus.py")
    assert spec is not None and spec.loader is not None
    mod = importlib.util.module_from_spec(spec)
    sys.modules[name] = mod
    spec.loader.exec_module(mod)
    return mod


corpus = _load()


def _write(path: Path, data: bytes | str) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    if isinstance(data, str):
        data = data.encode("utf-8")
    path.write_bytes(data)
    return path


def _synthetic_sources(root: Path, n: int) -> None:
    # varied but repetitive Python, enough distinct pairs for a few hundred merges
    for i in range(n):
        body = "".join(
            f"def func_{i}_{j}(value_{j}: int, name='x{j}') -> int:\n"
            f'    """Return value {j} times {i}."""\n'
            f"    if value_{j} > {j}:\n\treturn value_{j} * {i + j}  \n"
            f"    return len(name) + {j}\r\n\n"
            for j in range(30)
        )
        _write(root / f"pkg{i % 7}" / f"mod_{i}.py", f"import os\nimport sys\n\n{body}# ünïcode ✓ {i}\n")


def test_list_sources_sorts_dedups_and_skips(tmp_path: Path) -> None:
    a = tmp_path / "a"
    b = tmp_path / "b"
    _write(a / "z.py", "x = 1\n")
    _write(a / "sub" / "m.py", "y = 2\n")
    _write(a / "dup_later.py", "x = 1\n")  # same content as z.py, but sorts first: it is the one kept
    _write(a / "big.py", "#" * 200 + "\n")
    _write(a / "latin1.py", b"s = '\xe9'\n")
    _write(a / "notes.txt", "not python\n")
    _write(a / "__pycache__" / "c.py", "cached = 1\n")
    _write(a / "site-packages" / "pkg.py", "nested_site = 1\n")
    _write(b / "m.py", "y = 2\n")  # duplicates a/sub/m.py, which sorts first ("a/..." < "b/...")
    _write(b / "own.py", "w = 3\r\n")

    files = corpus.list_sources([("b", b), ("a", a)], max_bytes=100)
    names = [f.name for f in files]
    assert names == ["a/dup_later.py", "a/sub/m.py", "b/own.py"]
    assert names == sorted(names)
    f0 = files[0]
    assert f0.path == a / "dup_later.py"
    assert f0.digest == hashlib.sha256(b"x = 1\n").hexdigest()
    assert corpus.read_text(f0) == "x = 1\n"
    assert corpus.read_text(files[2]) == "w = 3\r\n"  # exact text: no newline translation
    # the size cap is inclusive of max_bytes and only skips larger files
    assert "a/big.py" in {f.name for f in corpus.list_sources([("a", a)], max_bytes=201)}


def test_list_sources_symlinks(tmp_path: Path) -> None:
    root = tmp_path / "root"
    outside = _write(tmp_path / "outside" / "secret.py", "secret = 1\n")
    _write(root / "pkg" / "real.py", "real = 1\n")
    os.symlink(root, root / "pkg" / "loop")  # a directory cycle must not be walked forever
    os.symlink(tmp_path / "outside", root / "dirlink")
    os.symlink(outside, root / "filelink_out.py")
    os.symlink(root / "pkg" / "real.py", root / "alias.py")  # inside: kept, then deduped against real.py
    files = corpus.list_sources([("r", root)])
    assert [f.name for f in files] == ["r/alias.py"]
    assert corpus.read_text(files[0]) == "real = 1\n"


def test_list_sources_excludes_the_repo(tmp_path: Path) -> None:
    # the repository's own sources, as a root or through a link, never enter the corpus
    assert corpus.REPO_ROOT == REPO
    assert corpus.list_sources([("tools", REPO / "tools")]) == []
    root = tmp_path / "root"
    _write(root / "keep.py", "keep = 1\n")
    os.symlink(REPO / "tools" / "demo" / "corpus.py", root / "corpus_link.py")
    assert [f.name for f in corpus.list_sources([("r", root)])] == ["r/keep.py"]
    # ...but a virtual environment's site-packages inside a checkout is third-party code
    assert corpus._excluded(REPO / "tools" / "x.py")
    assert not corpus._excluded(REPO / ".venv" / "lib" / "python3.11" / "site-packages" / "numpy" / "a.py")
    assert not corpus._excluded(tmp_path / "x.py")


def test_list_sources_skips_installed_hyspec(tmp_path: Path) -> None:
    site = tmp_path / "site"
    _write(site / "hyspec_server" / "engine.py", "engine = 1\n")
    _write(site / "__editable___hyspec_finder.py", "finder = 1\n")
    _write(site / "numpy" / "core.py", "core = 1\n")
    assert [f.name for f in corpus.list_sources([("site", site)])] == ["site/numpy/core.py"]


def test_default_roots_are_distinct_dirs() -> None:
    roots = corpus.default_roots()
    assert roots[0][0] == "stdlib"
    assert [p for p, _ in roots[1:]] == ["site", *(f"site{i}" for i in range(1, len(roots) - 1))]
    resolved = [r.resolve() for _, r in roots]
    assert len(set(resolved)) == len(resolved)
    assert all(r.is_dir() for r in resolved)


def test_validation_and_chat_fractions() -> None:
    names = [f"site/pkg{i % 97}/module_{i}.py" for i in range(20_000)]
    val = [n for n in names if corpus.is_validation(n)]
    chat = [n for n in names if corpus.chat_wrapped(n)]
    assert 0.006 < len(val) / len(names) < 0.014
    assert 0.03 < len(chat) / len(names) < 0.05
    # independent hashes: the chat rate among validation names is the overall rate, not 0 or 1
    both = sum(corpus.chat_wrapped(n) for n in val)
    assert both < len(val) / 4
    assert corpus.is_validation(val[0]) and corpus.is_validation(val[0])  # deterministic
    files = [corpus.SourceFile(name=n, path=Path(n), digest="") for n in names[:3000]]
    train, vfiles = corpus.split_sources(files)
    assert [f.name for f in vfiles] == [n for n in names[:3000] if corpus.is_validation(n)]
    assert len(train) + len(vfiles) == 3000
    assert not {f.name for f in train} & {f.name for f in vfiles}


@pytest.fixture(scope="module")
def trained(tmp_path_factory: pytest.TempPathFactory) -> tuple[Any, list[Any]]:
    root = tmp_path_factory.mktemp("src")
    _synthetic_sources(root, 40)
    files = corpus.list_sources([("s", root)])
    return corpus.train_tokenizer(files, vocab_size=400), files


def test_train_tokenizer_exact_size_and_specials(trained: tuple[Any, list[Any]]) -> None:
    tok, files = trained
    assert tok.get_vocab_size() == 400
    for i, t in enumerate(corpus.SPECIAL_TOKENS):
        assert tok.token_to_id(t) == i
    assert corpus.SPECIAL_TOKENS[:2] == (corpus.EOS, corpus.PAD)
    assert corpus.SPECIAL_TOKENS[4] == corpus.MASK
    # no post-processor: nothing (no BOS) is added around the text
    ids = tok.encode("x = 1\n").ids
    assert not set(ids) & set(range(5))
    # deterministic: the same data gives the same tokenizer
    again = corpus.train_tokenizer(files, vocab_size=400)
    assert again.to_str() == tok.to_str()
    with pytest.raises(ValueError, match="vocab_size=100000"):
        corpus.train_tokenizer(files[:2], vocab_size=100_000)


def test_saved_tokenizer_with_transformers(trained: tuple[Any, list[Any]], tmp_path: Path) -> None:
    from transformers import AutoTokenizer

    tok, _ = trained
    corpus.save_tokenizer(tok, tmp_path, model_max_length=256)
    hf = AutoTokenizer.from_pretrained(tmp_path)
    assert hf.is_fast
    assert hf.eos_token == corpus.EOS and hf.eos_token_id == 0
    assert hf.pad_token == corpus.PAD and hf.pad_token_id == 1
    assert hf.bos_token is None
    assert hf.model_max_length == 256
    assert len(hf) == 400
    assert hf.chat_template == corpus.CHAT_TEMPLATE
    assert hf.clean_up_tokenization_spaces is False
    for text in [
        "def f(x):\n\treturn x  \n",
        "  leading and trailing   \r\n\r\nwindows line\r\n",
        "ünïcödé ✓ 日本語 🐍 \x00\x7f",
        "a , b . c ' d n't",
        "",
    ]:
        ids = hf.encode(text, add_special_tokens=False)
        assert hf.decode(ids) == text
        assert ids == tok.encode(text).ids
    assert hf.encode("x", add_special_tokens=True) == hf.encode("x", add_special_tokens=False)
    msgs = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "yo"}]
    rendered = hf.apply_chat_template(msgs, tokenize=False, add_generation_prompt=False)
    assert rendered == "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\nyo<|im_end|>\n"
    prompt = hf.apply_chat_template(msgs[:1], tokenize=False, add_generation_prompt=True)
    assert prompt == "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n"
    ids = hf.encode(prompt, add_special_tokens=False)
    assert ids[0] == 2 and ids.count(3) == 1


def test_encode_files_eos_and_chat(trained: tuple[Any, list[Any]], tmp_path: Path) -> None:
    tok, _ = trained
    # enough names that some are chat-wrapped and some are not
    names = [f"s/pkg/m{i}.py" for i in range(200)]
    wrapped = [n for n in names if corpus.chat_wrapped(n)]
    plain = [n for n in names if not corpus.chat_wrapped(n)]
    assert len(wrapped) >= 3 and plain
    files = [
        corpus.SourceFile(
            name=n, path=_write(tmp_path / n, f"def {Path(n).stem}():\n    return 1\n"), digest=""
        )
        for n in sorted([*wrapped[:3], *plain[:5]])
    ]
    arr = corpus.encode_files(tok, files, batch_docs=3)
    assert arr.dtype == np.uint16 and arr.ndim == 1
    eos = tok.token_to_id(corpus.EOS)
    docs = np.split(arr, np.flatnonzero(arr == eos) + 1)
    assert docs[-1].size == 0 and len(docs) - 1 == len(files)
    assert sum(corpus.chat_wrapped(f.name) for f in files) == 3
    for f, doc in zip(files, docs[:-1]):
        text = corpus.read_text(f)
        decoded = tok.decode(doc[:-1].tolist(), skip_special_tokens=False)
        if corpus.chat_wrapped(f.name):
            module = "/".join(f.name.split("/")[-2:])
            assert decoded == (
                f"<|im_start|>user\nWrite the Python module {module}.<|im_end|>\n"
                f"<|im_start|>assistant\n{text}<|im_end|>\n"
            )
            assert doc[0] == 2 and (doc == 3).sum() == 2
        else:
            assert decoded == text
            assert not set(doc[:-1].tolist()) & set(range(5))
    assert corpus.encode_files(tok, []).size == 0


def test_xz_and_validation_bytes(tmp_path: Path) -> None:
    rep = b"def f(x):\n    return x + 1\n" * 500
    assert 0 < corpus.xz_bits_per_byte(rep) < 1.0
    noise = np.random.default_rng(0).integers(0, 256, 20_000, dtype=np.uint8).tobytes()
    assert 7.9 < corpus.xz_bits_per_byte(noise) < 8.2
    names = [f"v/m{i}.py" for i in range(3000)]
    val_names = [n for n in names if corpus.is_validation(n)][:2]
    train_name = next(n for n in names if not corpus.is_validation(n))
    files = [
        corpus.SourceFile(name=n, path=_write(tmp_path / n, f"# {n}\r\n"), digest="")
        for n in [val_names[0], train_name, val_names[1]]
    ]
    assert corpus.validation_bytes(files) == f"# {val_names[0]}\r\n\n# {val_names[1]}\r\n".encode()


def test_shipped_tokenizer_round_trips_the_validation_files() -> None:
    import transformers
    from hyspec_server.default_model import demo_model_dir

    _, val = corpus.split_sources(corpus.list_sources())
    assert val, "no validation files found on this machine"
    tok = transformers.AutoTokenizer.from_pretrained(demo_model_dir("qwen3_5"))
    for f in val:
        text = corpus.read_text(f)
        ids = tok(text, add_special_tokens=False)["input_ids"]
        assert tok.decode(ids) == text, f.name
    chat = tok.apply_chat_template(
        [{"role": "user", "content": "hi"}], tokenize=False, add_generation_prompt=True
    )
    assert chat == "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n"
