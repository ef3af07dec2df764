from hyspec_server import LLM, SamplingParams
from hyspec_server.metrics import EngineMetrics, Histogram
from hyspec_server.testing import toy_engine


def _values(text: str) -> dict[str, float]:
    pairs = [line.rsplit(" ", 1) for line in text.splitlines() if line[:1] != "#"]
    return {name: float(value) for name, value in pairs}


def test_histogram_buckets_are_cumulative() -> None:
    h = Histogram((0.1, 1.0))
    for v in (0.05, 0.1, 0.5, 3.0):
        h.observe(v)
    v = _values("\n".join(h.render("x", "help")))
    assert (v['x_bucket{le="0.1"}'], v['x_bucket{le="1.0"}'], v['x_bucket{le="+Inf"}']) == (2, 3, 4)
    assert v["x_count"] == 4 and abs(v["x_sum"] - 3.65) < 1e-9


def test_engine_metrics_after_a_run() -> None:
    eng = toy_engine(seqs=4, pages=256)
    LLM.from_engine(eng).generate(["ab", "cde"], SamplingParams(max_tokens=5, temperature=0, ignore_eos=True))
    m = EngineMetrics()
    assert "accept_length" not in m.render()  # only once speculation reports something
    eng.stats.accept_lengths.extend([1, 3, 3])
    m.observe(eng)
    v = _values(m.render())
    assert v["hyspec_generation_tokens_total"] == 10 and v["hyspec_prompt_tokens_total"] == 5
    assert v["hyspec_request_success_total"] == 2
    assert v["hyspec_time_to_first_token_seconds_count"] == 2
    assert v["hyspec_time_per_output_token_seconds_count"] == 2
    assert v["hyspec_spec_decode_accept_length_count"] == 3 and v["hyspec_spec_decode_accept_length_sum"] == 7
    assert eng.stats.ttft == [] and eng.stats.accept_lengths == []  # drained
    m.observe(eng)
    assert _values(m.render())["hyspec_time_to_first_token_seconds_count"] == 2  # not double counted
