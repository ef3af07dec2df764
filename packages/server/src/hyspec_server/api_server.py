"""The OpenAI-compatible HTTP server: /v1/completions, /v1/chat/completions, /v1/models, /health, /metrics.

Handlers parse and validate the body themselves (so malformed JSON and wrong types are 400, not FastAPI's
422), hand the request to the `AsyncEngine` and stream its outputs as server-sent events. A client that
disconnects (streaming or not) aborts its request, which frees its memory before the next step.
"""

from __future__ import annotations

import asyncio
import json
import time
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any, TypeVar

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, PlainTextResponse, Response, StreamingResponse
from pydantic import BaseModel, ValidationError
from starlette.exceptions import HTTPException as StarletteHTTPException

from hyspec_server.async_engine import AsyncEngine, RequestStream
from hyspec_server.outputs import RequestOutput
from hyspec_server.protocol import APIError, ChatCompletionRequest, CompletionRequest
from hyspec_server.sampling_params import SamplingParams
from hyspec_server.scheduler import QueueFullError

_M = TypeVar("_M", bound=BaseModel)
_DISCONNECT_POLL_S = 0.05
_SAMPLING_FIELDS = set(SamplingParams.__dataclass_fields__)


def build_app(engine: AsyncEngine, *, model_name: str, api_key: str | None = None) -> FastAPI:
    app = FastAPI(title="hyspec", docs_url=None, redoc_url=None)
    created = int(time.time())
    max_model_len = engine.engine.max_model_len

    @app.exception_handler(APIError)
    async def _api_error(_: Request, e: APIError) -> JSONResponse:
        return JSONResponse(e.body(), status_code=e.status)

    @app.exception_handler(RequestValidationError)
    async def _validation_error(_: Request, e: RequestValidationError) -> JSONResponse:
        return JSONResponse(APIError(400, str(e)).body(), status_code=400)

    @app.exception_handler(StarletteHTTPException)
    async def _http_error(_: Request, e: StarletteHTTPException) -> JSONResponse:
        kind = "not_found_error" if e.status_code == 404 else "invalid_request_error"
        return JSONResponse(
            APIError(e.status_code, str(e.detail), type_=kind).body(), status_code=e.status_code
        )

    @app.middleware("http")
    async def _auth(request: Request, call_next: Callable[[Request], Awaitable[Response]]) -> Response:
        if api_key is not None and request.url.path.startswith("/v1"):
            if request.headers.get("authorization", "") != f"Bearer {api_key}":
                err = APIError(
                    401, "missing or wrong API key", type_="authentication_error", code="invalid_api_key"
                )
                return JSONResponse(err.body(), status_code=401)
        return await call_next(request)

    def check_model(name: str) -> None:
        if name != model_name:
            raise APIError(
                404,
                f"the model {name!r} does not exist; this server serves {model_name!r}",
                type_="not_found_error",
                param="model",
                code="model_not_found",
            )

    async def submit(prompt: str | list[int], params: SamplingParams, rid: str) -> RequestStream:
        try:
            return await engine.add(prompt, params, rid)
        except QueueFullError as e:
            raise APIError(429, str(e), type_="rate_limit_error", code="queue_full") from e
        except ValueError as e:
            raise APIError(400, str(e), param="max_tokens" if "max_tokens" in str(e) else "prompt") from e

    @app.get("/health")
    async def health() -> Response:
        if not engine.is_alive():
            return JSONResponse(APIError(503, "engine is not running", type_="server_error").body(), 503)
        return JSONResponse({"status": "ok"})

    @app.get("/metrics")
    async def metrics() -> Response:
        return PlainTextResponse(engine.metrics.render(), media_type="text/plain; version=0.0.4")

    @app.get("/v1/models")
    async def models() -> dict[str, Any]:
        card = {
            "id": model_name,
            "object": "model",
            "created": created,
            "owned_by": "hyspec",
            "max_model_len": max_model_len,
        }
        return {"object": "list", "data": [card]}

    @app.post("/v1/completions")
    async def completions(raw: Request) -> Response:
        req = _parse(CompletionRequest, await _json_body(raw))
        check_model(req.model)
        prompt = _single_prompt(req.prompt)
        if req.max_tokens is None:
            raise APIError(400, "max_tokens must be an int >= 1", param="max_tokens")
        params = _params(req, max_tokens=req.max_tokens, logprobs=req.logprobs)
        rid = f"cmpl-{uuid.uuid4().hex}"
        stream = await submit(prompt, params, rid)
        tok = engine.tokenizer
        include_usage = bool(req.stream_options and req.stream_options.include_usage)

        def choice(out: RequestOutput, text: str, start: int, end: int) -> dict[str, Any]:
            c = out.outputs[0]
            ch: dict[str, Any] = {
                "index": 0,
                "text": text,
                "logprobs": None,
                "finish_reason": c.finish_reason if out.finished else None,
                "stop_reason": c.stop_reason if out.finished else None,
            }
            if c.logprobs is not None:
                ch["logprobs"] = _completion_logprobs(tok, c.token_ids[start:end], c.logprobs[start:end])
            if req.return_token_ids:
                ch["token_ids"] = c.token_ids[start:end]
            return ch

        if req.stream:

            async def events() -> AsyncIterator[str]:
                sent = 0
                last: RequestOutput | None = None
                async for out in stream.outputs():
                    last = out
                    n = len(out.outputs[0].token_ids)
                    if out.delta_text or out.finished:
                        body = {
                            "id": rid,
                            "object": "text_completion",
                            "created": int(time.time()),
                            "model": model_name,
                            "choices": [choice(out, out.delta_text, sent, n)],
                        }
                        sent = n
                        yield _sse(body)
                if include_usage and last is not None:
                    yield _sse(
                        {
                            "id": rid,
                            "object": "text_completion",
                            "created": int(time.time()),
                            "model": model_name,
                            "choices": [],
                            "usage": _usage(last),
                        }
                    )
                yield "data: [DONE]\n\n"

            return _event_stream(events(), stream)
        out = await _collect(stream, raw)
        text = (prompt if isinstance(prompt, str) and req.echo else "") + out.outputs[0].text
        body = {
            "id": rid,
            "object": "text_completion",
            "created": int(time.time()),
            "model": model_name,
            "choices": [choice(out, text, 0, len(out.outputs[0].token_ids))],
            "usage": _usage(out),
        }
        return JSONResponse(body)

    @app.post("/v1/chat/completions")
    async def chat(raw: Request) -> Response:
        req = _parse(ChatCompletionRequest, await _json_body(raw))
        check_model(req.model)
        try:
            messages = [{"role": m.role, "content": m.text()} for m in req.messages]
        except ValueError as e:
            raise APIError(400, str(e), param="messages") from e
        tok = engine.tokenizer
        try:
            prompt_ids: list[int] = await asyncio.to_thread(tok.apply_chat_template, messages)
        except ValueError as e:
            raise APIError(400, str(e), param="messages") from e
        max_tokens = req.max_completion_tokens if req.max_completion_tokens is not None else req.max_tokens
        if max_tokens is None:
            max_tokens = max_model_len - len(prompt_ids)
            if max_tokens < 1:
                raise APIError(
                    400,
                    f"the prompt ({len(prompt_ids)} tokens) fills the context max_model_len={max_model_len}",
                    param="messages",
                )
        if req.top_logprobs is not None and not req.logprobs:
            raise APIError(400, "top_logprobs needs logprobs=true", param="top_logprobs")
        logprobs = (req.top_logprobs or 0) if req.logprobs else None
        params = _params(req, max_tokens=max_tokens, logprobs=logprobs)
        rid = f"chatcmpl-{uuid.uuid4().hex}"
        stream = await submit(prompt_ids, params, rid)
        include_usage = bool(req.stream_options and req.stream_options.include_usage)

        def lp(out: RequestOutput, start: int, end: int) -> dict[str, Any] | None:
            c = out.outputs[0]
            if c.logprobs is None:
                return None
            return {"content": _chat_logprobs(tok, c.token_ids[start:end], c.logprobs[start:end])}

        if req.stream:

            async def events() -> AsyncIterator[str]:
                base = {"id": rid, "object": "chat.completion.chunk", "model": model_name}
                yield _sse(
                    {
                        **base,
                        "created": int(time.time()),
                        "choices": [
                            {
                                "index": 0,
                                "delta": {"role": "assistant", "content": ""},
                                "logprobs": None,
                                "finish_reason": None,
                            }
                        ],
                    }
                )
                sent = 0
                last: RequestOutput | None = None
                async for out in stream.outputs():
                    last = out
                    n = len(out.outputs[0].token_ids)
                    if out.delta_text or out.finished:
                        c = out.outputs[0]
                        ch: dict[str, Any] = {
                            "index": 0,
                            "delta": {"content": out.delta_text} if out.delta_text else {},
                            "logprobs": lp(out, sent, n),
                            "finish_reason": c.finish_reason if out.finished else None,
                        }
                        if req.return_token_ids:
                            ch["token_ids"] = c.token_ids[sent:n]
                        sent = n
                        yield _sse({**base, "created": int(time.time()), "choices": [ch]})
                if include_usage and last is not None:
                    yield _sse({**base, "created": int(time.time()), "choices": [], "usage": _usage(last)})
                yield "data: [DONE]\n\n"

            return _event_stream(events(), stream)
        out = await _collect(stream, raw)
        c = out.outputs[0]
        ch: dict[str, Any] = {
            "index": 0,
            "message": {"role": "assistant", "content": c.text},
            "logprobs": lp(out, 0, len(c.token_ids)),
            "finish_reason": c.finish_reason,
            "stop_reason": c.stop_reason,
        }
        if req.return_token_ids:
            ch["token_ids"] = c.token_ids
        body = {
            "id": rid,
            "object": "chat.completion",
            "created": int(time.time()),
            "model": model_name,
            "choices": [ch],
            "usage": _usage(out),
        }
        return JSONResponse(body)

    return app


async def _json_body(raw: Request) -> Any:
    data = await raw.body()
    try:
        return json.loads(data)
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise APIError(400, f"the request body is not valid JSON: {e}") from e


def _parse(model: type[_M], body: Any) -> _M:
    if not isinstance(body, dict):
        raise APIError(400, "the request body must be a JSON object")
    try:
        return model.model_validate(body)
    except ValidationError as e:
        err = e.errors()[0]
        loc = ".".join(str(p) for p in err["loc"]) or None
        raise APIError(400, f"{loc}: {err['msg']}", param=loc) from e


def _params(
    req: CompletionRequest | ChatCompletionRequest, *, max_tokens: int, logprobs: int | None
) -> SamplingParams:
    try:
        return req.sampling_params(max_tokens=max_tokens, logprobs=logprobs)
    except ValueError as e:
        first = str(e).split(" ", 1)[0]
        raise APIError(400, str(e), param=first if first in _SAMPLING_FIELDS else None) from e


def _single_prompt(prompt: str | list[int] | list[str] | list[list[int]]) -> str | list[int]:
    if isinstance(prompt, str):
        return prompt
    if prompt and all(isinstance(p, int) for p in prompt):
        return [int(p) for p in prompt]  # type: ignore[arg-type]
    if len(prompt) == 1:
        only = prompt[0]
        if isinstance(only, str):
            return only
        if isinstance(only, list):
            return list(only)
    raise APIError(400, "prompt must be one string or one list of token ids", param="prompt")


def _usage(out: RequestOutput) -> dict[str, int]:
    p, c = len(out.prompt_token_ids), len(out.outputs[0].token_ids)
    return {"prompt_tokens": p, "completion_tokens": c, "total_tokens": p + c}


def _sse(body: dict[str, Any]) -> str:
    return f"data: {json.dumps(body)}\n\n"


def _event_stream(events: AsyncIterator[str], stream: RequestStream) -> StreamingResponse:
    async def guarded() -> AsyncIterator[str]:
        try:
            async for e in events:
                yield e
        except APIError as e:
            yield _sse(e.body())
        except RuntimeError as e:
            yield _sse(APIError(500, str(e), type_="server_error").body())
        finally:
            # a disconnect cancels this generator; the abort frees the request's memory
            if not stream.finished:
                stream.abort()

    return StreamingResponse(guarded(), media_type="text/event-stream")


async def _collect(stream: RequestStream, raw: Request) -> RequestOutput:
    """The final output, aborting the request if the client goes away while it runs."""
    task = asyncio.ensure_future(stream.final())
    try:
        while True:
            done, _ = await asyncio.wait({task}, timeout=_DISCONNECT_POLL_S)
            if done:
                try:
                    return task.result()
                except RuntimeError as e:
                    raise APIError(500, str(e), type_="server_error") from e
            if await raw.is_disconnected():
                raise APIError(499, "client disconnected", type_="client_closed_request")
    finally:
        if not task.done():
            task.cancel()
            stream.abort()


def _completion_logprobs(tok: Any, ids: list[int], lps: list[dict[int, float]]) -> dict[str, Any]:
    tokens = [tok.decode([t], skip_special_tokens=False) for t in ids]
    offsets, pos = [], 0
    for s in tokens:
        offsets.append(pos)
        pos += len(s)
    return {
        "tokens": tokens,
        "token_logprobs": [d[t] for t, d in zip(ids, lps)],
        "top_logprobs": [{tok.decode([k], skip_special_tokens=False): v for k, v in d.items()} for d in lps],
        "text_offset": offsets,
    }


def _chat_logprobs(tok: Any, ids: list[int], lps: list[dict[int, float]]) -> list[dict[str, Any]]:
    def entry(t: int, v: float) -> dict[str, Any]:
        s = tok.decode([t], skip_special_tokens=False)
        return {"token": s, "logprob": v, "bytes": list(s.encode("utf-8"))}

    out = []
    for t, d in zip(ids, lps):
        e = entry(t, d[t])
        e["top_logprobs"] = [entry(k, v) for k, v in sorted(d.items(), key=lambda kv: -kv[1])]
        out.append(e)
    return out
