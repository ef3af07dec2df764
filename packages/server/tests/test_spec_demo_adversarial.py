"""Speculative decoding on the shipped demo models, whose trained drafters really get accepted: stops,
budgets, logprobs and aborts landing inside accepted runs, with every drafter, compared with plain decoding.

The tiny random checkpoints of the other tests accept almost no model draft (forced drafters stand in for
acceptance there); here MTP, EAGLE-3 and DFlash runs of several accepted drafts are the common case, so the
verify commit, the drafter's own memory and the prefix cache meet them under every request feature that
cuts a round short. Each request is compared with the same request decoded without speculation, token for
token, with its text, finish and stop reasons and its logprob keys and ranks.
"""

from __future__ import annotations

from typing import Any

import pytest
from hyspec_server import LLM, EngineArgs, SamplingParams
from hyspec_server.builder import build_engine
from hyspec_server.default_model import demo_model_dir
from hyspec_server.outputs import RequestOutput
from hyspec_testing.spec import track_proposals

TARGET = "qwen3_5"
EOS = 3  # <|im_end|>, one of the demo's generation-config EOS ids
PROMPTS = [
    'import os\n\n\ndef read_lines(path):\n    """Return the lines of a text file."""',
    "class Stack:\n    def __init__(self):\n        self.items = []\n\n    def push(self, item):",
    "for i in range(10):",
    # shares its first 50 characters with the Stack prompt above (a prefix-cache hit)
    "class Stack:\n    def __init__(self):\n        self.items = []\n\n    def pop(self):",
]
NEW = 20
CASES: dict[str, dict[str, Any]] = {
    "mtp": {"method": "mtp", "num_speculative_tokens": 3},
    "mtp-tree": {"method": "mtp", "num_speculative_tokens": 3, "topk": 2, "num_draft_tokens": 6},
    "eagle3": {"method": "eagle3", "model": "qwen3_5-eagle3", "num_speculative_tokens": 3},
    "eagle3-tree": {
        "method": "eagle3",
        "model": "qwen3_5-eagle3",
        "num_speculative_tokens": 3,
        "topk": 2,
        "num_draft_tokens": 6,
    },
    "dflash": {"method": "dflash", "model": "qwen3_5-dflash", "num_speculative_tokens": 5},
    "ngram": {"method": "ngram", "num_speculative_tokens": 3},
}


def _spec(name: str) -> Any:  # a dict: EngineArgs validates it into a SpeculativeConfig
    spec = dict(CASES[name])
    if "model" in spec:
        spec["model"] = str(demo_model_dir(spec["model"]))
    return spec


def _greedy(max_tokens: int = NEW, **kw: Any) -> SamplingParams:
    return SamplingParams(max_tokens=max_tokens, temperature=0, **kw)


def _summary(out: RequestOutput) -> list[tuple[Any, ...]]:
    """Everything a request returns that speculation must not change (logprob values to 1e-3: the verify
    forward sums in another order than a decode)."""

    def lp(d: dict[int, Any] | None) -> list[tuple[int, int | None, float]] | None:
        return None if d is None else sorted((t, v.rank, round(v.logprob, 3)) for t, v in d.items())

    prompt_lps = None if out.prompt_logprobs is None else [lp(d) for d in out.prompt_logprobs]
    return [
        (
            c.index,
            c.token_ids,
            c.text,
            c.finish_reason,
            c.stop_reason,
            None if c.logprobs is None else [lp(d) for d in c.logprobs],
            prompt_lps,
        )
        for c in out.outputs
    ]


def _close(want: list[tuple[Any, ...]], got: list[tuple[Any, ...]]) -> bool:
    """Equal, logprob values within 2e-3 (rounding may split a value a hair's breadth from a boundary)."""

    def same(a: Any, b: Any) -> bool:
        if isinstance(a, float) and isinstance(b, float):
            return abs(a - b) <= 2e-3
        if isinstance(a, list | tuple) and isinstance(b, list | tuple):
            return len(a) == len(b) and all(same(x, y) for x, y in zip(a, b))
        return bool(a == b)

    return same(want, got)


@pytest.fixture(scope="module")
def plain() -> LLM:
    return LLM(model=str(demo_model_dir(TARGET)), max_num_seqs=4, enable_prefix_caching=False)


@pytest.fixture(scope="module")
def refs(plain: LLM) -> list[list[int]]:
    outs = plain.generate(PROMPTS, _greedy(ignore_eos=True), use_tqdm=False)
    return [o.outputs[0].token_ids for o in outs]


def _first_new(tokens: list[int], start: int) -> int:
    """The first index >= start whose token did not occur before it."""
    return next(j for j in range(start, len(tokens)) if tokens[j] not in tokens[:j])


def _stop_piece(plain: LLM, tokens: list[int], start: int) -> tuple[int, str]:
    """(j, the text token j completes) for the first j >= start whose text is new to the output so far."""
    tok = plain.get_tokenizer()
    for j in range(start, len(tokens)):
        before = tok.decode(tokens[:j])
        piece = tok.decode(tokens[: j + 1])[len(before) :].strip()
        if piece and piece not in before:
            return j, piece
    raise AssertionError("no stop piece in the reference")


def _mixed_params(plain: LLM, refs: list[list[int]]) -> tuple[list[str], list[SamplingParams]]:
    """Requests whose ends fall mid-run: a stop string, a stop token id (and the same held back by
    min_tokens), budgets of 1 to 3 tokens, logprobs and prompt logprobs, seeded samples (n = 2)."""
    j0, piece0 = _stop_piece(plain, refs[0], 5)
    _, piece3 = _stop_piece(plain, refs[3], 7)
    j1 = _first_new(refs[1], 4)
    prompts = [PROMPTS[i] for i in (0, 1, 2, 3, 1, 0, 2, 3)]
    params = [
        _greedy(stop=[piece0], ignore_eos=True),
        _greedy(stop_token_ids=[refs[1][j1]]),
        _greedy(2),
        _greedy(3, logprobs=2, prompt_logprobs=1),
        _greedy(stop_token_ids=[refs[1][j1]], min_tokens=j1 + 2),
        _greedy(1, ignore_eos=True),
        SamplingParams(max_tokens=10, temperature=0.8, top_p=0.95, seed=11, n=2),
        _greedy(stop=[piece3], include_stop_str_in_output=True, logprobs=0),
    ]
    assert j0 < NEW - 1
    return prompts, params


@pytest.mark.parametrize("case", list(CASES))
def test_real_drafters_equal_plain_with_stops_budgets_and_logprobs(
    case: str, plain: LLM, refs: list[list[int]]
) -> None:
    prompts, params = _mixed_params(plain, refs)
    want = [_summary(o) for o in plain.generate(prompts, params, use_tqdm=False)]
    # the stop string, the stop id and the min_tokens hold really cut the plain outputs short
    assert want[0][0][3] == "stop" and want[1][0][3] == "stop" and want[7][0][3] == "stop"
    assert len(want[4][0][1]) > len(want[1][0][1])
    # three seats for eight requests (later ones join running rounds); caching on, run twice: the second
    # run resumes the prompts, drafter memory included, from the first run's prefixes
    llm = LLM(
        model=str(demo_model_dir(TARGET)),
        max_num_seqs=3,
        page_size=4,
        enable_prefix_caching=True,
        prefix_cache_snapshot_interval=8,  # snapshots inside the prompts: the shared prefixes are found
        speculative_config=_spec(case),
    )
    for run in range(2):
        outs = llm.generate(prompts, params, use_tqdm=False)
        got = [_summary(o) for o in outs]
        for i, (w, g) in enumerate(zip(want, got, strict=True)):
            assert _close(w, g), (case, run, i, params[i], w, g)
        if run == 1:
            assert sum(o.num_cached_tokens for o in outs) > 0
    accepted = llm.engine.stats.spec_num_accepted_tokens
    assert accepted > 0 and accepted <= llm.engine.stats.spec_num_draft_tokens
    llm.engine.leak_check()


@pytest.mark.parametrize("case", ["ngram", "mtp"])
def test_a_natural_eos_inside_an_accepted_draft_run(case: str, plain: LLM) -> None:
    """The model emits EOS itself (no shim) while the drafts of its round run past it: the round ends at the
    EOS, which stays out of the text, and nothing after it is emitted."""
    tok = plain.get_tokenizer()
    line = tok("def f(x):\n    return x\n")["input_ids"]
    # the model has seen the line end in EOS twice: it ends the third copy the same way
    prompt = {"prompt_token_ids": [*line, EOS, *line, EOS, *line[:3]]}
    params = _greedy(16)
    (want,) = plain.generate(prompt, params, use_tqdm=False)
    w = want.outputs[0]
    assert w.token_ids[-1] == EOS and len(w.token_ids) < 16
    # the generation config's EOS (the tokenizer's own is <|endoftext|>): it names itself, as vLLM's
    assert (w.finish_reason, w.stop_reason) == ("stop", EOS)
    llm = LLM(model=str(demo_model_dir(TARGET)), speculative_config=_spec(case))
    blocks = track_proposals(llm.engine.runner.spec.drafter)  # type: ignore[attr-defined]
    (got,) = llm.generate(prompt, params, use_tqdm=False)
    assert _summary(got) == _summary(want)
    # some round drafted the EOS with a draft after it (columns: root, then the drafts)
    assert any(EOS in row[1:-1] for b in blocks for row in b.tolist()), [b.tolist() for b in blocks]
    st = got.spec_stats
    assert st is not None and 0 < st.num_accepted_tokens
    # every emitted token is a round's accepted draft or its bonus, or the prefill's token
    assert st.num_accepted_tokens + st.num_drafts + 1 <= len(w.token_ids)
    llm.engine.leak_check()


@pytest.mark.parametrize("case", ["mtp", "eagle3-tree", "dflash"])
def test_model_drafters_under_preemption_equal_plain(case: str, plain: LLM) -> None:
    """A KV pool holding one full request and a few pages more: requests are preempted mid-run and
    recomputed, drafter memory included; greedy, seeded and logprob outputs stay plain decoding's."""
    params = [_greedy(30, ignore_eos=True)] * 3 + [
        SamplingParams(max_tokens=30, temperature=0.8, seed=7, ignore_eos=True, logprobs=1)
    ] * 2
    prompts = [*PROMPTS, "def f(x):\n    return"]
    want = [_summary(o) for o in plain.generate(prompts[:5], params, use_tqdm=False)]
    args: dict[str, Any] = dict(
        model=str(demo_model_dir(TARGET)),
        max_num_seqs=5,
        max_model_len=64,
        page_size=4,
        speculative_config=_spec(case),
    )
    plan = build_engine(EngineArgs(**args)).runner.memory.pool.plan  # type: ignore[attr-defined]
    fixed = plan.total_bytes - plan.kv_bytes
    eng = build_engine(
        EngineArgs(**args, kv_cache_bytes=fixed + (plan.max_pages_per_request + 6) * plan.kv_bytes_per_page)
    )
    got = [_summary(o) for o in LLM.from_engine(eng).generate(prompts[:5], params, use_tqdm=False)]
    assert eng.scheduler.num_preemptions > 0
    for i, (w, g) in enumerate(zip(want, got, strict=True)):
        assert _close(w, g), (case, i, w, g)
    assert eng.stats.spec_num_accepted_tokens > 0
    eng.leak_check()


@pytest.mark.parametrize("case", ["mtp", "dflash"])
def test_an_abort_mid_run_spares_the_others_and_the_prefix_cache(
    case: str, plain: LLM, refs: list[list[int]]
) -> None:
    """A request aborted while it decodes (drafts in flight) frees its memory at once; the requests beside it,
    and a later request of the aborted one's prompt (resumed from the prefix cache), are plain decoding's."""
    eng = build_engine(
        EngineArgs(
            model=str(demo_model_dir(TARGET)),
            max_num_seqs=4,
            page_size=4,
            enable_prefix_caching=True,
            prefix_cache_snapshot_interval=8,
            speculative_config=_spec(case),
        )
    )
    params = _greedy(ignore_eos=True)
    ids = [eng.add_request(p, params) for p in PROMPTS]
    final: dict[str, RequestOutput] = {}
    victim = eng.requests[ids[1]]
    while len(victim.output_token_ids) < 2:  # through its prefill and into its rounds
        for o in eng.step():
            assert not o.finished
    live = eng.runner.memory.num_live()
    out = eng.abort(ids[1])
    assert out is not None and out.finished and out.outputs[0].finish_reason == "abort"
    assert 0 < len(out.outputs[0].token_ids) < NEW
    assert out.outputs[0].token_ids == refs[1][: len(out.outputs[0].token_ids)]
    assert eng.runner.memory.num_live() == live - 1
    again = eng.add_request(PROMPTS[1], params)
    while eng.has_unfinished():
        for o in eng.step():
            if o.finished:
                final[o.request_id] = o
    assert set(final) == {ids[0], ids[2], ids[3], again}
    for rid, i in ((ids[0], 0), (ids[2], 2), (ids[3], 3), (again, 1)):
        assert final[rid].outputs[0].token_ids == refs[i], (case, i)
    assert final[again].num_cached_tokens > 0
    eng.leak_check()
