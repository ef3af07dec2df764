"""`hyspec draft-vocab`: the most frequent tokens of a corpus, written as a draft vocabulary file that
`speculative_config.draft_vocab` reads; bad arguments are an error naming the flag."""

from __future__ import annotations

import json
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
