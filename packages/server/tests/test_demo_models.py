"""The shipped demo models (`hyspec_server/demo_models`): loading, transformers parity, lossless speculation
with every trained drafter (chains and trees, batched), real acceptance and the demo command (the shipped
tokenizer on the validation split: test_demo_corpus.py)."""

from __future__ import annotations

import json
from typing import Any

import pytest
from hyspec_runner.config import DEFAULT_SPECULATIVE_CONFIG
from hyspec_server import LLM, SamplingParams
from hyspec_server.cli import main
from hyspec_server.default_model import (
    DEMO_MODELS,
    default_model_dir,
    demo_model_dir,
)
from hyspec_testing.hf_reference import hf_greedy

PROMPTS = [
    'import os\n\n\ndef read_lines(path):\n    """Return the lines of a text file."""',
    "class Stack:\n    def __init__(self):\n        self.items = []\n\n    def push(self, item):",
    "for i in range(10):",
]
NEW = 32
TARGETS = ("qwen3_5", "lfm2")


# (target, label, speculative_config, least mean tokens per verify round, greedy, over PROMPTS)
CASES: list[tuple[str, str, dict[str, Any], float]] = [
    ("qwen3_5", "mtp", {"method": "mtp", "num_speculative_tokens": 3}, 2.0),
    (
        "qwen3_5",
        "mtp-tree",
        {"method": "mtp", "num_speculative_tokens": 3, "topk": 2, "num_draft_tokens": 6},
        2.0,
    ),
    ("qwen3_5", "mtp-adaptive", {"method": "mtp", "num_speculative_tokens": 3, "adaptive": True}, 1.0),
    ("qwen3_5", "eagle3", {"method": "eagle3", "model": "qwen3_5-eagle3", "num_speculative_tokens": 3}, 1.6),
    (
        "qwen3_5",
        "eagle3-tree",
        {
            "method": "eagle3",
            "model": "qwen3_5-eagle3",
            "num_speculative_tokens": 3,
            "topk": 2,
            "num_draft_tokens": 6,
        },
        1.6,
    ),
    ("qwen3_5", "dflash", {"method": "dflash", "model": "qwen3_5-dflash", "num_speculative_tokens": 5}, 1.6),
    ("qwen3_5", "ngram", {"method": "ngram", "num_speculative_tokens": 3}, 1.0),
    ("lfm2", "eagle3", {"method": "eagle3", "model": "lfm2-eagle3", "num_speculative_tokens": 3}, 1.6),
    (
        "lfm2",
        "eagle3-tree",
        {
            "method": "eagle3",
            "model": "lfm2-eagle3",
            "num_speculative_tokens": 2,
            "topk": 3,
            "num_draft_tokens": 5,
        },
        1.6,
    ),
]


def test_shipped_files_fit_the_size_budget() -> None:
    files = [p for p in DEMO_MODELS.rglob("*") if p.is_file()]
    names = {p.relative_to(DEMO_MODELS).as_posix() for p in files}
    for target in TARGETS:
        for f in ("config.json", "generation_config.json", "model.safetensors", "tokenizer.json"):
            assert f"{target}/{f}" in names
    for draft in ("qwen3_5-eagle3", "qwen3_5-dflash", "lfm2-eagle3"):
        assert {f"{draft}/config.json", f"{draft}/model.safetensors"} <= names
    assert max(p.stat().st_size for p in files) < 16 * 10**6
    assert sum(p.stat().st_size for p in files) <= 32 * 10**6


@pytest.fixture(scope="module")
def greedy_plain() -> dict[str, list[list[int]]]:
    out: dict[str, list[list[int]]] = {}
    for target in TARGETS:
        llm = LLM(model=str(demo_model_dir(target)), max_num_seqs=4)
        res = llm.generate(PROMPTS, SamplingParams(max_tokens=NEW, temperature=0, ignore_eos=True))
        out[target] = [r.outputs[0].token_ids for r in res]
    return out


@pytest.mark.parametrize("target", TARGETS)
def test_transformers_greedy_equals_hyspec(target: str, greedy_plain: dict[str, list[list[int]]]) -> None:
    import transformers

    path = demo_model_dir(target)
    tok = transformers.AutoTokenizer.from_pretrained(path)
    model = transformers.AutoModelForCausalLM.from_pretrained(path, dtype="float32").eval()
    for prompt, ours in zip(PROMPTS, greedy_plain[target], strict=True):
        assert hf_greedy(model, tok(prompt)["input_ids"], NEW) == ours


@pytest.mark.parametrize(("target", "label", "spec", "least"), CASES, ids=[f"{c[0]}-{c[1]}" for c in CASES])
def test_speculation_is_lossless_and_accepts(
    target: str, label: str, spec: dict[str, Any], least: float, greedy_plain: dict[str, list[list[int]]]
) -> None:
    spec = dict(spec)
    if "model" in spec:
        spec["model"] = str(demo_model_dir(spec["model"]))
    for max_num_seqs in (1, 4):
        llm = LLM(model=str(demo_model_dir(target)), max_num_seqs=max_num_seqs, speculative_config=spec)
        res = llm.generate(PROMPTS, SamplingParams(max_tokens=NEW, temperature=0, ignore_eos=True))
        assert [r.outputs[0].token_ids for r in res] == greedy_plain[target], (label, max_num_seqs)
        drafts = sum(r.spec_stats.num_drafts for r in res if r.spec_stats is not None)
        accepted = sum(r.spec_stats.num_accepted_tokens for r in res if r.spec_stats is not None)
        # trained drafters agree with their target: the bound fails for untrained (random) drafters, which
        # accept almost nothing (mean tokens per round ~1.0)
        if drafts:
            assert 1 + accepted / drafts >= least, (label, max_num_seqs, accepted, drafts)
        else:
            assert least <= 1.0, label


def test_default_llm_is_the_demo_model_with_mtp() -> None:
    llm = LLM()
    res = llm.generate(PROMPTS[:1], SamplingParams(max_tokens=16, temperature=0, ignore_eos=True))[0]
    plain = LLM(model=str(default_model_dir()))
    ref = plain.generate(PROMPTS[:1], SamplingParams(max_tokens=16, temperature=0, ignore_eos=True))[0]
    assert res.outputs[0].token_ids == ref.outputs[0].token_ids
    assert res.spec_stats is not None and res.spec_stats.num_drafts > 0
    assert ref.spec_stats is None or ref.spec_stats.num_drafts == 0
    assert dict(DEFAULT_SPECULATIVE_CONFIG)["method"] == "mtp"


def test_demo_command_writes_code_and_reports_acceptance(capsys: pytest.CaptureFixture[str]) -> None:
    prompt = PROMPTS[0]
    args = ["generate", "--prompt", prompt, "--max-tokens", "48", "--temperature", "0.7", "--top-p", "0.95"]
    assert main([*args, "--repetition-penalty", "1.1"]) == 0
    captured = capsys.readouterr()
    assert captured.out.startswith(prompt) and len(captured.out.strip()) > len(prompt) + 20
    assert "drafts accepted" in captured.err and "tokens per round" in captured.err
    assert main([*args, "--json"]) == 0
    doc = json.loads(capsys.readouterr().out)
    assert doc["text"].strip() and doc["spec_stats"]["num_drafts"] > 0
