import pytest
from hyspec_server import SamplingParams


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
