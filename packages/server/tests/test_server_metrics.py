from hyspec_server import LLM, SamplingParams
from hyspec_server.metrics import EngineMetrics
from hyspec_testing.server import metric_sample, toy_engine


def test_engine_metrics_after_a_run() -> None:
    eng = toy_engine(seqs=4, pages=256)
    LLM.from_engine(eng).generate(["ab", "cde"], SamplingParams(max_tokens=5, temperature=0, ignore_eos=True))
    m = EngineMetrics("toy")
    m.observe(eng)
    assert b"spec_decode" not in m.render()  # the toy engine does not speculate
    text = m.render().decode()
    assert metric_sample(text, "hyspec:generation_tokens_total") == 10
    assert metric_sample(text, "hyspec:prompt_tokens_total") == 5
    assert metric_sample(text, "hyspec:request_success_total", finished_reason="length") == 2
    assert metric_sample(text, "hyspec:time_to_first_token_seconds_count") == 2
    assert metric_sample(text, "hyspec:request_time_per_output_token_seconds_count") == 2
    assert not eng.stats.ttft and not eng.stats.itl  # drained
    m.observe(eng)
    text = m.render().decode()
    # neither counters nor histograms count twice
    assert metric_sample(text, "hyspec:time_to_first_token_seconds_count") == 2
    assert metric_sample(text, "hyspec:generation_tokens_total") == 10
