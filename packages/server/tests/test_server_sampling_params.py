from __future__ import annotations

from pathlib import Path

import pytest
from hyspec_server import LLM, SamplingParams, StructuredOutputsParams
from hyspec_server.sampling_params import MAX_TEMPERATURE, MAX_TOKEN_ID_ENTRIES
from hyspec_testing.server import TOY_VOCAB, toy_engine, toy_greedy


def test_defaults_mirror_vllm() -> None:
    p = SamplingParams()
    assert (p.max_tokens, p.temperature, p.top_p, p.top_k, p.min_p) == (16, 1.0, 1.0, -1, 0.0)
    assert p.stop_strings == () and p.stop_token_set == frozenset() and not p.greedy
    assert SamplingParams(temperature=0).greedy


@pytest.mark.parametrize(
    ("kwargs", "field"),
    [
        ({"max_tokens": 0}, "max_tokens"),
        ({"max_tokens": -3}, "max_tokens"),
        ({"max_tokens": True}, "max_tokens"),
        ({"max_tokens": 2.0}, "max_tokens"),
        ({"temperature": -0.1}, "temperature"),
        ({"temperature": float("nan")}, "temperature"),
        ({"temperature": "1"}, "temperature"),
        ({"top_p": 0.0}, "top_p"),
        ({"top_p": 1.5}, "top_p"),
        ({"top_k": -2}, "top_k"),
        ({"top_k": 1.5}, "top_k"),
        ({"min_p": -0.01}, "min_p"),
        ({"min_p": 1.01}, "min_p"),
        ({"seed": "x"}, "seed"),
        ({"stop": ""}, "stop"),
        ({"stop": ["ok", 3]}, "stop"),
        ({"stop_token_ids": [-1]}, "stop_token_ids"),
        ({"stop_token_ids": "5"}, "stop_token_ids"),
        ({"ignore_eos": 1}, "ignore_eos"),
        ({"logprobs": -1}, "logprobs"),
        ({"logprobs": 21}, "logprobs"),  # past vLLM's default max_logprobs
        ({"prompt_logprobs": 10**9}, "prompt_logprobs"),
        ({"n": 0}, "n"),
        ({"n": 129}, "n"),
        # extreme floats: NaN and inf everywhere, and a temperature past MAX_TEMPERATURE (past fp32's range
        # the sampler divided by inf: NaN logits under a constraint, arbitrary top-k / top-p tokens)
        ({"temperature": 1e308}, "temperature"),
        ({"temperature": 10**400}, "temperature"),  # an int too large for a float
        ({"temperature": float("inf")}, "temperature"),
        ({"top_p": float("nan")}, "top_p"),
        ({"top_p": float("inf")}, "top_p"),
        ({"min_p": float("nan")}, "min_p"),
        ({"presence_penalty": float("nan")}, "presence_penalty"),
        ({"presence_penalty": 1e308}, "presence_penalty"),
        ({"frequency_penalty": float("-inf")}, "frequency_penalty"),
        ({"repetition_penalty": float("nan")}, "repetition_penalty"),
        ({"repetition_penalty": float("inf")}, "repetition_penalty"),
        ({"logit_bias": {5: float("inf")}}, "logit_bias"),
        ({"logit_bias": {5: 1e308}}, "logit_bias"),
    ],
)
def test_bad_values_name_the_field(kwargs: dict[str, object], field: str) -> None:
    with pytest.raises(ValueError, match=f"^{field} "):
        SamplingParams(**kwargs)  # type: ignore[arg-type]


def test_stop_forms_and_frozen() -> None:
    assert SamplingParams(stop="a").stop_strings == ("a",)
    assert SamplingParams(stop=["a", "bc"]).stop_strings == ("a", "bc")
    assert SamplingParams(stop_token_ids=[3, 4]).stop_token_set == {3, 4}
    assert SamplingParams(top_k=0).top_k == 0 and SamplingParams(top_k=5).top_k == 5
    with pytest.raises(AttributeError):
        SamplingParams().max_tokens = 3  # type: ignore[misc]


def test_ranges_that_fit_the_tensors_and_tiny_temperatures() -> None:
    from hyspec_server.sampling_params import GREEDY_BELOW, MAX_ID

    with pytest.raises(ValueError, match="top_k"):
        SamplingParams(top_k=2**63)
    with pytest.raises(ValueError, match="stop_token_ids"):
        SamplingParams(stop_token_ids=[2**63])
    with pytest.raises(ValueError, match="repetition_penalty"):
        SamplingParams(repetition_penalty=1e-300)
    with pytest.raises(ValueError, match="repetition_penalty"):
        SamplingParams(repetition_penalty=1e300)
    assert SamplingParams(top_k=MAX_ID).top_k == MAX_ID
    # a temperature that would overflow logits / T to inf decodes greedily instead of sampling from NaN
    p = SamplingParams(temperature=1e-40)
    assert p.temperature == 0.0 and p.greedy
    assert SamplingParams(temperature=GREEDY_BELOW).temperature == GREEDY_BELOW


def test_stop_lists_are_bounded() -> None:
    from hyspec_server.sampling_params import MAX_STOP_CHARS, MAX_STOP_STRINGS

    SamplingParams(stop=[f"s{i}" for i in range(MAX_STOP_STRINGS)])
    SamplingParams(stop="x" * MAX_STOP_CHARS)
    with pytest.raises(ValueError, match="stop: at most"):
        SamplingParams(stop=[f"s{i}" for i in range(MAX_STOP_STRINGS + 1)])
    with pytest.raises(ValueError, match="stop: at most"):
        SamplingParams(stop="x" * (MAX_STOP_CHARS + 1))
    with pytest.raises(ValueError, match="stop: at most"):
        SamplingParams(stop=["a", "y" * (MAX_STOP_CHARS + 1)])


def test_params_own_copies_of_the_callers_lists() -> None:
    stop, ids, bias = ["ab", "cd"], [3, 4], {5: 1.0, 6: -2}
    p = SamplingParams(stop=stop, stop_token_ids=ids, logit_bias=bias)
    stop.append("ef")
    ids[0] = 10**12  # past every bound: it would fail the step, never validated
    bias[7] = 1000.0
    del bias[5]
    assert p.stop == ("ab", "cd") and p.stop_strings == ("ab", "cd")
    assert p.stop_token_ids == (3, 4) and p.stop_token_set == {3, 4}
    assert p.logit_bias == {5: 1.0, 6: -2.0} and p.logit_bias is not bias
    assert SamplingParams(stop="x").stop == "x"  # a single string stays one
    choice, schema = ["yes", "no"], {"type": "object", "properties": {"a": {"type": "integer"}}}
    so = StructuredOutputsParams(choice=choice)
    js = StructuredOutputsParams(json=schema)
    choice.append("")
    schema["properties"]["a"]["type"] = "string"
    assert so.choice == ("yes", "no") and so.key == ("choice", '["yes", "no"]')
    assert js.json == {"type": "object", "properties": {"a": {"type": "integer"}}}


def test_a_request_keeps_its_stop_ids_when_the_caller_changes_its_list() -> None:
    eng = toy_engine()
    prompt = [5, 6, 7]
    ref = toy_greedy(prompt, 20, ignore_eos=True)
    stop = ref[4]
    ids = [stop]
    rid = eng.add_request(
        prompt, SamplingParams(max_tokens=20, temperature=0, ignore_eos=True, stop_token_ids=ids)
    )
    ids[0] = ref[1]  # after add_request: the request must still stop at `stop`, not earlier
    ids.append(ref[0])
    final = None
    while eng.has_unfinished():
        for out in eng.step():
            if out.request_id == rid and out.finished:
                final = out
    assert final is not None
    assert final.outputs[0].token_ids == ref[: ref.index(stop) + 1] and final.outputs[0].stop_reason == stop
    eng.leak_check()


def test_token_id_lists_are_bounded() -> None:
    SamplingParams(stop_token_ids=[1] * MAX_TOKEN_ID_ENTRIES)
    SamplingParams(logit_bias={i: 1.0 for i in range(MAX_TOKEN_ID_ENTRIES)})
    with pytest.raises(ValueError, match=f"^stop_token_ids: at most {MAX_TOKEN_ID_ENTRIES} token ids, got "):
        SamplingParams(stop_token_ids=[1] * (MAX_TOKEN_ID_ENTRIES + 1))
    with pytest.raises(
        ValueError, match=f"^logit_bias: at most {MAX_TOKEN_ID_ENTRIES} token ids, got 1000000"
    ):
        SamplingParams(logit_bias=dict.fromkeys(range(10**6), 1.0))
    # a refused huge list is not repeated whole in the message
    with pytest.raises(ValueError, match="stop_token_ids") as e:
        SamplingParams(stop_token_ids=[-1] * 10**5)
    assert len(str(e.value)) < 400


def test_token_ids_outside_the_vocabulary_are_refused_by_the_engine() -> None:
    eng = toy_engine()
    llm = LLM.from_engine(eng)
    for field, value in (("logit_bias", {3: 1.0, TOY_VOCAB: 1.0, TOY_VOCAB + 5: -1.0}),):
        params = SamplingParams(max_tokens=2, **{field: value})  # type: ignore[arg-type]
        want = rf"^{field}: token ids must be in \[0, {TOY_VOCAB}\) for this model, got \[{TOY_VOCAB}"
        with pytest.raises(ValueError, match=want):
            eng.add_request([1, 2], params)
        with pytest.raises(ValueError, match=rf"prompts\[1\]: {field}: token ids"):
            llm.generate(
                [{"prompt_token_ids": [1]}] * 2, [SamplingParams(max_tokens=2), params], use_tqdm=False
            )
    # the last id of the vocabulary is fine; stop token ids past it too (never generated, as in vLLM)
    ok = SamplingParams(max_tokens=2, logit_bias={TOY_VOCAB - 1: 1.0}, stop_token_ids=[TOY_VOCAB + 9])
    assert llm.generate([{"prompt_token_ids": [1]}], ok, use_tqdm=False)[0].finished
    eng.leak_check()


def test_extreme_finite_sampling_values_on_a_tiny_model(tiny_qwen3_5: Path) -> None:
    # the largest temperature still divides fp32 logits safely: top-k 1 and a tiny top-p keep the most
    # likely token (greedy output), and a constrained row never samples from NaN (1e308 was inf in fp32:
    # top-k kept an arbitrary token and the constrained request failed its step)
    llm = LLM(str(tiny_qwen3_5), device="cpu", max_model_len=128, max_num_seqs=4)
    prompt = [{"prompt_token_ids": [1, 2, 3]}]
    greedy = llm.generate(
        prompt, SamplingParams(max_tokens=8, temperature=0, ignore_eos=True), use_tqdm=False
    )
    want = greedy[0].outputs[0].token_ids
    for extra in ({"top_k": 1}, {"top_p": 5e-324}, {"top_p": 1e-9, "min_p": 5e-324}):
        p = SamplingParams(max_tokens=8, temperature=MAX_TEMPERATURE, seed=3, ignore_eos=True, **extra)  # type: ignore[arg-type]
        assert llm.generate(prompt, p, use_tqdm=False)[0].outputs[0].token_ids == want, extra
    so = StructuredOutputsParams(choice=["ab", "cd"])
    p = SamplingParams(max_tokens=8, temperature=MAX_TEMPERATURE, seed=1, structured_outputs=so)
    out = llm.generate(prompt * 3, p, use_tqdm=False)
    assert all(o.outputs[0].text in ("ab", "cd") and o.outputs[0].finish_reason == "stop" for o in out)
    # penalties and biases at their bounds, sampled at the largest temperature, with logprobs
    p = SamplingParams(
        max_tokens=8,
        temperature=MAX_TEMPERATURE,
        seed=2,
        presence_penalty=-2.0,
        frequency_penalty=2.0,
        repetition_penalty=100.0,
        logit_bias={5: 100.0, 6: -100.0},
        logprobs=2,
        ignore_eos=True,
    )
    c = llm.generate(prompt, p, use_tqdm=False)[0].outputs[0]
    assert len(c.token_ids) == 8 and c.cumulative_logprob is not None and c.cumulative_logprob > float("-inf")
    with pytest.raises(ValueError, match=r"^temperature "):
        SamplingParams(temperature=MAX_TEMPERATURE * 1.01)
    llm.leak_check()
