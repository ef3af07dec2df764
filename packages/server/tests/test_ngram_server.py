"""The n-gram drafter in the engine: its per-request indexes (kept between rounds) give plain greedy output
under preemption (a preempted request is freed and recomputed: its index is dropped and rebuilt), and every
index is dropped when its request ends, finished or aborted (the engine's leak check covers them)."""

from __future__ import annotations

from pathlib import Path

import pytest
from hyspec_server import LLM, SamplingParams
from hyspec_spec_workers import NgramDrafter
from hyspec_testing.tiny import build_tiny_checkpoint

PAGE = 16
# repetitive prompts, so n-gram lookups hit
PROMPTS = [[(i * 7 + r) % 9 + 5 for i in range(40 + 9 * r)] for r in range(4)]


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_tiny_checkpoint(tmp_path_factory.mktemp("ngram") / "lfm2", "lfm2")


def _llm(path: Path, spec: dict[str, object] | None, kv_cache_bytes: int | None = None) -> LLM:
    return LLM(
        model=str(path),
        max_num_seqs=4,
        speculative_config=spec,
        page_size=PAGE,
        max_model_len=160,
        enable_prefix_caching=False,
        kv_cache_bytes=kv_cache_bytes,
    )


def test_ngram_indexes_under_preemption_equal_plain_and_are_freed(checkpoint: Path) -> None:
    params = SamplingParams(max_tokens=40, temperature=0, ignore_eos=True)
    prompts = [{"prompt_token_ids": p} for p in PROMPTS]
    plain = [o.outputs[0].token_ids for o in _llm(checkpoint, None).generate(prompts, params)]
    spec = {"method": "ngram", "num_speculative_tokens": 3}
    plan = _llm(checkpoint, spec).engine.runner.memory.pool.plan  # type: ignore[attr-defined]
    # KV for one full request and two pages more: the four requests preempt one another
    budget = int(plan.total_bytes - plan.kv_bytes + (plan.max_pages_per_request + 2) * plan.kv_bytes_per_page)
    llm = _llm(checkpoint, spec, budget)
    got = [o.outputs[0].token_ids for o in llm.generate(prompts, params)]
    engine = llm.engine
    assert engine.scheduler.num_preemptions > 0
    assert engine.stats.spec_num_accepted_tokens > 0  # the lookups hit
    assert got == plain
    drafter = engine.runner.spec.drafter  # type: ignore[union-attr]
    assert isinstance(drafter, NgramDrafter) and not drafter.followed
    engine.leak_check()
    # an aborted request's index goes too
    engine.add_request(PROMPTS[0], params, request_id="gone")
    for _ in range(3):
        engine.step()
    assert "gone" in {str(r) for r in drafter.followed}
    engine.abort("gone")
    assert not drafter.followed
    engine.leak_check()


def test_request_tokens_view_of_a_server_request_across_prompt_and_output(checkpoint: Path) -> None:
    from hyspec_server.request import Request
    from hyspec_server.tokenizer import HFTokenizer
    from hyspec_spec_workers.round_types import RequestTokens

    req = Request.create(
        request_id="r",
        prompt=None,
        prompt_token_ids=[5, 6, 7],
        params=SamplingParams(max_tokens=8, ignore_eos=True),
        tokenizer=HFTokenizer(checkpoint),
        arrival_time=0.0,
    )
    for t in (8, 9, 10):
        req.append_token(t, max_model_len=100, now=0.0)
    every = [5, 6, 7, 8, 9, 10]
    view = RequestTokens(req, 5)  # the round's history: the last token not yet in it
    assert len(view) == 5 and list(view) == every[:5] and view.tolist() == every[:5]
    for a in range(-6, 7):
        for b in range(-6, 7):
            assert view[a:b] == every[:5][a:b], (a, b)
    assert [view[i] for i in range(-5, 5)] == [every[:5][i] for i in range(-5, 5)]
