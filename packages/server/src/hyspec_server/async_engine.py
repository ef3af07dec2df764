"""Runs an `LLMEngine` on a background thread and streams its outputs to asyncio tasks.

The engine is single-threaded: only the engine thread touches it. Handlers post commands (add, abort) to a
thread-safe queue and await a `concurrent.futures.Future` for the answer, so the event loop never blocks on a
model step. Outputs are pushed into each request's `asyncio.Queue` with `call_soon_threadsafe`.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import logging
import queue
import threading
from collections.abc import AsyncIterator, Callable, Sequence
from typing import Any

from hyspec_server.engine import EngineStepError, LLMEngine
from hyspec_server.metrics import EngineMetrics
from hyspec_server.outputs import RequestOutput
from hyspec_server.sampling_params import SamplingParams

log = logging.getLogger(__name__)


class EngineDeadError(RuntimeError):
    """The engine thread has stopped; no request can be served."""


class RequestStream:
    """Outputs of one request, in step order. Leaving `outputs()` before the end aborts the request."""

    def __init__(self, engine: AsyncEngine, request_id: str, loop: asyncio.AbstractEventLoop) -> None:
        self.engine = engine
        self.request_id = request_id
        self.loop = loop
        self.queue: asyncio.Queue[RequestOutput | BaseException] = asyncio.Queue()
        self.finished = False

    async def outputs(self) -> AsyncIterator[RequestOutput]:
        try:
            while not self.finished:
                item = await self.queue.get()
                if isinstance(item, BaseException):
                    self.finished = True
                    raise item
                self.finished = item.finished
                yield item
        finally:
            if not self.finished:
                self.abort()

    async def final(self) -> RequestOutput:
        last: RequestOutput | None = None
        async for out in self.outputs():
            last = out
        assert last is not None and last.finished
        return last

    def abort(self) -> None:
        self.finished = True
        self.engine.abort(self.request_id)


class AsyncEngine:
    def __init__(self, engine: LLMEngine, *, idle_wait_s: float = 0.05) -> None:
        self.engine = engine
        self.metrics = EngineMetrics()
        self._commands: queue.SimpleQueue[Callable[[], None]] = queue.SimpleQueue()
        self._streams: dict[str, RequestStream] = {}
        self._idle_wait_s = idle_wait_s
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, name="hyspec-engine", daemon=True)
        self._thread.start()

    @property
    def tokenizer(self) -> Any:
        return self.engine.tokenizer

    def shutdown(self) -> None:
        self._stop.set()
        self._commands.put(lambda: None)
        self._thread.join(timeout=10)

    def is_alive(self) -> bool:
        return self._thread.is_alive()

    async def call(self, fn: Callable[[LLMEngine], Any]) -> Any:
        """Runs `fn(engine)` on the engine thread between steps and returns its result."""
        if not self.is_alive():
            raise EngineDeadError("the engine thread has stopped")
        fut: concurrent.futures.Future[Any] = concurrent.futures.Future()

        def run() -> None:
            try:
                fut.set_result(fn(self.engine))
            except BaseException as e:
                fut.set_exception(e)

        self._commands.put(run)
        return await asyncio.wrap_future(fut)

    async def add(
        self, prompt: str | Sequence[int], params: SamplingParams, request_id: str
    ) -> RequestStream:
        """Queues a request; ValueError (does not fit) and QueueFullError surface here, before any output."""
        stream = RequestStream(self, request_id, asyncio.get_running_loop())

        def add(engine: LLMEngine) -> None:
            engine.add_request(prompt, params, request_id=request_id)
            self._streams[request_id] = stream

        await self.call(add)
        return stream

    def abort(self, request_id: str) -> None:
        """Fire and forget: the engine thread aborts the request and frees its memory before the next step."""

        def run() -> None:
            self._streams.pop(request_id, None)
            self.engine.abort(request_id)

        self._commands.put(run)

    def _deliver(self, out: RequestOutput | BaseException, request_id: str) -> None:
        done = isinstance(out, BaseException) or out.finished
        stream = self._streams.pop(request_id, None) if done else self._streams.get(request_id)
        if stream is not None:
            stream.loop.call_soon_threadsafe(stream.queue.put_nowait, out)

    def _loop(self) -> None:
        eng = self.engine
        while not self._stop.is_set():
            if not eng.has_unfinished():
                try:
                    self._commands.get(timeout=self._idle_wait_s)()
                except queue.Empty:
                    continue
            # every pending add and abort lands before the next step
            while True:
                try:
                    self._commands.get_nowait()()
                except queue.Empty:
                    break
            if not eng.has_unfinished():
                self.metrics.observe(eng)
                continue
            try:
                outputs = eng.step()
            except EngineStepError as e:
                log.exception("engine step failed")
                for rid in e.request_ids:
                    self._deliver(RuntimeError(f"engine step failed for request {rid}"), rid)
                outputs = []
            for out in outputs:
                self._deliver(out, out.request_id)
            self.metrics.observe(eng)
