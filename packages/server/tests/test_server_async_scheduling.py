"""Async scheduling: a plain decode step's next decode queued before its tokens are read (`run_ahead`).

The queued decode feeds the sampled tokens on the device and advances every row's KV and recurrent state by
one token before the host knows whether a request ended, so each test compares against the same engine with
`async_scheduling=False` and counts the decodes that ran ahead (a feature that never runs would pass the
comparisons). On the CPU the runner leaves the decode batch built ahead off, as on a GPU it is on; these
tests turn it on. The GPU test runs the same through CUDA graphs in bf16.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
from hyspec_runner.plain_forward import PlainForwards
from hyspec_server import LLM, EngineArgs, LLMEngine, SamplingParams
from hyspec_server.builder import build_engine
from hyspec_server.outputs import RequestOutput

PROMPTS: list[list[int]] = [[5, 9, 17, 33, 2, 7, 5, 9, 11], [40, 41], [7, 7, 7, 8, 7], [1], [20, 30, 40, 20]]
BUDGETS = [21, 9, 30, 14, 25]


def _engine(path: Path, *, run_ahead: bool, **kw: Any) -> LLMEngine:
    args: dict[str, Any] = dict(model=str(path), max_num_seqs=8, page_size=4, max_model_len=64)
    args.update(kw)
    eng = build_engine(EngineArgs(async_scheduling=run_ahead, **args))
    eng.runner.ahead.enabled = True  # type: ignore[attr-defined]
    return eng


def _plain(eng: LLMEngine) -> PlainForwards:
    plain = eng.runner.plain  # type: ignore[attr-defined]
    assert isinstance(plain, PlainForwards)
    return plain


def _generate(eng: LLMEngine, params: list[SamplingParams], prompts: list[list[int]] = PROMPTS) -> Any:
    return LLM.from_engine(eng).generate([{"prompt_token_ids": p} for p in prompts], params)


def _greedy(budgets: list[int] = BUDGETS, **kw: Any) -> list[SamplingParams]:
    return [SamplingParams(max_tokens=m, temperature=0, ignore_eos=True, **kw) for m in budgets]


@pytest.mark.parametrize("arch", ["lfm2", "qwen3_5"])
def test_decodes_run_ahead_and_outputs_equal_synchronous_steps(
    arch: str, request: pytest.FixtureRequest
) -> None:
    path: Path = request.getfixturevalue(f"tiny_{arch}")
    ref = [o.outputs[0].token_ids for o in _generate(_engine(path, run_ahead=False), _greedy())]
    eng = _engine(path, run_ahead=True)
    got = [o.outputs[0].token_ids for o in _generate(eng, _greedy())]
    assert got == ref
    # one prefill step, then 29 decode steps: all but the last (whose requests all end by their budget,
    # so it builds nothing ahead) queue the next one; the 4 steps after a request ended too
    assert _plain(eng).num_ran_ahead == 28
    eng.leak_check()


def test_requests_ending_at_a_stop_token_drop_out_of_the_decode_that_ran_ahead(tiny_qwen3_5: Path) -> None:
    """A stop token (and EOS) ends a request after its next decode was queued: the next step takes that
    decode without its row. Sampled rows with seeds, penalties and logprobs equal the synchronous engine's
    (their sampling runs after the host read the tokens, as before)."""
    ref = [o.outputs[0].token_ids for o in _generate(_engine(tiny_qwen3_5, run_ahead=False), _greedy())]
    stops = {0: ref[0][3], 2: ref[2][4], 4: ref[4][10]}
    params = [
        SamplingParams(
            max_tokens=m,
            temperature=0.8 if i in (1, 3) else 0,
            seed=100 + i,
            repetition_penalty=1.3 if i == 3 else 1.0,
            presence_penalty=0.5 if i == 1 else 0.0,
            logprobs=2,
            ignore_eos=i != 4,
            stop_token_ids=[stops[i]] if i in stops else None,
        )
        for i, m in enumerate(BUDGETS)
    ]
    outs, logprobs = [], []
    for run_ahead in (False, True):
        eng = _engine(tiny_qwen3_5, run_ahead=run_ahead)
        got = [o.outputs[0] for o in _generate(eng, params)]
        outs.append([(o.token_ids, o.finish_reason) for o in got])
        # the top-2 of each position: (token, logprob) pairs
        logprobs.append([[(t, lp.logprob) for d in o.logprobs for t, lp in sorted(d.items())] for o in got])
        eng.leak_check()
    assert outs[1] == outs[0]
    assert [reason for _, reason in outs[1]][::2] == ["stop"] * 3
    for a, b in zip(*logprobs, strict=True):
        # a step after a request ended ran its forward with that row still in the batch: other fp32 sums
        assert [t for t, _ in a] == [t for t, _ in b]
        assert [lp for _, lp in a] == pytest.approx([lp for _, lp in b], rel=1e-4, abs=1e-5)
    # the longest request (row 3, 14 tokens) decodes in 13 steps: every one but its last ran the next
    # ahead, also those whose tokens ended other requests at their stop tokens
    assert _plain(eng).num_ran_ahead == 12


def test_a_request_arriving_mid_decode_waits_at_most_a_step_and_aborts_drop_out(tiny_lfm2: Path) -> None:
    """Requests added and aborted between steps, driven step by step: each output equals the synchronous
    engine's under the same calls; the newcomer is admitted (no run-ahead while it waits)."""

    def drive(eng: LLMEngine) -> dict[str, list[int]]:
        params = _greedy()
        ids = [eng.add_request(p, params[i], request_id=f"r{i}") for i, p in enumerate(PROMPTS[:3])]
        finished: dict[str, list[int]] = {}
        steps = 0
        while eng.has_unfinished() or steps < 6:
            steps += 1
            if steps == 4:
                eng.add_request(PROMPTS[3], params[3], request_id="late")
            if steps == 7:
                aborted = eng.abort(ids[2])
                assert aborted is not None
                finished[ids[2]] = aborted.outputs[0].token_ids
            outs: list[RequestOutput] = eng.step()
            for o in outs:
                if o.finished:
                    finished[o.request_id] = o.outputs[0].token_ids
        return finished

    ref = drive(_engine(tiny_lfm2, run_ahead=False))
    eng = _engine(tiny_lfm2, run_ahead=True)
    got = drive(eng)
    assert got.keys() == ref.keys() == {"r0", "r1", "r2", "late"}
    assert got == ref
    assert eng.requests == {} and _plain(eng).num_ran_ahead > 10
    eng.leak_check()


@pytest.mark.parametrize("fail_step", [5, 8])
def test_a_step_that_fails_after_its_decode_ran_ahead_forgets_it(tiny_qwen3_5: Path, fail_step: int) -> None:
    """The read of a step's tokens fails after the next decode was queued: the engine recomputes the
    step's requests one by one (quarantine), which must not meet the forgotten decode again; the outputs
    equal the synchronous engine's under the same failure."""

    def drive(eng: LLMEngine) -> dict[str, list[int]]:
        plain = _plain(eng)
        read = plain.read
        steps = {"n": 0}

        def failing(queued: Any) -> Any:
            if steps["n"] == fail_step:
                steps["n"] += 1
                raise RuntimeError("injected read failure")
            return read(queued)

        plain.read = failing  # type: ignore[method-assign]
        params = _greedy()
        for i, prompt in enumerate(PROMPTS):
            eng.add_request(prompt, params[i], request_id=f"r{i}")
        finished: dict[str, list[int]] = {}
        while eng.has_unfinished():
            steps["n"] += 1
            for o in eng.step():
                if o.finished:
                    finished[o.request_id] = o.outputs[0].token_ids
        return finished

    ref = drive(_engine(tiny_qwen3_5, run_ahead=False))
    eng = _engine(tiny_qwen3_5, run_ahead=True)
    assert drive(eng) == ref and len(ref) == len(PROMPTS)
    assert _plain(eng).num_ran_ahead > 0
    eng.leak_check()


def test_a_decode_that_ran_ahead_and_cannot_be_scheduled_is_recomputed(tiny_qwen3_5: Path) -> None:
    """An invariant of the step after a decode ran ahead breaks (the memory refuses its room, as a model
    without KV once did near max_model_len): that step's requests are recomputed from scratch, and the
    engine goes on (it used to raise at every later step); the outputs equal the synchronous engine's."""
    ref = _generate(_engine(tiny_qwen3_5, run_ahead=False), _greedy())
    eng = _engine(tiny_qwen3_5, run_ahead=True)
    grow = eng.scheduler.memory.grow
    refused: list[int] = []

    def refuse_once(request_ids: Any, num_tokens: Any) -> bool:
        if eng.scheduler.ran_ahead and not refused:
            refused.append(len(request_ids))
            return False
        return grow(request_ids, num_tokens)

    eng.scheduler.memory.grow = refuse_once  # type: ignore[method-assign]
    got = _generate(eng, _greedy())
    assert refused and [o.outputs[0].token_ids for o in got] == [o.outputs[0].token_ids for o in ref]
    assert _plain(eng).num_ran_ahead > 0
    eng.leak_check()


@pytest.mark.parametrize("arch", ["lfm2", "qwen3_5"])
def test_a_finished_request_caches_the_state_its_run_ahead_decode_left(
    arch: str, request: pytest.FixtureRequest
) -> None:
    """A request that ends at a stop token after its next decode was queued caches its state with that
    token in it (one more than it computed): the next turn resumes from it and equals a run without the
    prefix cache. Caching it as the computed tokens alone would resume from a state one token ahead."""
    path: Path = request.getfixturevalue(f"tiny_{arch}")
    first = PROMPTS[0]
    ref = _generate(_engine(path, run_ahead=False, enable_prefix_caching=False), _greedy([12]), [first])
    stop = ref[0].outputs[0].token_ids[6]

    def turns(eng: LLMEngine) -> tuple[list[int], list[int], list[int], list[int]]:
        one = _generate(eng, [SamplingParams(max_tokens=12, temperature=0, stop_token_ids=[stop])], [first])
        out1 = one[0].outputs[0].token_ids
        # the next turn; and a branch off the first output's third token (position 12, where a decode step
        # saved a snapshot at the interval, queued before the decode that ran ahead of it)
        more = _generate(eng, _greedy([8, 8]), [first + out1 + [3, 4], first + out1[:3] + [3, 4]])
        return out1, *(o.outputs[0].token_ids for o in more), [o.num_cached_tokens for o in more]

    base = turns(_engine(path, run_ahead=True, enable_prefix_caching=False))
    eng = _engine(path, run_ahead=True, prefix_cache_snapshot_interval=4)
    got = turns(eng)
    assert got[:3] == base[:3]
    assert base[0][-1] == stop and len(base[0]) <= 7
    # the whole first conversation (prompt, its output with the stop token) came from the cache, and the
    # branch resumed at the decode's snapshot
    assert got[3] == [len(first) + len(base[0]), 12]
    assert _plain(eng).num_ran_ahead > 0
    eng.leak_check()


@pytest.mark.parametrize("max_num_seqs", [1, 2])
def test_decodes_run_ahead_while_the_others_wait_for_a_seat(tiny_qwen3_5: Path, max_num_seqs: int) -> None:
    """Every seat taken: nobody can be admitted before a request ends, so decodes run ahead although
    requests wait; the step after a seat frees is the decode that ran ahead, the one after it admits."""
    params = _greedy()
    ref = [o.outputs[0].token_ids for o in _generate(_engine(tiny_qwen3_5, run_ahead=False), params)]
    eng = _engine(tiny_qwen3_5, run_ahead=True, max_num_seqs=max_num_seqs)
    assert [o.outputs[0].token_ids for o in _generate(eng, params)] == ref
    if max_num_seqs == 1:
        # a request of budget m decodes in m - 1 steps, all but the last ahead (m - 2); the one-token prompt
        # [1] prefills as a decode, which runs its first decode ahead too: 19 + 7 + 28 + 13 + 23
        assert _plain(eng).num_ran_ahead == 90
    else:
        assert _plain(eng).num_ran_ahead == 55  # (23 with run-ahead only while nobody waits)
    eng.leak_check()


# lengths from acceptance alone (no measured costs, which differ between runs): the same rounds in both
ADAPTIVE_MTP = {
    "method": "mtp",
    "num_speculative_tokens": 3,
    "adaptive": {"candidate_steps": [1, 3], "warmup_batches": 0, "update_interval": 1, "cost_aware": False},
}


def _failed_steps(eng: LLMEngine) -> list[Any]:
    """From now on, the requests of every step that failed and was recomputed one by one (quarantined)."""
    failed: list[Any] = []
    quarantine = eng.scheduler.quarantine
    eng.scheduler.quarantine = lambda reqs: failed.append(reqs) or quarantine(reqs)  # type: ignore[method-assign]
    return failed


def _lengths_at_zero(eng: LLMEngine, probe_wait: int) -> tuple[list[int], list[Any]]:
    """Every request's adaptive length starts at 0 and probes after `probe_wait` rounds at 0; returns the
    rows of each verify round run, and the quarantines (a step that failed: a run-ahead the round broke)."""
    rnd: Any = eng.runner.spec  # type: ignore[attr-defined]
    new_request = rnd.adaptive.new_request

    def at_zero(costs: Any = None) -> Any:
        st = new_request(costs)
        st.steps, st._probe_wait = 0, probe_wait
        return st

    rnd.adaptive.new_request = at_zero
    rounds: list[int] = []
    run = rnd.run
    rnd.run = lambda target, rows, **kw: rounds.append(len(rows)) or run(target, rows, **kw)
    plain_round = rnd.plain_round
    rnd.queued_ahead = []  # per plain round: its forward was queued during the last step
    rnd.timed_rows = []  # per plain round: (rows its cost is recorded at, rows its forward ran, its requests)
    timer_plain = rnd.timer.plain

    def recording(ids: Any, step: Any, **kw: Any) -> Any:
        rnd.queued_ahead.append(kw.get("queued_ahead", False))
        ran = kw.get("queued_rows") if kw.get("queued_ahead") else None
        rnd.timer.plain = lambda *a, **k: (
            rnd.timed_rows.append((k["rows"], ran or len(ids), len(ids))),
            timer_plain(*a, **k),
        )
        try:
            return plain_round(ids, step, **kw)
        finally:
            rnd.timer.plain = timer_plain  # (a drafting round's own plain steps are not followed)

    rnd.plain_round = recording
    failed = _failed_steps(eng)
    return rounds, failed


@pytest.mark.parametrize("probe_wait", [10**6, 4])
def test_speculative_rounds_that_draft_nothing_run_ahead(tiny_qwen3_5: Path, probe_wait: int) -> None:
    """Adaptive lengths at 0 (a drafter that does not pay): the steps are plain engine steps, and while the
    next round surely drafts nothing either (no request due to probe) the next one's decode runs ahead.
    With probes every 4 rounds at 0, drafting rounds follow rounds that ran ahead: the same tokens, the
    same accepted drafts (the drafter was fed the decodes that ran ahead, their layers included) and no
    step that failed, against the same engine without async scheduling."""
    out, stats = [], []
    for run_ahead in (False, True):
        eng = _engine(tiny_qwen3_5, run_ahead=run_ahead, speculative_config=ADAPTIVE_MTP)
        rounds, failed = _lengths_at_zero(eng, probe_wait)
        out.append([o.outputs[0].token_ids for o in _generate(eng, _greedy())])
        stats.append((len(rounds), eng.stats.spec_num_drafts, eng.stats.spec_num_accepted_tokens))
        assert failed == []
        eng.leak_check()
    assert (
        out[1]
        == out[0]
        == [o.outputs[0].token_ids for o in _generate(_engine(tiny_qwen3_5, run_ahead=False), _greedy())]
    )
    assert stats[1] == stats[0]
    if probe_wait == 4:
        assert stats[1][1] > 0  # rounds drafted (probes)
        assert 0 < _plain(eng).num_ran_ahead < 28
    else:
        assert stats[1] == (0, 0, 0)
        assert _plain(eng).num_ran_ahead == 28  # as a plain engine
    # each decode that ran ahead is its next round's forward, which the cost model charges the whole step
    queued = eng.runner.spec.queued_ahead  # type: ignore[attr-defined]
    assert sum(queued) == _plain(eng).num_ran_ahead
    timed = eng.runner.spec.timed_rows  # type: ignore[attr-defined]
    assert timed and all(rows == ran for rows, ran, _ in timed), timed


def test_a_plain_step_that_ran_ahead_is_timed_at_the_batch_it_ran(tiny_qwen3_5: Path) -> None:
    """A request that ends on a stop token nobody foresaw leaves its next decode queued ahead in a batch one
    row larger than the next step's: that step's cost goes to the batch size that ran (its bucket), not to
    the smaller one's; outputs as the synchronous engine's."""
    plain = _generate(_engine(tiny_qwen3_5, run_ahead=False), _greedy())
    toks = plain[1].outputs[0].token_ids
    stop = next(t for i, t in enumerate(toks) if i >= 2 and t not in toks[:i])  # first met at index >= 2
    params = _greedy()
    params[1] = SamplingParams(max_tokens=BUDGETS[1], temperature=0, ignore_eos=True, stop_token_ids=[stop])
    ref = _generate(_engine(tiny_qwen3_5, run_ahead=False), params)
    eng = _engine(tiny_qwen3_5, run_ahead=True, speculative_config=ADAPTIVE_MTP)
    _, failed = _lengths_at_zero(eng, 10**6)
    out = _generate(eng, params)
    assert failed == [] and [o.outputs[0].token_ids for o in out] == [o.outputs[0].token_ids for o in ref]
    timed = eng.runner.spec.timed_rows  # type: ignore[attr-defined]
    assert all(rows == ran for rows, ran, _ in timed), timed
    assert any(ran > ids for _, ran, ids in timed), timed  # the step after the stop


def test_a_round_that_drafts_after_its_decode_ran_ahead_recomputes_even_alone(tiny_qwen3_5: Path) -> None:
    """An over-eager `plain_next` (never expected) lets a probe round meet a decode that ran ahead: the
    step fails with RanAheadMismatch and the engine recomputes its request, at batch 1 too (not an abort),
    with the output of the synchronous engine."""
    params = _greedy([21])
    ref = _generate(_engine(tiny_qwen3_5, run_ahead=False), params, PROMPTS[:1])[0].outputs[0]
    eng = _engine(tiny_qwen3_5, run_ahead=True, speculative_config=ADAPTIVE_MTP)
    _, failed = _lengths_at_zero(eng, 4)
    eng.runner.spec.plain_next = lambda ids: True  # type: ignore[attr-defined]
    got = _generate(eng, params, PROMPTS[:1])[0].outputs[0]
    assert (got.token_ids, got.finish_reason) == (ref.token_ids, "length")
    assert len(failed) >= 1  # the mismatch happened, and was recomputed
    eng.leak_check()


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("arch", ["lfm2", "qwen3_5"])
def test_graphed_decodes_run_ahead_on_the_gpu(arch: str, request: pytest.FixtureRequest) -> None:
    """On CUDA (graphs, bf16, the decode batch built ahead on by default): the same tokens and finish
    reasons with and without async scheduling, stop tokens included, and most decodes ran ahead."""
    path: Path = request.getfixturevalue(f"tiny_{arch}")
    outs = []
    for run_ahead in (False, True):
        eng = build_engine(
            EngineArgs(
                model=str(path), device="cuda", dtype="bfloat16", max_num_seqs=8, async_scheduling=run_ahead
            )
        )
        greedy = _generate(eng, _greedy())
        stops = [o.outputs[0].token_ids[5] for o in greedy]
        params = [
            SamplingParams(max_tokens=m, temperature=0, ignore_eos=True, stop_token_ids=[stops[i]])
            for i, m in enumerate(BUDGETS)
        ]
        stopped = _generate(eng, params)
        outs.append([(o.outputs[0].token_ids, o.outputs[0].finish_reason) for o in [*greedy, *stopped]])
        eng.leak_check()
    assert outs[1] == outs[0]
    assert _plain(eng).num_ran_ahead >= 28


def test_the_cost_models_timing_rounds_run_ahead_as_a_plain_engines_steps(tiny_qwen3_5: Path) -> None:
    """Cost-aware adaptive lengths time plain steps in rounds where nobody drafts (`RoundTimer`): the first
    of a timing queues the second's forward ahead and the second the third's, so the steady ones are timed as
    a plain engine runs them (a synchronous step is slower, which would make drafting look cheaper). The
    outputs stay the plain engine's and no step fails."""
    spec = {"method": "mtp", "num_speculative_tokens": 3, "adaptive": {"candidate_steps": [1, 3]}}
    eng = _engine(tiny_qwen3_5, run_ahead=True, speculative_config=spec)
    rnd: Any = eng.runner.spec  # type: ignore[attr-defined]
    seen: list[tuple[bool, bool]] = []  # per plain round: (a timing round, its forward was queued ahead)
    plain_round = rnd.plain_round

    def recording(ids: Any, step: Any, **kw: Any) -> Any:
        seen.append((rnd.timer.timing(len(ids)), kw.get("queued_ahead", False)))
        return plain_round(ids, step, **kw)

    rnd.plain_round = recording
    failed = _failed_steps(eng)
    got = [o.outputs[0].token_ids for o in _generate(eng, _greedy())]
    assert got == [
        o.outputs[0].token_ids for o in _generate(_engine(tiny_qwen3_5, run_ahead=False), _greedy())
    ]
    assert seen[:3] == [(True, False), (True, True), (True, True)], seen
    assert failed == []
    eng.leak_check()


def test_a_batch_that_shrinks_into_a_timed_bucket_after_a_timing_step_ran_ahead(tiny_qwen3_5: Path) -> None:
    """A timing round over a bucket without a plain step timed must not promise that the next round drafts
    nothing: a request ending in it leaves a smaller batch, in a bucket whose costs are measured, which
    drafts; its decode queued ahead would fail the step (found by review: the 5th request of a batch of 5)."""
    spec = {"method": "mtp", "num_speculative_tokens": 3, "adaptive": {"candidate_steps": [1, 3]}}
    eng = _engine(tiny_qwen3_5, run_ahead=True, speculative_config=spec)
    rnd: Any = eng.runner.spec  # type: ignore[attr-defined]
    # as after a while at 4 rows: bucket 4 measured, the start-up timing done; a 5th request joins (bucket 8)
    for _ in range(3):
        rnd.costs.record_decode(0.010, rows=4)
    rnd.costs.record_draft(1, 0.001, rows=4)
    rnd.costs.record_verify(2, 0.0105, rows=4)
    rnd.costs.record_verify(4, 0.011, rows=4)
    rnd.timer._timing_left = 0
    failed = _failed_steps(eng)
    prompts = [[5, 9, 17, 33, 2, 7], [40, 41], [7, 7, 7, 8, 7], [1, 3], [20, 30, 40, 20]]
    params = [SamplingParams(max_tokens=m, temperature=0, ignore_eos=True) for m in (12, 12, 12, 12, 2)]
    outs = LLM.from_engine(eng).generate([{"prompt_token_ids": p} for p in prompts], params)
    assert failed == [] and [len(o.outputs[0].token_ids) for o in outs] == [12, 12, 12, 12, 2]
