"""`hyspec draft-vocab`: the most frequent tokens of a corpus, written as a draft vocabulary file that
`speculative_config.draft_vocab` reads; bad arguments are an error naming the flag."""

from __future__ import annotations

import json
import re
from collections import Counter
from pathlib import Path

import pytest
from hyspec_server.cli import main
from hyspec_server.default_model import DEMO_MODELS
from hyspec_server.tokenizer import HFTokenizer
from hyspec_spec_workers.draft_vocab import read_draft_vocab

MODEL = DEMO_MODELS / "qwen3_5"


def test_the_most_frequent_tokens_and_the_special_ones(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    text = "def add(a, b):\n    return a + b\n" * 20 + "class Point:\n    x: int\n"
    (tmp_path / "a.py").write_text(text)
    (tmp_path / "b.jsonl").write_text(json.dumps({"prompt": "import os", "completion": "print(1)"}) + "\n\n")
    out = tmp_path / "vocab.json"
    assert (
        main(
            [
                "draft-vocab",
                "--model",
                str(MODEL),
                "--corpus",
                str(tmp_path / "a.py"),
                str(tmp_path / "b.jsonl"),
                "--size",
                "5",
                "--output",
                str(out),
            ]
        )
        == 0
    )
    assert "wrote" in capsys.readouterr().out
    ids = json.loads(out.read_text())
    assert ids == sorted(set(ids))
    tok = HFTokenizer(MODEL)
    counts: Counter[int] = Counter()
    for line in text.splitlines(keepends=True):
        counts.update(tok.encode(line, add_special_tokens=False))
    counts.update(tok.encode("import os", add_special_tokens=False))
    counts.update(tok.encode("print(1)", add_special_tokens=False))
    top = [t for t, _ in sorted(counts.items(), key=lambda kv: (-kv[1], kv[0]))[:5]]
    special = set(tok.hf_tokenizer.all_special_ids) | set(tok.eos_token_ids)
    assert set(ids) == set(top) | special
    assert len(set(counts) - set(ids)) > 0  # the rarer tokens are left out
    vocab_size = json.loads((MODEL / "config.json").read_text())["vocab_size"]
    assert read_draft_vocab(str(out), vocab_size=vocab_size).tolist() == ids


def test_bad_arguments_name_the_flag(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    (tmp_path / "a.txt").write_text("x\n")
    base = ["draft-vocab", "--output", str(tmp_path / "v.json")]
    cases = [
        (["--model", str(MODEL), "--corpus", str(tmp_path / "nope.txt")], "--corpus"),
        (["--model", str(MODEL), "--corpus", str(tmp_path / "a.txt"), "--size", "0"], "--size"),
        (["--model", str(tmp_path), "--corpus", str(tmp_path / "a.txt")], "--model"),
    ]
    for extra, flag in cases:
        assert main([*base, *extra]) == 2
        assert f"error: {flag}" in capsys.readouterr().err
    assert not (tmp_path / "v.json").exists()


def test_jsonl_rows_are_counted(tmp_path: Path) -> None:
    # the .jsonl rows alone decide the top tokens: the text file holds one rare line
    rows = [{"text": "alpha beta"}, {"prompt": "alpha", "completion": "alpha gamma"}, {"messages": []}]
    (tmp_path / "c.jsonl").write_text("\n".join(json.dumps(r) for r in rows) + "\n")
    (tmp_path / "d.txt").write_text("zeta\n")
    out = tmp_path / "v.json"
    argv = [
        "draft-vocab",
        "--model",
        str(MODEL),
        "--corpus",
        str(tmp_path / "c.jsonl"),
        str(tmp_path / "d.txt"),
    ]
    assert main([*argv, "--size", "1", "--output", str(out)]) == 0
    tok = HFTokenizer(MODEL)
    counts: Counter[int] = Counter()
    for text in ("alpha beta", "alpha", "alpha gamma", "zeta\n"):
        counts.update(tok.encode(text, add_special_tokens=False))
    (top, n), (_, second) = counts.most_common(2)
    assert n > second  # one token wins outright
    special = set(tok.hf_tokenizer.all_special_ids) | set(tok.eos_token_ids)
    assert set(json.loads(out.read_text())) == {top} | special


def test_bad_corpora_and_outputs_are_errors(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    (tmp_path / "bad.jsonl").write_text('{"text": "x"}\n{not json\n')
    (tmp_path / "empty.jsonl").write_text(json.dumps({"messages": [{"role": "user"}]}) + "\n")
    (tmp_path / "a.txt").write_text("x\n")
    cases = [
        (str(tmp_path / "bad.jsonl"), str(tmp_path / "v.json"), "--corpus: .*bad.jsonl:2 is not valid JSON"),
        (str(tmp_path / "empty.jsonl"), str(tmp_path / "v.json"), "--corpus: no text found"),
        (str(tmp_path / "a.txt"), str(tmp_path / "no" / "v.json"), "--output: no such directory"),
    ]
    for corpus, output, match in cases:
        assert main(["draft-vocab", "--model", str(MODEL), "--corpus", corpus, "--output", output]) == 2
        assert re.search("error: " + match, capsys.readouterr().err)
    assert not (tmp_path / "v.json").exists()
