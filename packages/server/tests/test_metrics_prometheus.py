"""/metrics through prometheus_client: every number equals what the requests served add up to.

The HTTP tests run the toy engine; the speculative one a tiny LFM2 checkpoint with a drafter that knows the
target's greedy continuation.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import threading
from pathlib import Path
from typing import Any

import httpx
import pytest
from hyspec_runner.pool_memory import StatePoolMemory
from hyspec_runner.speculative import DrafterRegistry
from hyspec_server import LLM, EngineArgs, SamplingParams
from hyspec_server.async_engine import AsyncEngine
from hyspec_server.builder import build_engine
from hyspec_server.engine import LLMEngine
from hyspec_server.metrics import EngineMetrics
from hyspec_server.serve import ServerThread
from hyspec_testing.server import metric_sample, toy_engine
from hyspec_testing.spec import ForcedDrafter
from prometheus_client import CONTENT_TYPE_LATEST
from prometheus_client.parser import text_string_to_metric_families

KEY = {"Authorization": "Bearer k"}
# token-id prompts and their max_tokens (ignore_eos: each request generates exactly that many); one request
# of a single token has no time per output token and no inter-token latency
REQUESTS = [([1, 2, 3], 5), ([4] * 7, 1), ([9] * 12, 8), ([5, 6], 3)]


def _scrape(srv: ServerThread) -> str:
    r = httpx.get(srv.base_url + "/metrics", headers=KEY)
    assert r.status_code == 200
    assert r.headers["content-type"] == CONTENT_TYPE_LATEST
    return r.text


def _complete(srv: ServerThread, prompt: list[int], max_tokens: int, *, stream: bool = False) -> int:
    """Runs one completion; returns the tokens it generated."""
    body: dict[str, Any] = {"prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True}
    url = srv.base_url + "/v1/completions"
    if not stream:
        r = httpx.post(url, json=body, headers=KEY, timeout=30)
        assert r.status_code == 200
        return int(r.json()["usage"]["completion_tokens"])
    body |= {"stream": True, "stream_options": {"include_usage": True}}
    usage = None
    with httpx.stream("POST", url, json=body, headers=KEY, timeout=30) as resp:
        for line in resp.iter_lines():
            if line.startswith("data: {") and (chunk := json.loads(line[6:])).get("usage"):
                usage = chunk["usage"]
    assert usage is not None
    return int(usage["completion_tokens"])


def _observed(eng: LLMEngine, name: str = "toy") -> str:
    m = EngineMetrics(name)
    m.observe(eng)
    return m.render().decode()


def _memory(eng: LLMEngine) -> StatePoolMemory:
    mem = eng.runner.memory
    assert isinstance(mem, StatePoolMemory)
    return mem


def test_http_metrics_add_up_to_the_requests_served() -> None:
    srv = ServerThread(toy_engine(seqs=4), model_name="toy-a", api_key="k").start()
    try:
        generated = [_complete(srv, p, n, stream=i == 0) for i, (p, n) in enumerate(REQUESTS)]
        assert generated == [n for _, n in REQUESTS]
        srv.wait_idle_and_leak_check()
        text = _scrape(srv)
    finally:
        srv.stop()

    def val(name: str, **labels: str) -> float:
        return metric_sample(text, "hyspec:" + name, **labels)

    n = len(REQUESTS)
    assert val("prompt_tokens_total") == sum(len(p) for p, _ in REQUESTS)
    assert val("generation_tokens_total") == sum(generated)
    assert val("request_success_total", finished_reason="length") == n
    assert val("request_success_total", finished_reason="stop") == 0
    assert val("request_success_total", finished_reason="abort") == 0
    assert val("num_preemptions_total") == 0
    for hist in ("time_to_first_token_seconds", "e2e_request_latency_seconds"):
        assert val(hist + "_count") == n
        assert val(hist + "_bucket", le="+Inf") == n
    # more than one token: a time per output token; every token after a request's first: one inter-token gap
    assert val("request_time_per_output_token_seconds_count") == sum(g > 1 for g in generated)
    assert val("inter_token_latency_seconds_count") == sum(g - 1 for g in generated)
    assert val("e2e_request_latency_seconds_sum") >= val("time_to_first_token_seconds_sum") > 0
    idle = ("num_requests_running", "num_requests_waiting", "kv_cache_usage_perc")
    for gauge in (*idle, "recurrent_state_usage_perc"):
        assert val(gauge) == 0
    # every sample of every family carries the served model name
    families = list(text_string_to_metric_families(text))
    assert {f.name for f in families} >= {"hyspec:prompt_tokens", "hyspec:inter_token_latency_seconds"}
    assert all(s.labels.get("model_name") == "toy-a" for f in families for s in f.samples)
    assert not any("spec_decode" in f.name or "prefix_cache" in f.name for f in families)


def test_two_servers_in_one_process_keep_their_own_registries() -> None:
    a = ServerThread(toy_engine(), model_name="a", api_key="k").start()
    b = ServerThread(toy_engine(), model_name="b", api_key="k").start()
    try:
        _complete(a, [1, 2, 3, 4], 2)
        a.wait_idle_and_leak_check()
        text_a, text_b = _scrape(a), _scrape(b)
    finally:
        a.stop()
        b.stop()
    assert metric_sample(text_a, "hyspec:prompt_tokens_total", model_name="a") == 4
    assert metric_sample(text_b, "hyspec:prompt_tokens_total", model_name="b") == 0
    assert 'model_name="b"' not in text_a and 'model_name="a"' not in text_b


def test_pool_gauges_follow_what_requests_hold() -> None:
    eng = toy_engine(seqs=4, pages=64, page_size=4)
    pool = _memory(eng).pool
    params = SamplingParams(max_tokens=6, temperature=0, ignore_eos=True)
    ids = [eng.add_request(p, params) for p in ([1] * 10, [2] * 5)]
    eng.step()
    text = _observed(eng)
    held = sum(len(pool.request_pages(r)) for r in ids)
    assert held > 0
    assert metric_sample(text, "hyspec:kv_cache_usage_perc") == held / 64
    assert metric_sample(text, "hyspec:recurrent_state_usage_perc") == 2 / 4
    assert metric_sample(text, "hyspec:num_requests_running") == 2
    while eng.has_unfinished():
        eng.step()
    text = _observed(eng)
    assert metric_sample(text, "hyspec:kv_cache_usage_perc") == 0
    assert metric_sample(text, "hyspec:recurrent_state_usage_perc") == 0


def test_pages_only_the_prefix_cache_holds_count_as_free() -> None:
    eng = toy_engine(seqs=4, pages=64, page_size=4, snapshots=4, snapshot_interval=8, max_len=128)
    mem = _memory(eng)
    kv = mem.pool.kv
    llm = LLM.from_engine(eng)
    prompt = {"prompt_token_ids": list(range(40, 80))}
    params = SamplingParams(max_tokens=4, temperature=0, ignore_eos=True)
    llm.generate([prompt], params, use_tqdm=False)
    assert kv.num_free < kv.num_pages  # the cache keeps the prompt's pages
    text = _observed(eng)
    assert metric_sample(text, "hyspec:kv_cache_usage_perc") == 0
    # its snapshot slots are not the requests' to use, so they count neither way
    assert metric_sample(text, "hyspec:recurrent_state_usage_perc") == 0
    assert metric_sample(text, "hyspec:prefix_cache_snapshots") > 0
    # a request that maps cached pages holds them: they count as used again
    rid = eng.add_request(list(range(40, 80)), params)
    eng.step()
    assert eng.requests[rid].num_cached_tokens > 0
    text = _observed(eng)
    used = len(mem.pool.request_pages(rid)) / kv.num_pages
    assert metric_sample(text, "hyspec:kv_cache_usage_perc") == used
    assert metric_sample(text, "hyspec:recurrent_state_usage_perc") == 1 / 4
    assert metric_sample(text, "hyspec:prefix_cache_hits_total") == eng.requests[rid].num_cached_tokens
    assert metric_sample(text, "hyspec:prefix_cache_queries_total") == 2 * 40


def test_aborted_requests_count_by_reason_and_stay_out_of_the_latencies() -> None:
    eng = toy_engine(seqs=4)
    params = SamplingParams(max_tokens=4, temperature=0, ignore_eos=True)
    keep = eng.add_request([1, 2, 3], params)
    drop = eng.add_request([4, 5], params)
    eng.step()
    assert eng.abort(drop) is not None
    while eng.has_unfinished():
        eng.step()
    assert keep not in eng.requests
    text = _observed(eng)
    assert metric_sample(text, "hyspec:request_success_total", finished_reason="abort") == 1
    assert metric_sample(text, "hyspec:request_success_total", finished_reason="length") == 1
    assert metric_sample(text, "hyspec:prompt_tokens_total") == 5
    assert metric_sample(text, "hyspec:generation_tokens_total") == 4 + 1
    assert metric_sample(text, "hyspec:time_to_first_token_seconds_count") == 1
    assert metric_sample(text, "hyspec:e2e_request_latency_seconds_count") == 1


S = 3  # draft tokens per round
SPEC_PROMPTS = [[5, 9, 17, 33, 2, 7, 5, 9, 11, 12, 13], [40, 41], [20, 30, 40, 20, 30, 40, 20], [1]]
SPEC_NEW = 24


def test_speculative_decoding_counters_equal_the_requests_stats(tiny_lfm2: Path) -> None:
    args: dict[str, Any] = dict(model=str(tiny_lfm2), max_num_seqs=4, page_size=4, max_model_len=64)
    prompts = [{"prompt_token_ids": p} for p in SPEC_PROMPTS]
    params = SamplingParams(max_tokens=SPEC_NEW, temperature=0, ignore_eos=True)
    plain = LLM.from_engine(build_engine(EngineArgs(**args))).generate(prompts, params, use_tqdm=False)
    refs = [p + o.outputs[0].token_ids for p, o in zip(SPEC_PROMPTS, plain)]
    drafter = ForcedDrafter(refs, S, vocab=json.loads((tiny_lfm2 / "config.json").read_text())["vocab_size"])
    spec: Any = {"method": "ngram", "num_speculative_tokens": S}
    eng = build_engine(
        EngineArgs(speculative_config=spec, **args), drafters=DrafterRegistry({"ngram": lambda _: drafter})
    )
    outs = LLM.from_engine(eng).generate(prompts, params, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outs] == [o.outputs[0].token_ids for o in plain]
    stats = [o.spec_stats for o in outs]
    assert all(s is not None for s in stats)
    text = _observed(eng, "tiny")

    def val(name: str, **labels: str) -> float:
        return metric_sample(text, "hyspec:" + name, **labels)

    drafts = sum(s.num_drafts for s in stats if s)
    accepted = sum(s.num_accepted_tokens for s in stats if s)
    assert val("spec_decode_num_drafts_total") == drafts > 0
    assert val("spec_decode_num_draft_tokens_total") == sum(s.num_draft_tokens for s in stats if s)
    assert val("spec_decode_num_accepted_tokens_total") == accepted > 0
    per_pos = [val("spec_decode_num_accepted_tokens_per_pos_total", position=str(i)) for i in range(S)]
    with pytest.raises(KeyError):
        val("spec_decode_num_accepted_tokens_per_pos_total", position=str(S))
    assert sum(per_pos) == accepted
    assert per_pos[S - 1] > 0  # every position was reached
    # the accept-length histogram is kept apart (a queue of round outcomes): position i was accepted in every
    # round that committed more than i + 1 tokens
    for i in range(S):
        assert per_pos[i] == drafts - val("spec_decode_accept_length_bucket", le=str(float(i + 1)))
    assert val("spec_decode_accept_length_count") == drafts
    assert val("spec_decode_accept_length_sum") == accepted + drafts

    gen = [len(o.outputs[0].token_ids) for o in outs]
    assert val("prompt_tokens_total") == sum(len(p) for p in SPEC_PROMPTS)
    assert val("generation_tokens_total") == sum(gen) == SPEC_NEW * len(SPEC_PROMPTS)
    assert val("request_success_total", finished_reason="length") == len(SPEC_PROMPTS)
    assert val("time_to_first_token_seconds_count") == len(SPEC_PROMPTS)
    # one gap per round after the first token, however many tokens the round committed: a round commits its
    # accepted drafts plus one
    rounds = sum(g - 1 - (s.num_accepted_tokens if s else 0) for g, s in zip(gen, stats, strict=True))
    assert val("inter_token_latency_seconds_count") == rounds < sum(gen) - len(gen)


def test_a_cancelled_engine_call_leaves_the_engine_thread_running() -> None:
    # /metrics waits on the engine thread with a timeout: a caller that stops waiting must not end it
    engine = AsyncEngine(toy_engine(), model_name="toy")
    gate = threading.Event()

    async def run() -> None:
        blocker = asyncio.ensure_future(engine.call(lambda _: gate.wait(10)))
        waiter = asyncio.ensure_future(engine.call(lambda _: 1))  # queued behind the blocker
        await asyncio.sleep(0.05)
        waiter.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await waiter
        gate.set()
        assert await blocker
        assert await asyncio.wait_for(engine.call(lambda _: 2), 5) == 2

    try:
        asyncio.run(run())
        assert engine.is_alive()
    finally:
        gate.set()
        engine.shutdown()
