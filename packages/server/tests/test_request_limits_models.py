"""Request limits of vLLM's API on real tiny checkpoints, with and without speculation.

Generation up to the context's end: `SamplingParams(max_tokens=None)` runs a request until it fills
`max_model_len`; `LLM.generate` lets a request whose max_tokens runs past the context stop at its end.
Both end with finish_reason "length" and exactly the tokens of a request that asks for that room (the
round's budget and the decode queued ahead stop at the context end too); a prompt that fills the context
is a ValueError naming it, and the engine's own `add_request` (the HTTP server's path) still refuses a
max_tokens past the context.

`allowed_token_ids`: every generated token is one of the list, greedy and sampled, and greedy speculation
emits exactly plain decoding's tokens under the list (every verify node is limited as a plain step is).
`bad_words`: no banned token sequence is ever completed, and a batch mixing a row with bad words (which
verifies no drafts) and rows without emits plain decoding's tokens.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
from hyspec_server import LLM, SamplingParams
from hyspec_testing.spec import DRAFTER_CASES, DrafterCase, build_case_checkpoints

MAX_LEN = 40
PROMPTS = [[(i * 7 + 3) % 200 + 5 for i in range(n)] for n in (5, 17, 38, 39)]  # the last leaves one token
CASES: tuple[DrafterCase, ...] = (
    DrafterCase("plain-qwen3_5", "qwen3_5", {}),
    DrafterCase("plain-lfm2", "lfm2", {}),
    *(c for c in DRAFTER_CASES if c.name in ("mtp", "mtp-tree")),
    DrafterCase("ngram", "lfm2", {"method": "ngram", "num_speculative_tokens": 3}),
)


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    return build_case_checkpoints(tmp_path_factory.mktemp("context-end"), CASES)


def _llm(path: Path, spec: dict[str, Any] | None, max_model_len: int) -> LLM:
    # two seats for three or four prompts: the later ones wait for the first ones' seats
    return LLM(
        model=str(path),
        max_model_len=max_model_len,
        max_num_seqs=2,
        page_size=8,
        speculative_config=spec or None,
    )


def test_max_tokens_none_is_valid_and_bad_values_name_it() -> None:
    assert SamplingParams(max_tokens=None, min_tokens=5000).max_tokens is None
    for bad in (0, -1, 1.5, True, "8"):
        with pytest.raises(ValueError, match=r"max_tokens must be None or an int >= 1"):
            SamplingParams(max_tokens=bad)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match=r"min_tokens must be an int in \[0, max_tokens=4\]"):
        SamplingParams(max_tokens=4, min_tokens=5)


@pytest.mark.parametrize("case", CASES, ids=[c.name for c in CASES])
def test_requests_stop_at_the_context_end(case: DrafterCase, checkpoints: dict[str, Path]) -> None:
    spec = case.speculative_config()
    llm = _llm(checkpoints[case.arch], spec, MAX_LEN)
    greedy = {"temperature": 0.0, "ignore_eos": True}
    prompts = [{"prompt_token_ids": p} for p in PROMPTS]
    exact = llm.generate(prompts, [SamplingParams(max_tokens=MAX_LEN - len(p), **greedy) for p in PROMPTS])
    want = [o.outputs[0].token_ids for o in exact]
    assert [len(t) for t in want] == [MAX_LEN - len(p) for p in PROMPTS]
    for params in (
        SamplingParams(max_tokens=None, **greedy),
        SamplingParams(max_tokens=1000, **greedy),
        SamplingParams(max_tokens=None, min_tokens=1000, **greedy),  # min_tokens past the room: the end wins
    ):
        outs = llm.generate(prompts, params)
        assert [o.outputs[0].token_ids for o in outs] == want, (case.name, params)
        assert all(o.outputs[0].finish_reason == "length" for o in outs)
    # n > 1 requests of one prompt each run to the end too
    (two,) = llm.generate([prompts[1]], SamplingParams(max_tokens=None, n=2, **greedy))
    assert [c.token_ids for c in two.outputs] == [want[1], want[1]]
    with pytest.raises(ValueError, match=r"prompts\[1\]: prompt \(40 tokens\) leaves no room to generate"):
        llm.generate([prompts[0], {"prompt_token_ids": [5] * MAX_LEN}], SamplingParams(max_tokens=None))
    # the engine's default (the HTTP server's path) refuses what the offline API caps
    with pytest.raises(ValueError, match=r"prompt \(17 tokens\) plus max_tokens \(24\) is over"):
        llm.engine.add_request(prompts[1], SamplingParams(max_tokens=MAX_LEN - 17 + 1))
    llm.engine.leak_check()


@pytest.mark.parametrize("case", CASES, ids=[c.name for c in CASES])
def test_allowed_token_ids_hold_with_speculation(case: DrafterCase, checkpoints: dict[str, Path]) -> None:
    llm = _llm(checkpoints[case.arch], None, 64)
    greedy = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)
    prompts = [{"prompt_token_ids": p} for p in PROMPTS[:3]]
    free = [o.outputs[0].token_ids for o in llm.generate(prompts, greedy)]
    # the plain run's own tokens of the first prompt (so drafts from its history can be right) and others
    allowed = sorted(set(free[0][:4]) | {3, 10, 11, 12, 40, 41})
    limited = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True, allowed_token_ids=allowed)
    want = [o.outputs[0].token_ids for o in llm.generate(prompts, limited)]
    assert want != free and all(set(t) <= set(allowed) for t in want)
    spec = case.speculative_config()
    if spec:
        llm = _llm(checkpoints[case.arch], spec, 64)
        got = [o.outputs[0].token_ids for o in llm.generate(prompts, limited)]
        assert got == want, case.name
    sampled = SamplingParams(
        max_tokens=12, temperature=1.0, seed=3, ignore_eos=True, allowed_token_ids=allowed
    )
    assert all(set(o.outputs[0].token_ids) <= set(allowed) for o in llm.generate(prompts, sampled))
    llm.engine.leak_check()


@pytest.mark.parametrize("case", CASES, ids=[c.name for c in CASES])
def test_bad_words_hold_with_speculation(case: DrafterCase, checkpoints: dict[str, Path]) -> None:
    from hyspec_server.request import bad_words_token_ids

    llm = _llm(checkpoints[case.arch], None, 64)
    prompts = [{"prompt_token_ids": p} for p in PROMPTS[:3]]
    greedy = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)
    free = [o.outputs[0].token_ids for o in llm.generate(prompts, greedy)]
    tok = llm.get_tokenizer()
    word = tok.decode(free[0][3:5])  # what the first prompt writes unbanned
    seqs = bad_words_token_ids([word], tok)
    banned = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True, bad_words=[word])
    params = [banned, greedy, greedy]  # one row with bad words among rows without
    want = [o.outputs[0].token_ids for o in llm.generate(prompts, params)]
    assert want[1:] == free[1:]
    for seq in seqs:
        k = len(seq)
        assert all(tuple(want[0][i : i + k]) != seq for i in range(len(want[0]))), (word, seq, want[0])
    spec = case.speculative_config()
    if spec:
        llm = _llm(checkpoints[case.arch], spec, 64)
        assert [o.outputs[0].token_ids for o in llm.generate(prompts, params)] == want, case.name
    llm.engine.leak_check()
