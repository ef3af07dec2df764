"""`hyspec chat` and `hyspec complete`: terminal clients of a running OpenAI-compatible server.

They behave as `vllm chat` / `vllm complete`: `--url` (default DEFAULT_URL), `--model-name` (default: the
first model of `GET /models`), `--api-key` (default: HYSPEC_API_KEY, then OPENAI_API_KEY), `-q/--quick` (one
message, then exit). Chat keeps the conversation and streams each reply from `/chat/completions`; complete
streams `/completions` for each input line, with no history.

Standard library only (urllib and a small SSE reader): hyspec-server's runtime dependencies include no HTTP
client (httpx and openai are dev dependencies), and talking to a server should not need one installed.

`cli.py` owns the top-level parser: it calls `add_client_commands` on its subparsers and `run_client` for
the two commands.
"""

from __future__ import annotations

import argparse
import http.client
import json
import os
import sys
import urllib.error
import urllib.request
from collections.abc import Callable, Generator, Iterable, Iterator
from typing import Any, Protocol, TextIO

DEFAULT_URL = "http://localhost:8000/v1"
TIMEOUT_S = 600.0
"""Seconds one socket operation may wait: a large model on a busy server can be slow to its first token,
and an idle timeout that fires mid-answer would lose the reply."""

CLIENT_COMMANDS = ("chat", "complete")


class ServerError(Exception):
    """The server answered, with an error: the turn fails, an interactive session goes on."""


class UnreachableError(Exception):
    """No usable HTTP answer (refused, reset, timed out, bad URL): nothing later can work either, exit 1."""


def add_client_commands(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    """Adds the "chat" and "complete" subcommands to `sub` (the top-level parser's subparsers)."""
    c = sub.add_parser(
        "chat",
        help="chat with a running server (streams replies, keeps the conversation)",
        description="Interactive chat with a running OpenAI-compatible server. Each input line is a user "
        "message; the reply streams back and the conversation is kept. Ctrl-D or Ctrl-C quits.",
    )
    _common_flags(c)
    c.add_argument("--system-prompt", default=None, help="a system message that starts the conversation")
    c.add_argument(
        "-q", "--quick", metavar="MESSAGE", default=None, help="send MESSAGE, print the reply and exit"
    )
    p = sub.add_parser(
        "complete",
        help="text completion against a running server (one prompt per input line)",
        description="Streams a completion of each input line from a running OpenAI-compatible server. "
        "Ctrl-D or Ctrl-C quits.",
    )
    _common_flags(p)
    p.add_argument(
        "-q", "--quick", metavar="PROMPT", default=None, help="complete PROMPT, print the completion and exit"
    )


def _common_flags(p: argparse.ArgumentParser) -> None:
    p.add_argument("--url", default=DEFAULT_URL, help=f"the server's API base URL (default {DEFAULT_URL})")
    p.add_argument("--model-name", default=None, help="model to ask for (default: the first of /models)")
    p.add_argument(
        "--api-key",
        default=None,
        help="bearer token (default: the HYSPEC_API_KEY, then the OPENAI_API_KEY environment variable)",
    )
    p.add_argument(
        "--max-tokens", type=int, default=None, help="most tokens per reply (default: the server's)"
    )
    p.add_argument("--temperature", type=float, default=None, help="0 is greedy (default: the server's)")


def run_client(ns: argparse.Namespace, stdin: TextIO = sys.stdin, stdout: TextIO = sys.stdout) -> int:
    """Runs `ns.command` ("chat" or "complete"); returns the exit status.

    0: EOF or Ctrl-C ended the session, or `--quick` got its answer. 1: the server is unreachable, the model
    could not be resolved, or the `--quick` request failed. A server error inside an interactive session is
    printed to stderr and the session goes on.
    """
    command: str = ns.command
    if command not in CLIENT_COMMANDS:
        raise ValueError(f"run_client runs {CLIENT_COMMANDS}, not {command!r}")
    api_key = ns.api_key or os.environ.get("HYSPEC_API_KEY") or os.environ.get("OPENAI_API_KEY") or None
    client = _Client(ns.url, api_key)
    # stderr is looked up at call time: a test (or a caller) may have replaced sys.stderr since import
    err = sys.stderr
    try:
        model = ns.model_name or client.first_model()
        sampling: dict[str, Any] = {}
        if ns.max_tokens is not None:
            sampling["max_tokens"] = ns.max_tokens
        if ns.temperature is not None:
            sampling["temperature"] = ns.temperature
        if command == "chat":
            session: _Session = _Chat(client, model, sampling, ns.system_prompt, stdout)
        else:
            session = _Complete(client, model, sampling, stdout)
        if ns.quick is not None:
            session.turn(ns.quick)
            return 0
        if _is_terminal(stdin, stdout):
            print(f"Using model {model} at {client.base_url}; Ctrl-D or Ctrl-C quits.", file=err)
        for line in _input_lines(stdin, stdout):
            if not line.strip():
                continue  # an empty message is nearly always a stray Enter, not a question
            try:
                session.turn(line)
            except ServerError as e:
                _report(command, str(e), err)
        return 0
    except KeyboardInterrupt:
        # Ctrl-C ends the session, mid-reply too (`_stream_text` has closed the connection, so the server
        # aborts the request); the newline ends the line the prompt or the cut reply left open
        stdout.write("\n")
        stdout.flush()
        return 0
    except (ServerError, UnreachableError) as e:
        _report(command, str(e), err)
        return 1


def _report(command: str, message: str, err: TextIO) -> None:
    # one line, whatever the server put in its message (validation errors span several)
    print(f"hyspec {command}: error: {' '.join(message.split())}", file=err)


def _is_terminal(stdin: TextIO, stdout: TextIO) -> bool:
    return stdin is sys.stdin and stdout is sys.stdout and stdin.isatty()


def _input_lines(stdin: TextIO, stdout: TextIO) -> Iterator[str]:
    """The user's lines until EOF. On a terminal through `input()`, for its prompt and line editing; from a
    pipe or a file with no prompt, so that stdout carries only the model's text."""
    if _is_terminal(stdin, stdout):
        try:
            import readline  # noqa: F401  (importing it gives input() editing and history)
        except ImportError:  # not on every platform
            pass
        while True:
            try:
                yield input("> ")
            except EOFError:
                stdout.write("\n")  # Ctrl-D leaves the cursor after the prompt
                return
    while line := stdin.readline():
        yield line.rstrip("\r\n")


class _Session(Protocol):
    def turn(self, text: str) -> None:
        """Sends `text`, streams the answer to stdout; ServerError / UnreachableError when that fails."""


class _Chat:
    def __init__(
        self,
        client: _Client,
        model: str,
        sampling: dict[str, Any],
        system_prompt: str | None,
        stdout: TextIO,
    ) -> None:
        self.client, self.model, self.sampling, self.stdout = client, model, sampling, stdout
        self.history: list[dict[str, str]] = []
        if system_prompt:
            self.history.append({"role": "system", "content": system_prompt})

    def turn(self, text: str) -> None:
        user = {"role": "user", "content": text}
        body = {"model": self.model, "messages": [*self.history, user], "stream": True, **self.sampling}
        reply = _stream_text(
            self.client.stream("/chat/completions", body),
            lambda c: (c.get("delta") or {}).get("content"),
            self.stdout,
        )
        # only a finished turn joins the history: a failed one would poison every later prompt
        self.history += [user, {"role": "assistant", "content": reply}]


class _Complete:
    def __init__(self, client: _Client, model: str, sampling: dict[str, Any], stdout: TextIO) -> None:
        self.client, self.model, self.sampling, self.stdout = client, model, sampling, stdout

    def turn(self, text: str) -> None:
        body = {"model": self.model, "prompt": text, "stream": True, **self.sampling}
        _stream_text(self.client.stream("/completions", body), lambda c: c.get("text"), self.stdout)


def _stream_text(
    chunks: Generator[dict[str, Any], None, None],
    piece: Callable[[dict[str, Any]], str | None],
    stdout: TextIO,
) -> str:
    """Writes each chunk's text to stdout as it arrives, ends the line, returns the whole text."""
    parts: list[str] = []
    try:
        for chunk in chunks:
            # choice 0 only: the requests ask for one; the usage chunk has no choices
            for choice in chunk.get("choices") or []:
                if choice.get("index", 0) != 0:
                    continue
                text = piece(choice)
                if text:
                    parts.append(text)
                    stdout.write(text)
                    stdout.flush()
    except (ServerError, UnreachableError):
        # a reply cut short still ends its line, so the error message after it stands alone
        if parts:
            stdout.write("\n")
            stdout.flush()
        raise
    finally:
        # closes the connection now, also on Ctrl-C: the server aborts the request when its client goes
        chunks.close()
    stdout.write("\n")
    stdout.flush()
    return "".join(parts)


class _Client:
    """The few requests the two commands make, with errors turned into ServerError / UnreachableError."""

    def __init__(self, base_url: str, api_key: str | None, timeout_s: float = TIMEOUT_S) -> None:
        self.base_url = base_url.rstrip("/")
        self.timeout_s = timeout_s
        self.headers = {"Accept": "application/json", "User-Agent": "hyspec-client"}
        if api_key:
            self.headers["Authorization"] = f"Bearer {api_key}"

    def first_model(self) -> str:
        try:
            with self._open("GET", "/models", None) as resp:
                listing = json.loads(resp.read())
        except ServerError as e:
            hint = "" if self.base_url.endswith("/v1") else " (does --url need to end in /v1?)"
            raise ServerError(f"cannot list the models: {e}{hint}") from e
        except ValueError as e:  # not JSON: something else listens there
            raise ServerError(f"{self.base_url}/models did not answer a model list") from e
        data = listing.get("data") if isinstance(listing, dict) else None
        if not data or not isinstance(data[0], dict) or "id" not in data[0]:
            raise ServerError(f"{self.base_url}/models lists no model; pass --model-name")
        return str(data[0]["id"])

    def stream(self, path: str, body: dict[str, Any]) -> Generator[dict[str, Any], None, None]:
        """The JSON chunks of a `stream: true` request, up to `data: [DONE]`."""
        with self._open("POST", path, body) as resp:
            try:
                for data in sse_data(resp):
                    if data == "[DONE]":
                        return
                    try:
                        chunk = json.loads(data)
                    except ValueError as e:
                        raise ServerError(f"the server sent a chunk that is not JSON: {data[:80]!r}") from e
                    if isinstance(chunk, dict) and "error" in chunk:
                        # an error after the 200 (the engine failed mid-stream) comes as an event
                        raise ServerError(_error_text(chunk, None))
                    yield chunk
            except (OSError, http.client.HTTPException) as e:
                raise UnreachableError(f"lost the connection to {self.base_url}: {_reason(e)}") from e
        raise ServerError("the stream ended before data: [DONE] (did the server stop?)")

    def _open(self, method: str, path: str, body: dict[str, Any] | None) -> http.client.HTTPResponse:
        url = self.base_url + path
        headers = dict(self.headers)
        data = None
        if body is not None:
            data = json.dumps(body).encode()
            headers["Content-Type"] = "application/json"
        try:
            req = urllib.request.Request(url, data=data, headers=headers, method=method)
            resp = urllib.request.urlopen(req, timeout=self.timeout_s)
        except urllib.error.HTTPError as e:
            try:
                parsed = json.loads(e.read())
            except (ValueError, OSError, http.client.HTTPException):
                parsed = None
            finally:
                e.close()
            msg = f"HTTP {e.code} {e.reason}" if parsed is None else _error_text(parsed, e.code)
            raise ServerError(msg) from None
        except ValueError as e:  # urllib's answer to a malformed URL
            raise UnreachableError(f"bad server URL {self.base_url!r}: {e}") from e
        except (OSError, http.client.HTTPException) as e:
            raise UnreachableError(f"cannot reach the server at {self.base_url}: {_reason(e)}") from e
        assert isinstance(resp, http.client.HTTPResponse)  # http(s) URLs; others have no API to call
        return resp


def _error_text(body: Any, status: int | None) -> str:
    """OpenAI's `{"error": {"message": ...}}` (FastAPI's `{"detail": ...}` too) as one message."""
    err = body.get("error") if isinstance(body, dict) else None
    if isinstance(err, dict) and err.get("message"):
        msg = str(err["message"])
    elif isinstance(err, str):
        msg = err
    elif isinstance(body, dict) and "detail" in body:
        msg = str(body["detail"])
    else:
        msg = json.dumps(body)[:200]
    return msg if status is None else f"{msg} (HTTP {status})"


def _reason(e: BaseException) -> str:
    reason = getattr(e, "reason", None)  # URLError wraps the socket error
    inner = reason if isinstance(reason, BaseException) else e
    if isinstance(inner, OSError) and inner.strerror:
        return inner.strerror
    return str(reason or e) or type(e).__name__


def sse_data(lines: Iterable[bytes]) -> Iterator[str]:
    """The `data` of each server-sent event in `lines` (a byte stream read line by line).

    Multi-line data fields join with newlines, comments (`: ...`) and other fields are skipped, an event
    ends at a blank line; a last event with no blank line after it is incomplete and dropped, as the SSE
    specification says.
    """
    data: list[str] = []
    for raw in lines:
        # a broken byte must not end the session; the server sends UTF-8 JSON, escaped to ASCII anyway
        line = raw.decode("utf-8", errors="replace").rstrip("\r\n")
        if not line:
            if data:
                yield "\n".join(data)
                data = []
            continue
        field, _, value = line.partition(":")
        if field == "data":
            data.append(value[1:] if value.startswith(" ") else value)
