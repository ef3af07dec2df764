"""The OpenAI-compatible server, live on 127.0.0.1, driven by the official `openai` client and httpx."""

from __future__ import annotations

import asyncio
import json
import random
import re
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import httpx
import openai
import pytest
from hyspec_server.serve import ServerThread
from hyspec_testing.server import ByteTokenizer, ToyModelRunner, metric_sample, toy_engine, toy_greedy

API_KEY = "test-key"
AUTH = {"Authorization": f"Bearer {API_KEY}"}
TOK = ByteTokenizer()


def client(srv: ServerThread) -> openai.OpenAI:
    return openai.OpenAI(base_url=srv.base_url + "/v1", api_key=API_KEY, max_retries=0)


def expected_text(prompt_ids: list[int], n: int) -> str:
    return TOK.decode(toy_greedy(prompt_ids, n, ignore_eos=True))


def test_completions_greedy_stream_and_not(toy_server: ServerThread) -> None:
    c = client(toy_server)
    r = c.completions.create(
        model="toy",
        prompt="Hello there",
        max_tokens=20,
        temperature=0,
        extra_body={"ignore_eos": True, "return_token_ids": True},
    )
    want = toy_greedy(TOK.encode("Hello there"), 20, ignore_eos=True)
    choice = r.choices[0]
    assert choice.model_extra is not None and choice.model_extra["token_ids"] == want
    assert choice.text == TOK.decode(want) and choice.finish_reason == "length"
    assert r.usage is not None and (r.usage.prompt_tokens, r.usage.completion_tokens) == (11, 20)
    chunks = list(
        c.completions.create(
            model="toy",
            prompt="Hello there",
            max_tokens=20,
            temperature=0,
            stream=True,
            stream_options={"include_usage": True},
            extra_body={"ignore_eos": True},
        )
    )
    text = "".join(ch.choices[0].text for ch in chunks if ch.choices)
    assert text == choice.text
    assert [ch.choices[0].finish_reason for ch in chunks if ch.choices][-1] == "length"
    assert chunks[-1].usage is not None and chunks[-1].usage.completion_tokens == 20
    # token-id prompts
    r = c.completions.create(
        model="toy", prompt=[72, 105], max_tokens=5, temperature=0, extra_body={"ignore_eos": True}
    )
    assert r.choices[0].text == expected_text([72, 105], 5)


def test_chat_stream_and_not(toy_server: ServerThread) -> None:
    c = client(toy_server)
    msgs: list[Any] = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "hi"}]
    prompt = TOK.apply_chat_template(msgs)
    r = c.chat.completions.create(
        model="toy", messages=msgs, max_tokens=12, temperature=0, extra_body={"ignore_eos": True}
    )
    assert r.choices[0].message.content == expected_text(prompt, 12)
    assert r.choices[0].message.role == "assistant" and r.object == "chat.completion"
    assert r.usage is not None and r.usage.prompt_tokens == len(prompt)
    stream = c.chat.completions.create(
        model="toy", messages=msgs, max_tokens=12, temperature=0, stream=True, extra_body={"ignore_eos": True}
    )
    parts = [ch.choices[0].delta.content or "" for ch in stream]
    assert "".join(parts) == r.choices[0].message.content
    # no max_tokens: runs to EOS or the context end
    r = c.chat.completions.create(model="toy", messages=msgs, temperature=0)
    assert r.choices[0].finish_reason in ("stop", "length")
    lp = c.chat.completions.create(
        model="toy",
        messages=msgs,
        max_tokens=3,
        temperature=0,
        logprobs=True,
        top_logprobs=2,
        extra_body={"ignore_eos": True},
    )
    assert lp.choices[0].logprobs is not None and lp.choices[0].logprobs.content is not None
    assert len(lp.choices[0].logprobs.content) == 3
    assert all(e.logprob <= 0 and len(e.top_logprobs) >= 2 for e in lp.choices[0].logprobs.content)


def test_concurrent_requests_are_each_correct(toy_server: ServerThread) -> None:
    c = client(toy_server)
    rng = random.Random(0)
    prompts = ["".join(chr(rng.randrange(97, 123)) for _ in range(rng.randrange(1, 30))) for _ in range(24)]

    def one(p: str) -> str:
        r = c.completions.create(
            model="toy", prompt=p, max_tokens=16, temperature=0, extra_body={"ignore_eos": True}
        )
        return r.choices[0].text

    with ThreadPoolExecutor(8) as pool:
        got = list(pool.map(one, prompts))
    assert got == [expected_text(TOK.encode(p), 16) for p in prompts]


def test_models_health_metrics(toy_server: ServerThread) -> None:
    models = client(toy_server).models.list()
    assert [m.id for m in models.data] == ["toy"]
    assert httpx.get(toy_server.base_url + "/health").status_code == 200
    client(toy_server).completions.create(model="toy", prompt="m", max_tokens=4, temperature=0)
    assert httpx.get(toy_server.base_url + "/metrics").status_code == 401  # behind the key, as /v1
    text = httpx.get(toy_server.base_url + "/metrics", headers=AUTH).text
    assert metric_sample(text, "hyspec:generation_tokens_total", model_name="toy") >= 4
    assert metric_sample(text, "hyspec:time_to_first_token_seconds_count") >= 1
    assert metric_sample(text, "hyspec:request_time_per_output_token_seconds_bucket", le="+Inf") >= 1
    assert metric_sample(text, "hyspec:num_requests_running") == 0
    assert metric_sample(text, "hyspec:num_requests_waiting") == 0


def _post(
    srv: ServerThread, path: str, body: Any, *, key: str | None = API_KEY, raw: bytes | None = None
) -> httpx.Response:
    headers = {"Authorization": f"Bearer {key}"} if key is not None else {}
    if raw is not None:
        return httpx.post(
            srv.base_url + path, content=raw, headers={**headers, "Content-Type": "application/json"}
        )
    return httpx.post(srv.base_url + path, json=body, headers=headers)


GOOD = {"model": "toy", "prompt": "ok", "max_tokens": 3}
CHAT = {"model": "toy", "messages": [{"role": "user", "content": "ok"}], "max_tokens": 3}


@pytest.mark.parametrize(
    ("path", "body", "status", "param"),
    [
        ("/v1/completions", {**GOOD, "max_tokens": "3"}, 400, "max_tokens"),
        ("/v1/completions", {**GOOD, "prompt": 5}, 400, None),
        ("/v1/completions", {**GOOD, "temperature": "hot"}, 400, "temperature"),
        ("/v1/completions", {**GOOD, "max_tokens": -1}, 400, "max_tokens"),
        ("/v1/completions", {**GOOD, "max_tokens": 0}, 400, "max_tokens"),
        ("/v1/completions", {**GOOD, "max_tokens": 10**9}, 400, "max_tokens"),
        ("/v1/completions", {**GOOD, "temperature": -0.5}, 400, "temperature"),
        ("/v1/completions", {**GOOD, "top_p": 2}, 400, "top_p"),
        ("/v1/completions", {**GOOD, "n": 0}, 400, "n"),
        ("/v1/completions", {**GOOD, "n": 129}, 400, "n"),
        # the prompt alone fills the context (256): the prompt's fault, not max_tokens'
        ("/v1/completions", {**GOOD, "prompt": "x" * 300}, 400, "prompt"),
        ("/v1/completions", {**GOOD, "prompt": "x" * 250, "max_tokens": 10}, 400, "max_tokens"),
        ("/v1/completions", {**GOOD, "model": "gpt-5"}, 404, "model"),
        ("/v1/completions", {**GOOD, "model": 5}, 400, "model"),  # left out it is the served model
        ("/v1/completions", [1, 2], 400, None),
        ("/v1/chat/completions", {**CHAT, "messages": "hi"}, 400, "messages"),
        ("/v1/chat/completions", {**CHAT, "messages": []}, 400, "messages"),
        (
            "/v1/chat/completions",
            {**CHAT, "messages": [{"role": "user", "content": "x" * 300}]},
            400,
            "messages",
        ),
        ("/v1/chat/completions", {**CHAT, "messages": [{"role": "wizard", "content": "x"}]}, 400, None),
        ("/v1/chat/completions", {**CHAT, "max_tokens": 1000}, 400, "max_tokens"),
        ("/v1/chat/completions", {**CHAT, "model": "nope"}, 404, "model"),
    ],
)
def test_bad_inputs_get_openai_errors_and_server_keeps_serving(
    toy_server: ServerThread, path: str, body: Any, status: int, param: str | None
) -> None:
    r = _post(toy_server, path, body)
    assert r.status_code == status, r.text
    err = r.json()["error"]
    assert set(err) == {"message", "type", "param", "code"} and err["message"]
    if param is not None:
        assert err["param"] is not None and err["param"].startswith(param)
    assert _post(toy_server, "/v1/completions", GOOD).status_code == 200


def test_malformed_json_auth_and_unknown_route(toy_server: ServerThread) -> None:
    r = _post(toy_server, "/v1/completions", None, raw=b'{"model": "toy", "prompt": ')
    assert r.status_code == 400 and "JSON" in r.json()["error"]["message"]
    assert _post(toy_server, "/v1/completions", GOOD, key=None).status_code == 401
    r = _post(toy_server, "/v1/completions", GOOD, key="wrong")
    assert r.status_code == 401 and r.json()["error"]["type"] == "authentication_error"
    assert httpx.get(toy_server.base_url + "/v1/models").status_code == 401
    assert httpx.get(toy_server.base_url + "/health").status_code == 200  # health needs no key
    r = httpx.get(toy_server.base_url + "/v1/nothing", headers={"Authorization": f"Bearer {API_KEY}"})
    assert r.status_code == 404 and "error" in r.json()
    with pytest.raises(openai.AuthenticationError):
        openai.OpenAI(base_url=toy_server.base_url + "/v1", api_key="bad", max_retries=0).models.list()
    assert _post(toy_server, "/v1/completions", GOOD).status_code == 200


class SlowToy(ToyModelRunner):
    def execute(self, step: Any, *, while_queued: Any = None) -> Any:
        time.sleep(0.02)
        return super().execute(step, while_queued=while_queued)


def test_full_queue_answers_429() -> None:
    srv = ServerThread(toy_engine(seqs=1, max_waiting=1, runner_cls=SlowToy), model_name="toy").start()
    try:

        def one(_: int) -> int:
            body = {"model": "toy", "prompt": "q", "max_tokens": 15, "ignore_eos": True}
            return httpx.post(srv.base_url + "/v1/completions", json=body, timeout=30).status_code

        with ThreadPoolExecutor(8) as pool:
            codes = list(pool.map(one, range(8)))
        assert 429 in codes and 200 in codes and set(codes) <= {200, 429}
        r = httpx.post(
            srv.base_url + "/v1/completions", json={"model": "toy", "prompt": "q", "max_tokens": 2}
        )
        assert r.status_code == 200
        srv.wait_idle_and_leak_check()
    finally:
        srv.stop()


def test_200_concurrent_requests_with_random_disconnects() -> None:
    srv = ServerThread(toy_engine(seqs=32, pages=1024), model_name="toy", api_key=API_KEY).start()
    rng = random.Random(7)
    plan = []
    for i in range(200):
        prompt = "".join(chr(rng.randrange(97, 123)) for _ in range(rng.randrange(1, 24)))
        mode = rng.choice(["stream", "stream", "plain", "drop_stream", "drop_plain"])
        plan.append((i, prompt, mode, rng.randrange(1, 4)))

    async def one(http: httpx.AsyncClient, prompt: str, mode: str, after: int) -> str | None:
        body = {
            "model": "toy",
            "prompt": prompt,
            "max_tokens": 24,
            "temperature": 0,
            "ignore_eos": True,
            "stream": mode in ("stream", "drop_stream"),
        }
        if mode == "drop_plain":
            # the client gives up while the request is queued or running
            with pytest.raises(httpx.TimeoutException):
                await http.post("/v1/completions", json=body, timeout=0.01 * after)
            return None
        if mode == "plain":
            r = await http.post("/v1/completions", json=body)
            assert r.status_code == 200, r.text
            return str(r.json()["choices"][0]["text"])
        text = ""
        async with http.stream("POST", "/v1/completions", json=body) as r:
            assert r.status_code == 200
            n = 0
            async for line in r.aiter_lines():
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                text += json.loads(line[6:])["choices"][0]["text"]
                n += 1
                if mode == "drop_stream" and n >= after:
                    return None  # leaving the block closes the connection mid-stream
        return text

    async def run_all() -> list[str | None]:
        limits = httpx.Limits(max_connections=250, max_keepalive_connections=0)
        headers = {"Authorization": f"Bearer {API_KEY}"}
        async with httpx.AsyncClient(
            base_url=srv.base_url, limits=limits, headers=headers, timeout=60
        ) as http:
            return await asyncio.gather(*(one(http, p, m, a) for _, p, m, a in plan))

    try:
        t0 = time.monotonic()
        results = asyncio.run(asyncio.wait_for(run_all(), timeout=120))
        assert time.monotonic() - t0 < 120
        completed = 0
        for (_, prompt, mode, _), got in zip(plan, results):
            if mode in ("stream", "plain"):
                assert got == expected_text(TOK.encode(prompt), 24)
                completed += 1
        assert completed > 100
        srv.wait_idle_and_leak_check()
        text = httpx.get(srv.base_url + "/metrics", headers=AUTH).text
        # some disconnects reached the engine before their end
        assert metric_sample(text, "hyspec:request_success_total", finished_reason="abort") > 0
        # and the server still serves
        r = client(srv).completions.create(
            model="toy", prompt="after", max_tokens=5, temperature=0, extra_body={"ignore_eos": True}
        )
        assert r.choices[0].text == expected_text(TOK.encode("after"), 5)
    finally:
        srv.stop()


def test_engine_thread_never_blocks_the_event_loop(toy_server: ServerThread) -> None:
    # /health answers while long generations run
    c = client(toy_server)
    done = threading.Event()

    def long() -> None:
        c.completions.create(
            model="toy", prompt="long", max_tokens=200, temperature=0, extra_body={"ignore_eos": True}
        )
        done.set()

    t = threading.Thread(target=long)
    t.start()
    latencies = []
    while not done.is_set():
        t0 = time.monotonic()
        assert httpx.get(toy_server.base_url + "/health").status_code == 200
        latencies.append(time.monotonic() - t0)
    t.join()
    assert latencies and min(latencies) < 0.5


@pytest.mark.parametrize(
    ("field", "value"),
    [("top_k", 2**63), ("stop_token_ids", [2**63]), ("repetition_penalty", 1e-300), ("top_k", -2)],
)
def test_out_of_range_sampling_fields_are_400_naming_the_field(
    toy_server: ServerThread, field: str, value: Any
) -> None:
    # values that once reached the tensors (int64 overflow, NaN distributions) and failed the whole step
    body = {"model": "toy", "prompt": "hi", "max_tokens": 2, "temperature": 0.7, field: value}
    r = _post(toy_server, "/v1/completions", body)
    assert r.status_code == 400, r.text
    assert field in r.json()["error"]["message"]


def test_api_key_covers_every_route_but_health(toy_server: ServerThread) -> None:
    base = toy_server.base_url
    for path in ("/metrics", "/openapi.json", "/v1/models", "/no-such-route"):
        r = httpx.get(base + path)
        assert r.status_code == 401, path
        assert r.json()["error"]["type"] == "authentication_error"
        assert httpx.get(base + path, headers={"Authorization": "Bearer wrong"}).status_code == 401, path
    assert httpx.get(base + "/health").status_code == 200
    assert httpx.get(base + "/metrics", headers=AUTH).status_code == 200
    assert httpx.get(base + "/openapi.json", headers=AUTH).json()["info"]["title"] == "hyspec"


@pytest.mark.parametrize(
    "raw",
    [
        b'{"model": "toy", "prompt": ' + b"[" * 100_000 + b"]" * 100_000 + b"}",  # nesting
        b'{"model": "toy", "prompt": "hi", "max_tokens": ' + b"9" * 5000 + b"}",  # a 5000-digit integer
        b'{"model": "toy", "prompt": "hi \\ud800 there", "max_tokens": 2}',  # a lone surrogate
        # numbers Python's JSON reads as inf / NaN
        b'{"model": "toy", "prompt": "hi", "max_tokens": 2, "temperature": 1e400}',
        b'{"model": "toy", "prompt": "hi", "max_tokens": 2, "top_p": NaN}',
        b'{"model": "toy", "prompt": "hi", "max_tokens": 2, "logit_bias": {"5": -Infinity}}',
    ],
    ids=["deep-nesting", "huge-integer", "lone-surrogate", "inf-temperature", "nan-top-p", "inf-bias"],
)
def test_hostile_json_is_an_openai_400(toy_server: ServerThread, raw: bytes) -> None:
    r = _post(toy_server, "/v1/completions", None, raw=raw)
    assert r.status_code == 400, r.text
    assert r.json()["error"]["type"] == "invalid_request_error"
    # and the server still serves
    assert _post(toy_server, "/v1/completions", GOOD).status_code == 200


def test_empty_stop_string_and_list_of_it_mean_the_same(toy_server: ServerThread) -> None:
    texts = []
    for stop in ("", [""], None):
        body = {**GOOD, "temperature": 0, "max_tokens": 6, "stop": stop}
        r = _post(toy_server, "/v1/completions", body)
        assert r.status_code == 200, (stop, r.text)
        texts.append(r.json()["choices"][0]["text"])
    assert texts[0] == texts[1] == texts[2]


def test_request_bodies_are_bounded() -> None:
    from hyspec_server.api_server import MIN_BODY_BYTES, max_body_bytes_for
    from hyspec_testing.server import toy_engine

    assert max_body_bytes_for(16) == MIN_BODY_BYTES and max_body_bytes_for(1 << 20) == 64 << 20
    srv = ServerThread(toy_engine(), model_name="toy", max_body_bytes=4096).start()
    try:
        big = {"model": "toy", "prompt": "x" * 5000, "max_tokens": 2}
        r = httpx.post(srv.base_url + "/v1/completions", json=big)
        assert r.status_code == 413 and r.json()["error"]["code"] == "request_too_large"

        def chunks() -> Any:  # no Content-Length: refused while streaming in, not after
            yield b'{"model": "toy", "prompt": "'
            for _ in range(100):
                yield b"y" * 100
            yield b'", "max_tokens": 2}'

        r = httpx.post(srv.base_url + "/v1/completions", content=chunks())
        assert r.status_code == 413
        ok = httpx.post(
            srv.base_url + "/v1/completions", json={"model": "toy", "prompt": "hi", "max_tokens": 2}
        )
        assert ok.status_code == 200
    finally:
        srv.stop()


def test_completion_prompts_are_tokenized_off_the_engine_thread() -> None:
    from hyspec_testing.server import toy_engine

    eng = toy_engine()
    threads: list[str] = []
    encode = eng.tokenizer.encode

    def recording(text: str, *, add_special_tokens: bool = True) -> list[int]:
        threads.append(threading.current_thread().name)
        return encode(text, add_special_tokens=add_special_tokens)

    eng.tokenizer.encode = recording  # type: ignore[method-assign]
    srv = ServerThread(eng, model_name="toy").start()
    try:
        body = {
            "model": "toy",
            "prompt": ["a long prompt " * 10, "another"],
            "max_tokens": 3,
            "temperature": 0,
        }
        r = httpx.post(srv.base_url + "/v1/completions", json=body)
        assert r.status_code == 200, r.text
        assert len(threads) >= 2 and "hyspec-engine" not in threads
        # the same tokens as a request the engine tokenized itself
        want = expected_text(TOK.encode("another"), 3)
        assert r.json()["choices"][1]["text"] == want
    finally:
        srv.stop()


def test_openapi_declares_request_bodies_and_error_answers() -> None:
    from hyspec_testing.server import toy_engine

    srv = ServerThread(toy_engine(), model_name="toy").start()
    try:
        doc = httpx.get(srv.base_url + "/openapi.json").json()
        schemas = doc["components"]["schemas"]
        for path, model in (
            ("/v1/completions", "CompletionRequest"),
            ("/v1/chat/completions", "ChatCompletionRequest"),
        ):
            op = doc["paths"][path]["post"]
            body = op["requestBody"]["content"]["application/json"]["schema"]
            assert body == {"$ref": f"#/components/schemas/{model}"} and op["requestBody"]["required"]
            assert {"max_tokens", "temperature", "stop"} <= set(schemas[model]["properties"])
            assert {"200", "400", "401", "404", "413", "429", "500"} <= set(op["responses"])
            err = op["responses"]["400"]["content"]["application/json"]["schema"]
            assert err == {"$ref": "#/components/schemas/ErrorResponse"}
        # every reference in the document resolves (fuzzers and client generators follow them)
        refs = re.findall(r'"\$ref": "#/components/schemas/([^"]+)"', json.dumps(doc))
        assert refs and all(r in schemas for r in refs)
        # a wrong method is a 405 naming the allowed ones
        r = httpx.get(srv.base_url + "/v1/completions")
        assert r.status_code == 405 and r.headers["allow"] == "POST"
        assert r.json()["error"]["type"] == "invalid_request_error"
    finally:
        srv.stop()


def test_a_slow_reader_holds_one_merged_output_per_request() -> None:
    from hyspec_server.async_engine import OutputQueue
    from hyspec_server.outputs import CompletionOutput, RequestMetrics, RequestOutput

    def out(i: int, *, finished: bool = False) -> RequestOutput:
        done = [*range(i + 1)]
        c = CompletionOutput(index=0, text="x" * (i + 1), token_ids=done, finish_reason=None)
        return RequestOutput(
            request_id="r",
            prompt="p",
            prompt_token_ids=[1],
            outputs=[c],
            finished=finished,
            metrics=RequestMetrics(arrival_time=0.0),
            delta_text="x",
            delta_token_ids=[i],
        )

    async def run() -> None:
        q = OutputQueue()
        for i in range(500):  # the engine keeps producing; nobody reads
            q.put_nowait(out(i))
        assert q.qsize() == 1
        first = q.get_nowait()
        assert isinstance(first, RequestOutput)
        assert first.delta_text == "x" * 500 and first.delta_token_ids == list(range(500))
        assert first.outputs[0].token_ids == list(range(500))  # the newest cumulative state
        q.put_nowait(out(500))
        q.put_nowait(out(501, finished=True))
        last = q.get_nowait()
        assert isinstance(last, RequestOutput) and last.finished and last.delta_token_ids == [500, 501]
        err = RuntimeError("step failed")
        q.put_nowait(out(502))
        q.put_nowait(err)  # an error is never merged away
        assert q.qsize() == 2 and q.get_nowait().delta_token_ids == [502] and q.get_nowait() is err  # type: ignore[union-attr]

    asyncio.run(run())


def _read_response(sock: Any) -> bytes:
    """One whole HTTP response off a raw socket: headers, then Content-Length bytes of body (the server may
    send them in separate packets)."""
    data = b""
    while b"\r\n\r\n" not in data:
        chunk = sock.recv(4096)
        if not chunk:
            return data
        data += chunk
    head, _, body = data.partition(b"\r\n\r\n")
    length = next(
        (
            int(line.split(b":", 1)[1])
            for line in head.split(b"\r\n")
            if line.lower().startswith(b"content-length:")
        ),
        0,
    )
    while len(body) < length:
        chunk = sock.recv(4096)
        if not chunk:
            break
        body += chunk
    return head + b"\r\n\r\n" + body


def test_a_half_sent_body_times_out_with_408() -> None:
    import socket

    from hyspec_testing.server import toy_engine

    srv = ServerThread(toy_engine(), model_name="toy", body_read_timeout_s=0.5).start()
    try:
        with socket.create_connection((srv.host, srv.port), timeout=10) as s:
            # slowloris: headers promise 100 bytes, 10 arrive, then nothing
            s.sendall(
                b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                b"Content-Length: 100\r\n\r\n" + b'{"model": '
            )
            t0 = time.monotonic()
            reply = _read_response(s)
            assert time.monotonic() - t0 < 8
        assert reply.startswith(b"HTTP/1.1 408") and b"request_timeout" in reply
        ok = httpx.post(
            srv.base_url + "/v1/completions", json={"model": "toy", "prompt": "hi", "max_tokens": 2}
        )
        assert ok.status_code == 200
    finally:
        srv.stop()


def test_a_client_gone_while_sending_its_body_logs_no_error(capfd: pytest.CaptureFixture[str]) -> None:
    """A client that closes its connection half-way through its body is answered (to no one) as a bad
    request: no "Exception in ASGI application" traceback per such client in the server's error log (a log
    anyone could flood), and the server serves the next request."""
    import socket

    from hyspec_testing.server import toy_engine

    srv = ServerThread(toy_engine(), model_name="toy").start()
    try:
        for _ in range(3):
            with socket.create_connection((srv.host, srv.port), timeout=10) as s:
                s.sendall(
                    b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                    b"Content-Length: 100\r\n\r\n" + b'{"model": '
                )
                time.sleep(0.05)  # the server is reading the body when the client goes
        ok = httpx.post(
            srv.base_url + "/v1/completions", json={"model": "toy", "prompt": "hi", "max_tokens": 2}
        )
        assert ok.status_code == 200
        time.sleep(0.5)  # the closed connections' handlers finish
        err = capfd.readouterr().err
        assert "Exception in ASGI application" not in err and "ClientDisconnect" not in err, err[-2000:]
    finally:
        srv.stop()


def test_a_body_dribbled_byte_by_byte_times_out_in_all() -> None:
    import socket

    from hyspec_testing.server import toy_engine

    srv = ServerThread(toy_engine(), model_name="toy", body_read_timeout_s=0.5).start()
    try:
        with socket.create_connection((srv.host, srv.port), timeout=10) as s:
            # each byte within the per-part timeout, the whole body never: 408 after 4 x 0.5 s
            s.sendall(
                b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                b"Content-Length: 100\r\n\r\n"
            )
            t0 = time.monotonic()
            for _ in range(40):
                try:
                    s.sendall(b" ")
                except OSError:
                    break  # the server answered and closed
                time.sleep(0.2)
                if time.monotonic() - t0 > 3.5:
                    break
            reply = _read_response(s)
            assert time.monotonic() - t0 < 8
        assert reply.startswith(b"HTTP/1.1 408") and b"in all" in reply, reply[:300]
        ok = httpx.post(
            srv.base_url + "/v1/completions", json={"model": "toy", "prompt": "hi", "max_tokens": 2}
        )
        assert ok.status_code == 200
    finally:
        srv.stop()


def test_a_streaming_client_that_stops_reading_is_aborted() -> None:
    """A client that asks for a long stream and then reads nothing: once its socket buffers are full, the
    request is aborted after the stall timeout (its memory freed), and the server keeps serving."""
    import socket

    from hyspec_testing.server import toy_engine

    srv = ServerThread(
        toy_engine(max_len=32768, pages=8400), model_name="toy", stream_stall_timeout_s=0.5
    ).start()
    try:
        body = json.dumps(
            {
                "model": "toy",
                "prompt": "go",
                "max_tokens": 30000,
                "ignore_eos": True,
                "stream": True,
                "logprobs": 20,
            }
        ).encode()
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
            s.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)  # a small window fills at once
            s.connect((srv.host, srv.port))
            s.sendall(
                b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                + f"Content-Length: {len(body)}\r\n\r\n".encode()
                + body
            )
            deadline = time.monotonic() + 10
            while time.monotonic() < deadline:  # the request runs
                text = httpx.get(srv.base_url + "/metrics").text
                if metric_sample(text, "hyspec:generation_tokens_total") > 0:
                    break
                time.sleep(0.05)
            # read nothing: once the socket buffers hold a few MB the stream stalls, and the request must end
            # long before its 30000 tokens (the bound is loose: a loaded 2-core machine streams slowly)
            srv.wait_idle_and_leak_check(timeout_s=120)
        text = httpx.get(srv.base_url + "/metrics").text
        assert metric_sample(text, "hyspec:request_success_total", finished_reason="abort") == 1
        assert metric_sample(text, "hyspec:generation_tokens_total") < 30000
        ok = httpx.post(
            srv.base_url + "/v1/completions", json={"model": "toy", "prompt": "hi", "max_tokens": 2}
        )
        assert ok.status_code == 200
    finally:
        srv.stop()


def test_half_sent_headers_are_closed_after_the_header_timeout() -> None:
    """Slowloris on the request head (which never reaches the app): the connection is closed after the
    header timeout, a byte at a time or not; complete requests are served as usual."""
    import socket

    from hyspec_testing.server import toy_engine

    srv = ServerThread(toy_engine(), model_name="toy", header_read_timeout_s=0.5).start()
    try:
        with socket.create_connection((srv.host, srv.port), timeout=10) as s:
            s.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\n")
            t0 = time.monotonic()
            for _ in range(3):  # trickling bytes do not extend the deadline
                time.sleep(0.1)
                s.sendall(b"X-A: b\r\n")
            assert s.recv(1024) == b""  # closed by the server
            assert time.monotonic() - t0 < 5
        ok = httpx.post(
            srv.base_url + "/v1/completions", json={"model": "toy", "prompt": "hi", "max_tokens": 2}
        )
        assert ok.status_code == 200
    finally:
        srv.stop()
