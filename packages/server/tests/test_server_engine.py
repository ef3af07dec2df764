import random
from collections.abc import Callable

import pytest
from hyspec_runner.runner import RunnerOutput
from hyspec_server import LLM, EngineArgs, SamplingParams
from hyspec_server.engine import EngineStepError, LLMEngine
from hyspec_server.scheduler import QueueFullError, SchedulerConfig, SchedulerOutput
from hyspec_spec_workers.config import SpeculativeConfig
from hyspec_testing.server import TOY_EOS, ByteTokenizer, ToyModelRunner, toy_engine, toy_greedy, toy_pool

GREEDY = SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True)


def make_engine(
    *,
    pages: int = 128,
    page_size: int = 4,
    budget: int = 64,
    seqs: int = 8,
    max_len: int = 160,
    max_waiting: int = 1024,
) -> LLMEngine:
    pool = toy_pool(max_num_seqs=seqs, max_model_len=max_len, num_kv_pages=pages, page_size=page_size)
    runner = ToyModelRunner(pool, max_model_len=max_len)
    cfg = SchedulerConfig(max_num_seqs=seqs, max_num_batched_tokens=budget, max_waiting=max_waiting)
    return LLMEngine(runner, ByteTokenizer(), cfg)


def prompts(n: int, seed: int = 0) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(32, 127) for _ in range(rng.randrange(1, 40))] for _ in range(n)]


@pytest.mark.parametrize(("budget", "page_size"), [(7, 1), (64, 4), (13, 5)])
def test_greedy_batch_matches_reference_with_chunked_prefill(budget: int, page_size: int) -> None:
    eng = make_engine(budget=budget, page_size=page_size, pages=800 // page_size)
    ps = prompts(10)
    outs = LLM.from_engine(eng).generate([{"prompt_token_ids": p} for p in ps], GREEDY)
    for p, o in zip(ps, outs):
        assert o.prompt_token_ids == p
        assert o.outputs[0].token_ids == toy_greedy(p, 24, ignore_eos=True)
        assert o.outputs[0].finish_reason == "length" and o.finished
    eng.leak_check()


def test_preemption_under_tiny_kv_pool_gives_same_greedy_outputs() -> None:
    ps = prompts(8, seed=1)
    params = SamplingParams(max_tokens=40, temperature=0.0, ignore_eos=True)
    big = make_engine(pages=400)
    ref = LLM.from_engine(big).generate([{"prompt_token_ids": p} for p in ps], params)
    # 24 pages of 4 tokens: one request at max context fits, eight at once do not
    small = make_engine(pages=24, max_len=90)
    outs = LLM.from_engine(small).generate([{"prompt_token_ids": p} for p in ps], params)
    assert small.scheduler.num_preemptions > 0
    assert sum(o.metrics.num_preemptions for o in outs) == small.scheduler.num_preemptions
    assert [o.outputs[0].token_ids for o in outs] == [o.outputs[0].token_ids for o in ref]
    small.leak_check()


def test_seeded_sampling_is_independent_of_batch_and_preemption() -> None:
    p = [72, 101, 108, 108, 111]
    params = SamplingParams(max_tokens=30, temperature=1.0, top_k=20, seed=1234, ignore_eos=True)
    alone = LLM.from_engine(make_engine()).generate([{"prompt_token_ids": p}], params)[0].outputs[0].token_ids
    crowd = [SamplingParams(max_tokens=30, temperature=0.8, ignore_eos=True)] * 6
    eng = make_engine(pages=30, max_len=90)
    outs = LLM.from_engine(eng).generate(
        [{"prompt_token_ids": q} for q in prompts(6, seed=3)] + [{"prompt_token_ids": p}], [*crowd, params]
    )
    assert outs[-1].outputs[0].token_ids == alone
    assert alone != toy_greedy(p, 30, ignore_eos=True)  # it sampled
    other = SamplingParams(max_tokens=30, temperature=1.0, top_k=20, seed=99, ignore_eos=True)
    assert (
        LLM.from_engine(make_engine()).generate([{"prompt_token_ids": p}], other)[0].outputs[0].token_ids
        != alone
    )


def test_eos_stop_ids_and_max_model_len() -> None:
    ps = prompts(30, seed=4)
    eng = make_engine()
    outs = LLM.from_engine(eng).generate(
        [{"prompt_token_ids": p} for p in ps], SamplingParams(max_tokens=40, temperature=0)
    )
    hit_eos = 0
    for p, o in zip(ps, outs):
        ref = toy_greedy(p, 40)
        assert o.outputs[0].token_ids == ref
        if ref[-1] == TOY_EOS:
            hit_eos += 1
            assert o.outputs[0].finish_reason == "stop" and o.outputs[0].text == ByteTokenizer().decode(
                ref[:-1]
            )
    assert hit_eos > 0
    p = ps[0]
    ref = toy_greedy(p, 20, ignore_eos=True)
    stop_id = ref[5]
    o = (
        LLM.from_engine(eng)
        .generate(
            [{"prompt_token_ids": p}],
            SamplingParams(max_tokens=20, temperature=0, stop_token_ids=[stop_id], ignore_eos=True),
        )[0]
        .outputs[0]
    )
    assert o.token_ids == ref[: ref.index(stop_id) + 1] and o.stop_reason == stop_id
    short = make_engine(max_len=len(p) + 30)
    o = LLM.from_engine(short).generate(
        [{"prompt_token_ids": p}], SamplingParams(max_tokens=30, temperature=0, ignore_eos=True)
    )[0]
    assert len(o.outputs[0].token_ids) == 30 and o.outputs[0].finish_reason == "length"
    eng.leak_check()


def test_stop_string_from_the_models_own_output() -> None:
    eng = make_engine()
    p = list(b"stop strings")
    ref = toy_greedy(p, 40, ignore_eos=True)
    full = ByteTokenizer().decode(ref)
    stop = full[12:15]
    first = full.index(stop)
    o = (
        LLM.from_engine(eng)
        .generate(
            [{"prompt_token_ids": p}],
            SamplingParams(max_tokens=40, temperature=0, stop=[stop, "\x00never"], ignore_eos=True),
        )[0]
        .outputs[0]
    )
    assert o.text == full[:first] and o.finish_reason == "stop" and o.stop_reason == stop
    # the last token kept is the one that completed the stop string
    k = next(k for k in range(len(ref) + 1) if stop in ByteTokenizer().decode(ref[:k]))
    assert o.token_ids == ref[:k]


def test_abort_frees_memory_and_spares_others() -> None:
    eng = make_engine()
    ps = prompts(4, seed=5)
    ids = [eng.add_request(p, GREEDY) for p in ps]
    for _ in range(3):
        eng.step()
    live = eng.runner.memory.num_live()
    out = eng.abort(ids[1])
    assert out is not None and out.outputs[0].finish_reason == "abort" and out.finished
    assert eng.runner.memory.num_live() == live - 1
    assert eng.abort(ids[1]) is None  # twice is harmless
    final = {}
    while eng.has_unfinished():
        for o in eng.step():
            if o.finished:
                final[o.request_id] = o
    assert set(final) == {ids[0], ids[2], ids[3]}
    for i in (0, 2, 3):
        assert final[ids[i]].outputs[0].token_ids == toy_greedy(ps[i], 24, ignore_eos=True)
    eng.leak_check()


def test_a_failed_step_is_retried_request_by_request() -> None:
    """A step that fails once (nobody to blame): its requests are recomputed one at a time and then batched
    again; every output is what it would have been, nothing is aborted."""
    eng = make_engine()
    ps = prompts(3)
    ids = [eng.add_request(p, GREEDY) for p in ps]
    eng.step()
    eng.runner.fail_next_step = True  # type: ignore[attr-defined]
    final = {}
    while eng.has_unfinished():
        for o in eng.step():
            if o.finished:
                final[o.request_id] = o
    assert [final[i].outputs[0].token_ids for i in ids] == [toy_greedy(p, 24, ignore_eos=True) for p in ps]
    assert all(final[i].outputs[0].finish_reason == "length" for i in ids)
    eng.leak_check()


class PoisonRunner(ToyModelRunner):
    """Fails every step that holds a request whose prompt starts with POISON (a request that breaks the
    model step, as `top_k: 2**63` once did)."""

    def execute(
        self, step: SchedulerOutput, *, while_queued: Callable[[], None] | None = None
    ) -> RunnerOutput:
        if any(c.request.prompt_token_ids[0] == POISON for c in step.chunks):
            raise RuntimeError("toy runner: poisoned batch")
        return super().execute(step, while_queued=while_queued)


POISON = 7


def test_one_bad_request_fails_alone_and_the_others_finish() -> None:
    eng = toy_engine(runner_cls=PoisonRunner)
    ps = prompts(4)
    bad = [POISON, 1, 2, 3]
    ids = [eng.add_request(p, GREEDY) for p in ps[:2]]
    bad_id = eng.add_request(bad, GREEDY)
    ids += [eng.add_request(p, GREEDY) for p in ps[2:]]
    final, failed = {}, []
    while eng.has_unfinished():
        try:
            outs = eng.step()
        except EngineStepError as e:
            failed += e.request_ids
            assert all(o.outputs[0].finish_reason == "abort" for o in e.outputs)
            continue
        final.update({o.request_id: o for o in outs if o.finished})
    assert failed == [bad_id]  # blamed alone, once
    assert [final[i].outputs[0].token_ids for i in ids] == [toy_greedy(p, 24, ignore_eos=True) for p in ps]
    eng.leak_check()


def test_logprobs_are_reported_for_every_token() -> None:
    eng = make_engine()
    o = LLM.from_engine(eng).generate(
        "hi", SamplingParams(max_tokens=6, temperature=0, logprobs=2, ignore_eos=True)
    )[0]
    c = o.outputs[0]
    assert c.logprobs is not None and len(c.logprobs) == 6
    for t, d in zip(c.token_ids, c.logprobs):
        # greedy: the chosen token is the most likely one, rank 1
        assert t in d and len(d) in (2, 3) and max(x.logprob for x in d.values()) == d[t].logprob
        assert d[t].rank == 1 and d[t].decoded_token == chr(t)
    assert c.cumulative_logprob == pytest.approx(sum(d[t].logprob for t, d in zip(c.token_ids, c.logprobs)))


def test_admission_errors() -> None:
    eng = make_engine(max_len=50, max_waiting=2)
    with pytest.raises(ValueError, match="max_model_len=50"):
        eng.add_request([1] * 40, SamplingParams(max_tokens=11))
    with pytest.raises(ValueError, match="at least one token"):
        eng.add_request([], SamplingParams())
    eng.add_request([1], SamplingParams(max_tokens=2), request_id="a")
    with pytest.raises(ValueError, match="already in use"):
        eng.add_request([1], SamplingParams(max_tokens=2), request_id="a")
    eng.add_request([1], SamplingParams(max_tokens=2))
    with pytest.raises(QueueFullError):
        eng.add_request([1], SamplingParams(max_tokens=2))
    with pytest.raises(ValueError, match="does not fit in the KV pool"):
        make_engine(pages=4, max_len=50)


def test_speculative_config_is_validated_in_engine_args() -> None:
    # valid configs pass; every invalid one names its field (more cases in test_server_speculative.py)
    EngineArgs(speculative_config={"method": "mtp", "num_speculative_tokens": 2})
    EngineArgs(speculative_config='{"method": "ngram"}')
    with pytest.raises(ValueError, match=r"speculative_config\.num_speculative_tokens"):
        EngineArgs(speculative_config={"method": "ngram", "num_speculative_tokens": -1})
    assert EngineArgs(model="m", speculative_config=None).speculative_config is None
    # parsed once, here: the field holds the validated config
    parsed = EngineArgs(speculative_config={"method": "mtp", "num_speculative_tokens": 2}).speculative_config
    assert isinstance(parsed, SpeculativeConfig) and parsed.num_speculative_tokens == 2
    assert EngineArgs(speculative_config=parsed).speculative_config is parsed
    # the embedded default (no model) speculates with its MTP layer unless a config is given
    default = EngineArgs().speculative_config
    assert default == SpeculativeConfig.from_dict({"method": "mtp", "num_speculative_tokens": 3})
    ngram = EngineArgs(speculative_config={"method": "ngram"}).speculative_config
    assert ngram is not None and ngram.method == "ngram"


def test_running_requests_grow_in_one_call_and_preempt_the_newest_when_short() -> None:
    """The decoding rows of a step grow together (one page-table write) when memory holds them all; when
    it does not, nothing is granted by that call and rows grow one by one, preempting the newest request,
    exactly as before (outputs equal to a roomy pool's)."""
    ps = prompts(6, seed=3)
    params = SamplingParams(max_tokens=30, temperature=0.0, ignore_eos=True)
    ref = LLM.from_engine(make_engine(pages=400)).generate([{"prompt_token_ids": p} for p in ps], params)
    for pages, expect_preemption in ((400, False), (20, True)):
        eng = make_engine(pages=pages, max_len=80, budget=256)
        calls: list[int] = []
        grow = eng.scheduler.memory.grow

        def counted(ids: list[str], num: list[int], grow: object = grow, calls: list[int] = calls) -> bool:
            calls.append(len(ids))
            return grow(ids, num)  # type: ignore[operator]

        eng.scheduler.memory.grow = counted  # type: ignore[method-assign]
        outs = LLM.from_engine(eng).generate([{"prompt_token_ids": p} for p in ps], params)
        assert [o.outputs[0].token_ids for o in outs] == [o.outputs[0].token_ids for o in ref]
        assert (eng.scheduler.num_preemptions > 0) == expect_preemption
        assert max(calls) > 1  # several running rows in one call
        if not expect_preemption:
            # with room, every step after admission makes one grow call for all its running rows
            assert calls.count(len(ps)) >= 25
        eng.leak_check()
