"""`hyspec bench serve | latency | throughput`, as `vllm bench serve | latency | throughput`.

- `serve` drives a running OpenAI-compatible server (hyspec's, vLLM's, any other) with streamed requests
  and reports TTFT, TPOT, ITL and end-to-end latency (mean, median, std, percentiles), request and token
  throughput and goodput under SLOs; `--save-result` writes them as JSON, with a PNG of latency CDFs and
  output throughput over time when matplotlib is installed. The workloads are in bench_datasets.py.
- `latency` times one batch end to end, offline through `hyspec_server.LLM`, after warm-up iterations.
- `throughput` runs a random dataset through `LLM` at once and reports requests and tokens per second.

The client is the standard library's asyncio (one HTTP/1.1 connection per request, chunked transfer and
server-sent events parsed here): hyspec-server has no HTTP client among its runtime dependencies, and one
event loop holds hundreds of concurrent streams without threads.

`cli.py` owns the top-level parser: it calls `add_bench_command` on its subparsers and `run_bench` for
`hyspec bench ...`.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import importlib
import json
import math
import os
import random
import ssl
import statistics
import sys
import time
import urllib.error
import urllib.parse
import urllib.request
from collections.abc import AsyncIterator, Awaitable, Sequence
from dataclasses import dataclass, field
from datetime import datetime
from pathlib import Path
from typing import Any, TypeVar

from hyspec_server.bench_datasets import (
    DATASETS,
    Conversation,
    Lengths,
    Turn,
    arrival_times,
    code_dataset,
    load_tokenizer,
    multi_turn_dataset,
    random_dataset,
    sample_len,
    shared_prefix_dataset,
)
from hyspec_server.engine_flags import add_engine_flags, engine_kwargs

DEFAULT_BASE_URL = "http://localhost:8000"
ENDPOINTS = {"openai": "/v1/completions", "vllm": "/v1/completions", "openai-chat": "/v1/chat/completions"}
"""Each backend's default endpoint; `vllm` is vLLM's name for its default, the completions API."""
TIMEOUT_S = 600.0
"""Seconds one socket operation may wait: a loaded server can be slow to a first token, and a request that
times out mid-stream is counted as failed."""
SLO_METRICS = ("ttft", "tpot", "e2el")
LATENCY_PERCENTILES = (10, 25, 50, 75, 90, 99)

T = TypeVar("T")


class BenchError(Exception):
    """The benchmark cannot run (no model to ask for, a file that cannot be written): exit status 1."""


class RequestFailed(Exception):
    """One request failed (an HTTP error, an error event, a broken stream): counted, the run goes on."""


# ----------------------------------------------------------------------------------------------- parser


def add_bench_command(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    """Adds "bench" to `sub` (the top-level subparsers), with subcommands serve, latency and throughput
    under `bench_command`."""
    bench = sub.add_parser(
        "bench",
        help="benchmark a running server (serve) or the engine offline (latency, throughput)",
        description="Benchmarks, as `vllm bench`: serve drives a running OpenAI-compatible server; latency "
        "and throughput run the engine in this process through hyspec_server.LLM.",
    )
    bs = bench.add_subparsers(dest="bench_command", required=True)
    _serve_flags(
        bs.add_parser(
            "serve",
            help="online benchmark of a running OpenAI-compatible server",
            description="Sends streamed requests to a running OpenAI-compatible server and reports TTFT, "
            "TPOT, ITL, end-to-end latency, throughput and goodput. Failed requests are counted; the exit "
            "status is 1 when none succeeded.",
        )
    )
    _latency_flags(
        bs.add_parser(
            "latency",
            help="offline latency of one batch",
            description="Times the generation of one batch of random prompts (ignore_eos, greedy), "
            "through hyspec_server.LLM in this process.",
        )
    )
    _throughput_flags(
        bs.add_parser(
            "throughput",
            help="offline throughput over a random dataset",
            description="Generates for every prompt of a random dataset at once (ignore_eos, greedy), "
            "through hyspec_server.LLM in this process, and reports requests and tokens per second.",
        )
    )


def _serve_flags(p: argparse.ArgumentParser) -> None:
    s = p.add_argument_group("Server")
    s.add_argument(
        "--backend",
        choices=sorted(ENDPOINTS),
        default="openai",
        help="openai (or vllm): the completions API; openai-chat: the chat completions API (default openai)",
    )
    s.add_argument("--base-url", default=DEFAULT_BASE_URL, help=f"the server (default {DEFAULT_BASE_URL})")
    s.add_argument(
        "--endpoint",
        default=None,
        help="the API path (default: /v1/completions, or /v1/chat/completions with --backend openai-chat)",
    )
    s.add_argument("--model", default=None, help="model to ask for (default: the first of /v1/models)")
    s.add_argument(
        "--api-key",
        default=None,
        help="bearer token (default: the HYSPEC_API_KEY, then the OPENAI_API_KEY environment variable)",
    )
    s.add_argument(
        "--tokenizer",
        default=None,
        help="a local tokenizer directory (transformers, offline): prompts of exactly the asked token "
        "lengths; without it lengths are approximate (the token counts reported are the server's)",
    )
    d = p.add_argument_group("Dataset")
    d.add_argument(
        "--dataset-name",
        choices=DATASETS,
        default="random",
        help="random: random words; shared-prefix: groups of prompts sharing a long prefix; multi-turn: "
        "chats resending their history each turn (needs --backend openai-chat); code: Python snippets to "
        "complete, cut from hyspec's own source files (no held-out split of the demo models' corpus ships "
        "with hyspec, and that corpus excludes hyspec's sources) (default random)",
    )
    d.add_argument("--num-prompts", type=int, default=1000, help="requests to send (default 1000)")
    d.add_argument(
        "--random-input-len", type=int, default=1024, help="tokens of each prompt or turn (default 1024)"
    )
    d.add_argument("--random-output-len", type=int, default=128, help="tokens to generate (default 128)")
    d.add_argument(
        "--random-range-ratio",
        type=float,
        default=0.0,
        help="lengths are uniform in [len * (1 - r), len * (1 + r)], 0 <= r < 1 (default 0)",
    )
    d.add_argument(
        "--shared-prefix-len", type=int, default=512, help="shared-prefix: tokens of the prefix (default 512)"
    )
    d.add_argument("--num-groups", type=int, default=8, help="shared-prefix: distinct prefixes (default 8)")
    d.add_argument("--num-turns", type=int, default=3, help="multi-turn: turns per conversation (default 3)")
    d.add_argument("--seed", type=int, default=0, help="seed of the dataset and the arrivals (default 0)")
    t = p.add_argument_group("Traffic")
    t.add_argument(
        "--request-rate",
        type=float,
        default=math.inf,
        help="requests (conversations, for multi-turn) per second, Poisson arrivals; inf sends all at once "
        "(default inf)",
    )
    t.add_argument(
        "--burstiness",
        type=float,
        default=1.0,
        help="shape of the gamma-distributed gaps: 1 Poisson, < 1 burstier, > 1 more even (default 1)",
    )
    t.add_argument(
        "--max-concurrency", type=int, default=None, help="most requests in flight (default: no bound)"
    )
    r = p.add_argument_group("Requests")
    r.add_argument(
        "--ignore-eos", action="store_true", help="send ignore_eos, so every output has its asked length"
    )
    r.add_argument("--temperature", type=float, default=0.0, help="sampling temperature (default 0, greedy)")
    r.add_argument(
        "--extra-body", type=_json_object, default=None, help="a JSON object merged into every request body"
    )
    o = p.add_argument_group("Results")
    o.add_argument(
        "--goodput",
        nargs="+",
        type=_slo,
        default=None,
        metavar="KEY:MS",
        help="SLOs for goodput, in ms, of ttft, tpot and e2el (e.g. ttft:500 tpot:50): the rate of "
        "requests meeting all of them",
    )
    o.add_argument(
        "--metric-percentiles",
        type=_percentiles,
        default=(90.0, 99.0),
        help="comma-separated percentiles to report (default 90,99)",
    )
    o.add_argument("--disable-tqdm", action="store_true", help="no progress bar")
    o.add_argument(
        "--save-result",
        action="store_true",
        help="write the results as JSON (and a PNG of the latency distributions, with matplotlib)",
    )
    o.add_argument(
        "--save-detailed",
        action="store_true",
        help="with --save-result: per-request lengths, latencies, errors and texts too",
    )
    o.add_argument("--result-dir", default=".", help="where --save-result writes (default .)")
    o.add_argument(
        "--result-filename",
        default=None,
        help="JSON file name (default: LABEL-RATEqps-concurrencyN-MODEL-DATE.json)",
    )
    o.add_argument("--label", default=None, help="names the results (default: the backend)")


def _latency_flags(p: argparse.ArgumentParser) -> None:
    b = p.add_argument_group("Benchmark")
    b.add_argument("--input-len", type=int, default=32, help="prompt tokens (default 32)")
    b.add_argument("--output-len", type=int, default=128, help="generated tokens (default 128)")
    b.add_argument("--batch-size", type=int, default=8, help="prompts in the batch (default 8)")
    b.add_argument("--num-iters-warmup", type=int, default=10, help="untimed iterations first (default 10)")
    b.add_argument("--num-iters", type=int, default=30, help="timed iterations (default 30)")
    b.add_argument("--output-json", default=None, help="write the results to this JSON file")
    b.add_argument("--disable-tqdm", action="store_true", help="no progress bar")
    _engine_flags(p)


def _throughput_flags(p: argparse.ArgumentParser) -> None:
    b = p.add_argument_group("Benchmark")
    b.add_argument("--dataset-name", choices=("random",), default="random", help="random token ids (default)")
    b.add_argument("--num-prompts", type=int, default=1000, help="prompts (default 1000)")
    b.add_argument("--input-len", type=int, default=128, help="prompt tokens (default 128)")
    b.add_argument("--output-len", type=int, default=128, help="generated tokens (default 128)")
    b.add_argument(
        "--random-range-ratio",
        type=float,
        default=0.0,
        help="lengths are uniform in [len * (1 - r), len * (1 + r)], 0 <= r < 1 (default 0)",
    )
    b.add_argument("--output-json", default=None, help="write the results to this JSON file")
    b.add_argument("--disable-tqdm", action="store_true", help="no progress bar")
    _engine_flags(p)


def _engine_flags(p: argparse.ArgumentParser) -> None:
    """`LLM(...)` arguments, passed only when given, so `LLM`'s defaults apply otherwise (`--model` left
    out: the embedded demo model and its speculation)."""
    add_engine_flags(p, model_help="", only_given=True)


def _json_object(text: str) -> dict[str, Any]:
    try:
        value = json.loads(text)
    except json.JSONDecodeError as e:
        raise argparse.ArgumentTypeError(f"not JSON: {e}") from e
    if not isinstance(value, dict):
        raise argparse.ArgumentTypeError("expected a JSON object")
    return value


def _slo(text: str) -> tuple[str, float]:
    key, sep, value = text.partition(":")
    if not sep or key not in SLO_METRICS:
        raise argparse.ArgumentTypeError(
            f"{text!r}: expected KEY:MS with KEY one of {', '.join(SLO_METRICS)}"
        )
    try:
        ms = float(value)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r}: {value!r} is not a number of ms") from None
    if not ms >= 0:
        raise argparse.ArgumentTypeError(f"{text!r}: the SLO must be >= 0 ms")
    return key, ms


def _percentiles(text: str) -> tuple[float, ...]:
    try:
        ps = tuple(float(x) for x in text.split(","))
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r}: expected numbers separated by commas") from None
    if not all(0 <= p <= 100 for p in ps):
        raise argparse.ArgumentTypeError(f"{text!r}: percentiles are in [0, 100]")
    return ps


# ------------------------------------------------------------------------------------------------ entry


def run_bench(ns: argparse.Namespace) -> int:
    """Runs `ns.bench_command`; returns the exit status: 0 done, 1 the benchmark could not run (or, for
    serve, no request succeeded), 2 bad arguments."""
    command: str = ns.bench_command
    try:
        if command == "serve":
            return _bench_serve(ns)
        if command == "latency":
            return _bench_latency(ns)
        if command == "throughput":
            return _bench_throughput(ns)
        raise ValueError(f"unknown bench command {command!r}")
    except (ValueError, TypeError) as e:
        _error(command, str(e))
        return 2
    except BenchError as e:
        _error(command, str(e))
        return 1
    except KeyboardInterrupt:
        _error(command, "interrupted")
        return 130


def _error(command: str, message: str) -> None:
    print(f"hyspec bench {command}: error: {' '.join(message.split())}", file=sys.stderr)


# ------------------------------------------------------------------------------------------ bench serve


def _bench_serve(ns: argparse.Namespace) -> int:
    _check_serve_args(ns)
    chat = ns.backend == "openai-chat"
    api_key = ns.api_key or os.environ.get("HYSPEC_API_KEY") or os.environ.get("OPENAI_API_KEY") or None
    url = _join_url(ns.base_url, ns.endpoint or ENDPOINTS[ns.backend])
    model = ns.model or _first_model(_join_url(ns.base_url, "/v1/models"), api_key)
    convs = _serve_dataset(ns)
    schedule = arrival_times(len(convs), ns.request_rate, ns.burstiness, ns.seed)
    client = _Client(url, api_key, _request_fields(ns, model), chat)
    print(
        f"Benchmarking {url} (model {model}): {ns.num_prompts} requests of the {ns.dataset_name} dataset, "
        f"request rate {ns.request_rate}, max concurrency {ns.max_concurrency or 'unbounded'}",
        file=sys.stderr,
    )
    run = asyncio.run(_run(client, convs, schedule, ns.max_concurrency, ns.disable_tqdm))
    result = _summarize(run, dict(ns.goodput or []), ns.metric_percentiles)
    result = {**_run_info(ns, model, url), **result}
    _print_table(result, ns.metric_percentiles)
    if ns.save_result:
        _save(result, run, ns)
    return 0 if result["completed"] else 1


def _check_serve_args(ns: argparse.Namespace) -> None:
    for name in ("num_prompts", "random_input_len", "random_output_len", "num_groups", "num_turns"):
        if getattr(ns, name) < 1:
            raise ValueError(f"--{name.replace('_', '-')} must be >= 1")
    if ns.shared_prefix_len < 0:
        raise ValueError("--shared-prefix-len must be >= 0")
    if not 0 <= ns.random_range_ratio < 1:
        raise ValueError("--random-range-ratio must be in [0, 1)")
    if ns.max_concurrency is not None and ns.max_concurrency < 1:
        raise ValueError("--max-concurrency must be >= 1")
    if not ns.request_rate > 0 or not ns.burstiness > 0:
        raise ValueError("--request-rate and --burstiness must be > 0")
    if ns.dataset_name == "multi-turn" and ns.backend != "openai-chat":
        raise ValueError("the multi-turn dataset needs --backend openai-chat (it sends chat histories)")


def _serve_dataset(ns: argparse.Namespace) -> list[Conversation]:
    lengths = Lengths(load_tokenizer(ns.tokenizer) if ns.tokenizer else None)
    common: dict[str, Any] = {
        "input_len": ns.random_input_len,
        "output_len": ns.random_output_len,
        "range_ratio": ns.random_range_ratio,
        "lengths": lengths,
        "seed": ns.seed,
    }
    n = ns.num_prompts
    if ns.dataset_name == "shared-prefix":
        return shared_prefix_dataset(n, ns.shared_prefix_len, ns.num_groups, **common)
    if ns.dataset_name == "multi-turn":
        return multi_turn_dataset(n, ns.num_turns, **common)
    if ns.dataset_name == "code":
        return code_dataset(n, **common)
    return random_dataset(n, **common)


def _request_fields(ns: argparse.Namespace, model: str) -> dict[str, Any]:
    """What every request body carries besides its prompt and length."""
    body: dict[str, Any] = {
        "model": model,
        "temperature": ns.temperature,
        "stream": True,
        # the final chunk then counts the tokens, as the server's tokenizer saw them
        "stream_options": {"include_usage": True},
    }
    if ns.ignore_eos:
        body["ignore_eos"] = True
    return {**body, **(ns.extra_body or {})}


def _join_url(base_url: str, path: str) -> str:
    """base + path, where a base ending in /v1 and a path starting with /v1/ share it (both spellings of
    the base URL are common)."""
    base = base_url.rstrip("/")
    if base.endswith("/v1") and path.startswith("/v1/"):
        path = path[3:]
    return base + (path if path.startswith("/") else "/" + path)


def _first_model(url: str, api_key: str | None) -> str:
    req = urllib.request.Request(url, headers=_auth(api_key))
    try:
        with urllib.request.urlopen(req, timeout=30) as resp:
            return str(json.load(resp)["data"][0]["id"])
    except urllib.error.HTTPError as e:
        raise BenchError(f"cannot list the models at {url}: {_http_error(e.code, e.read())}") from e
    except (OSError, ValueError, KeyError, IndexError, TypeError) as e:
        raise BenchError(f"cannot list the models at {url} ({e}); or give --model") from e


def _auth(api_key: str | None) -> dict[str, str]:
    return {"Authorization": f"Bearer {api_key}"} if api_key else {}


# ----------------------------------------------------------------------------------------------- client


@dataclass
class TurnResult:
    """One request as the client saw it; times are perf_counter seconds."""

    input_len: int
    output_len: int = 0
    ok: bool = False
    error: str = ""
    start: float = 0.0
    end: float = 0.0
    ttft: float = 0.0
    chunk_times: list[float] = field(default_factory=list)
    usage: bool = False  # the token counts came from the server's usage
    text: str = ""

    @property
    def latency(self) -> float:
        return self.end - self.start

    @property
    def tpot(self) -> float | None:
        """Mean time per output token after the first; None with one token."""
        if self.output_len < 2:
            return None
        return (self.latency - self.ttft) / (self.output_len - 1)

    @property
    def itls(self) -> list[float]:
        return [b - a for a, b in zip(self.chunk_times, self.chunk_times[1:])]


class _Client:
    """Streams one completion or chat request per call over its own HTTP/1.1 connection."""

    def __init__(self, url: str, api_key: str | None, body: dict[str, Any], chat: bool) -> None:
        u = urllib.parse.urlsplit(url)
        if u.scheme not in ("http", "https") or not u.hostname:
            raise ValueError(f"--base-url: expected http(s)://host[:port], got {url!r}")
        self.host = u.hostname
        self.port = u.port or (443 if u.scheme == "https" else 80)
        self.ssl = ssl.create_default_context() if u.scheme == "https" else None
        self.path = (u.path or "/") + (f"?{u.query}" if u.query else "")
        default_port = self.port == (443 if self.ssl else 80)
        self.host_header = self.host if default_port else f"{self.host}:{self.port}"
        self.api_key = api_key
        self.body = body
        self.chat = chat

    async def send(self, prompt: str | list[dict[str, str]], turn: Turn) -> TurnResult:
        r = TurnResult(input_len=turn.input_len)
        r.start = time.perf_counter()
        try:
            await self._stream(self._payload(prompt, turn.output_len), r)
        except Exception as e:  # any failure is one failed request, never the end of the run
            r.error = str(e) if isinstance(e, RequestFailed) else f"{type(e).__name__}: {e}"
        r.end = time.perf_counter()
        if r.error:
            return r
        if not r.chunk_times:
            r.error = "the reply had no content, so no token to time"
            return r
        r.ttft = r.chunk_times[0] - r.start
        r.ok = True
        return r

    def _payload(self, prompt: str | list[dict[str, str]], max_tokens: int) -> bytes:
        if self.chat:
            body = {"messages": prompt, "max_completion_tokens": max_tokens, **self.body}
        else:
            body = {"prompt": prompt, "max_tokens": max_tokens, **self.body}
        return json.dumps(body).encode()

    async def _stream(self, payload: bytes, r: TurnResult) -> None:
        """Fills `r` with the token chunks' arrival times, the text and the token counts."""
        pieces: list[str] = []
        async for t, event in self._events(payload):
            text = _content(event, self.chat)
            if text is not None:
                r.chunk_times.append(t)
                pieces.append(text)
            usage = event.get("usage")
            if isinstance(usage, dict) and isinstance(usage.get("completion_tokens"), int):
                r.usage = True
                r.output_len = usage["completion_tokens"]
                r.input_len = int(usage.get("prompt_tokens", r.input_len))
        r.text = "".join(pieces)
        if not r.usage:
            r.output_len = len(r.chunk_times)  # a server without usage: one token a chunk, at best

    async def _events(self, payload: bytes) -> AsyncIterator[tuple[float, dict[str, Any]]]:
        """The SSE events of the answer, each with the time its bytes arrived, until `data: [DONE]`."""
        reader, writer = await _timed(
            asyncio.open_connection(self.host, self.port, ssl=self.ssl, limit=1 << 20)
        )
        try:
            writer.write(self._head(len(payload)) + payload)
            await _timed(writer.drain())
            status, headers = await _read_head(reader)
            body = _read_body(reader, headers)
            if status != 200:
                raise RequestFailed(_http_error(status, b"".join([piece async for _, piece in body])))
            parser = _SSEParser()
            async for t, piece in body:
                for data in parser.feed(piece):
                    if data == "[DONE]":
                        return
                    event = json.loads(data)
                    if isinstance(event, dict) and "error" in event:
                        raise RequestFailed(f"error event: {_message_of(event)}")
                    yield t, event
            raise RequestFailed("the stream ended before data: [DONE]")
        finally:
            writer.close()
            with contextlib.suppress(Exception):
                await writer.wait_closed()

    def _head(self, length: int) -> bytes:
        lines = [
            f"POST {self.path} HTTP/1.1",
            f"Host: {self.host_header}",
            "User-Agent: hyspec-bench",
            "Content-Type: application/json",
            "Accept: text/event-stream",
            f"Content-Length: {length}",
            "Connection: close",
            *(f"{k}: {v}" for k, v in _auth(self.api_key).items()),
        ]
        return ("\r\n".join(lines) + "\r\n\r\n").encode("latin-1")


async def _timed(aw: Awaitable[T]) -> T:
    return await asyncio.wait_for(aw, TIMEOUT_S)


async def _read_head(reader: asyncio.StreamReader) -> tuple[int, dict[str, str]]:
    parts = (await _timed(reader.readline())).split(None, 2)
    if len(parts) < 2 or not parts[0].startswith(b"HTTP/") or not parts[1].isdigit():
        raise RequestFailed("the server's answer is not HTTP")
    headers: dict[str, str] = {}
    while True:
        line = await _timed(reader.readline())
        if line in (b"\r\n", b"\n", b""):
            return int(parts[1]), headers
        key, _, value = line.decode("latin-1").partition(":")
        headers[key.strip().lower()] = value.strip()


async def _read_body(
    reader: asyncio.StreamReader, headers: dict[str, str]
) -> AsyncIterator[tuple[float, bytes]]:
    """The body's pieces as they arrive (chunked, sized or up to EOF), each with its arrival time."""
    if "chunked" in headers.get("transfer-encoding", "").lower():
        while True:
            size = int((await _timed(reader.readline())).split(b";")[0].strip() or b"0", 16)
            if size == 0:
                return
            data = await _timed(reader.readexactly(size))
            yield time.perf_counter(), data
            await _timed(reader.readexactly(2))  # the CRLF after each chunk
    elif "content-length" in headers:
        data = await _timed(reader.readexactly(int(headers["content-length"])))
        yield time.perf_counter(), data
    else:
        while data := await _timed(reader.read(1 << 16)):
            yield time.perf_counter(), data


class _SSEParser:
    """Server-sent events from arbitrary pieces of the stream: each event's data (its `data:` lines)."""

    def __init__(self) -> None:
        self.buf = b""
        self.data: list[str] = []

    def feed(self, piece: bytes) -> list[str]:
        *lines, self.buf = (self.buf + piece).split(b"\n")
        out = []
        for raw in lines:
            line = raw.rstrip(b"\r").decode("utf-8")
            if not line:  # a blank line ends the event
                if self.data:
                    out.append("\n".join(self.data))
                self.data = []
            elif line.startswith("data:"):
                self.data.append(line[5:].removeprefix(" "))
        return out


def _content(event: dict[str, Any], chat: bool) -> str | None:
    """The generated text of a chunk (reasoning text counts: it is generated tokens too); "" for a chunk of
    tokens that decode to no text yet (part of a character, a held-back stop string); None for a chunk that
    carries no tokens (the chat role chunk, a bare finish, the usage chunk)."""
    choices = event.get("choices") or []
    if not choices or not isinstance(choices[0], dict):
        return None
    c = choices[0]
    keys = ("text",) if not chat else ("reasoning_content", "reasoning", "content")
    where = c if not chat else (c.get("delta") or {})
    text = "".join(str(where.get(k) or "") for k in keys)
    if text:
        return text
    if c.get("finish_reason") is not None or "role" in where or not any(k in where for k in keys):
        return None
    return ""


def _http_error(status: int, body: bytes) -> str:
    try:
        message = _message_of(json.loads(body))
    except ValueError:
        message = body.decode("utf-8", errors="replace")
    return f"HTTP {status}: {' '.join(message.split())[:500]}"


def _message_of(body: Any) -> str:
    if isinstance(body, dict):
        err = body.get("error", body.get("detail", body))
        if isinstance(err, dict) and "message" in err:
            return str(err["message"])
        return str(err)
    return str(body)


# ----------------------------------------------------------------------------------------------- driver


@dataclass
class ServeRun:
    """Every request's result, in dataset order, and the wall time of the run."""

    results: list[TurnResult]
    t0: float
    duration: float


async def _run(
    client: _Client,
    convs: Sequence[Conversation],
    schedule: Sequence[float],
    max_concurrency: int | None,
    disable_tqdm: bool,
) -> ServeRun:
    total = sum(len(c.turns) for c in convs)
    gate = asyncio.Semaphore(max_concurrency or total)
    bar = None if disable_tqdm else _progress_bar(total)
    t0 = time.perf_counter()

    async def conversation(conv: Conversation, at: float) -> list[TurnResult]:
        await asyncio.sleep(max(0.0, t0 + at - time.perf_counter()))
        history: list[dict[str, str]] = []
        out: list[TurnResult] = []
        for turn in conv.turns:
            if out and not out[-1].ok:
                # without the earlier answer there is no history to send
                out.append(TurnResult(input_len=turn.input_len, error="an earlier turn of its chat failed"))
            else:
                user = {"role": "user", "content": turn.text}
                async with gate:
                    out.append(await client.send([*history, user] if client.chat else turn.text, turn))
                history += [user, {"role": "assistant", "content": out[-1].text}]
            if bar is not None:
                bar.update(1)
        return out

    try:
        done = await asyncio.gather(*(conversation(c, at) for c, at in zip(convs, schedule)))
    finally:
        if bar is not None:
            bar.close()
    return ServeRun([r for rs in done for r in rs], t0, time.perf_counter() - t0)


def _progress_bar(total: int) -> Any:
    try:
        from tqdm import tqdm
    except ImportError:
        return None
    return tqdm(total=total, desc="Requests", dynamic_ncols=True)


# ---------------------------------------------------------------------------------------------- metrics


def _summarize(run: ServeRun, slos: dict[str, float], percentiles: Sequence[float]) -> dict[str, Any]:
    """vLLM's result fields: counts, throughputs, goodput and each latency metric's statistics in ms."""
    ok = [r for r in run.results if r.ok]
    dt = max(run.duration, 1e-9)
    out_tokens = sum(r.output_len for r in ok)
    in_tokens = sum(r.input_len for r in ok)
    errors = [r.error for r in run.results if not r.ok]
    result: dict[str, Any] = {
        "duration": run.duration,
        "completed": len(ok),
        "failed": len(errors),
        "first_error": _first_error(run.results),
        "total_input_tokens": in_tokens,
        "total_output_tokens": out_tokens,
        "token_counts_from_usage": all(r.usage for r in ok),
        "request_throughput": len(ok) / dt,
        "request_goodput": sum(_meets(r, slos) for r in ok) / dt if slos else None,
        "goodput_slos_ms": slos or None,
        "output_throughput": out_tokens / dt,
        "total_token_throughput": (in_tokens + out_tokens) / dt,
        "peak_output_throughput": _peak_output_throughput(run),
        "peak_concurrent_requests": _peak_concurrency(run.results),
    }
    for name, values in _latency_series(ok).items():
        result.update(_stats(name, [v * 1000 for v in values], percentiles))
    return result


def _first_error(results: Sequence[TurnResult]) -> str | None:
    """The error of the failure that came first (turns skipped after a failed one were never sent)."""
    sent = sorted((r for r in results if not r.ok and r.end), key=lambda r: r.end)
    return sent[0].error if sent else next((r.error for r in results if not r.ok), None)


def _latency_series(ok: Sequence[TurnResult]) -> dict[str, list[float]]:
    """Seconds: TTFT and e2e latency per request, TPOT per request of 2+ tokens, every inter-chunk gap."""
    return {
        "ttft": [r.ttft for r in ok],
        "tpot": [t for r in ok if (t := r.tpot) is not None],
        "itl": [g for r in ok for g in r.itls],
        "e2el": [r.latency for r in ok],
    }


def _stats(name: str, ms: Sequence[float], percentiles: Sequence[float]) -> dict[str, float]:
    xs = sorted(ms)
    out = {
        f"mean_{name}_ms": statistics.fmean(xs) if xs else 0.0,
        f"median_{name}_ms": percentile(xs, 50),
        f"std_{name}_ms": statistics.pstdev(xs) if xs else 0.0,
    }
    for p in percentiles:
        out[f"p{p:g}_{name}_ms"] = percentile(xs, p)
    return out


def percentile(sorted_xs: Sequence[float], p: float) -> float:
    """The p-th percentile of sorted values, interpolated linearly between ranks (numpy's default)."""
    if not sorted_xs:
        return 0.0
    k = (len(sorted_xs) - 1) * p / 100
    lo = math.floor(k)
    hi = min(lo + 1, len(sorted_xs) - 1)
    return sorted_xs[lo] + (sorted_xs[hi] - sorted_xs[lo]) * (k - lo)


def _meets(r: TurnResult, slos: dict[str, float]) -> bool:
    got = {"ttft": r.ttft, "tpot": r.tpot or 0.0, "e2el": r.latency}
    return all(got[k] * 1000 <= ms for k, ms in slos.items())


def _peak_concurrency(results: Sequence[TurnResult]) -> int:
    # ends sort before starts at the same instant: a request that ends as another starts is not overlap
    edges = sorted((t, d) for r in results if r.end for t, d in ((r.start, 1), (r.end, -1)))
    running = peak = 0
    for _, d in edges:
        running += d
        peak = max(peak, running)
    return peak


def _token_events(run: ServeRun) -> list[tuple[float, float]]:
    """(seconds from the start, tokens) of every content chunk, in time order. A chunk can carry several
    tokens (speculative decoding commits a few at once, a busy server sends what piled up), so each
    request's token count is spread evenly over its chunks."""
    events = [
        (t - run.t0, r.output_len / len(r.chunk_times)) for r in run.results if r.ok for t in r.chunk_times
    ]
    return sorted(events)


def _peak_output_throughput(run: ServeRun, window_s: float = 1.0) -> float:
    """Most output tokens/s over any `window_s` of the run (the whole run when it is shorter)."""
    events = _token_events(run)
    window = min(window_s, max(run.duration, 1e-9))
    best = inside = 0.0
    first = 0
    for t, k in events:
        inside += k
        while events[first][0] <= t - window:
            inside -= events[first][1]
            first += 1
        best = max(best, inside)
    return best / window


def _output_timeline(run: ServeRun, bin_s: float = 1.0) -> list[float]:
    """Output tokens per second in consecutive `bin_s` bins from the start (the last one as long as what
    is left of the run)."""
    n = max(1, math.ceil(run.duration / bin_s))
    tokens = [0.0] * n
    for t, k in _token_events(run):
        tokens[min(n - 1, int(t / bin_s))] += k
    widths = [bin_s] * (n - 1) + [max(run.duration - (n - 1) * bin_s, 1e-9)]
    return [k / w for k, w in zip(tokens, widths)]


# ----------------------------------------------------------------------------------------------- report


def _run_info(ns: argparse.Namespace, model: str, url: str) -> dict[str, Any]:
    return {
        "date": datetime.now().strftime("%Y%m%d-%H%M%S"),
        "backend": ns.backend,
        "label": ns.label or ns.backend,
        "url": url,
        "model_id": model,
        "tokenizer_id": ns.tokenizer,
        "dataset_name": ns.dataset_name,
        "num_prompts": ns.num_prompts,
        # JSON has no infinity
        "request_rate": ns.request_rate if math.isfinite(ns.request_rate) else "inf",
        "burstiness": ns.burstiness,
        "max_concurrency": ns.max_concurrency,
        "ignore_eos": ns.ignore_eos,
        "random_input_len": ns.random_input_len,
        "random_output_len": ns.random_output_len,
        "random_range_ratio": ns.random_range_ratio,
        "seed": ns.seed,
    }


_SECTIONS = (
    ("ttft", "Time to First Token", "TTFT"),
    ("tpot", "Time per Output Token (excl. 1st token)", "TPOT"),
    ("itl", "Inter-token Latency", "ITL"),
    ("e2el", "End-to-end Latency", "E2EL"),
)


def _print_table(res: dict[str, Any], percentiles: Sequence[float]) -> None:
    def row(label: str, value: Any) -> None:
        text = f"{value:.2f}" if isinstance(value, float) else str(value)
        print(f"{label:<40} {text:<10}")

    print("{s:{c}^50}".format(s=" Serving Benchmark Result ", c="="))
    row("Successful requests:", res["completed"])
    row("Failed requests:", res["failed"])
    row("Maximum request concurrency:", res["max_concurrency"] or "unbounded")
    row("Request rate configured (RPS):", res["request_rate"])
    row("Benchmark duration (s):", res["duration"])
    row("Total input tokens:", res["total_input_tokens"])
    row("Total generated tokens:", res["total_output_tokens"])
    row("Request throughput (req/s):", res["request_throughput"])
    if res["request_goodput"] is not None:
        row("Request goodput (req/s):", res["request_goodput"])
    row("Output token throughput (tok/s):", res["output_throughput"])
    row("Peak output token throughput (tok/s):", res["peak_output_throughput"])
    row("Peak concurrent requests:", res["peak_concurrent_requests"])
    row("Total token throughput (tok/s):", res["total_token_throughput"])
    for key, title, short in _SECTIONS:
        print("{s:{c}^50}".format(s=title, c="-"))
        row(f"Mean {short} (ms):", res[f"mean_{key}_ms"])
        row(f"Median {short} (ms):", res[f"median_{key}_ms"])
        for p in percentiles:
            row(f"P{p:g} {short} (ms):", res[f"p{p:g}_{key}_ms"])
    print("=" * 50)
    if res["first_error"]:
        print(f"First error: {res['first_error']}")
    if res["completed"] and not res["token_counts_from_usage"]:
        print("Note: the server sent no usage; output tokens were counted as content chunks")


def _save(result: dict[str, Any], run: ServeRun, ns: argparse.Namespace) -> None:
    out = dict(result)
    if ns.save_detailed:
        out.update(_details(run))
    name = ns.result_filename or _default_filename(result)
    path = Path(ns.result_dir) / name
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(out, indent=2) + "\n")
    except OSError as e:
        raise BenchError(f"cannot write {path}: {e}") from e
    print(f"Results: {path}")
    note = _plot(run, result, path.with_suffix(".png"))
    print(note)


def _details(run: ServeRun) -> dict[str, Any]:
    rs = run.results
    return {
        "input_lens": [r.input_len for r in rs],
        "output_lens": [r.output_len for r in rs],
        "start_times": [r.start - run.t0 if r.start else None for r in rs],
        "ttfts": [r.ttft if r.ok else None for r in rs],
        "tpots": [r.tpot if r.ok else None for r in rs],
        "itls": [r.itls for r in rs],
        "e2els": [r.latency if r.ok else None for r in rs],
        "errors": [r.error for r in rs],
        "generated_texts": [r.text for r in rs],
    }


def _default_filename(result: dict[str, Any]) -> str:
    model = str(result["model_id"]).replace("/", "_")
    concurrency = result["max_concurrency"] or "inf"
    rate = result["request_rate"]
    return f"{result['label']}-{rate}qps-concurrency{concurrency}-{model}-{result['date']}.json"


def _plot(run: ServeRun, result: dict[str, Any], path: Path) -> str:
    """Latency CDFs and output throughput over time into `path`; the line to print either way."""
    try:
        mpl = importlib.import_module("matplotlib")
    except ImportError:
        return (
            "Note: matplotlib is not installed, so no plot (pip install matplotlib for a PNG of the results)"
        )
    mpl.use("Agg")  # no display needed
    plt = importlib.import_module("matplotlib.pyplot")
    fig = plt.figure(figsize=(15, 8))
    grid = fig.add_gridspec(2, 3)
    cells = [grid[0, 0], grid[0, 1], grid[0, 2], grid[1, 0]]
    series = _latency_series([r for r in run.results if r.ok])
    for cell, (key, title, short) in zip(cells, _SECTIONS):
        ax = fig.add_subplot(cell)
        xs = sorted(v * 1000 for v in series[key])
        if xs:
            # the step function of the empirical CDF, from 0 at the smallest value
            ax.plot([xs[0], *xs], [0.0, *((i + 1) / len(xs) for i in range(len(xs)))], drawstyle="steps-post")
        of = "inter-token gaps" if key == "itl" else "requests"
        ax.set(title=f"{short}: {title}", xlabel="ms", ylabel=f"fraction of {of}", ylim=(0, 1.02))
        ax.grid(alpha=0.3)
    ax = fig.add_subplot(grid[1, 1:])
    # about 60 points over a short run, one a second over a long one
    bin_s = 1.0 if run.duration >= 60 else max(run.duration / 60, 1e-3)
    timeline = _output_timeline(run, bin_s)
    ax.plot([(i + 0.5) * bin_s for i in range(len(timeline))], timeline, marker=".")
    ax.set(
        title=f"Output token throughput ({bin_s:.3g} s bins)",
        xlabel="seconds from the start",
        ylabel="tokens/s",
        ylim=(0, None),
    )
    ax.grid(alpha=0.3)
    fig.suptitle(
        f"{result['model_id']} at {result['url']}: {result['dataset_name']}, {result['completed']} requests, "
        f"rate {result['request_rate']}, concurrency {result['max_concurrency'] or 'unbounded'}"
    )
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return f"Plot: {path}"


# ---------------------------------------------------------------------------------- latency, throughput


def _make_llm(ns: argparse.Namespace) -> Any:
    from hyspec_server.llm import LLM  # the engine (and torch) only for the offline benchmarks

    return LLM(ns.model, **engine_kwargs(ns))


def _vocab_size(llm: Any) -> int:
    tok = llm.get_tokenizer()
    size = getattr(tok, "vocab_size", None)
    return int(size) if isinstance(size, int) and size > 0 else len(tok)


def _random_ids(rng: random.Random, vocab: int, n: int) -> dict[str, list[int]]:
    return {"prompt_token_ids": [rng.randrange(vocab) for _ in range(n)]}


def _greedy(max_tokens: int) -> Any:
    from hyspec_server.sampling_params import SamplingParams

    # every request generates exactly max_tokens tokens, whatever the model would stop at
    return SamplingParams(max_tokens=max_tokens, ignore_eos=True, temperature=0.0)


def _bench_latency(ns: argparse.Namespace) -> int:
    for name in ("input_len", "output_len", "batch_size", "num_iters"):
        if getattr(ns, name) < 1:
            raise ValueError(f"--{name.replace('_', '-')} must be >= 1")
    if ns.num_iters_warmup < 0:
        raise ValueError("--num-iters-warmup must be >= 0")
    llm = _make_llm(ns)
    rng = random.Random(ns.seed or 0)
    vocab = _vocab_size(llm)
    prompts = [_random_ids(rng, vocab, ns.input_len) for _ in range(ns.batch_size)]
    params = _greedy(ns.output_len)

    def once() -> tuple[float, list[Any]]:
        t0 = time.perf_counter()
        outs = llm.generate(prompts, params, use_tqdm=False)
        return time.perf_counter() - t0, outs

    for _ in _iterations(ns.num_iters_warmup, "Warmup iterations", ns.disable_tqdm):
        once()
    latencies: list[float] = []
    outs: list[Any] = []
    for _ in _iterations(ns.num_iters, "Profiling iterations", ns.disable_tqdm):
        dt, got = once()
        latencies.append(dt)
        outs += got
    xs = sorted(latencies)
    result: dict[str, Any] = {
        "avg_latency": statistics.fmean(xs),
        "latencies": latencies,
        "percentiles": {str(p): percentile(xs, p) for p in LATENCY_PERCENTILES},
        "input_len": ns.input_len,
        "output_len": ns.output_len,
        "batch_size": ns.batch_size,
        "num_iters": ns.num_iters,
        "output_tokens_per_iter": sum(len(c.token_ids) for o in outs for c in o.outputs) / ns.num_iters,
        "spec_decode": _spec_summary(outs),
    }
    print(f"Avg latency: {result['avg_latency']:.4f} seconds")
    for p, v in result["percentiles"].items():
        print(f"{p}% percentile latency: {v:.4f} seconds")
    _print_spec(result["spec_decode"])
    _write_json(ns.output_json, result)
    return 0


def _iterations(n: int, desc: str, disable: bool) -> Any:
    if disable:
        return range(n)
    try:
        from tqdm import tqdm
    except ImportError:
        return range(n)
    return tqdm(range(n), desc=desc, dynamic_ncols=True)


def _bench_throughput(ns: argparse.Namespace) -> int:
    for name in ("input_len", "output_len", "num_prompts"):
        if getattr(ns, name) < 1:
            raise ValueError(f"--{name.replace('_', '-')} must be >= 1")
    if not 0 <= ns.random_range_ratio < 1:
        raise ValueError("--random-range-ratio must be in [0, 1)")
    llm = _make_llm(ns)
    rng = random.Random(ns.seed or 0)
    vocab = _vocab_size(llm)
    prompts, params = [], []
    for _ in range(ns.num_prompts):
        prompts.append(_random_ids(rng, vocab, sample_len(rng, ns.input_len, ns.random_range_ratio)))
        params.append(_greedy(sample_len(rng, ns.output_len, ns.random_range_ratio)))
    t0 = time.perf_counter()
    outs = llm.generate(prompts, params, use_tqdm=not ns.disable_tqdm)
    elapsed = time.perf_counter() - t0
    prompt_tokens = sum(len(o.prompt_token_ids) for o in outs)
    output_tokens = sum(len(c.token_ids) for o in outs for c in o.outputs)
    total = prompt_tokens + output_tokens
    result: dict[str, Any] = {
        "elapsed_time": elapsed,
        "num_requests": len(outs),
        "total_num_tokens": total,
        "total_prompt_tokens": prompt_tokens,
        "total_output_tokens": output_tokens,
        "requests_per_second": len(outs) / elapsed,
        "tokens_per_second": total / elapsed,
        "output_tokens_per_second": output_tokens / elapsed,
        "spec_decode": _spec_summary(outs),
    }
    print(
        f"Throughput: {result['requests_per_second']:.2f} requests/s, "
        f"{result['tokens_per_second']:.2f} total tokens/s, "
        f"{result['output_tokens_per_second']:.2f} output tokens/s"
    )
    print(f"Total num prompt tokens:  {prompt_tokens}")
    print(f"Total num output tokens:  {output_tokens}")
    _print_spec(result["spec_decode"])
    _write_json(ns.output_json, result)
    return 0


def _spec_summary(outs: Sequence[Any]) -> dict[str, Any] | None:
    """Speculative decoding's totals over the outputs; None without speculation."""
    stats = [o.spec_stats for o in outs if o.spec_stats is not None]
    if not stats:
        return None
    drafts = sum(s.num_drafts for s in stats)
    accepted = sum(s.num_accepted_tokens for s in stats)
    return {
        "num_drafts": drafts,
        "num_draft_tokens": sum(s.num_draft_tokens for s in stats),
        "num_accepted_tokens": accepted,
        # tokens per verify round: the accepted drafts plus the target's own token
        "mean_accept_length": 1 + accepted / drafts if drafts else None,
    }


def _print_spec(spec: dict[str, Any] | None) -> None:
    if spec and spec["num_drafts"]:
        print(
            f"Speculative decoding: {spec['num_accepted_tokens']}/{spec['num_draft_tokens']} drafted tokens "
            f"accepted, {spec['mean_accept_length']:.2f} tokens per verify round"
        )


def _write_json(path: str | None, result: dict[str, Any]) -> None:
    if path is None:
        return
    try:
        Path(path).parent.mkdir(parents=True, exist_ok=True)
        Path(path).write_text(json.dumps(result, indent=2) + "\n")
    except OSError as e:
        raise BenchError(f"cannot write {path}: {e}") from e
    print(f"Results: {path}")
