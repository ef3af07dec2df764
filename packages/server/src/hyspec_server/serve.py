"""Starting the HTTP server: engine, background thread, FastAPI app, uvicorn."""

from __future__ import annotations

import asyncio
import socket
import threading
import time
from collections.abc import Sequence
from types import FrameType
from typing import Any

import h11
import uvicorn
from hyspec_runner.config import EngineArgs
from uvicorn.protocols.http.h11_impl import H11Protocol

from hyspec_server.api_server import build_app
from hyspec_server.async_engine import AsyncEngine
from hyspec_server.engine import LLMEngine


def model_name_of(args: EngineArgs) -> str:
    """The served model name when `--served-model-name` is not given: the model argument as given, as vLLM's
    (a client sends the hub id or path the server was started with; its last part alone would be a 404)."""
    return args.model if args.model else "hyspec-default"


GRACEFUL_SHUTDOWN_S = 30
HEADER_READ_TIMEOUT_S = 30.0
"""A connection that has not sent a whole request head this long after it opened (or after its last
response) is closed: half-sent headers (slowloris) never reach the app, whose body timeout cannot see
them."""


def header_timeout_protocol(seconds: float) -> type[H11Protocol]:
    """uvicorn's h11 protocol with a deadline for each request head."""

    class HeaderDeadlineH11(H11Protocol):
        _deadline: asyncio.TimerHandle | None = None

        def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
            super().connection_made(transport)
            self._arm()

        def on_response_complete(self) -> None:
            super().on_response_complete()
            self._arm()  # the next request on this connection gets the same deadline

        def connection_lost(self, exc: Exception | None) -> None:
            if self._deadline is not None:
                self._deadline.cancel()
            super().connection_lost(exc)

        def _arm(self) -> None:
            if self._deadline is not None:
                self._deadline.cancel()
            self._deadline = self.loop.call_later(seconds, self._expire)

        def _expire(self) -> None:
            # h11 stays IDLE on the client's side until a whole request line and headers arrived
            if self.conn.their_state is h11.IDLE and not self.transport.is_closing():
                self.transport.close()

    return HeaderDeadlineH11


"""How long SIGTERM / SIGINT waits for running requests before closing their connections."""


class _Server(uvicorn.Server):
    """uvicorn's server, where a second SIGTERM (not only a second SIGINT) exits at once."""

    def handle_exit(self, sig: int, frame: FrameType | None) -> None:
        if self.should_exit:
            self.force_exit = True
        super().handle_exit(sig, frame)


def serve(
    args: EngineArgs,
    *,
    host: str = "127.0.0.1",
    port: int = 8000,
    api_key: str | None = None,
    served_model_name: str | None = None,
    max_body_bytes: int | None = None,
    graceful_shutdown_s: int | None = None,
    limit_concurrency: int | None = None,
    allowed_origins: Sequence[str] = ("*",),
    chat_template: str | None = None,
    trust_request_chat_template: bool = False,
    stream_stall_timeout_s: float | None = None,
) -> None:
    """Blocks until SIGTERM / SIGINT: new connections are refused, running requests get `graceful_shutdown_s`
    to finish (a client that never reads cannot hold the exit longer), a second signal exits at once.

    Args:
        graceful_shutdown_s: seconds running requests get after the first signal (None: GRACEFUL_SHUTDOWN_S).
        max_body_bytes: see `api_server.build_app`.
        limit_concurrency: most open connections and requests; beyond it 503 (None: 2 x
            (max_num_seqs + max_waiting), what the engine can hold plus as many more in flight).
        allowed_origins: CORS origins (see `api_server.build_app`).

    The port is bound before the model loads, so a port in use fails at once (OSError), not after minutes.
    """
    from hyspec_server.builder import build_engine

    sock = socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind((host, port))
    except OSError as e:
        sock.close()
        raise OSError(f"cannot listen on {host}:{port}: {e.strerror or e}") from e
    name = served_model_name or model_name_of(args)
    engine = AsyncEngine(build_engine(args), model_name=name)
    app = build_app(
        engine,
        model_name=name,
        api_key=api_key,
        max_body_bytes=max_body_bytes,
        allowed_origins=allowed_origins,
        chat_template=chat_template,
        trust_request_chat_template=trust_request_chat_template,
        stream_stall_timeout_s=stream_stall_timeout_s,
    )
    running = engine.engine.scheduler.config.max_num_seqs  # resolved: what fit the memory
    limit = 2 * (running + args.max_waiting) if limit_concurrency is None else limit_concurrency
    config = uvicorn.Config(
        app,
        host=host,
        port=port,
        log_level="info",
        timeout_graceful_shutdown=GRACEFUL_SHUTDOWN_S if graceful_shutdown_s is None else graceful_shutdown_s,
        limit_concurrency=limit,
        http=header_timeout_protocol(HEADER_READ_TIMEOUT_S),
    )
    try:
        _Server(config).run(sockets=[sock])
    finally:
        engine.shutdown()
        sock.close()


class ServerThread:
    """uvicorn on a background thread, bound to a free port of `host` (tests, notebooks)."""

    def __init__(
        self,
        engine: LLMEngine,
        *,
        model_name: str,
        api_key: str | None = None,
        host: str = "127.0.0.1",
        max_body_bytes: int | None = None,
        body_read_timeout_s: float | None = None,
        header_read_timeout_s: float = HEADER_READ_TIMEOUT_S,
        **app_options: Any,
    ) -> None:
        """`app_options`: `build_app`'s other keywords (chat_template, allowed_origins, ...)."""
        self.async_engine = AsyncEngine(engine, model_name=model_name)
        self.app = build_app(
            self.async_engine,
            model_name=model_name,
            api_key=api_key,
            max_body_bytes=max_body_bytes,
            body_read_timeout_s=body_read_timeout_s,
            **app_options,
        )
        self.sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        self.sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        self.sock.bind((host, 0))
        self.host, self.port = host, int(self.sock.getsockname()[1])
        config = uvicorn.Config(
            self.app,
            log_level="warning",
            timeout_graceful_shutdown=2,
            http=header_timeout_protocol(header_read_timeout_s),
        )
        self.server = uvicorn.Server(config)
        self.thread = threading.Thread(target=self.server.run, kwargs={"sockets": [self.sock]}, daemon=True)

    @property
    def base_url(self) -> str:
        return f"http://{self.host}:{self.port}"

    def start(self, timeout_s: float = 20.0) -> ServerThread:
        self.thread.start()
        deadline = time.monotonic() + timeout_s
        while not self.server.started:
            if time.monotonic() > deadline or not self.thread.is_alive():
                raise RuntimeError("uvicorn did not start")
            time.sleep(0.02)
        return self

    def wait_idle_and_leak_check(self, timeout_s: float = 30.0) -> None:
        """Waits until the engine has no live request, then runs `leak_check` on the engine thread."""

        async def run() -> None:
            deadline = time.monotonic() + timeout_s
            while await self.async_engine.call(lambda e: e.has_unfinished() or bool(e.requests)):
                if time.monotonic() > deadline:
                    raise TimeoutError("the engine did not go idle")
                await asyncio.sleep(0.05)
            await self.async_engine.call(lambda e: e.leak_check())

        asyncio.run(run())

    def stop(self) -> None:
        self.server.should_exit = True
        self.thread.join(timeout=10)
        self.async_engine.shutdown()
        self.sock.close()
