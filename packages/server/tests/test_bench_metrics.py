"""`hyspec bench serve`'s metrics (bench_report.summarize) on synthetic timings, checked against values
computed by hand with vLLM's `vllm bench serve` definitions; and its driver (bench_cli._run) with a fake
client: concurrency bound, arrivals, failed turns."""

from __future__ import annotations

import asyncio
import itertools
import random
import statistics
from typing import Any

import pytest
from hyspec_server import bench_cli
from hyspec_server.bench_client import TurnResult
from hyspec_server.bench_datasets import Conversation, Turn, arrival_times, sample_len
from hyspec_server.bench_report import ServeRun, summarize


def req(start: float, chunks: list[float], tokens: int, input_len: int = 10) -> TurnResult:
    """A successful request that started at `start` and got content chunks at `chunks`; the stream ended
    with its last chunk."""
    return TurnResult(
        input_len=input_len,
        output_len=tokens,
        ok=True,
        start=start,
        end=chunks[-1],
        ttft=chunks[0] - start,
        chunk_times=list(chunks),
        usage=True,
    )


def failed(start: float, end: float, input_len: int = 7) -> TurnResult:
    return TurnResult(input_len=input_len, error="HTTP 500: boom", start=start, end=end)


def test_summarize_matches_hand_computed_vllm_metrics() -> None:
    runs = [
        # TTFT 0.1, E2EL 0.5, 5 tokens in 3 chunks (speculative: a chunk holds several tokens):
        # TPOT = (0.5 - 0.1) / 4 = 0.1; ITL per chunk: 0.2, 0.2
        req(0.0, [0.1, 0.3, 0.5], tokens=5, input_len=10),
        # one output token: no TPOT (0 for goodput), no ITL; TTFT = E2EL = 0.2
        req(0.5, [0.7], tokens=1, input_len=20),
        # TTFT 0.3, E2EL 1.0, 3 tokens: TPOT = 0.7 / 2 = 0.35; ITL 0.7
        req(1.0, [1.3, 2.0], tokens=3, input_len=30),
        failed(0.2, 0.4),
    ]
    run = ServeRun(runs, t0=0.0, duration=2.0)
    res = summarize(run, {"ttft": 250.0, "tpot": 200.0}, (50.0, 90.0, 99.9))
    assert res["completed"] == 3 and res["failed"] == 1
    assert res["first_error"] == "HTTP 500: boom"
    # failed requests count no tokens
    assert res["total_input_tokens"] == 60
    assert res["total_output_tokens"] == 9
    assert res["request_throughput"] == pytest.approx(3 / 2.0)
    assert res["output_throughput"] == pytest.approx(9 / 2.0)
    assert res["total_token_throughput"] == pytest.approx(69 / 2.0)
    # request 1: ttft 100 <= 250, tpot 100 <= 200; request 2: ttft 200, tpot 0; request 3: ttft 300 > 250
    assert res["request_goodput"] == pytest.approx(2 / 2.0)
    assert res["goodput_slos_ms"] == {"ttft": 250.0, "tpot": 200.0}

    ttfts = [100.0, 200.0, 300.0]
    tpots = [100.0, 350.0]
    itls = [200.0, 200.0, 700.0]
    e2els = [500.0, 200.0, 1000.0]
    for name, xs in (("ttft", ttfts), ("tpot", tpots), ("itl", itls), ("e2el", e2els)):
        assert res[f"mean_{name}_ms"] == pytest.approx(statistics.fmean(xs)), name
        assert res[f"median_{name}_ms"] == pytest.approx(statistics.median(xs)), name
        assert res[f"std_{name}_ms"] == pytest.approx(statistics.pstdev(xs)), name
        assert res[f"p50_{name}_ms"] == pytest.approx(statistics.median(xs)), name
    # numpy's linear percentile, by hand: p90 of [100, 200, 300] is at rank 1.8
    assert res["p90_ttft_ms"] == pytest.approx(200 + 0.8 * 100)
    assert res["p99.9_tpot_ms"] == pytest.approx(100 + 0.999 * 250)
    assert res["p90_itl_ms"] == pytest.approx(200 + 0.8 * 500)
    assert res["peak_concurrent_requests"] == 2


def test_goodput_e2el_and_none_without_slos() -> None:
    run = ServeRun([req(0.0, [0.1, 0.5], 2), req(0.0, [0.1, 0.9], 2)], t0=0.0, duration=1.0)
    assert summarize(run, {"e2el": 500.0}, ())["request_goodput"] == pytest.approx(1.0)
    # an SLO of exactly the measured value is met
    assert summarize(run, {"e2el": 900.0}, ())["request_goodput"] == pytest.approx(2.0)
    no_slo = summarize(run, {}, ())
    assert no_slo["request_goodput"] is None and no_slo["goodput_slos_ms"] is None


def test_no_successful_request_gives_zero_statistics() -> None:
    run = ServeRun([failed(0.0, 0.1), failed(0.0, 0.2)], t0=0.0, duration=0.3)
    res = summarize(run, {"ttft": 1.0}, (99.0,))
    assert res["completed"] == 0 and res["failed"] == 2
    assert res["request_goodput"] == 0.0 and res["output_throughput"] == 0.0
    for name in ("ttft", "tpot", "itl", "e2el"):
        assert res[f"mean_{name}_ms"] == res[f"p99_{name}_ms"] == res[f"std_{name}_ms"] == 0.0


def test_range_ratio_bounds_as_vllm() -> None:
    # vLLM: uniform integers in [floor(len * (1 - r)), ceil(len * (1 + r))], at least 1
    rng = random.Random(0)
    seen = {sample_len(rng, 100, 0.25) for _ in range(4000)}
    assert min(seen) == 75 and max(seen) == 125 and len(seen) == 51
    assert {sample_len(rng, 7, 0.0) for _ in range(50)} == {7}
    assert {sample_len(rng, 1, 0.9) for _ in range(200)} == {1, 2}


def test_gamma_arrivals_mean_rate_and_first_at_zero() -> None:
    for burstiness in (0.5, 1.0, 4.0):
        times = arrival_times(4001, 20.0, burstiness, seed=3)
        assert times[0] == 0.0
        gaps = [b - a for a, b in itertools.pairwise(times)]
        assert statistics.fmean(gaps) == pytest.approx(1 / 20.0, rel=0.08)
        # gamma(k, theta): variance k * theta^2 = mean^2 / k
        assert statistics.pvariance(gaps) == pytest.approx((1 / 20.0) ** 2 / burstiness, rel=0.2)
    assert arrival_times(5, 3.0, 1.0, seed=1) == arrival_times(5, 3.0, 1.0, seed=1)
    assert arrival_times(5, 3.0, 1.0, seed=1) != arrival_times(5, 3.0, 1.0, seed=2)


class FakeClient:
    """Answers after `delay` seconds; tracks how many requests are in flight at once."""

    def __init__(self, delay: float, chat: bool = False, fail_text: str | None = None) -> None:
        self.delay = delay
        self.chat = chat
        self.fail_text = fail_text
        self.running = 0
        self.peak = 0
        self.sent: list[Any] = []

    async def send(self, prompt: Any, turn: Turn) -> TurnResult:
        self.running += 1
        self.peak = max(self.peak, self.running)
        self.sent.append(prompt)
        r = TurnResult(input_len=turn.input_len, start=asyncio.get_running_loop().time())
        await asyncio.sleep(self.delay)
        self.running -= 1
        r.end = asyncio.get_running_loop().time()
        if self.fail_text is not None and self.fail_text in str(prompt):
            r.error = "failed"
            return r
        r.ok, r.output_len, r.text, r.chunk_times = True, 1, "answer", [r.end]
        return r


def one(text: str) -> Conversation:
    return Conversation((Turn(text, 1, 1),))


@pytest.mark.parametrize("limit", [1, 3, 7])
def test_max_concurrency_is_respected_exactly(limit: int) -> None:
    client = FakeClient(delay=0.01)
    convs = [one(f"p{i}") for i in range(20)]
    run = asyncio.run(bench_cli._run(client, convs, [0.0] * 20, limit, True))  # type: ignore[arg-type]
    assert client.peak == limit
    assert len(run.results) == 20 and all(r.ok for r in run.results)
    # dataset order is kept in the results
    assert [r.text for r in run.results] == ["answer"] * 20


def test_multi_turn_failure_skips_the_rest_and_counts_them() -> None:
    client = FakeClient(delay=0.001, chat=True, fail_text="bad")
    convs = [
        Conversation((Turn("a1", 1, 1), Turn("bad", 1, 1), Turn("a3", 1, 1))),
        Conversation((Turn("b1", 1, 1), Turn("b2", 1, 1))),
    ]
    run = asyncio.run(bench_cli._run(client, convs, [0.0, 0.0], 2, True))  # type: ignore[arg-type]
    assert [r.ok for r in run.results] == [True, False, False, True, True]
    assert run.results[2].error == "an earlier turn of its chat failed" and run.results[2].end == 0.0
    # the second turn of b carried b's history
    last = client.sent[-1]
    assert [m["content"] for m in last] == ["b1", "answer", "b2"]
    res = summarize(run, {}, ())
    assert res["completed"] == 3 and res["failed"] == 2 and res["first_error"] == "failed"
