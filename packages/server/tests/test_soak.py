"""A bounded soak of a live server on a real (tiny) model with speculation: a few hundred mixed requests,
streamed and not, greedy and seeded-sampled, clients that disconnect mid-stream or while queued, and invalid
requests interleaved. Afterwards nothing leaks (slots, pages, prefix cache bookkeeping), and every valid
request that completed got exactly what the same request gets alone."""

from __future__ import annotations

import asyncio
import json
import random
from pathlib import Path
from typing import Any

import pytest
from hyspec_server import LLM, EngineArgs, SamplingParams
from hyspec_server.builder import build_engine

httpx = pytest.importorskip("httpx")

NEW = 12
SPEC = {"method": "ngram", "num_speculative_tokens": 3}
# invalid bodies: each must be a 4xx with an OpenAI error, and must not disturb the others
BAD: list[dict[str, Any]] = [
    {"temperature": -1.0},
    {"top_k": 2**63},
    {"stop_token_ids": [2**63]},
    {"repetition_penalty": 5e-324},
    {"n": 0},
    {"max_tokens": 10**9},
    {"logprobs": 99},
    {"prompt": ""},
    {"structured_outputs": {"regex": "(ab"}},
]


def _plan(rng: random.Random, n: int) -> list[dict[str, Any]]:
    plan = []
    for i in range(n):
        words = " ".join(
            rng.choice(["def", "x", "return", "(", ")", "for", "in", "1"])
            for _ in range(rng.randrange(1, 30))
        )
        kind = rng.choice(["stream", "stream", "plain", "plain", "drop_stream", "drop_plain", "bad"])
        seed = rng.randrange(1, 10**6) if rng.random() < 0.4 else None
        body: dict[str, Any] = {
            "model": "m",
            "prompt": words,
            "max_tokens": NEW,
            "temperature": 0.8 if seed is not None else 0.0,
            "ignore_eos": True,
            "return_token_ids": True,
            "stream": kind in ("stream", "drop_stream"),
        }
        if seed is not None:
            body["seed"] = seed
        if kind == "bad":
            body.update(rng.choice(BAD))
        plan.append({"i": i, "kind": kind, "body": body, "after": rng.randrange(1, 4)})
    return plan


async def _one(http: Any, item: dict[str, Any]) -> list[int] | None:
    body, kind = item["body"], item["kind"]
    if kind == "bad":
        r = await http.post("/v1/completions", json=body)
        assert 400 <= r.status_code < 500, (body, r.status_code, r.text)
        assert "error" in r.json()
        return None
    if kind == "drop_plain":
        with pytest.raises(httpx.TimeoutException):
            await http.post("/v1/completions", json=body, timeout=0.005 * item["after"])
        return None
    if kind == "plain":
        r = await http.post("/v1/completions", json=body)
        assert r.status_code == 200, r.text
        return list(r.json()["choices"][0]["token_ids"])
    ids: list[int] = []
    async with http.stream("POST", "/v1/completions", json=body) as r:
        assert r.status_code == 200
        async for line in r.aiter_lines():
            if not line.startswith("data: {"):
                continue
            ch = json.loads(line[6:])["choices"]
            if ch:
                ids += ch[0].get("token_ids") or []
                if kind == "drop_stream" and len(ids) >= item["after"]:
                    return None  # leaving the block closes the connection mid-stream
    return ids


def test_soak_mixed_clients_on_a_speculative_server(tiny_lfm2: Path) -> None:
    from hyspec_server.serve import ServerThread

    args = dict(model=str(tiny_lfm2), device="cpu", max_num_seqs=8, speculative_config=SPEC)
    srv = ServerThread(build_engine(EngineArgs(**args)), model_name="m").start()  # type: ignore[arg-type]
    plan = _plan(random.Random(11), 240)

    async def run_all() -> list[list[int] | None]:
        limits = httpx.Limits(max_connections=64, max_keepalive_connections=0)
        async with httpx.AsyncClient(base_url=srv.base_url, limits=limits, timeout=120) as http:
            return await asyncio.gather(*(_one(http, item) for item in plan))

    try:
        results = asyncio.run(asyncio.wait_for(run_all(), timeout=300))
        srv.wait_idle_and_leak_check()
    finally:
        srv.stop()
    done = [(item, got) for item, got in zip(plan, results, strict=True) if got is not None]
    assert len(done) == sum(item["kind"] in ("stream", "plain") for item in plan)  # every full one finished
    assert sum(bool(item["body"].get("seed")) for item, _ in done) > 20  # seeded sampling among them
    # each completed request alone, on a fresh engine without speculation: the same tokens
    alone = LLM(**{**args, "speculative_config": None})  # type: ignore[arg-type]
    for item, got in done:
        b = item["body"]
        params = SamplingParams(
            max_tokens=NEW, temperature=b["temperature"], seed=b.get("seed"), ignore_eos=True
        )
        (want,) = alone.generate([b["prompt"]], params, use_tqdm=False)
        assert got == want.outputs[0].token_ids, item
    alone.leak_check()
