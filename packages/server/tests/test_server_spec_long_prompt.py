"""Every drafter at `max_num_seqs=1` (the batch-1 latency setup) and batched, with a prompt longer than every
internal buffer (the drafters' batch buffers hold 256 tokens per request; the step budget is 512), greedy
output identical to plain decoding. Both once crashed: multi_layer_mtp's default path on a single request
(an in-place write that overlapped itself) and the draft extends of MTP / EAGLE-3 / DFlash over a prompt
longer than their buffers."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
from hyspec_server import LLM, SamplingParams
from hyspec_testing.spec import DRAFTER_CASES, DrafterCase, build_case_checkpoints

LONG = [(i * 37 + 11) % 280 + 5 for i in range(700)]
SHORT = [7, 8, 9, 10]
NEW = 12

CASES: tuple[DrafterCase, ...] = (
    *DRAFTER_CASES,
    DrafterCase("mtp-adaptive", "qwen3_5", {"method": "mtp", "num_speculative_tokens": 3, "adaptive": True}),
    DrafterCase("ngram", "lfm2", {"method": "ngram", "num_speculative_tokens": 3}),
)


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    return build_case_checkpoints(tmp_path_factory.mktemp("long"), CASES)


def _run(path: Path, spec: dict[str, Any] | None, max_num_seqs: int) -> list[list[int]]:
    llm = LLM(model=str(path), max_num_seqs=max_num_seqs, speculative_config=spec)
    params = SamplingParams(max_tokens=NEW, temperature=0, ignore_eos=True)
    outs = llm.generate([{"prompt_token_ids": LONG}, {"prompt_token_ids": SHORT}], params)
    llm.engine.leak_check()
    return [o.outputs[0].token_ids for o in outs]


@pytest.mark.parametrize("case", CASES, ids=[c.name for c in CASES])
def test_batch_one_and_batched_with_a_prompt_longer_than_every_buffer(
    case: DrafterCase, checkpoints: dict[str, Path]
) -> None:
    target = checkpoints[case.arch]
    draft = None if case.draft is None else str(checkpoints[f"{case.draft}@{case.arch}"])
    spec = case.speculative_config(draft)
    plain = _run(target, None, 1)
    for max_num_seqs in (1, 2):
        assert _run(target, spec, max_num_seqs) == plain, (case.name, max_num_seqs)
