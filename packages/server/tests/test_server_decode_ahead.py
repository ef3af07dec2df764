"""The next decode batch prepared during the current step (decode_ahead.py), on tiny real checkpoints.

On the CPU the runner leaves it off (nothing to overlap); these tests turn it on. A prepared batch that is
used when it should not be feeds a wrong position, KV slot or state slot, which changes the greedy tokens;
one that is never used would make the feature a no-op, so the tests also count uses and drops.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any

import pytest
import torch
from hyspec_runner.decode_ahead import DecodeAhead
from hyspec_server import LLM, EngineArgs, LLMEngine, SamplingParams
from hyspec_server.builder import build_engine

# mixed lengths (prefills of different sizes join decodes), and budgets that end requests at different
# steps, so batches change under prepared ones
PROMPTS: list[list[int]] = [[5, 9, 17, 33, 2, 7, 5, 9, 11], [40, 41], [7, 7, 7, 8, 7], [1], [20, 30, 40, 20]]
BUDGETS = [21, 9, 30, 14, 25]


def _engine(path: Path, *, ahead: bool, spec: dict[str, Any] | None = None, **kw: Any) -> LLMEngine:
    # the decode batch alone: async scheduling (a forward queued ahead, test_server_async_scheduling.py) off
    args: dict[str, Any] = dict(
        model=str(path), max_num_seqs=8, page_size=4, max_model_len=64, async_scheduling=False
    )
    args.update(kw)
    eng = build_engine(EngineArgs(speculative_config=spec, **args))
    eng.runner.ahead.enabled = ahead  # type: ignore[attr-defined]
    return eng


def _run(eng: LLMEngine, prompts: list[list[int]] = PROMPTS) -> list[list[int]]:
    params = [SamplingParams(max_tokens=m, temperature=0, ignore_eos=True) for m in BUDGETS[: len(prompts)]]
    outs = LLM.from_engine(eng).generate([{"prompt_token_ids": p} for p in prompts], params)
    return [o.outputs[0].token_ids for o in outs]


def _ahead(eng: LLMEngine) -> DecodeAhead:
    ahead = eng.runner.ahead  # type: ignore[attr-defined]
    assert isinstance(ahead, DecodeAhead)
    return ahead


@pytest.mark.parametrize("arch", ["lfm2", "qwen3_5"])
def test_plain_decode_with_batches_prepared_ahead_equals_without(
    arch: str, request: pytest.FixtureRequest
) -> None:
    path: Path = request.getfixturevalue(f"tiny_{arch}")
    ref = _run(_engine(path, ahead=False))
    eng = _engine(path, ahead=True)
    assert _run(eng) == ref
    ahead = _ahead(eng)
    # one prefill step, then 29 decode steps: the first has nothing prepared (a prefill is no decode), the
    # other 28 take theirs, also the 4 right after a request finished: by its token budget, which the batch
    # built during its last step already left out
    assert (ahead.num_used, ahead.num_dropped) == (28, 0)
    eng.leak_check()


def test_a_request_stopped_by_a_token_drops_the_prepared_batch(tiny_qwen3_5: Path) -> None:
    """A stop token ends a request in a way no batch built before the token was read can know: the step
    after it drops its prepared batch, and the outputs stay those of building every batch on time."""
    ref = _run(_engine(tiny_qwen3_5, ahead=False))
    stop = ref[2][4]  # request 2 stops at its fifth token (or earlier, if it came before)
    params = [
        SamplingParams(
            max_tokens=m, temperature=0, ignore_eos=True, stop_token_ids=[stop] if i == 2 else None
        )
        for i, m in enumerate(BUDGETS)
    ]
    for ahead_on in (False, True):
        eng = _engine(tiny_qwen3_5, ahead=ahead_on)
        outs = LLM.from_engine(eng).generate([{"prompt_token_ids": p} for p in PROMPTS], params)
        got = [o.outputs[0].token_ids for o in outs]
        assert got[:2] + got[3:] == ref[:2] + ref[3:]
        assert got[2] == ref[2][: ref[2].index(stop) + 1]
    assert _ahead(eng).num_dropped == 1 and _ahead(eng).num_used > 0
    eng.leak_check()


@pytest.mark.parametrize(
    ("arch", "spec"),
    [
        ("lfm2", {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 1}),
        (
            "qwen3_5",
            {
                "method": "mtp",
                "num_speculative_tokens": 1,
                "adaptive": {"candidate_steps": [1, 3], "warmup_batches": 0, "update_interval": 1},
            },
        ),
    ],
    ids=["ngram", "mtp-adaptive"],
)
def test_speculative_rounds_with_batches_prepared_ahead_equal_plain(
    arch: str, spec: dict[str, Any], request: pytest.FixtureRequest
) -> None:
    """Rounds without drafts decode through run_plain and prepare ahead; a drafting round (verify forward,
    draft extend) in between must drop what was prepared."""
    path: Path = request.getfixturevalue(f"tiny_{arch}")
    ref = _run(_engine(path, ahead=False))
    eng = _engine(path, ahead=True, spec=spec)
    assert _run(eng) == ref
    ahead = _ahead(eng)
    assert ahead.num_used > 0 and ahead.num_dropped > 0, (ahead.num_used, ahead.num_dropped)
    assert eng.stats.spec_num_drafts > 0  # some rounds did draft
    eng.leak_check()


def test_rounds_without_drafts_take_their_batches_like_plain_decoding(tiny_qwen3_5: Path) -> None:
    """With speculation on, the scheduler reserves KV for the drafts a round may add, also when nobody
    drafts; the prepared batch reserves the same, so lookahead page boundaries (every 4 steps here) do not
    change the table under it: exactly as many batches are used and dropped as without speculation."""
    spec = {"method": "mtp", "num_speculative_tokens": 3}
    eng = _engine(tiny_qwen3_5, ahead=True, spec=spec)
    eng.runner.spec.draft_lengths = lambda rows: [0] * len(rows)  # type: ignore[attr-defined]
    plain = _engine(tiny_qwen3_5, ahead=True)
    assert _run(eng) == _run(plain)
    assert eng.stats.spec_num_drafts == 0
    assert (_ahead(eng).num_used, _ahead(eng).num_dropped) == (
        _ahead(plain).num_used,
        _ahead(plain).num_dropped,
    )
    eng.leak_check()


def test_steps_whose_adaptive_lengths_are_zero_are_plain_engine_steps(tiny_qwen3_5: Path) -> None:
    """Adaptive lengths at 0 (a drafter that does not pay): the step runs as a plain engine's
    (`SpeculativeRound.plain_round`: no round, no round rows, the decode batch prepared ahead exactly as
    without speculation), the requests' lengths count those rounds at 0 (their wait to the next probe) and
    the cost model times plain steps; their prompt ends and finishes save no draft KV (no eager draft
    extend for a drafter that does not pay); outputs equal plain decoding."""
    spec = {
        "method": "mtp",
        "num_speculative_tokens": 3,
        "adaptive": {"candidate_steps": [1, 3], "warmup_batches": 0, "update_interval": 1},
    }
    eng = _engine(tiny_qwen3_5, ahead=True, spec=spec)
    rnd: Any = eng.runner.spec  # type: ignore[attr-defined]
    made: list[Any] = []
    new_request = rnd.adaptive.new_request

    def at_zero(costs: Any = None) -> Any:
        st = new_request(costs)
        st.steps, st._probe_wait = 0, 10**6  # never probes within the test
        made.append(st)
        return st

    rnd.adaptive.new_request = at_zero
    saved: list[int] = []  # the drafter's prefix saves: none for requests that do not draft
    save_prefixes = rnd.model_drafter.save_prefixes
    rnd.model_drafter.save_prefixes = lambda saves: saved.append(len(saves)) or save_prefixes(saves)
    rounds: list[int] = []
    run = rnd.run
    rnd.run = lambda target, rows, **kw: rounds.append(len(rows)) or run(target, rows, **kw)
    plain = _engine(tiny_qwen3_5, ahead=True)
    assert _run(eng) == _run(plain)
    assert rounds == [] and saved == [] and eng.stats.spec_num_drafts == 0
    assert eng.scheduler.memory.snapshot_interval  # prefix caching on: the target saved its prefixes
    assert (_ahead(eng).num_used, _ahead(eng).num_dropped) == (_ahead(plain).num_used, 0)
    assert len(made) == len(PROMPTS) and all(st._zero_rounds > 0 for st in made)
    assert rnd.costs.has_decode  # the timing rounds ran as plain steps too
    eng.leak_check()


def test_preemption_drops_prepared_batches(tiny_lfm2: Path) -> None:
    probe = _engine(tiny_lfm2, ahead=False)
    plan = probe.runner.memory.pool.plan  # type: ignore[attr-defined]
    fixed = plan.total_bytes - plan.kv_bytes
    budget = fixed + (plan.max_pages_per_request + 4) * plan.kv_bytes_per_page  # not all fit at once
    prompts = [PROMPTS[0] * 3, *PROMPTS[1:]]
    ref = _run(_engine(tiny_lfm2, ahead=False, kv_cache_bytes=budget), prompts)
    eng = _engine(tiny_lfm2, ahead=True, kv_cache_bytes=budget)
    assert _run(eng, prompts) == ref
    assert eng.scheduler.num_preemptions > 0 and _ahead(eng).num_used > 0
    eng.leak_check()


def _decoding(path: Path) -> tuple[LLMEngine, DecodeAhead, Any]:
    """An engine whose pool holds requests "a" and "b" with KV for 8 tokens each, and its ahead."""
    eng = _engine(path, ahead=True)
    runner: Any = eng.runner
    pool = runner.pool
    pool.alloc(["a", "b"])
    pool.ensure_kv_capacity(["a", "b"], [8, 8])
    return eng, _ahead(eng), runner


def _build(ahead: DecodeAhead, runner: Any, prefix: list[int], tokens: list[int]) -> None:
    rows = runner.pool.req_rows(["a", "b"])
    ahead.build(
        req_ids=["a", "b"], req_rows=rows, prefix_lens=prefix, next_tokens=torch.tensor(tokens), keep=[0, 1]
    )
    ahead.sampled(tokens)


def _tensors(batch: Any) -> dict[str, torch.Tensor]:
    """Every tensor of a ForwardBatch (typed index tensors unwrapped), copied."""
    out: dict[str, torch.Tensor] = {}
    for f in dataclasses.fields(batch):
        v = getattr(batch, f.name)
        t = v if isinstance(v, torch.Tensor) else getattr(v, "tensor", None)
        if isinstance(t, torch.Tensor):
            out[f.name] = t.clone()
    return out


def test_a_prepared_batch_is_the_batch_the_step_would_prepare(tiny_lfm2: Path) -> None:
    _, ahead, runner = _decoding(tiny_lfm2)
    _build(ahead, runner, [5, 3], [11, 12])
    got = ahead.take(req_ids=["a", "b"], prefix_lens=[5, 3], tokens=[11, 12])
    assert got is not None
    kept = _tensors(got)  # copies: the fresh batch below is written into the same buffers
    assert {"input_ids", "positions", "kv_slots", "state_slots", "page_table"} <= set(kept)
    rows = runner.pool.req_rows(["a", "b"])
    fresh = runner.graphs.prepare_decode(req_rows=rows, input_ids=torch.tensor([11, 12]), prefix_lens=[5, 3])
    assert kept.keys() == _tensors(fresh).keys()
    for name, value in _tensors(fresh).items():
        assert torch.equal(kept[name], value), name
    # used once
    assert ahead.take(req_ids=["a", "b"], prefix_lens=[5, 3], tokens=[11, 12]) is None


def test_another_requests_row_may_change_under_a_prepared_batch(tiny_lfm2: Path) -> None:
    """A batch holds copies of its own requests' rows only: another request allocated, grown and freed in
    between (a request that finished, one that joined) leaves it valid, and it is what the step would
    prepare."""
    _, ahead, runner = _decoding(tiny_lfm2)
    pool = runner.pool
    _build(ahead, runner, [5, 3], [11, 12])
    pool.alloc(["c"])
    pool.ensure_kv_capacity(["c"], [8])
    pool.free(["c"])
    got = ahead.take(req_ids=["a", "b"], prefix_lens=[5, 3], tokens=[11, 12])
    assert got is not None
    kept = _tensors(got)
    rows = pool.req_rows(["a", "b"])
    fresh = runner.graphs.prepare_decode(req_rows=rows, input_ids=torch.tensor([11, 12]), prefix_lens=[5, 3])
    for name, value in _tensors(fresh).items():
        assert torch.equal(kept[name], value), name


@pytest.mark.parametrize("change", ["pages", "slot", "buffers", "tokens", "positions", "requests"])
def test_a_prepared_batch_is_dropped_when_anything_it_was_built_from_changed(
    tiny_lfm2: Path, change: str
) -> None:
    _, ahead, runner = _decoding(tiny_lfm2)
    pool = runner.pool
    _build(ahead, runner, [5, 3], [11, 12])
    ids, prefix, tokens = ["a", "b"], [5, 3], [11, 12]
    if change == "pages":
        # a's second page (positions 4..7) goes back and a different one comes: position 5's KV slot moves
        pool.spare_pages = 0  # (the truncation keeps no spare page: the page really goes back)
        pool.alloc(["c"])
        pool.truncate_kv("a", 4)
        pool.ensure_kv_capacity(["c"], [4])  # takes the page a just returned
        pool.ensure_kv_capacity(["a"], [8])
    elif change == "slot":
        pool.free(["b"])
        pool.alloc(["b"])  # same request id, a new row and state slot
    elif change == "buffers":
        rows = pool.req_rows(["a"])
        runner.backend.prepare_extend(
            req_rows=rows, input_ids=torch.tensor([1, 2]), q_lens=[2], prefix_lens=[0]
        )
    elif change == "tokens":
        tokens = [11, 13]  # what the host read is not what the batch feeds
    elif change == "positions":
        prefix = [5, 4]
    else:
        ids = ["b", "a"]
    assert ahead.take(req_ids=ids, prefix_lens=prefix, tokens=tokens) is None
    assert ahead.num_dropped == 1 and ahead.num_used == 0


def test_a_page_boundary_gets_its_page_unless_the_pool_has_none(
    tiny_lfm2: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # exact pages: spares would make up for the last ones (test_statepool_lifecycle tests them)
    monkeypatch.setattr("hyspec_runner.runner_memory.ENGINE_SPARE_PAGES", 0)
    _, ahead, runner = _decoding(tiny_lfm2)
    pool = runner.pool
    _build(ahead, runner, [8, 3], [11, 12])  # a has pages for positions 0..7: position 8 needs a new one
    cap = pool.kv_capacity("a")
    assert cap == 12
    got = ahead.take(req_ids=["a", "b"], prefix_lens=[8, 3], tokens=[11, 12])
    assert got is not None and got.kv_slots is not None
    row = torch.tensor(pool.req_rows(["a"]).tolist())
    assert got.kv_slots.tolist()[0] == int(pool.table.kv_slots(row, torch.tensor([8]))[0])
    # no page left: nothing is prepared, and the pool is as it was
    pool.kv.alloc(pool.kv.num_free)  # held by nobody: this pool is thrown away
    assert pool.kv.num_free == 0
    layout = pool.row_layout(["a", "b"])  # every live row
    _build(ahead, runner, [cap, 3], [11, 12])
    assert pool.row_layout(["a", "b"]) == layout and pool.kv_capacity("a") == cap
    assert ahead.take(req_ids=["a", "b"], prefix_lens=[cap, 3], tokens=[11, 12]) is None
    # a position past the request table (a step that can never come) is not prepared, and raises nothing
    width = pool.plan.table_width
    _build(ahead, runner, [width, 3], [11, 12])
    assert ahead.take(req_ids=["a", "b"], prefix_lens=[width, 3], tokens=[11, 12]) is None
    assert ahead.num_used == 1


@pytest.mark.parametrize("ahead_on", [False, True])
@pytest.mark.parametrize("arch", ["lfm2", "qwen3_5"])
def test_decode_batches_moved_on_give_the_tokens_of_built_ones(
    arch: str, ahead_on: bool, request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Every engine's target moves a decode batch of the same rows as the last one on instead of building it
    (`BatchRewrite`, `move_batches`): greedy tokens equal an engine that builds every batch, and only a step
    whose rows changed (the first decode after the prefill, a request ending) builds one."""
    from hyspec_attn_backends.batch_builder import BatchBuilder
    from hyspec_attn_backends.batch_rewrite import BatchRewrite

    path: Path = request.getfixturevalue(f"tiny_{arch}")
    rewrite = BatchRewrite.rewrite
    monkeypatch.setattr(BatchRewrite, "rewrite", lambda *a, **k: None)
    ref = _run(_engine(path, ahead=ahead_on))
    monkeypatch.setattr(BatchRewrite, "rewrite", rewrite)
    calls = {"moved": 0, "built": 0}
    prepare, build = BatchBuilder.prepare_decode, BatchBuilder._build

    def counted_prepare(self: BatchBuilder, **kw: Any) -> Any:
        builds = calls["built"]
        out = prepare(self, **kw)
        calls["moved"] += calls["built"] == builds
        return out

    def counted_build(self: BatchBuilder, mode: Any, *args: Any, **kw: Any) -> Any:
        calls["built"] += mode.name == "DECODE"
        return build(self, mode, *args, **kw)

    monkeypatch.setattr(BatchBuilder, "prepare_decode", counted_prepare)
    monkeypatch.setattr(BatchBuilder, "_build", counted_build)
    eng = _engine(path, ahead=ahead_on)
    assert _run(eng) == ref
    # 29 decode steps; the rows change at the first one and when each of the five requests ends (the last
    # one's end leaves no batch): at most 5 builds, every other step moved on
    assert calls["built"] <= 5 and calls["moved"] >= 29 - 5, calls
    eng.leak_check()
