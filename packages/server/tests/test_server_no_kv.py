"""A target without attention layers keeps no KV: a request's row still reaches max_model_len + Dmax
positions.

A verify block looks past a request's last committed token (its lookahead: up to Dmax - 1 drafts), so near
max_model_len a speculative step asks the memory for more than max_model_len positions. A model with KV gets
them (the request table is that wide); one without KV used to be refused at max_model_len, which the
scheduler took for a full pool: it preempted every other running request and then the request itself (their
states recomputed from scratch, no prefix cache without attention), and a decode that ran ahead there raised
inside `schedule` on every later step (the engine stalled). Each test compares with the same requests
without the feature and counts the preemptions and decodes that ran ahead.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
from hyspec_runner.plain_forward import PlainForwards
from hyspec_server import LLM, EngineArgs, LLMEngine, SamplingParams
from hyspec_server.builder import build_engine
from hyspec_testing.tiny import build_tiny_checkpoint

MAX_LEN = 64
NEAR_END = [3 + (i * 7) % 50 for i in range(50)]  # 50 + 14 tokens: ends exactly at MAX_LEN


@pytest.fixture(scope="module")
def gdn_only(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A tiny Qwen3.5 of three Gated DeltaNet layers and no attention layer (MTP drafter included)."""
    return build_tiny_checkpoint(
        tmp_path_factory.mktemp("gdn_only"),
        "qwen3_5",
        mtp_layers=1,
        config_overrides={"layer_types": ["linear_attention"] * 3},
    )


def _engine(path: Path, spec: dict[str, Any] | None, **kw: Any) -> LLMEngine:
    args = EngineArgs(
        model=str(path), device="cpu", dtype="float32", max_model_len=MAX_LEN, speculative_config=spec, **kw
    )
    return build_engine(args)


def _greedy(max_tokens: int) -> SamplingParams:
    return SamplingParams(max_tokens=max_tokens, temperature=0, ignore_eos=True)


def _run(eng: LLMEngine, requests: list[tuple[str, list[int], int]]) -> dict[str, list[int]]:
    for rid, prompt, budget in requests:
        eng.add_request(prompt, _greedy(budget), request_id=rid)
    out: dict[str, list[int]] = {}
    for _ in range(400):
        if not eng.has_unfinished():
            break
        for o in eng.step():
            if o.finished:
                out[o.request_id] = list(o.outputs[0].token_ids)
    assert not eng.has_unfinished()
    eng.leak_check()
    return out


@pytest.mark.parametrize("method", ["ngram", "mtp"])
def test_a_request_at_max_model_len_preempts_nobody(gdn_only: Path, method: str) -> None:
    """The oldest request ends exactly at max_model_len while three younger ones run: with speculation its
    last verify blocks reach past max_model_len, which must not preempt anyone."""
    requests = [("old", NEAR_END, MAX_LEN - len(NEAR_END))]
    requests += [(f"young{j}", [5 + j, 9, 17, 33, 2, 7] * 4, 30) for j in range(3)]
    ref = _run(_engine(gdn_only, None, max_num_seqs=4), requests)
    eng = _engine(gdn_only, {"method": method, "num_speculative_tokens": 3}, max_num_seqs=4)
    assert _run(eng, requests) == ref
    assert eng.scheduler.num_preemptions == 0
    assert len(ref["old"]) == MAX_LEN - len(NEAR_END)


def test_a_decode_run_ahead_two_tokens_before_max_model_len_does_not_stall(gdn_only: Path) -> None:
    """Adaptive lengths at 0 (a drafter that does not pay): plain rounds whose next decode is queued ahead,
    up to a request that ends at max_model_len, beside another one. Every step succeeds, the outputs equal
    the engine's without async scheduling, and decodes did run ahead."""
    spec = {
        "method": "mtp",
        "num_speculative_tokens": 3,
        "adaptive": {
            "candidate_steps": [1, 3],
            "warmup_batches": 0,
            "update_interval": 1,
            "cost_aware": False,
        },
    }
    requests = [("near_end", NEAR_END, MAX_LEN - len(NEAR_END)), ("other", [7, 8, 9], 30)]
    outs = []
    plains = []
    for run_ahead in (False, True):
        eng = _engine(gdn_only, spec, max_num_seqs=2, async_scheduling=run_ahead)
        eng.runner.ahead.enabled = True  # type: ignore[attr-defined]  # as on CUDA
        rnd = eng.runner.spec  # type: ignore[attr-defined]
        new_request = rnd.adaptive.new_request

        def at_zero(costs: Any = None, new_request: Any = new_request) -> Any:
            st = new_request(costs)
            st.steps, st._probe_wait = 0, 10**6  # at 0 from the start, never probing
            return st

        rnd.adaptive.new_request = at_zero
        outs.append(_run(eng, requests))
        plain = eng.runner.plain  # type: ignore[attr-defined]
        assert isinstance(plain, PlainForwards)
        plains.append(plain.num_ran_ahead)
        assert eng.scheduler.num_preemptions == 0
    assert outs[1] == outs[0]
    assert plains[0] == 0 and plains[1] > 0
    assert len(outs[1]["near_end"]) == MAX_LEN - len(NEAR_END)


def test_llm_generate_near_max_model_len_with_speculation(gdn_only: Path) -> None:
    """The user's call: `LLM.generate` of a prompt whose budget ends at max_model_len, speculative engine."""
    ref = LLM.from_engine(_engine(gdn_only, None, max_num_seqs=2)).generate(
        [{"prompt_token_ids": NEAR_END}], _greedy(MAX_LEN - len(NEAR_END))
    )
    eng = _engine(gdn_only, {"method": "ngram", "num_speculative_tokens": 3}, max_num_seqs=2)
    got = LLM.from_engine(eng).generate([{"prompt_token_ids": NEAR_END}], _greedy(MAX_LEN - len(NEAR_END)))
    assert got[0].outputs[0].token_ids == ref[0].outputs[0].token_ids
    assert eng.scheduler.num_preemptions == 0
