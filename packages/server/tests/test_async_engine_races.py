"""`AsyncEngine` under concurrency, on the toy engine and without HTTP: aborts racing with finishes, aborts
during prefill, `n` samples aborted mid-stream, bad requests among good ones, an engine step that raises."""

from __future__ import annotations

import asyncio
import json
import threading
import time
from collections.abc import AsyncGenerator, Iterator
from typing import Any

import pytest
from hyspec_server.async_engine import AddError, AsyncEngine, EngineDeadError
from hyspec_server.sampling_params import SamplingParams
from hyspec_testing.server import toy_engine, toy_greedy


@pytest.fixture
def engine() -> Iterator[AsyncEngine]:
    eng = AsyncEngine(toy_engine(seqs=8, pages=512, budget=16), model_name="toy", idle_wait_s=0.01)
    yield eng
    eng.shutdown()


def greedy(n: int, **kw: Any) -> SamplingParams:
    return SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True, **kw)


async def idle_and_leak_free(engine: AsyncEngine, timeout_s: float = 10.0) -> None:
    deadline = time.monotonic() + timeout_s
    while await engine.call(lambda e: e.has_unfinished() or bool(e.requests)):
        assert time.monotonic() < deadline, "the engine did not go idle"
        await asyncio.sleep(0.01)
    await engine.call(lambda e: e.leak_check())
    assert not engine._streams


def test_aborts_racing_with_finishes(engine: AsyncEngine) -> None:
    async def run() -> None:
        for round_ in range(30):
            streams = [await engine.add([65 + i, 66], greedy(1 + i % 3), f"r{round_}-{i}") for i in range(6)]
            # abort half of them at once, whether they finished already or not
            for s in streams[::2]:
                s.abort()
            for i, s in enumerate(streams[1::2]):
                out = await asyncio.wait_for(s.final(), 5)
                k = 2 * i + 1
                assert out.outputs[0].token_ids == toy_greedy([65 + k, 66], 1 + k % 3, ignore_eos=True)
        await idle_and_leak_free(engine)

    asyncio.run(run())


def test_abort_during_prefill_frees_the_request(engine: AsyncEngine) -> None:
    # steps of 20 ms: the prompt's 13 prefill chunks then outlast the polls below by far, also on a loaded
    # machine (at the toy's own speed a poll delayed by other work found the whole prompt prefilled)
    runner: Any = engine.engine.runner
    execute = runner.execute

    def slow(*args: Any, **kw: Any) -> Any:
        time.sleep(0.02)
        return execute(*args, **kw)

    runner.execute = slow

    async def run() -> None:
        other = await engine.add([70, 71], greedy(20), "other")
        # a 200-token prompt takes many 16-token prefill chunks
        long = await engine.add(list(range(200)), greedy(5), "long")
        got = engine.engine  # read on this thread only after idle

        def computed(e: Any) -> int:
            return int(e.requests["long"].num_computed_tokens)

        # abort it between two of its prefill chunks (each call runs between steps)
        while (n := await engine.call(computed)) == 0:
            pass
        assert n < 150
        long.abort()
        with pytest.raises(StopAsyncIteration):
            await long.outputs().__anext__()  # an aborted stream ends, its output is not awaited
        out = await asyncio.wait_for(other.final(), 10)
        assert out.outputs[0].token_ids == toy_greedy([70, 71], 20, ignore_eos=True)
        await idle_and_leak_free(engine)
        assert got.stats.num_aborted == 1

    asyncio.run(run())


def test_n_samples_aborted_mid_stream_free_every_child(engine: AsyncEngine) -> None:
    async def run() -> None:
        items = [([80, 81, 82], greedy(50, seed=i), f"n-{i}") for i in range(4)]
        group = await engine.add_many(items)
        outs = group.outputs()
        assert isinstance(outs, AsyncGenerator)
        for _ in range(3):
            await outs.__anext__()
        # as the server's streaming generator: closed when the client goes away
        await outs.aclose()
        assert group.finished
        await idle_and_leak_free(engine)
        assert engine.engine.stats.num_aborted == 4

    asyncio.run(run())


def test_bad_requests_among_many_concurrent_good_ones(engine: AsyncEngine) -> None:
    async def one(i: int) -> tuple[int, Any]:
        prompt = [97 + i % 26, 98]
        if i % 5 == 0:
            params = greedy(10_000)  # over max_model_len
        elif i % 7 == 0:
            prompt = [999]  # out of the vocabulary
            params = greedy(4)
        else:
            params = greedy(4 + i % 5)
        try:
            s = await engine.add(prompt, params, f"c{i}")
        except ValueError as e:
            return i, e
        return i, await asyncio.wait_for(s.final(), 10)

    async def run() -> None:
        results = await asyncio.gather(*(one(i) for i in range(60)))
        for i, got in results:
            if i % 5 == 0 or i % 7 == 0:
                assert isinstance(got, ValueError), i
            else:
                want = toy_greedy([97 + i % 26, 98], 4 + i % 5, ignore_eos=True)
                assert got.outputs[0].token_ids == want, i
        # a batch with a bad member keeps none of it
        with pytest.raises(AddError) as e:
            await engine.add_many([([65], greedy(3), "b0"), ([65], greedy(10_000), "b1")])
        assert e.value.index == 1
        await idle_and_leak_free(engine)

    asyncio.run(run())


def test_an_unexpected_step_error_fails_every_waiter_instead_of_hanging() -> None:
    # an error the engine cannot attribute to a request (not an EngineStepError) ends the engine thread:
    # its live requests and the calls queued behind it get EngineDeadError (a 500), /health says 503
    eng = AsyncEngine(toy_engine(seqs=8, budget=16), model_name="toy", idle_wait_s=0.01)
    armed, release = threading.Event(), threading.Event()
    real_schedule = eng.engine.scheduler.schedule

    def schedule() -> Any:
        if armed.is_set():
            release.wait(5)
            raise RuntimeError("scheduler bug")
        return real_schedule()

    eng.engine.scheduler.schedule = schedule  # type: ignore[method-assign]

    async def run() -> None:
        a = await eng.add([65, 66], greedy(100), "a")
        b = await eng.add([67, 68], greedy(100), "b")
        armed.set()
        await asyncio.sleep(0.05)  # the engine thread is inside the failing step now
        queued = asyncio.ensure_future(eng.call(lambda e: 1))
        await asyncio.sleep(0.02)
        release.set()
        for s in (a, b):
            with pytest.raises(EngineDeadError, match="scheduler bug"):
                await asyncio.wait_for(s.final(), 5)
        with pytest.raises(EngineDeadError):
            await asyncio.wait_for(queued, 5)
        assert not eng.is_alive()
        with pytest.raises(EngineDeadError):
            await asyncio.wait_for(eng.add([65], greedy(2), "c"), 5)

    try:
        asyncio.run(run())
    finally:
        eng.shutdown()


def test_a_stopped_engine_answers_every_http_client() -> None:
    import httpx
    from hyspec_server.serve import ServerThread

    srv = ServerThread(toy_engine(seqs=8, budget=16), model_name="toy").start()
    eng = srv.async_engine.engine
    real_schedule = eng.scheduler.schedule

    def schedule() -> Any:
        if len(eng.requests) == 2:  # both requests run: the step fails
            raise RuntimeError("scheduler bug")
        return real_schedule()

    eng.scheduler.schedule = schedule  # type: ignore[method-assign]
    body = {"model": "toy", "prompt": "hi", "max_tokens": 250, "ignore_eos": True}

    async def run() -> None:
        async with httpx.AsyncClient(base_url=srv.base_url, timeout=10) as http:
            plain = asyncio.ensure_future(http.post("/v1/completions", json=body))
            async with http.stream("POST", "/v1/completions", json={**body, "stream": True}) as r:
                assert r.status_code == 200
                got_lines = [line async for line in r.aiter_lines() if line.startswith("data: ")]
            assert got_lines[-1] == "data: [DONE]"
            err = json.loads(got_lines[-2][6:])["error"]
            assert "scheduler bug" in err["message"] and err["type"] == "server_error"
            got = await plain
            assert got.status_code == 500 and "scheduler bug" in got.json()["error"]["message"]
            later = await http.post("/v1/completions", json=body)
            assert later.status_code == 503 and later.json()["error"]["type"] == "server_error"
            assert (await http.get("/health")).status_code == 503

    try:
        asyncio.run(run())
    finally:
        srv.stop()
