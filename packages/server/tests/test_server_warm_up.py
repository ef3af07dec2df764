"""The start-up warm-up of a speculative engine (warm_up.py), on the CPU with a tiny real checkpoint.

On a GPU the builder runs it so that no served round pays a kernel's first compile; here it is called
directly: it must run every (batch size, draft length) round shape, then leave nothing behind (requests,
statistics, prefix cache, the round's measured costs and adaptive evidence), and change no output.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
from hyspec_attn_backends import batch_rewrite
from hyspec_server import LLM, EngineArgs, SamplingParams
from hyspec_server.builder import build_engine
from hyspec_server.engine import LLMEngine
from hyspec_server.warm_up import warm_up_engine

SPEC: dict[str, Any] = {
    "method": "mtp",
    "num_speculative_tokens": 3,
    "adaptive": {"candidate_steps": [1, 3]},
}
PROMPTS = [[5, 9, 17, 33, 2, 7], [40, 41], [7, 7, 7, 8]]


def _engine(path: Path, max_model_len: int = 64) -> LLMEngine:
    return build_engine(
        EngineArgs(
            model=str(path), speculative_config=SPEC, max_num_seqs=4, page_size=4, max_model_len=max_model_len
        )
    )


def _record_rounds(eng: LLMEngine, monkeypatch: pytest.MonkeyPatch) -> tuple[set[tuple[int, int]], set[int]]:
    """From now on: the (rows, block size) of every verify forward, and the block sizes of the verify
    batches rewritten from the last round's (`advance_verify`, a Triton kernel per block size), the
    target's and the drafter's first block (S + 2) alike."""
    runner: Any = eng.runner
    shapes: set[tuple[int, int]] = set()
    verify = runner.forward_verify

    def recording(**kw: Any) -> Any:
        shapes.add((len(kw["req_ids"]), int(kw["block_tokens"].shape[1])))
        return verify(**kw)

    rewritten: set[int] = set()
    rewrite = batch_rewrite.advance_verify

    def recording_rewrite(**kw: Any) -> None:
        rewritten.add(int(kw["tokens"].shape[1]))
        rewrite(**kw)

    monkeypatch.setattr(runner, "forward_verify", recording)
    monkeypatch.setattr(batch_rewrite, "advance_verify", recording_rewrite)
    return shapes, rewritten


def _outputs(eng: LLMEngine) -> list[list[int]]:
    params = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)
    outs = LLM.from_engine(eng).generate([{"prompt_token_ids": p} for p in PROMPTS], params)
    return [o.outputs[0].token_ids for o in outs]


def _record_prompt_lens(eng: LLMEngine) -> list[int]:
    """The prompt length of every request added to `eng` from now on (until `del eng.add_request`)."""
    lens: list[int] = []
    add = eng.add_request

    def recording(prompt: Any, params: Any, **kw: Any) -> str:
        lens.append(len(prompt))
        return add(prompt, params, **kw)

    eng.add_request = recording  # type: ignore[method-assign]
    return lens


def test_warm_up_runs_every_round_shape_and_leaves_nothing_behind(
    tiny_qwen3_5: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    ref = _outputs(_engine(tiny_qwen3_5))
    eng = _engine(tiny_qwen3_5)
    runner: Any = eng.runner
    spec = runner.spec
    shapes, rewritten = _record_rounds(eng, monkeypatch)
    steps = warm_up_engine(eng, spec, [1, 3])
    monkeypatch.undo()
    # every batch size drafted every candidate length: blocks of k + 1 tokens
    assert {(1, 2), (3, 2), (1, 4), (3, 4)} <= shapes, shapes
    # and every block size was rewritten once at least: a served round compiles no rewrite kernel
    assert {2, 4} <= rewritten, rewritten
    assert steps > 0 and not eng.has_unfinished()
    assert eng.stats.num_steps == 0 and eng.stats.num_prompt_tokens == 0
    stats = runner.memory.prefix_cache_stats()
    assert stats.num_cached_pages == 0 and stats.num_snapshots == 0
    assert stats.num_queries == 0 and stats.num_hits == 0  # /metrics counts served prompts only
    # the round learns its costs and its drafter's acceptance from served rounds only
    assert not spec.costs.ready and not spec.costs.has_decode
    assert spec.adaptive is not None and spec.adaptive.shared.accepted == 0.0
    eng.leak_check()
    assert eng.new_request_id() == "req-0"
    assert _outputs(eng) == ref
    eng.leak_check()


@pytest.mark.parametrize("max_model_len", [4, 6, 11])
def test_warm_up_covers_the_round_shapes_of_a_short_max_model_len(
    tiny_qwen3_5: Path, monkeypatch: pytest.MonkeyPatch, max_model_len: int
) -> None:
    """At 4 positions no request drafts 3 (a one-token prompt drafts 1 at most): the warm-up runs no such
    round. At 6 a served one-token prompt drafts 3 (a block of 4): so does a warm-up round. At 11 a request
    fits two rounds of 3 drafts in a row: the warm-up rewrites a block of 4 as served rounds do."""
    eng = _engine(tiny_qwen3_5, max_model_len)
    shapes, rewritten = _record_rounds(eng, monkeypatch)
    warm_up_engine(eng, eng.runner.spec, [1])  # type: ignore[attr-defined]
    monkeypatch.undo()
    assert (1, 2) in shapes and ((1, 4) in shapes) == (max_model_len > 4), shapes
    if max_model_len == 11:
        assert {2, 4} <= rewritten, rewritten
    assert not eng.has_unfinished()
    eng.leak_check()


def test_a_forced_length_must_be_one_the_round_may_choose(tiny_qwen3_5: Path) -> None:
    spec: Any = _engine(tiny_qwen3_5).runner.spec  # type: ignore[attr-defined]
    assert spec.warm_up_lengths() == (1, 3)
    with pytest.raises(ValueError, match="steps"), spec.forced_length(2):
        pass


def test_a_plain_engine_warms_its_prefills_and_keeps_nothing(tiny_lfm2: Path) -> None:
    """Without speculation the warm-up runs its prompts only (every prefill tile height class, a decode)
    and leaves no request, figure or cache entry; outputs are unchanged."""
    args = EngineArgs(model=str(tiny_lfm2), max_num_seqs=4, page_size=4, max_model_len=64)
    ref = _outputs(build_engine(args))
    eng = build_engine(args)
    lens = _record_prompt_lens(eng)
    assert warm_up_engine(eng, None, [1, 3]) > 0
    del eng.add_request
    # each alone, then together (96 and the long prompt do not fit max_model_len 64 with two tokens), then
    # max_num_seqs two-token prompts at once (MANY_PROMPTS, capped)
    assert lens == [1, 2, 7, 12, 24, 48, 1, 2, 7, 12, 24, 48, 2, 2, 2, 2]
    assert eng.stats.num_steps == 0 and not eng.has_unfinished()
    stats = eng.runner.memory.prefix_cache_stats()
    assert stats is not None and stats.num_cached_pages == 0
    assert _outputs(eng) == ref
    eng.leak_check()


@pytest.mark.parametrize("limit", ["max_waiting", "max_model_len"])
def test_the_warm_up_fits_any_engine_it_may_run_on(tiny_qwen3_5: Path, limit: str) -> None:
    """A waiting queue shorter than a captured batch, and a max_model_len too short for a long prompt or
    even for the longest draft, start up all the same (the rounds that cannot run are skipped)."""
    kw: dict[str, Any] = {"max_waiting": 2} if limit == "max_waiting" else {"max_model_len": 7}
    args: dict[str, Any] = dict(model=str(tiny_qwen3_5), speculative_config=SPEC, max_num_seqs=4, page_size=4)
    args.setdefault("max_model_len", 64)
    args.update(kw)
    eng = build_engine(EngineArgs(**args))
    assert warm_up_engine(eng, eng.runner.spec, [1, 4]) > 0  # type: ignore[attr-defined]
    assert not eng.has_unfinished()
    eng.leak_check()


def test_the_warm_up_writes_snapshots_inside_a_prefill(tiny_qwen3_5: Path) -> None:
    """With snapshots written inside a prefill forward, one warm-up prompt passes snapshot positions, so the
    GDN prefill's saving variant compiles before serving; the cache it filled is emptied again."""
    args = EngineArgs(
        model=str(tiny_qwen3_5),
        max_num_seqs=4,
        page_size=16,
        max_model_len=256,
        prefix_cache_snapshot_interval=64,
    )
    eng = build_engine(args)
    runner: Any = eng.runner
    assert runner.memory.inner_snapshots
    saves: list[Any] = []
    prepare = runner.backend.prepare_extend

    def recording(**kw: Any) -> Any:
        saves.extend(kw.get("state_saves", ()))
        return prepare(**kw)

    runner.backend.prepare_extend = recording
    warm_up_engine(eng, None, [1])
    del runner.backend.prepare_extend
    assert [s.token for s in saves] == [64, 128]  # the prompt of 2 * 64 + 1 tokens, one forward
    stats = runner.memory.prefix_cache_stats()
    assert stats is not None and stats.num_snapshots == 0 and stats.num_cached_pages == 0
    eng.leak_check()


@pytest.mark.parametrize("max_model_len", [3, 4])
def test_a_tiny_max_model_len_runs_only_the_prompts_that_fit(tiny_lfm2: Path, max_model_len: int) -> None:
    # every warm-up request fits the engine's max_model_len (a request that does not is a ValueError that
    # would stop the server from starting)
    eng = build_engine(
        EngineArgs(model=str(tiny_lfm2), max_num_seqs=3, page_size=4, max_model_len=max_model_len)
    )
    lens = _record_prompt_lens(eng)
    assert warm_up_engine(eng, None, [1]) > 0
    assert lens == ([1, 1] if max_model_len == 3 else [1, 2, 1, 2, 2, 2, 2])
    eng.leak_check()
