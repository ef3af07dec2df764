"""`hyspec chat` / `hyspec complete` (client_cli.py) against a live toy server on 127.0.0.1.

The streamed output is compared with non-streamed answers the official `openai` client gets for the same
messages: the toy engine is greedy and deterministic, so equal text means the same prompt reached the engine
(for chat, the whole history)."""

from __future__ import annotations

import argparse
import io
import socket
from typing import Any

import httpx
import openai
import pytest
from hyspec_server import client_cli
from hyspec_server.client_cli import add_client_commands, run_client, sse_data
from hyspec_server.serve import ServerThread

API_KEY = "test-key"


def parser() -> argparse.ArgumentParser:
    # the shape cli.py gives it: one top-level parser, subcommands under `command`
    p = argparse.ArgumentParser(prog="hyspec")
    add_client_commands(p.add_subparsers(dest="command", required=True))
    return p


class CountingOut(io.StringIO):
    """stdout that counts writes: a streamed reply arrives in several."""

    def __init__(self) -> None:
        super().__init__()
        self.writes = 0

    def write(self, s: str) -> int:
        self.writes += 1
        return super().write(s)


def run(argv: list[str], stdin: str = "") -> tuple[int, CountingOut]:
    out = CountingOut()
    return run_client(parser().parse_args(argv), io.StringIO(stdin), out), out


def flags(srv: ServerThread, *extra: str) -> list[str]:
    return ["--url", srv.base_url + "/v1", "--api-key", API_KEY, "--temperature", "0", *extra]


def chat_reply(srv: ServerThread, messages: list[dict[str, str]], max_tokens: int) -> str:
    c = openai.OpenAI(base_url=srv.base_url + "/v1", api_key=API_KEY, max_retries=0)
    r = c.chat.completions.create(
        model="toy",
        messages=messages,  # type: ignore[arg-type]
        max_tokens=max_tokens,
        temperature=0,
    )
    return r.choices[0].message.content or ""


def completion(srv: ServerThread, prompt: str, max_tokens: int) -> str:
    c = openai.OpenAI(base_url=srv.base_url + "/v1", api_key=API_KEY, max_retries=0)
    return (
        c.completions.create(model="toy", prompt=prompt, max_tokens=max_tokens, temperature=0).choices[0].text
    )


def free_url() -> str:
    # a port that was free a moment ago and has nobody listening now
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    return f"http://127.0.0.1:{port}/v1"


def test_chat_streams_each_reply_and_keeps_the_history(
    toy_server: ServerThread, capsys: pytest.CaptureFixture[str]
) -> None:
    # no --model-name: the first model of /v1/models ("toy")
    rc, out = run(
        ["chat", *flags(toy_server, "--max-tokens", "12", "--system-prompt", "be brief")], "hi\nwhy?\n"
    )
    assert rc == 0 and capsys.readouterr().err == ""
    system = {"role": "system", "content": "be brief"}
    first = [system, {"role": "user", "content": "hi"}]
    a1 = chat_reply(toy_server, first, 12)
    a2 = chat_reply(
        toy_server, [*first, {"role": "assistant", "content": a1}, {"role": "user", "content": "why?"}], 12
    )
    assert a1 and a2
    assert out.getvalue() == f"{a1}\n{a2}\n"
    # the history mattered: the second message alone gets another answer
    assert chat_reply(toy_server, [system, {"role": "user", "content": "why?"}], 12) != a2


def test_complete_streams_each_line_without_history(toy_server: ServerThread) -> None:
    rc, out = run(
        ["complete", *flags(toy_server, "--max-tokens", "9", "--model-name", "toy")], "Hello\n\nabc\n"
    )
    assert rc == 0
    # the empty line is skipped
    assert out.getvalue() == f"{completion(toy_server, 'Hello', 9)}\n{completion(toy_server, 'abc', 9)}\n"


def test_quick_prints_the_answer_and_exits(toy_server: ServerThread) -> None:
    rc, out = run(["chat", *flags(toy_server, "--max-tokens", "7", "-q", "hi")], "not read\n")
    assert rc == 0
    assert out.getvalue() == chat_reply(toy_server, [{"role": "user", "content": "hi"}], 7) + "\n"
    rc, out = run(["complete", *flags(toy_server, "--max-tokens", "5", "--quick", "Hello")])
    assert (rc, out.getvalue()) == (0, completion(toy_server, "Hello", 5) + "\n")


@pytest.mark.parametrize(
    "argv", [["chat", "-q", "hi"], ["complete"], ["chat", "--model-name", "toy", "-q", "x"]]
)
def test_unreachable_server_exits_1_naming_the_url(
    argv: list[str], capsys: pytest.CaptureFixture[str]
) -> None:
    url = free_url()
    rc, out = run([*argv, "--url", url], "hello\n")
    err = capsys.readouterr().err
    assert rc == 1 and out.getvalue() == ""
    assert url in err and err.count("\n") == 1 and "hyspec" in err


def test_bad_model_name_shows_the_servers_error(
    toy_server: ServerThread, capsys: pytest.CaptureFixture[str]
) -> None:
    r = httpx.post(
        toy_server.base_url + "/v1/chat/completions",
        headers={"Authorization": f"Bearer {API_KEY}"},
        json={"model": "nope", "messages": [{"role": "user", "content": "hi"}]},
    )
    message = r.json()["error"]["message"]
    assert r.status_code == 404 and "nope" in message
    rc, out = run(["chat", *flags(toy_server, "--model-name", "nope", "-q", "hi")])
    err = capsys.readouterr().err
    assert rc == 1 and out.getvalue() == "" and message in err and err.count("\n") == 1
    # interactive: each turn reports the error, the session goes on until EOF
    rc, out = run(["complete", *flags(toy_server, "--model-name", "nope")], "a\nb\n")
    err = capsys.readouterr().err
    assert rc == 0 and out.getvalue() == "" and err.count(message) == 2


def test_a_failed_turn_stays_out_of_the_history(
    toy_server: ServerThread, capsys: pytest.CaptureFixture[str]
) -> None:
    # 300 characters + 100 tokens are over the toy's 256-token context: a 400; the next turn must not carry it
    rc, out = run(["chat", *flags(toy_server, "--max-tokens", "100")], "x" * 300 + "\nhi\n")
    err = capsys.readouterr().err
    assert rc == 0 and "max_model_len" in err and "(HTTP 400)" in err and err.count("\n") == 1
    assert out.getvalue() == chat_reply(toy_server, [{"role": "user", "content": "hi"}], 100) + "\n"


def test_api_key_comes_from_the_environment(
    toy_server: ServerThread, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    base = [
        "chat",
        "--url",
        toy_server.base_url + "/v1",
        "--temperature",
        "0",
        "--max-tokens",
        "3",
        "-q",
        "hi",
    ]
    monkeypatch.delenv("HYSPEC_API_KEY", raising=False)
    monkeypatch.setenv("OPENAI_API_KEY", API_KEY)
    assert run(base)[0] == 0
    monkeypatch.setenv("OPENAI_API_KEY", "wrong")
    monkeypatch.setenv("HYSPEC_API_KEY", API_KEY)  # HYSPEC_API_KEY comes first
    assert run(base)[0] == 0
    capsys.readouterr()
    monkeypatch.delenv("HYSPEC_API_KEY")
    assert run(base)[0] == 1
    assert "API key" in capsys.readouterr().err
    assert run([*base, "--api-key", API_KEY])[0] == 0  # the flag beats the environment


def test_eof_and_ctrl_c_exit_0(toy_server: ServerThread) -> None:
    rc, out = run(["chat", *flags(toy_server)], "")
    assert (rc, out.getvalue()) == (0, "")

    class InterruptAfterOneLine(io.StringIO):
        # typeshed's StringIO has two readline signatures (str from _TextIOBase, bytes from _IOBase)
        def readline(self, size: int = -1, /) -> str:  # type: ignore[override]
            if self.tell():
                raise KeyboardInterrupt
            return super().readline(size)

    stdout = io.StringIO()
    ns = parser().parse_args(["chat", *flags(toy_server, "--max-tokens", "4")])
    assert run_client(ns, InterruptAfterOneLine("hi\nnever sent\n"), stdout) == 0
    want = chat_reply(toy_server, [{"role": "user", "content": "hi"}], 4)
    # the reply's line, then the line Ctrl-C ends (at a terminal: the one after the "> " prompt)
    assert stdout.getvalue() == want + "\n\n"


def test_ctrl_c_mid_reply_exits_0_and_the_server_aborts(toy_server: ServerThread) -> None:
    class InterruptOnFirstToken(io.StringIO):
        def write(self, s: str) -> int:
            if not self.getvalue() and s != "\n":
                super().write(s)
                raise KeyboardInterrupt
            return super().write(s)

    out = InterruptOnFirstToken()
    ns = parser().parse_args(["complete", *flags(toy_server, "--max-tokens", "200", "-q", "Hello")])
    assert run_client(ns, io.StringIO(), out) == 0
    # the text up to Ctrl-C (the server may have sent several tokens in one chunk), then the line ends
    got = out.getvalue()
    assert got.endswith("\n") and len(got) > 1 and completion(toy_server, "Hello", 200).startswith(got[:-1])
    # the dropped connection aborted the request: nothing is left running or leaked
    toy_server.wait_idle_and_leak_check()


def fake_stream(monkeypatch: pytest.MonkeyPatch, body: bytes) -> None:
    """Every POST of the client answers `body` as its event stream (what a live server is not made to do)."""

    def open_(self: Any, method: str, path: str, payload: Any) -> io.BytesIO:
        return io.BytesIO(body)

    monkeypatch.setattr(client_cli._Client, "_open", open_)


def test_an_error_event_mid_stream(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    fake_stream(
        monkeypatch,
        b'data: {"choices": [{"index": 0, "text": "pa"}]}\n\n'
        b'data: {"choices": [{"index": 0, "text": "rt"}]}\n\n'
        b'data: {"error": {"message": "engine died", "type": "server_error"}}\n\n',
    )
    rc, out = run(["complete", "--model-name", "m", "-q", "x"])
    assert rc == 1 and out.getvalue() == "part\n"
    assert out.writes == 3  # each chunk as it comes, then the end of the line
    assert capsys.readouterr().err == "hyspec complete: error: engine died\n"
    # a stream cut before [DONE] is an error too
    fake_stream(monkeypatch, b'data: {"choices": [{"index": 0, "delta": {"content": "a"}}]}\n\n')
    rc, out = run(["chat", "--model-name", "m", "-q", "x"])
    assert rc == 1 and out.getvalue() == "a\n" and "[DONE]" in capsys.readouterr().err


def test_sse_data_parsing() -> None:
    lines = io.BytesIO(
        b": keep-alive comment\r\n"
        b"data: one\r\n\r\n"
        b"event: ignored\n"
        b"data:two\n"
        b"data:  three\n"
        b"\n"
        b"\n"
        b"data: caf\xc3\xa9\n\n"
        b"data: incomplete, dropped\n"
    )
    assert list(sse_data(lines)) == ["one", "two\n three", "café"]


def test_run_client_refuses_other_commands() -> None:
    with pytest.raises(ValueError, match="serve"):
        run_client(argparse.Namespace(command="serve"))
