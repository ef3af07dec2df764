"""Runs an `LLMEngine` on a background thread and streams its outputs to asyncio tasks.

The engine is single-threaded: only the engine thread touches it. Handlers post commands (add, abort) to a
thread-safe queue and await a `concurrent.futures.Future` for the answer, so the event loop never blocks on a
model step. Outputs are pushed into each request's `asyncio.Queue` with `call_soon_threadsafe`.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import logging
import queue
import threading
from collections import deque
from collections.abc import AsyncIterator, Callable, Sequence
from typing import Any

from hyspec_server.engine import EngineStepError, LLMEngine, TokensPrompt
from hyspec_server.metrics import EngineMetrics
from hyspec_server.outputs import RequestOutput
from hyspec_server.sampling_params import RequestOutputKind, SamplingParams

log = logging.getLogger(__name__)


class EngineDeadError(RuntimeError):
    """The engine thread has stopped; no request can be served."""


class OutputQueue(asyncio.Queue[RequestOutput | BaseException]):
    """A request's outputs waiting for its reader, at most one per request.

    An output carries the delta since the previous one, so a new output merges into one the reader has not
    taken yet: its deltas are joined, and the newer cumulative state kept (or, for a
    `RequestOutputKind.DELTA` request, whose completion is itself a delta, joined too). A client that reads
    slowly (or not at all) then holds one output, not one copy of the whole completion per engine step.
    """

    delta: bool = False  # the request's completions are deltas (RequestOutputKind.DELTA)

    def _init(self, maxsize: int) -> None:
        self._queue: deque[RequestOutput | BaseException] = deque()

    def _put(self, item: RequestOutput | BaseException) -> None:
        q = self._queue
        if isinstance(item, RequestOutput) and q and isinstance(prev := q[-1], RequestOutput):
            item.delta_text = prev.delta_text + item.delta_text
            item.delta_token_ids = prev.delta_token_ids + item.delta_token_ids
            if self.delta:
                c, pc = item.outputs[0], prev.outputs[0]
                c.text, c.token_ids = pc.text + c.text, pc.token_ids + c.token_ids
                if c.logprobs is not None and pc.logprobs is not None:
                    c.logprobs = pc.logprobs + c.logprobs
            q[-1] = item
        else:
            q.append(item)

    def _get(self) -> RequestOutput | BaseException:
        return self._queue.popleft()


class RequestStream:
    """Outputs of one request, in step order. Leaving `outputs()` before the end aborts the request."""

    def __init__(
        self,
        engine: AsyncEngine,
        request_id: str,
        loop: asyncio.AbstractEventLoop,
        *,
        kind: RequestOutputKind = RequestOutputKind.CUMULATIVE,
    ) -> None:
        self.engine = engine
        self.request_id = request_id
        self.loop = loop
        self.queue = OutputQueue()
        self.queue.delta = kind is RequestOutputKind.DELTA
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


class StreamGroup:
    """The requests of one HTTP call (one per prompt and sample), read together.

    `outputs()` yields `(index, output)` as the engine produces them; leaving it early, or an error from any
    request, aborts every unfinished request of the group.
    """

    def __init__(self, streams: Sequence[RequestStream]) -> None:
        if not streams:
            raise ValueError("streams must not be empty")
        self.streams = list(streams)

    @property
    def finished(self) -> bool:
        return all(s.finished for s in self.streams)

    def abort(self) -> None:
        for s in self.streams:
            if not s.finished:
                s.abort()

    async def outputs(self) -> AsyncIterator[tuple[int, RequestOutput]]:
        pending: dict[asyncio.Future[RequestOutput | BaseException], int] = {}
        try:
            for i, s in enumerate(self.streams):
                pending[asyncio.ensure_future(s.queue.get())] = i
            while pending:
                done, _ = await asyncio.wait(pending, return_when=asyncio.FIRST_COMPLETED)
                # index order within one wake-up, so a step's outputs come out in choice order
                for fut in sorted(done, key=lambda f: pending[f]):
                    i = pending.pop(fut)
                    item, stream = fut.result(), self.streams[i]
                    if isinstance(item, BaseException):
                        stream.finished = True
                        raise item
                    stream.finished = item.finished
                    if not stream.finished:
                        pending[asyncio.ensure_future(stream.queue.get())] = i
                    yield i, item
        finally:
            for fut in pending:
                fut.cancel()
            self.abort()

    async def finals(self) -> list[RequestOutput]:
        """The final output of every request, in index order."""
        last: dict[int, RequestOutput] = {}
        async for i, out in self.outputs():
            last[i] = out
        assert len(last) == len(self.streams) and all(o.finished for o in last.values())
        return [last[i] for i in range(len(self.streams))]


class AddError(Exception):
    """Adding request `index` of a batch failed with `cause`; no request of the batch was kept."""

    def __init__(self, index: int, cause: Exception) -> None:
        super().__init__(str(cause))
        self.index = index
        self.cause = cause


class AsyncEngine:
    """Args:
    model_name: the served model name, the `model_name` label of its Prometheus metrics.
    """

    def __init__(self, engine: LLMEngine, *, model_name: str, idle_wait_s: float = 0.05) -> None:
        self.engine = engine
        self.metrics = EngineMetrics(model_name)
        self._commands: queue.SimpleQueue[Callable[[], None]] = queue.SimpleQueue()
        self._streams: dict[str, RequestStream] = {}
        self._idle_wait_s = idle_wait_s
        self._stop = threading.Event()
        # set by the engine thread as it ends: commands run after it fail their caller instead of the engine
        self._dead: EngineDeadError | None = None
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
        return self._dead is None and self._thread.is_alive()

    async def call(self, fn: Callable[[LLMEngine], Any]) -> Any:
        """Runs `fn(engine)` on the engine thread between steps and returns its result."""
        if not self.is_alive():
            raise EngineDeadError("the engine thread has stopped")
        fut: concurrent.futures.Future[Any] = concurrent.futures.Future()

        def run() -> None:
            # the caller stopped waiting (its task was cancelled): skip `fn`, and never set a result on a
            # cancelled future, which raises here, on the engine thread, and would end it
            if not fut.set_running_or_notify_cancel():
                return
            if self._dead is not None:
                fut.set_exception(self._dead)
                return
            try:
                fut.set_result(fn(self.engine))
            except BaseException as e:
                fut.set_exception(e)

        self._commands.put(run)
        if self._dead is not None:
            # the engine thread ended after the check above; it may have drained its queue before this put
            self._drain_commands()
        return await asyncio.wrap_future(fut)

    async def add(
        self, prompt: str | Sequence[int], params: SamplingParams, request_id: str
    ) -> RequestStream:
        """Queues a request; ValueError (does not fit) and QueueFullError surface here, before any output."""
        stream = RequestStream(self, request_id, asyncio.get_running_loop(), kind=params.output_kind)

        def add(engine: LLMEngine) -> None:
            engine.add_request(prompt, params, request_id=request_id)
            self._streams[request_id] = stream

        await self.call(add)
        return stream

    async def add_many(
        self, items: Sequence[tuple[str | Sequence[int] | TokensPrompt, SamplingParams, str]]
    ) -> StreamGroup:
        """Queues `(prompt, params, request_id)` requests all or nothing, in one engine-thread call: when one
        cannot be added (ValueError, QueueFullError) the ones before it are aborted and `AddError` says which.
        """
        loop = asyncio.get_running_loop()
        streams = [RequestStream(self, rid, loop, kind=params.output_kind) for _, params, rid in items]

        def add(engine: LLMEngine) -> None:
            for i, (prompt, params, rid) in enumerate(items):
                try:
                    engine.add_request(prompt, params, request_id=rid)
                except Exception as e:
                    for _, _, done in items[:i]:
                        self._streams.pop(done, None)
                        engine.abort(done)
                    raise AddError(i, e) from e
                self._streams[rid] = streams[i]

        await self.call(add)
        return StreamGroup(streams)

    def abort(self, request_id: str) -> None:
        """Fire and forget: the engine thread aborts the request and frees its memory before the next step."""

        def run() -> None:
            if self._dead is None:
                self._streams.pop(request_id, None)
                self.engine.abort(request_id)

        self._commands.put(run)

    def _deliver(self, out: RequestOutput | BaseException, request_id: str) -> None:
        done = isinstance(out, BaseException) or out.finished
        stream = self._streams.pop(request_id, None) if done else self._streams.get(request_id)
        if stream is not None:
            stream.loop.call_soon_threadsafe(stream.queue.put_nowait, out)

    def _drain_commands(self) -> None:
        # once `_dead` is set a command touches no engine state: it fails its caller's future, or does nothing
        while True:
            try:
                self._commands.get_nowait()()
            except queue.Empty:
                return

    def _loop(self) -> None:
        try:
            self._serve()
        except BaseException as e:
            # not one request's failure (the engine attributes those: EngineStepError): its state is unknown
            log.exception("the engine loop failed; the engine is stopped")
            self._dead = EngineDeadError(f"the engine stopped: {type(e).__name__}: {e}")
        else:
            self._dead = EngineDeadError("the engine was shut down")
        # every live request, and every call queued, gets the error: none waits forever on a stopped thread
        streams, self._streams = self._streams, {}
        for stream in streams.values():
            with contextlib.suppress(RuntimeError):  # its event loop is closed: nobody waits on it
                stream.loop.call_soon_threadsafe(stream.queue.put_nowait, self._dead)
        self._drain_commands()

    def _serve(self) -> None:
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
            # the pool gauges are read per scrape (/metrics), not per step: their cost grows with the cache
            if not eng.has_unfinished():
                self.metrics.observe(eng, memory=False)
                continue
            try:
                outputs = eng.step()
            except EngineStepError as e:
                log.exception("engine step failed")
                for rid in e.request_ids:
                    # a request its own parameters left nothing to sample: its error says why (a 400)
                    self._deliver(
                        e.dead_ends.get(rid) or RuntimeError(f"engine step failed for request {rid}"), rid
                    )
                outputs = e.step_outputs  # the step served every other request
            for out in outputs:
                self._deliver(out, out.request_id)
            self.metrics.observe(eng, memory=False)
