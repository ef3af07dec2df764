"""`SamplingParams(n=k)` through `LLM.generate`: k completions per prompt, seeded like the HTTP server's."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any

import httpx
import pytest
from hyspec_server import LLM, SamplingParams
from hyspec_server.engine import LLMEngine
from hyspec_server.outputs import CompletionOutput
from hyspec_server.protocol import derived_seed as protocol_derived_seed
from hyspec_server.sampling_params import MAX_N, derived_seed
from hyspec_server.serve import ServerThread
from hyspec_testing.server import TOY_VOCAB, ByteTokenizer, toy_engine, toy_greedy

TOK = ByteTokenizer()


def sampled(n: int, seed: int | None, max_tokens: int = 8) -> SamplingParams:
    return SamplingParams(n=n, seed=seed, temperature=1.0, max_tokens=max_tokens, ignore_eos=True)


def token_ids(out: Sequence[CompletionOutput]) -> list[list[int]]:
    return [c.token_ids for c in out]


@pytest.mark.parametrize("n", [0, -1, MAX_N + 1, True, 2.0, "2"])
def test_bad_n_names_the_field(n: object) -> None:
    with pytest.raises(ValueError, match=r"^n "):
        SamplingParams(n=n)  # type: ignore[arg-type]


def test_n_bounds_and_the_shared_seed_rule() -> None:
    assert SamplingParams(n=MAX_N).n == MAX_N == 128
    # one function for both APIs: the HTTP server's import is the same object
    assert protocol_derived_seed is derived_seed
    assert derived_seed(5, 0) == 5 and derived_seed(None, 3) is None
    seeds = {derived_seed(5, j) for j in range(1, 64)}
    assert len(seeds) == 63 and 5 not in seeds


def test_outputs_count_indices_and_per_sample_seeds() -> None:
    llm = LLM.from_engine(toy_engine())
    prompts: list[str | dict[str, object]] = ["Hello", {"prompt_token_ids": [7, 8, 9]}, "x"]
    params = [sampled(3, 7), sampled(1, 7), sampled(2, None)]
    outs = llm.generate(prompts, params)
    assert [len(o.outputs) for o in outs] == [3, 1, 2]
    for o in outs:
        assert [c.index for c in o.outputs] == list(range(len(o.outputs)))
        assert o.finished and all(c.finish_reason == "length" and len(c.token_ids) == 8 for c in o.outputs)
    assert outs[0].prompt == "Hello" and outs[0].prompt_token_ids == TOK.encode("Hello")
    assert outs[1].prompt_token_ids == [7, 8, 9]
    assert len({o.request_id for o in outs}) == 3
    # sample j is exactly the n=1 request seeded derived_seed(7, j)
    singles = llm.generate(["Hello"] * 3, [sampled(1, derived_seed(7, j)) for j in range(3)])
    assert token_ids(outs[0].outputs) == [s.outputs[0].token_ids for s in singles]
    assert len({tuple(t) for t in token_ids(outs[0].outputs)}) == 3
    # n=1 requests keep the engine's own request id and their output object
    assert outs[1].request_id.startswith("req-") and "-" not in outs[1].request_id[4:]
    llm.leak_check()


def test_seeded_determinism_and_greedy_copies() -> None:
    llm = LLM.from_engine(toy_engine())
    a = llm.generate("seeded", sampled(4, 123))[0]
    b = llm.generate(["other", "seeded"], sampled(4, 123))[1]  # another batch mix, same samples
    c = llm.generate("seeded", sampled(4, 124))[0]
    assert token_ids(a.outputs) == token_ids(b.outputs)
    assert token_ids(a.outputs) != token_ids(c.outputs)
    g = llm.generate("greedy", SamplingParams(n=4, temperature=0, max_tokens=10, ignore_eos=True))[0]
    want = toy_greedy(TOK.encode("greedy"), 10, ignore_eos=True)
    assert token_ids(g.outputs) == [want] * 4
    assert [c.text for c in g.outputs] == [TOK.decode(want)] * 4
    llm.leak_check()


def test_bad_arguments_name_themselves_and_lose_nothing() -> None:
    """Wrong types and token ids the model has no embedding for are ValueErrors naming the argument, raised
    before anything runs; a good prompt in the same call is not started, and the engine serves on."""
    llm = LLM.from_engine(toy_engine())
    bad: list[tuple[Any, Any, str]] = [
        (None, None, "prompts"),
        (5, None, "prompts"),
        ("fine", {"max_tokens": 3}, "sampling_params"),
        ("fine", [SamplingParams(), {"max_tokens": 3}], "sampling_params"),
        (["fine", {"prompt_token_ids": [5, TOY_VOCAB]}], None, "prompt_token_ids"),
        (["fine", {"prompt_token_ids": [5, -1]}], None, "prompt_token_ids"),
    ]
    for prompts, params, name in bad:
        with pytest.raises(ValueError, match=name):
            llm.generate(prompts, params)
        assert not llm.engine.requests
        llm.leak_check()
    with pytest.raises(ValueError, match=f"prompt_token_ids: expected token ids in \\[0, {TOY_VOCAB}\\)"):
        llm.engine.add_request([1, TOY_VOCAB + 7], SamplingParams())
    # a list of params has one entry per prompt, and the message says so (it once asked for "1 or 2
    # entries" while refusing a list of 1)
    for params in ([sampled(1, 1)], [sampled(1, 1)] * 3):
        with pytest.raises(ValueError, match=r"one per prompt \(2\), got [13]; pass one SamplingParams"):
            llm.generate(["a", "b"], params)
        assert not llm.engine.requests
    assert len(llm.generate(["a", "b"], [sampled(1, 1)] * 2)) == 2
    # any iterable of prompts works (a generator, a dataset column)
    assert len(llm.generate((p for p in ["a", "b"]), sampled(1, 1))) == 2
    out = llm.generate({"prompt_token_ids": [5, TOY_VOCAB - 1]}, sampled(2, 1))
    assert len(out[0].outputs) == 2


def test_bad_prompt_after_a_fanned_out_one_aborts_every_sample() -> None:
    llm = LLM.from_engine(toy_engine())
    with pytest.raises(ValueError, match="at least one token"):
        llm.generate(["fine", ""], sampled(5, 1))
    assert not llm.engine.requests
    llm.leak_check()
    assert len(llm.generate("fine", sampled(5, 1))[0].outputs) == 5


def test_same_samples_as_the_http_server_and_no_double_fan_out() -> None:
    engine = toy_engine()
    seen: list[SamplingParams] = []
    add = engine.add_request

    def spy(prompt: str | Sequence[int], params: SamplingParams, *, request_id: str | None = None) -> str:
        seen.append(params)
        return add(prompt, params, request_id=request_id)

    engine.add_request = spy  # type: ignore[method-assign]
    srv = ServerThread(engine, model_name="toy").start()
    try:
        r = httpx.post(
            srv.base_url + "/v1/completions",
            json={
                "model": "toy",
                "prompt": "Hi there",
                "n": 3,
                "seed": 42,
                "temperature": 1.0,
                "max_tokens": 8,
                "ignore_eos": True,
                "return_token_ids": True,
            },
            timeout=30,
        )
        assert r.status_code == 200, r.text
        http = {ch["index"]: ch["token_ids"] for ch in r.json()["choices"]}
        srv.wait_idle_and_leak_check()
    finally:
        srv.stop()
    assert len(seen) == 3 and all(p.n == 1 for p in seen)
    llm = LLM.from_engine(toy_engine())
    out = llm.generate("Hi there", sampled(3, 42))[0]
    assert [http[i] for i in range(3)] == token_ids(out.outputs)
    llm.leak_check()


def test_tiny_lfm2_n_samples(tiny_lfm2: Path) -> None:
    llm = LLM(model=str(tiny_lfm2), max_num_seqs=4, max_num_batched_tokens=12, page_size=4)
    eng: LLMEngine = llm.engine
    prompt = [1, 5, 9, 2]
    fan = llm.generate({"prompt_token_ids": prompt}, sampled(3, 9, max_tokens=5))[0]
    singles = llm.generate(
        [{"prompt_token_ids": prompt}] * 3, [sampled(1, derived_seed(9, j), max_tokens=5) for j in range(3)]
    )
    assert [c.index for c in fan.outputs] == [0, 1, 2]
    assert token_ids(fan.outputs) == [s.outputs[0].token_ids for s in singles]
    greedy = llm.generate({"prompt_token_ids": prompt}, SamplingParams(n=2, temperature=0, max_tokens=5))[0]
    assert len(greedy.outputs) == 2 and greedy.outputs[0].token_ids == greedy.outputs[1].token_ids
    assert not eng.requests
    llm.leak_check()
