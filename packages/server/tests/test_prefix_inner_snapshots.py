"""Prefix-cache snapshots inside a prefill chunk (`inner_snapshots`): with a snapshot interval that is a
multiple of the GDN chunk size, a long prompt prefills in one forward that writes the states at every
interval it passes, instead of one step per interval; later requests resume from those inner positions.

Checked on real tiny checkpoints (fp32 on the CPU, so another chunk split computes the same numbers): output
with caching on equals caching off for every architecture and a drafter, the hits land exactly on the inner
positions (also after a resume at a position off the interval grid, and with a step budget smaller than the
prompt), a prompt passes its intervals in one step, and nothing leaks.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
from hyspec_server import LLM, SamplingParams
from hyspec_testing.spec import DrafterCase, build_case_checkpoints

NEW = 6
EVERY = 64
LONG = [(i * 37 + 11) % 240 + 5 for i in range(300)]
OTHER = [(i * 17 + 3) % 230 + 9 for i in range(120)]
# (prompt, prompt tokens the cache supplies): inner snapshots at 64, 128, 192 and 256 of LONG, its end at
# 300; then a resume off the grid (300) whose next chunk ends at 320 before passing 384
WORKLOAD = [
    (LONG, 0),
    (LONG[:200] + OTHER[:40], 192),
    (LONG[:130] + OTHER[40:60], 128),
    (LONG + OTHER, 300),
    (LONG + OTHER[:100] + OTHER[:30], 384),
]

CASES: tuple[DrafterCase, ...] = (
    DrafterCase("qwen3_5", "qwen3_5", {}),
    DrafterCase("qwen3_next", "qwen3_next", {}),
    DrafterCase("lfm2", "lfm2", {}),
    DrafterCase("lfm2_moe", "lfm2_moe", {}),
    DrafterCase("mtp", "qwen3_5", {"method": "mtp", "num_speculative_tokens": 3}),
)


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    return build_case_checkpoints(tmp_path_factory.mktemp("inner"), CASES)


def _llm(path: Path, spec: dict[str, Any] | None, caching: bool, budget: int) -> LLM:
    return LLM(
        model=str(path),
        max_num_seqs=2,
        max_model_len=1024,
        max_num_batched_tokens=budget,
        speculative_config=spec or None,
        enable_prefix_caching=caching,
        prefix_cache_snapshot_interval=EVERY,
        prefix_cache_snapshot_fraction=8.0,  # 16 snapshot slots: none of the workload is evicted
        page_size=16,
    )


def _run(llm: LLM) -> tuple[list[list[int]], list[int]]:
    params = SamplingParams(max_tokens=NEW, temperature=0, ignore_eos=True)
    outs, cached = [], []
    for prompt, _ in WORKLOAD:
        (o,) = llm.generate([{"prompt_token_ids": prompt}], params, use_tqdm=False)
        outs.append(o.outputs[0].token_ids)
        cached.append(o.num_cached_tokens)
    llm.engine.leak_check()
    return outs, cached


@pytest.mark.parametrize("case", CASES, ids=[c.name for c in CASES])
@pytest.mark.parametrize("budget", [512, 100])
def test_inner_snapshots_resume_and_equal_caching_off(
    case: DrafterCase, budget: int, checkpoints: dict[str, Path]
) -> None:
    spec = case.speculative_config(None)
    want, none = _run(_llm(checkpoints[case.arch], spec, False, budget))
    assert none == [0] * len(WORKLOAD)
    llm = _llm(checkpoints[case.arch], spec, True, budget)
    assert llm.engine.runner.memory.inner_snapshots
    got, cached = _run(llm)
    assert got == want, case.name
    assert cached == [c for _, c in WORKLOAD], (case.name, cached)
    assert llm.reset_prefix_cache()
    pool = llm.engine.runner.memory.pool
    assert pool.kv.num_free == pool.plan.num_kv_pages


def test_a_long_prompt_passes_its_intervals_in_one_step(checkpoints: dict[str, Path]) -> None:
    llm = _llm(checkpoints["qwen3_5"], None, True, 512)
    (o,) = llm.generate([{"prompt_token_ids": LONG}], SamplingParams(max_tokens=1), use_tqdm=False)
    assert o.num_cached_tokens == 0
    assert llm.engine.stats.num_steps == 1  # chunks ending at every interval would take 5
    stats = llm.engine.runner.memory.prefix_cache_stats()
    assert stats is not None and stats.num_snapshots == 5  # 64, 128, 192, 256 inside, 300 at the end
    # a step budget below the prompt: chunks end on the interval grid (256 + 44 tokens), never in between
    small = _llm(checkpoints["qwen3_5"], None, True, 280)
    small.generate([{"prompt_token_ids": LONG}], SamplingParams(max_tokens=1), use_tqdm=False)
    assert small.engine.stats.num_steps == 2


def test_a_failed_step_that_reserved_only_pages_resets_the_cache(checkpoints: dict[str, Path]) -> None:
    """A reservation inside a prefill chunk caches the request's pages before its forward fills them, also
    where the point's snapshot exists and no slot comes back (`PrefixCache.reserve` returns None: two
    requests computed one prefix, one's pages were evicted, its snapshot kept). When that step's forward
    fails, those pages hold nothing: the cache must be reset, or a later hit reads them."""
    llm = _llm(checkpoints["qwen3_5"], None, True, 512)
    eng: Any = llm.engine
    memory = eng.runner.memory
    real_reserve = memory.reserve_snapshots
    memory.reserve_snapshots = lambda saves: [None] * len(real_reserve(saves))  # pages cached, no slot
    real_execute = eng.runner.execute
    failed = [False]

    def failing(step: Any, *, while_queued: Any = None) -> Any:
        if not failed[0] and any(c.num_new > EVERY for c in step.chunks):
            failed[0] = True
            raise RuntimeError("injected: the forward that was to fill the reserved pages")
        return real_execute(step, while_queued=while_queued)

    eng.runner.execute = failing
    real_reset = memory.reset_prefix_cache
    resets: list[bool] = []
    memory.reset_prefix_cache = lambda **kw: resets.append(bool(real_reset(**kw))) or resets[-1]
    params = SamplingParams(max_tokens=NEW, temperature=0, ignore_eos=True)
    prompts = [{"prompt_token_ids": LONG}, {"prompt_token_ids": OTHER}]
    got = [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)]
    assert failed[0] and len(resets) == 1  # right after the failed step (its two requests retried alone)
    want = [o.outputs[0].token_ids for o in _llm(checkpoints["qwen3_5"], None, False, 512).generate(
        prompts, params, use_tqdm=False
    )]  # fmt: skip
    assert got == want
    eng.leak_check()


def test_an_interval_off_the_chunk_grid_ends_chunks_at_each_snapshot(checkpoints: dict[str, Path]) -> None:
    llm = LLM(
        model=str(checkpoints["qwen3_5"]),
        max_num_seqs=2,
        max_model_len=1024,
        prefix_cache_snapshot_interval=48,  # not a multiple of the GDN chunk (64): no inner snapshots
        page_size=16,
    )
    assert not llm.engine.runner.memory.inner_snapshots
    llm.generate([{"prompt_token_ids": LONG}], SamplingParams(max_tokens=1), use_tqdm=False)
    assert llm.engine.stats.num_steps == 7  # 48, 96, ..., 288, 300


def test_more_inner_snapshots_than_slots_keep_the_latest(checkpoints: dict[str, Path]) -> None:
    """One forward passes more snapshot positions than there are snapshot slots (4, the least): the step's
    reservations evict each other, each slot is written once, and the latest positions stay cached."""
    prompt = [(i * 7 + 1) % 240 + 5 for i in range(700)]
    params = SamplingParams(max_tokens=NEW, temperature=0, ignore_eos=True)
    outs = {}
    for caching in (False, True):
        llm = LLM(
            model=str(checkpoints["qwen3_5"]),
            max_num_seqs=1,
            max_model_len=1024,
            max_num_batched_tokens=1024,
            enable_prefix_caching=caching,
            prefix_cache_snapshot_interval=EVERY,
            prefix_cache_snapshot_fraction=0.5,  # max(4, 0.5 * 1) = 4 slots
            page_size=16,
        )
        got = []
        for p in (prompt, [*prompt[:650], 9, 9, 9]):
            (o,) = llm.generate([{"prompt_token_ids": p}], params, use_tqdm=False)
            got.append((o.outputs[0].token_ids, o.num_cached_tokens))
        llm.engine.leak_check()
        outs[caching] = got
        if caching:
            stats = llm.engine.runner.memory.prefix_cache_stats()
            assert stats is not None and stats.num_snapshot_slots == 4
    assert [t for t, _ in outs[True]] == [t for t, _ in outs[False]]
    # 10 inner positions (64 .. 640) and the prompt's end in 4 slots: the hit is the latest inner one
    assert outs[True][1][1] == 640


def test_inner_snapshots_of_a_chunk_beside_verify_blocks(checkpoints: dict[str, Path]) -> None:
    """MTP: a long prompt's chunk rides in a MIXED forward beside another request's verify block and writes
    the snapshots it passes there; a later request resumes from one. Output equals caching off."""
    spec = {"method": "mtp", "num_speculative_tokens": 3}
    params = SamplingParams(max_tokens=NEW, temperature=0, ignore_eos=True)
    short = [(i * 5 + 2) % 200 + 7 for i in range(10)]
    later = [*LONG[:200], *OTHER[:30]]
    results = {}
    for caching in (False, True):
        llm = _llm(checkpoints["qwen3_5"], spec, caching, 200)
        # step 1: the short prompt and LONG[:128] (an inner snapshot at 64); step 2: the short request's
        # verify block beside LONG[128:300] (inner snapshots at 192 and 256), one MIXED forward
        outs = llm.generate([{"prompt_token_ids": short}, {"prompt_token_ids": LONG}], params, use_tqdm=False)
        (o,) = llm.generate([{"prompt_token_ids": later}], params, use_tqdm=False)
        results[caching] = ([x.outputs[0].token_ids for x in (*outs, o)], o.num_cached_tokens)
        assert llm.engine.runner.num_mixed >= 1
        llm.engine.leak_check()
    assert results[True][0] == results[False][0]
    assert results[True][1] == 192


@pytest.mark.parametrize("budget", [512, 100])
def test_a_drafter_resumes_from_its_own_kv_at_an_inner_snapshot(
    budget: int, checkpoints: dict[str, Path]
) -> None:
    """A target hit at a snapshot inside a prompt chunk finds the MTP drafter's K/V there too (saved with the
    chunk's own saves once the draft passed it), not zeros: every cached token but the drafter's lag is a
    draft hit. (Found by a review: the drafter saved only where chunks ended, so it resumed a shared system
    prompt from zero K/V; output stays right, acceptance collapses.)"""
    spec = {"method": "mtp", "num_speculative_tokens": 3}
    llm = _llm(checkpoints["qwen3_5"], spec, True, budget)
    params = SamplingParams(max_tokens=NEW, temperature=0, ignore_eos=True)
    llm.generate([{"prompt_token_ids": LONG}], params, use_tqdm=False)
    cache = llm.engine.runner.spec.model_drafter.kv.cache  # type: ignore[union-attr]
    before = cache.stats()
    (o,) = llm.generate([{"prompt_token_ids": LONG[:200] + OTHER[:40]}], params, use_tqdm=False)
    after = cache.stats()
    assert o.num_cached_tokens == 192  # the target's inner snapshot at 192
    assert after.num_hits - before.num_hits == 192 - 1, (before, after)  # the drafter's lag: 1
    llm.engine.leak_check()
