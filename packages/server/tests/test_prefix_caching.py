"""Prefix caching through the engine, on the toy runner (its next token depends on every earlier token through
the paged KV and a conv-state hash, so a wrong page, slot or snapshot changes the output) and the HTTP server.

Each case checks the outputs against `toy_greedy` (what caching off computes), that the cache really served
tokens, and that nothing leaks afterwards.
"""

from __future__ import annotations

import random
from pathlib import Path
from typing import Any

import httpx
import pytest
from hyspec_runner.config import MIN_SNAPSHOT_SLOTS, EngineArgs
from hyspec_server import LLM, SamplingParams
from hyspec_server.cli import build_parser
from hyspec_server.engine import LLMEngine
from hyspec_server.metrics import EngineMetrics
from hyspec_server.serve import ServerThread
from hyspec_testing.server import metric_sample, toy_engine, toy_greedy

NEW = 8


def _params(n: int = NEW, **kw: object) -> SamplingParams:
    return SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True, **kw)  # type: ignore[arg-type]


def _engine(**kw: object) -> LLMEngine:
    args: dict[str, object] = dict(snapshots=8, snapshot_interval=8, page_size=4, budget=64, max_len=128)
    args.update(kw)
    return toy_engine(**args)  # type: ignore[arg-type]


def _check(llm: LLM, prompts: list[list[int]], n: int = NEW) -> list[int]:
    """Runs the prompts together; asserts exact outputs; returns each one's cached prompt tokens."""
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], _params(n))
    for p, o in zip(prompts, outs, strict=True):
        assert o.outputs[0].token_ids == toy_greedy(p, n, ignore_eos=True)
    return [o.num_cached_tokens for o in outs]


def _rand(rng: random.Random, n: int) -> list[int]:
    return [rng.randrange(32, 127) for _ in range(n)]


@pytest.mark.parametrize("system_len", [24, 26, 3])  # on a page boundary, inside a page, under a page
def test_shared_system_prompt_together_then_one_after_another(system_len: int) -> None:
    rng = random.Random(system_len)
    llm = LLM.from_engine(_engine())
    system = _rand(rng, system_len)
    prompts = [system + _rand(rng, k) for k in (1, 5, 13)]
    assert _check(llm, prompts) == [0, 0, 0]  # together: nothing was cached yet
    for p in prompts:
        # each one resumes at least after the snapshot at the last interval (8) of the system prompt
        (cached,) = _check(llm, [p])
        assert cached >= system_len - system_len % 8
    llm.leak_check()


def test_the_saves_of_one_step_reach_the_memory_together() -> None:
    """Prompts that end in one step, and requests that finish in one step, are saved in one call each (a
    drafter then catches up on all of them in one draft forward, not one per request)."""
    rng = random.Random(5)
    eng = _engine()
    memory: Any = eng.scheduler.memory
    inner = memory.save_prefixes
    calls: list[list[str]] = []

    def save_prefixes(saves: Any, **kw: Any) -> None:
        calls.append(sorted(str(s.req_id) for s in saves))
        inner(saves, **kw)

    memory.save_prefixes = save_prefixes
    prompts = [_rand(rng, 6) for _ in range(3)]
    _check(LLM.from_engine(eng), prompts)
    del memory.save_prefixes
    everyone = sorted({r for c in calls for r in c})
    # the prompts' ends, the interval position 8 (in decode), the finishes: each once for all three
    assert len(everyone) == 3 and calls == [everyone] * 3, calls
    eng.leak_check()


def test_prefill_saves_run_while_the_forward_is_queued(tiny_qwen3_5: Path) -> None:
    """On the real runner the snapshots of a step's prefill chunks are saved once its forward is queued and
    before its tokens are read (the host work overlaps the device's), and they hold the state that forward
    computed: a second request with the same prompt resumes from them with the same output."""
    from hyspec_server.builder import build_engine

    eng = build_engine(
        EngineArgs(
            model=str(tiny_qwen3_5),
            max_num_seqs=4,
            page_size=4,
            max_model_len=64,
            prefix_cache_snapshot_interval=8,
        )
    )
    order: list[str] = []
    runner: Any = eng.runner
    read, save = runner.plain.read, eng.scheduler.memory.save_prefixes

    def reading(queued: Any) -> Any:
        order.append("read")
        return read(queued)

    def saving(saves: Any, **kw: Any) -> None:
        order.append("save " + ",".join(str(len(s.token_ids)) for s in saves))
        save(saves, **kw)

    runner.plain.read = reading
    eng.scheduler.memory.save_prefixes = saving  # type: ignore[method-assign]
    llm = LLM.from_engine(eng)
    rng = random.Random(3)
    prompts = [_rand(rng, 10), _rand(rng, 10)]
    first = llm.generate([{"prompt_token_ids": p} for p in prompts], _params(3))
    # step 1: both prompts up to the interval (8), step 2: their last 2 tokens (sampling), step 3: a decode,
    # step 4: the last decode, then the finishes' saves
    assert order[:5] == ["save 8,8", "read", "save 10,10", "read", "read"], order
    # prompts that extend them resume from their prompt-end snapshots, with the output of caching off
    longer = [{"prompt_token_ids": [*p, 33, 34, 35]} for p in prompts]
    again = llm.generate(longer, _params(3))
    assert [o.num_cached_tokens for o in again] == [10, 10]
    off = LLM.from_engine(
        build_engine(
            EngineArgs(model=str(tiny_qwen3_5), max_num_seqs=4, page_size=4, enable_prefix_caching=False)
        )
    )
    assert [o.outputs[0].token_ids for o in again] == [
        o.outputs[0].token_ids for o in off.generate(longer, _params(3))
    ]
    assert first[0].outputs[0].token_ids  # (the first run's tokens were read)
    llm.leak_check()


def test_a_step_that_fails_after_its_saves_leaves_nothing_cached() -> None:
    """The snapshots of a step are saved while its forward runs; when the step then fails, the engine
    cannot tell what the failure half-wrote: the cache is reset, and the requests, retried alone, still
    give caching-off outputs."""
    eng = _engine()
    runner: Any = eng.runner
    inner = runner.execute
    failed = [False]

    def failing(step: Any, *, while_queued: Any = None) -> Any:
        if not failed[0] and len(step.chunks) > 1 and while_queued is not None:
            failed[0] = True
            inner(step, while_queued=while_queued)  # saves, then the step "fails"
            raise RuntimeError("injected after the saves")
        return inner(step, while_queued=while_queued)

    runner.execute = failing
    memory = runner.memory
    reset = memory.reset_prefix_cache
    resets: list[int] = []

    def counting(**kw: Any) -> bool:
        resets.append(memory.prefix_cache_stats().num_snapshots)
        return bool(reset(**kw))

    memory.reset_prefix_cache = counting
    rng = random.Random(9)
    prompts = [_rand(rng, 12), _rand(rng, 12)]
    assert _check(LLM.from_engine(eng), prompts) == [0, 0]
    # once, right after the failed step, which had saved both requests' interval snapshots
    assert failed[0] and resets == [2]
    eng.leak_check()


@pytest.mark.parametrize("prompt_len", [21, 5, 30])
def test_a_prompt_end_off_the_interval_leaves_a_snapshot(prompt_len: int) -> None:
    """The end of every prompt is saved, not only interval multiples: a later prompt that extends it resumes
    there (RAG / agent calls that append to one long context)."""
    rng = random.Random(prompt_len)
    llm = LLM.from_engine(_engine())
    prompt = _rand(rng, prompt_len)
    assert _check(llm, [prompt]) == [0]
    (cached,) = _check(llm, [prompt + _rand(rng, 3)])
    assert cached == prompt_len
    llm.leak_check()


def test_multi_turn_chat_resumes_after_the_previous_turns_output() -> None:
    rng = random.Random(1)
    eng = _engine()
    llm = LLM.from_engine(eng)
    history = _rand(rng, 30)
    computed = []
    for turn in range(5):
        before = eng.runner.num_tokens_computed  # type: ignore[attr-defined]
        (out,) = llm.generate([{"prompt_token_ids": history}], _params())
        assert out.outputs[0].token_ids == toy_greedy(history, NEW, ignore_eos=True)
        computed.append(eng.runner.num_tokens_computed - before)  # type: ignore[attr-defined]
        if turn:
            # the previous turn's prompt and output come from the cache
            assert out.num_cached_tokens == len(history) - 4, (turn, out.num_cached_tokens)
        history = history + out.outputs[0].token_ids + _rand(rng, 3)
    assert max(computed[1:]) <= 3 + NEW + 1  # the new user turn, the last output token, the output
    llm.leak_check()


def test_prefixes_on_and_inside_page_boundaries_and_salts() -> None:
    rng = random.Random(2)
    llm = LLM.from_engine(_engine(snapshot_interval=4, snapshots=64))
    base = _rand(rng, 40)
    _check(llm, [base])
    for cut in (4, 8, 9, 15, 16, 33, 39):
        p = base[:cut] + _rand(rng, 3)
        (cached,) = _check(llm, [p])
        assert cached == cut - cut % 4 or cached == cut, (cut, cached)
    eng = llm.engine
    rid = eng.add_request([*base, 1], _params(), cache_salt="other tenant")
    while eng.has_unfinished():
        eng.step()
    assert rid not in eng.requests
    stats = eng.prefix_cache_stats()
    assert stats is not None and stats.num_hits > 0
    llm.leak_check()


def test_eviction_under_tiny_budgets_and_preemption_keep_outputs_exact() -> None:
    rng = random.Random(3)
    # 2 snapshot slots, 40 pages of 4 tokens for 4 requests of up to 60 tokens: evictions and preemptions
    eng = _engine(snapshots=2, pages=40, seqs=4, max_len=60)
    llm = LLM.from_engine(eng)
    system = _rand(rng, 20)
    for _ in range(6):
        prompts = [system + _rand(rng, rng.randrange(1, 20)) for _ in range(4)]
        _check(llm, prompts, n=12)
    assert eng.scheduler.num_preemptions > 0
    stats = eng.prefix_cache_stats()
    assert stats is not None and stats.num_hits > 0
    llm.leak_check()


def test_abort_during_a_prefill_that_would_save_snapshots() -> None:
    rng = random.Random(4)
    eng = _engine(budget=8)  # a 40-token prompt takes 5 steps
    prompt = _rand(rng, 40)
    rid = eng.add_request(prompt, _params())
    eng.step()
    eng.step()
    eng.abort(rid)
    eng.leak_check()
    # whatever was cached before the abort is the prompt's true prefix
    llm = LLM.from_engine(eng)
    (cached,) = _check(llm, [prompt])
    assert cached == 16
    llm.leak_check()


def test_a_hit_while_another_request_still_prefills_the_same_prefix() -> None:
    rng = random.Random(5)
    eng = _engine(budget=16)
    prefix = _rand(rng, 48)
    first = eng.add_request([*prefix, 40], _params())
    for _ in range(4):
        eng.step()  # 32 tokens in (chunks end at every interval of 8), snapshots at 8 .. 32 saved
    second = eng.add_request([*prefix, 41, 42], _params())
    outs = {}
    while eng.has_unfinished():
        for o in eng.step():
            if o.finished:
                outs[o.request_id] = o
    assert outs[first].outputs[0].token_ids == toy_greedy([*prefix, 40], NEW, ignore_eos=True)
    assert outs[second].outputs[0].token_ids == toy_greedy([*prefix, 41, 42], NEW, ignore_eos=True)
    assert outs[second].num_cached_tokens >= 32
    eng.leak_check()


def test_seeded_sampling_is_identical_with_caching_on_and_off() -> None:
    rng = random.Random(6)
    prompts = [_rand(rng, 21) for _ in range(3)]
    params = SamplingParams(max_tokens=10, temperature=1.0, seed=7, ignore_eos=True)

    def run(snapshots: int) -> list[list[int]]:
        llm = LLM.from_engine(_engine(snapshots=snapshots, snapshot_interval=8 if snapshots else 0))
        out = []
        for _ in range(2):  # the second round hits
            for o in llm.generate([{"prompt_token_ids": p} for p in prompts], params):
                out.append(o.outputs[0].token_ids)
        llm.leak_check()
        return out

    assert run(4) == run(0)


def test_reset_prefix_cache_and_metrics() -> None:
    eng = _engine()
    llm = LLM.from_engine(eng)
    _check(llm, [list(range(40, 80))])
    (cached,) = _check(llm, [list(range(40, 80))])
    assert cached == 32  # the last snapshot short of the prompt's last token
    metrics = EngineMetrics("toy")
    metrics.observe(eng)
    text = metrics.render().decode()
    assert metric_sample(text, "hyspec:prefix_cache_queries_total") == 80
    assert metric_sample(text, "hyspec:prefix_cache_hits_total") == 32
    assert llm.reset_prefix_cache()
    (cached,) = _check(llm, [list(range(40, 80))])
    assert cached == 0
    llm.leak_check()
    assert not LLM.from_engine(toy_engine()).reset_prefix_cache()  # caching off


def test_http_usage_reports_cached_tokens_and_the_admin_route_needs_the_key() -> None:
    srv = ServerThread(_engine(), model_name="toy", api_key="k").start()
    try:
        auth = {"Authorization": "Bearer k"}
        body = {"model": "toy", "prompt": "x" * 50, "max_tokens": 4, "temperature": 0}
        with httpx.Client(base_url=srv.base_url, timeout=30) as c:
            first = c.post("/v1/completions", json=body, headers=auth).json()
            second = c.post("/v1/completions", json=body, headers=auth).json()
            assert first["usage"]["prompt_tokens_details"] == {"cached_tokens": 0}
            assert second["usage"]["prompt_tokens_details"]["cached_tokens"] == 48  # snapshot interval 8
            assert second["choices"][0]["text"] == first["choices"][0]["text"]
            salted = c.post("/v1/completions", json={**body, "cache_salt": "t2"}, headers=auth).json()
            assert salted["usage"]["prompt_tokens_details"]["cached_tokens"] == 0
            bad = c.post("/v1/completions", json={**body, "cache_salt": ""}, headers=auth)
            assert bad.status_code == 400
            assert c.post("/reset_prefix_cache").status_code == 401
            r = c.post("/reset_prefix_cache", headers=auth)
            assert r.status_code == 200 and r.json() == {"reset": True}
            third = c.post("/v1/completions", json=body, headers=auth).json()
            assert third["usage"]["prompt_tokens_details"]["cached_tokens"] == 0
            chat = {"model": "toy", "messages": [{"role": "user", "content": "y" * 40}], "max_tokens": 3}
            c.post("/v1/chat/completions", json=chat, headers=auth)
            again = c.post("/v1/chat/completions", json=chat, headers=auth).json()
            assert again["usage"]["prompt_tokens_details"]["cached_tokens"] > 0
            hits = metric_sample(c.get("/metrics", headers=auth).text, "hyspec:prefix_cache_hits_total")
            assert hits == 48 + again["usage"]["prompt_tokens_details"]["cached_tokens"]
    finally:
        srv.stop()


def test_a_single_sequence_engine_keeps_a_prompt_end_and_its_finish(tiny_qwen3_5: Path) -> None:
    """max_num_seqs=1 still gets snapshot slots for a prompt's interval, its end and its finish (at least
    `MIN_SNAPSHOT_SLOTS`): the same long prompt re-sent with another question resumes at its end, and the
    next chat turn after its output."""
    llm = LLM(model=str(tiny_qwen3_5), max_num_seqs=1, page_size=4, prefix_cache_snapshot_interval=64)
    cache = llm.engine.runner.memory.prefix_cache  # type: ignore[attr-defined]
    assert cache.num_snapshot_slots == MIN_SNAPSHOT_SLOTS
    rng = random.Random(7)
    prompt = _rand(rng, 150)
    params = SamplingParams(max_tokens=6, temperature=0, ignore_eos=True)
    llm.generate([{"prompt_token_ids": prompt}], params)
    question = [*prompt, 40, 41]
    (again,) = llm.generate([{"prompt_token_ids": question}], params)
    assert again.num_cached_tokens == len(prompt)
    turn = [*question, *again.outputs[0].token_ids, 50]
    (chat,) = llm.generate([{"prompt_token_ids": turn}], params)
    assert chat.num_cached_tokens == len(question) + 5  # all but the last output token, recomputed
    llm.engine.leak_check()


def test_flags_and_arguments() -> None:
    p = build_parser()
    assert p.parse_args(["generate"]).enable_prefix_caching is True
    assert p.parse_args(["generate", "--no-enable-prefix-caching"]).enable_prefix_caching is False
    assert p.parse_args(["serve", "--enable-prefix-caching"]).enable_prefix_caching is True
    for bad in (
        {"prefix_cache_snapshot_interval": 12},  # not a multiple of the page size
        {"prefix_cache_snapshot_interval": 0},
        {"prefix_cache_snapshot_fraction": 0.0},
        {"enable_prefix_caching": "yes"},
    ):
        with pytest.raises(ValueError, match=next(iter(bad))):
            EngineArgs(model="x", **bad)  # type: ignore[arg-type]
    # left out, the interval is the first multiple of the page size and of the GDN chunk (64) from 512 up:
    # any page size works with its default
    for page, every in ((16, 512), (5, 640), (48, 576), (1000, 8000)):
        assert EngineArgs(model="x", page_size=page).prefix_cache_snapshot_interval == every
    llm = LLM.from_engine(_engine())
    with pytest.raises(ValueError, match="cache_salt"):
        llm.generate([{"prompt_token_ids": [1, 2], "cache_salt": 5}], _params())
    llm.leak_check()
