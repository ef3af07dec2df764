"""Prefix caching on real tiny checkpoints: output with caching on equals output with caching off, for every
architecture with no drafter and for every drafter (MTP chain and tree, multi-layer MTP, EAGLE-3, DFlash,
n-gram, adaptive), on multi-turn chat (turn n + 1 extends turn n's prompt and output) and on requests sharing
a system prompt (together and one after another), with prefixes ending inside a page and on a page boundary.

A hit must really happen (the engine reports cached tokens) and nothing may leak. Storage is fp32 on the
CPU, so a different chunk split computes the same numbers the uncached run does.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
from hyspec_server import LLM, SamplingParams
from hyspec_testing.spec import DRAFTER_CASES, DrafterCase, build_case_checkpoints

NEW = 10
PAGE = 16
# the system prompt ends on a page boundary (48) and one request's prompt ends inside the next page
SYSTEM = [(i * 29 + 3) % 250 + 5 for i in range(48)]
SUFFIXES = [[7, 8, 9], [11] * 16, [40, 41, 42, 43, 44, 45, 46, 47, 48, 49, 50, 51, 52, 53, 54, 55, 56]]
CHAT = [(i * 13 + 1) % 240 + 3 for i in range(37)]
USER_TURNS = [[60, 61, 62], [70] * 5, [80, 81]]

CASES: tuple[DrafterCase, ...] = (
    DrafterCase("plain-qwen3_5", "qwen3_5", {}),
    DrafterCase("plain-qwen3_next", "qwen3_next", {}),
    DrafterCase("plain-lfm2", "lfm2", {}),
    DrafterCase("plain-lfm2_moe", "lfm2_moe", {}),
    *DRAFTER_CASES,
    DrafterCase("mtp-adaptive", "qwen3_5", {"method": "mtp", "num_speculative_tokens": 3, "adaptive": True}),
    DrafterCase("ngram", "lfm2", {"method": "ngram", "num_speculative_tokens": 3}),
)


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    return build_case_checkpoints(tmp_path_factory.mktemp("prefix"), CASES)


def _workload(llm: LLM) -> tuple[list[list[int]], int]:
    """Shared-prefix requests together, then one after another, then a 3-turn chat; the outputs and the
    prompt tokens the cache supplied."""
    params = SamplingParams(max_tokens=NEW, temperature=0, ignore_eos=True)
    outs: list[list[int]] = []
    cached = 0
    prompts = [{"prompt_token_ids": SYSTEM + s} for s in SUFFIXES]
    for o in llm.generate(prompts, params):
        outs.append(o.outputs[0].token_ids)
        cached += o.num_cached_tokens
    for p in prompts[::-1]:
        (o,) = llm.generate([p], params)
        outs.append(o.outputs[0].token_ids)
        cached += o.num_cached_tokens
    history = list(CHAT)
    for user in USER_TURNS:
        (o,) = llm.generate([{"prompt_token_ids": history}], params)
        outs.append(o.outputs[0].token_ids)
        cached += o.num_cached_tokens
        history = history + o.outputs[0].token_ids + user
    llm.engine.leak_check()
    return outs, cached


def _llm(path: Path, spec: dict[str, Any] | None, caching: bool, max_num_seqs: int) -> LLM:
    return LLM(
        model=str(path),
        max_num_seqs=max_num_seqs,
        speculative_config=spec or None,
        enable_prefix_caching=caching,
        prefix_cache_snapshot_interval=2 * PAGE,
        prefix_cache_snapshot_fraction=8 / max_num_seqs,  # 8 snapshot slots: room for the whole workload
        page_size=PAGE,
    )


@pytest.mark.parametrize("case", CASES, ids=[c.name for c in CASES])
def test_caching_on_equals_caching_off(case: DrafterCase, checkpoints: dict[str, Path]) -> None:
    target = checkpoints[case.arch]
    draft = None if case.draft is None else str(checkpoints[f"{case.draft}@{case.arch}"])
    spec = case.speculative_config(draft)
    off = _llm(target, spec, False, 4)
    want, none_cached = _workload(off)
    want_accepted = off.engine.stats.spec_num_accepted_tokens
    assert none_cached == 0
    for max_num_seqs in (1, 4):
        llm = _llm(target, spec, True, max_num_seqs)
        got, cached = _workload(llm)
        assert got == want, (case.name, max_num_seqs)
        # every sequential shared-prefix request and every later chat turn resumes from the cache
        assert cached >= 3 * len(SYSTEM) - PAGE, (case.name, max_num_seqs, cached)
        drafter = None if llm.engine.runner.spec is None else llm.engine.runner.spec.model_drafter
        draft_kv = getattr(drafter, "kv", None)
        if draft_kv is not None and not spec.get("adaptive"):
            # the drafter resumed its own KV from its prefix cache, not zeros: its drafts after a hit are
            # the ones it makes without caching, so the same drafts are accepted (with adaptive lengths a
            # request at 0, whose drafts the measured costs say do not pay, saves no draft KV)
            stats = draft_kv.cache.stats()
            assert stats.num_hits >= cached - 4 * len(USER_TURNS + SUFFIXES), (case.name, stats, cached)
        if not spec.get("adaptive"):  # (adaptive lengths follow measured costs)
            accepted = llm.engine.stats.spec_num_accepted_tokens
            assert accepted == want_accepted, (case.name, max_num_seqs, accepted, want_accepted)
        assert llm.reset_prefix_cache()
        llm.engine.leak_check()
        pool = llm.engine.runner.memory.pool
        assert pool.kv.num_free == pool.plan.num_kv_pages
        if draft_kv is not None:
            assert draft_kv.pool.kv.num_free == draft_kv.pool.plan.num_kv_pages


PREEMPT_CASES = [c for c in CASES if c.name in ("mtp", "eagle3", "dflash")]


@pytest.mark.parametrize("case", PREEMPT_CASES, ids=[c.name for c in PREEMPT_CASES])
def test_drafter_caches_under_preemption_and_eviction(
    case: DrafterCase, checkpoints: dict[str, Path]
) -> None:
    """A KV pool too small for four requests at once: they preempt one another and cached pages are evicted,
    in the target's pool and the drafter's; output equals caching off, the drafter still resumes from its
    cache, and nothing leaks."""
    target = checkpoints[case.arch]
    draft = None if case.draft is None else str(checkpoints[f"{case.draft}@{case.arch}"])
    spec = case.speculative_config(draft)

    def llm(caching: bool, kv_cache_bytes: int | None = None) -> LLM:
        return LLM(
            model=str(target),
            max_num_seqs=4,
            speculative_config=spec,
            enable_prefix_caching=caching,
            prefix_cache_snapshot_interval=PAGE,
            prefix_cache_snapshot_fraction=1.0,
            page_size=PAGE,
            max_model_len=128,
            kv_cache_bytes=kv_cache_bytes,
        )

    def budget(caching: bool) -> int:
        """What this config takes besides KV, and KV pages for one full request and two more pages."""
        plan = llm(caching).engine.runner.memory.pool.plan  # type: ignore[attr-defined]
        pages = plan.max_pages_per_request + 2
        return int(plan.total_bytes - plan.kv_bytes + pages * plan.kv_bytes_per_page)

    params = SamplingParams(max_tokens=40, temperature=0, ignore_eos=True)
    rounds = [[{"prompt_token_ids": SYSTEM + s + [60 + r]} for s in [*SUFFIXES, [9] * 20]] for r in range(2)]
    outs = {}
    for caching in (False, True):
        eng = llm(caching, budget(caching))
        got = [[o.outputs[0].token_ids for o in eng.generate(batch, params)] for batch in rounds]
        outs[caching] = got
        e = eng.engine
        assert e.scheduler.num_preemptions > 0, case.name
        if caching:
            cache = e.runner.spec.model_drafter.kv.cache  # type: ignore[union-attr]
            assert cache.stats().num_hits > 0, (case.name, cache.stats())
        e.leak_check()
    assert outs[True] == outs[False], case.name


@pytest.mark.parametrize(
    "spec", [{"method": "mtp", "num_speculative_tokens": 3}, {"method": "ngram", "num_speculative_tokens": 3}]
)
def test_strict_prefixes_and_aborted_decodes_with_a_drafter(tiny_qwen3_5: Path, spec: dict[str, Any]) -> None:
    """With a drafter on: a prompt that is a strict prefix of an earlier one (ending on a snapshot, which
    cannot serve its last token, and off one), and requests aborted in the middle of their speculative
    decode, whose prefixes are then asked for again: output equals caching off, and nothing leaks."""
    params = SamplingParams(max_tokens=12, temperature=0, ignore_eos=True)

    def llm(caching: bool) -> LLM:
        return LLM(
            model=str(tiny_qwen3_5),
            max_num_seqs=2,
            speculative_config=spec,
            enable_prefix_caching=caching,
            prefix_cache_snapshot_interval=PAGE,
            prefix_cache_snapshot_fraction=4.0,
            page_size=PAGE,
            max_num_batched_tokens=40,
        )

    on, off = llm(True), llm(False)
    base = SYSTEM + CHAT  # 85 tokens

    def same(prompt: list[int]) -> int:
        (a,) = on.generate([{"prompt_token_ids": prompt}], params, use_tqdm=False)
        (b,) = off.generate([{"prompt_token_ids": prompt}], params, use_tqdm=False)
        assert a.outputs[0].token_ids == b.outputs[0].token_ids, (len(prompt), a.num_cached_tokens)
        return a.num_cached_tokens

    assert same(base) == 0
    assert same(base[:64]) == 48  # its own end is a snapshot: the one before it serves
    assert same(base[:70]) == 64
    eng = on.engine
    for steps in (3, 4, 5):  # the prompt prefilled in 2 steps (budget 40), then decode rounds
        prompt = [*base[:50], 200 + steps, *CHAT[:steps]]
        rid = eng.add_request(prompt, params)
        for _ in range(steps):
            eng.step()
        assert rid in eng.requests  # not finished yet
        eng.abort(rid)
        eng.leak_check()
        assert same(prompt) >= 48
        assert same([*prompt, 9, 9]) >= len(prompt)
    eng.leak_check()
