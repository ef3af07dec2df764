"""The asyncio HTTP/SSE client of `hyspec bench serve` (bench_cli.py): streams one request per connection
and times every content chunk.

Standard library only (one HTTP/1.1 connection per request, chunked transfer and server-sent events parsed
here): hyspec-server has no HTTP client among its runtime dependencies, and one event loop holds hundreds
of concurrent streams without threads.

`BenchError` (the benchmark cannot run) is here too, at the bottom of the bench modules' imports, so that
bench_report.py and bench_offline.py raise it without importing bench_cli.py.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import ssl
import time
import urllib.error
import urllib.parse
import urllib.request
from collections.abc import AsyncIterator, Awaitable
from dataclasses import dataclass, field
from typing import Any, TypeVar

from hyspec_server.bench_datasets import Turn

ENDPOINTS = {"openai": "/v1/completions", "vllm": "/v1/completions", "openai-chat": "/v1/chat/completions"}
"""Each backend's default endpoint; `vllm` is vLLM's name for its default, the completions API."""
TIMEOUT_S = 600.0
"""Seconds one socket operation may wait: a loaded server can be slow to a first token, and a request that
times out mid-stream is counted as failed."""

T = TypeVar("T")


class BenchError(Exception):
    """The benchmark cannot run (no model to ask for, a file that cannot be written): exit status 1."""


class RequestFailed(Exception):
    """One request failed (an HTTP error, an error event, a broken stream): counted, the run goes on."""


def join_url(base_url: str, path: str) -> str:
    """base + path, where a base ending in /v1 and a path starting with /v1/ share it (both spellings of
    the base URL are common)."""
    base = base_url.rstrip("/")
    if base.endswith("/v1") and path.startswith("/v1/"):
        path = path[3:]
    return base + (path if path.startswith("/") else "/" + path)


def first_model(url: str, api_key: str | None) -> str:
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


class Client:
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
