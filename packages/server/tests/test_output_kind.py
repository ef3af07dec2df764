"""`SamplingParams.output_kind` (vLLM's RequestOutputKind): cumulative, delta and final-only outputs agree."""

import asyncio
import dataclasses
from pathlib import Path

import pytest
from hyspec_server import LLM, RequestOutput, RequestOutputKind, SamplingParams
from hyspec_server.async_engine import OutputQueue
from hyspec_server.engine import LLMEngine
from hyspec_server.outputs import CompletionOutput, Logprob, RequestMetrics
from hyspec_testing.server import toy_engine, toy_greedy

PROMPTS = [[65, 66, 67], [70, 71, 72, 73, 74, 75, 76], [90]]


def _steps(eng: LLMEngine) -> list[list[RequestOutput]]:
    """Every step's outputs until the engine is idle."""
    out = []
    while eng.has_unfinished():
        out.append(eng.step())
    return out


@pytest.mark.parametrize("stop", [None, ["zz", "q"]])
def test_the_three_kinds_give_one_completion(stop: list[str] | None) -> None:
    # greedy with logprobs (and stop strings, whose held-back text moves the deltas) on a toy model whose
    # requests finish at different steps; the three kinds of one prompt run side by side in one batch
    eng = toy_engine(budget=5)  # chunked prefill: some steps give a request no token
    base = SamplingParams(max_tokens=12, temperature=0, logprobs=2, stop=stop, ignore_eos=True)
    ids: dict[tuple[int, RequestOutputKind], str] = {}
    for i, p in enumerate(PROMPTS):
        for kind in RequestOutputKind:
            params = dataclasses.replace(base, max_tokens=6 + 3 * i, output_kind=kind)
            ids[(i, kind)] = eng.add_request({"prompt_token_ids": p}, params)
    seen: dict[str, list[RequestOutput]] = {rid: [] for rid in ids.values()}
    for outs in _steps(eng):
        for o in outs:
            seen[o.request_id].append(o)
    for i, p in enumerate(PROMPTS):
        cum = seen[ids[(i, RequestOutputKind.CUMULATIVE)]]
        delta = seen[ids[(i, RequestOutputKind.DELTA)]]
        final = seen[ids[(i, RequestOutputKind.FINAL_ONLY)]]
        whole = cum[-1].outputs[0]
        assert cum[-1].finished and len(cum) > 1
        if stop is None:
            assert whole.token_ids == toy_greedy(p, 6 + 3 * i, ignore_eos=True)
        # final only: one output, the whole completion
        assert len(final) == 1 and final[0].finished
        f = final[0].outputs[0]
        assert (f.text, f.token_ids, f.logprobs, f.cumulative_logprob, f.finish_reason) == (
            whole.text,
            whole.token_ids,
            whole.logprobs,
            whole.cumulative_logprob,
            whole.finish_reason,
        )
        # delta: as many outputs as cumulative, each completion what that step added
        assert len(delta) == len(cum) and delta[-1].finished
        for d, c in zip(delta, cum, strict=True):
            assert d.outputs[0].token_ids == c.delta_token_ids == d.delta_token_ids
            assert d.outputs[0].text == c.delta_text == d.delta_text
            assert d.outputs[0].cumulative_logprob == c.outputs[0].cumulative_logprob
        assert [t for d in delta for t in d.outputs[0].token_ids] == whole.token_ids
        assert "".join(d.outputs[0].text for d in delta) == whole.text
        assert [e for d in delta for e in d.outputs[0].logprobs or []] == whole.logprobs
        assert len(whole.logprobs or []) == len(whole.token_ids)


def test_generate_asks_the_engine_for_final_outputs_only_and_keeps_the_callers_params() -> None:
    eng = toy_engine()
    step = eng.step
    unfinished = []

    def counting() -> list[RequestOutput]:
        outs = step()
        unfinished.extend(o for o in outs if not o.finished)
        return outs

    eng.step = counting  # type: ignore[method-assign]
    params = SamplingParams(max_tokens=9, temperature=0, ignore_eos=True, n=2, seed=3)
    outs = LLM.from_engine(eng).generate([{"prompt_token_ids": p} for p in PROMPTS], params, use_tqdm=False)
    assert unfinished == []  # no output was built for a step before a request's last
    assert params.output_kind is RequestOutputKind.CUMULATIVE  # the caller's params, unchanged
    for p, o in zip(PROMPTS, outs, strict=True):
        assert [c.token_ids for c in o.outputs] == [toy_greedy(p, 9, ignore_eos=True)] * 2


def test_output_kind_must_be_a_request_output_kind() -> None:
    with pytest.raises(ValueError, match="output_kind"):
        SamplingParams(output_kind="delta")  # type: ignore[arg-type]


def test_an_unread_delta_output_merges_its_completion() -> None:
    def out(i: int) -> RequestOutput:
        lp = [{i: Logprob(-float(i))}]
        c = CompletionOutput(index=0, text=f"<{i}>", token_ids=[i], finish_reason=None, logprobs=lp)
        return RequestOutput(
            request_id="r",
            prompt=None,
            prompt_token_ids=[1],
            outputs=[c],
            finished=False,
            metrics=RequestMetrics(arrival_time=0.0),
            delta_text=f"<{i}>",
            delta_token_ids=[i],
        )

    async def run() -> None:
        q = OutputQueue()
        q.delta = True
        for i in range(3):  # nobody reads: one output holds the three steps' deltas
            q.put_nowait(out(i))
        assert q.qsize() == 1
        got = q.get_nowait()
        assert isinstance(got, RequestOutput)
        c = got.outputs[0]
        assert (c.text, c.token_ids) == ("<0><1><2>", [0, 1, 2])
        assert (got.delta_text, got.delta_token_ids) == ("<0><1><2>", [0, 1, 2])
        assert c.logprobs == [{i: Logprob(-float(i))} for i in range(3)]

    asyncio.run(run())


def test_kinds_agree_under_speculation_with_a_stop_inside_an_accepted_run(tmp_path: Path) -> None:
    """With an n-gram drafter a step emits several tokens: DELTA outputs carry the whole accepted run, a stop
    string found inside the run cuts it, and the kinds still agree on one completion (and with plain)."""
    from hyspec_testing.tiny import build_tiny_checkpoint

    ckpt = build_tiny_checkpoint(tmp_path / "lfm2", "lfm2")
    prompts = [[(i * 7 + r) % 9 + 5 for i in range(40 + 9 * r)] for r in range(3)]  # repetitive: drafts hit

    def engine(spec: dict[str, object] | None) -> LLMEngine:
        return LLM(model=str(ckpt), max_num_seqs=4, max_model_len=160, speculative_config=spec).engine

    base = SamplingParams(max_tokens=30, temperature=0, ignore_eos=True, logprobs=1)
    plain = [o.outputs[0] for o in LLM.from_engine(engine(None)).generate(
        [{"prompt_token_ids": p} for p in prompts], base, use_tqdm=False)]  # fmt: skip
    # a stop string from the middle of each plain completion's text (it ends inside some step's tokens)
    stops = [c.text[len(c.text) // 2 : len(c.text) // 2 + 2] for c in plain]
    eng = engine({"method": "ngram", "num_speculative_tokens": 3})
    ids = {}
    for i, p in enumerate(prompts):
        for kind in RequestOutputKind:
            params = dataclasses.replace(base, stop=[stops[i]], output_kind=kind)
            ids[(i, kind)] = eng.add_request({"prompt_token_ids": p}, params)
    seen: dict[str, list[RequestOutput]] = {rid: [] for rid in ids.values()}
    for outs in _steps(eng):
        for o in outs:
            seen[o.request_id].append(o)
    assert eng.stats.spec_num_accepted_tokens > 0
    assert any(len(o.delta_token_ids) > 1 for outs in seen.values() for o in outs)  # several tokens a step
    for i in range(len(prompts)):
        cum = seen[ids[(i, RequestOutputKind.CUMULATIVE)]][-1].outputs[0]
        final = seen[ids[(i, RequestOutputKind.FINAL_ONLY)]]
        delta = seen[ids[(i, RequestOutputKind.DELTA)]]
        assert len(final) == 1 and final[0].outputs[0].token_ids == cum.token_ids
        assert final[0].outputs[0].text == cum.text
        assert cum.finish_reason == "stop" and cum.stop_reason == stops[i]
        assert (
            plain[i].text.startswith(cum.text) and plain[i].token_ids[: len(cum.token_ids)] == cum.token_ids
        )
        assert [t for d in delta for t in d.outputs[0].token_ids] == cum.token_ids
        assert "".join(d.outputs[0].text for d in delta) == cum.text
        # the three are separate requests of one batch: their rounds' logprobs agree to float rounding
        joined = [e for d in delta for e in d.outputs[0].logprobs or []]
        assert cum.logprobs is not None and len(joined) == len(cum.logprobs) == len(cum.token_ids)
        for a, b in zip(joined, cum.logprobs, strict=True):
            assert list(a) == list(b) and [x.rank for x in a.values()] == [x.rank for x in b.values()]
            assert [x.logprob for x in a.values()] == pytest.approx([x.logprob for x in b.values()], abs=1e-5)


def test_an_aborted_request_gets_its_kinds_last_output() -> None:
    """Aborting mid-generation: a FINAL_ONLY request's one output is the whole completion so far (finished,
    "abort"); a DELTA request's last output holds only what it had not handed out; CUMULATIVE the whole."""
    eng = toy_engine()
    ids = {}
    for kind in RequestOutputKind:
        params = SamplingParams(max_tokens=40, temperature=0, ignore_eos=True, output_kind=kind)
        ids[kind] = eng.add_request({"prompt_token_ids": PROMPTS[1]}, params)
    seen: dict[str, list[RequestOutput]] = {rid: [] for rid in ids.values()}
    for _ in range(6):
        for o in eng.step():
            seen[o.request_id].append(o)
    assert seen[ids[RequestOutputKind.FINAL_ONLY]] == []  # nothing before the end
    for rid in ids.values():
        out = eng.abort(rid)
        assert out is not None and out.finished and out.outputs[0].finish_reason == "abort"
        seen[rid].append(out)
    cum = seen[ids[RequestOutputKind.CUMULATIVE]][-1].outputs[0]
    final = seen[ids[RequestOutputKind.FINAL_ONLY]]
    delta = seen[ids[RequestOutputKind.DELTA]]
    assert 0 < len(cum.token_ids) < 40 and cum.token_ids == toy_greedy(PROMPTS[1], 40)[: len(cum.token_ids)]
    assert len(final) == 1 and final[0].outputs[0].token_ids == cum.token_ids
    assert final[0].outputs[0].text == cum.text
    assert (
        delta[-1].outputs[0].token_ids == []
        and [t for d in delta for t in d.outputs[0].token_ids] == cum.token_ids
    )
