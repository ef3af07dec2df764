"""The OpenAI-compatible HTTP server: /v1/completions, /v1/chat/completions, /v1/models, /health, /metrics.

Handlers parse and validate the body themselves (so malformed JSON and wrong types are 400, not FastAPI's
422), hand the request to the `AsyncEngine` and stream its outputs as server-sent events. Every prompt of
a batch and every sample of `n` / `best_of` is its own engine request, queued all or nothing and read as one
`StreamGroup`. A client that disconnects (streaming or not) aborts all of them, which frees their memory
before the next step.

`build_app` builds one `ServerContext` (`api_context.py`), stores it on `app.state.ctx` and registers the
module-level handlers: the small routes here, the generation routes in `api_generate.py`; the formatting and
streaming helpers are in `api_format.py`.
"""

from __future__ import annotations

import asyncio
import contextlib
import hmac
import time
from collections.abc import Sequence
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.middleware.cors import CORSMiddleware
from fastapi.responses import JSONResponse, Response
from prometheus_client import CONTENT_TYPE_LATEST
from pydantic import BaseModel
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.types import ASGIApp, Receive, Scope, Send

from hyspec_server.api_context import ServerContext, server_context
from hyspec_server.api_format import json_body, parse
from hyspec_server.api_generate import chat, completions, render_chat_prompt
from hyspec_server.async_engine import AsyncEngine, EngineDeadError
from hyspec_server.protocol import (
    APIError,
    ChatCompletionRequest,
    CompletionRequest,
    ErrorResponse,
    TokenizeChatRequest,
)

MIN_BODY_BYTES = 1 << 20
BODY_BYTES_PER_TOKEN = 64
"""Request bodies are bounded (413) by the context they could fill: a token is a few characters of text, and
JSON escapes take at most 12 bytes per character; 64 bytes per token leaves room for the other fields."""


STREAM_STALL_TIMEOUT_S = 60.0
"""A streamed request whose client takes no chunk for this long (its socket buffers full) is aborted."""


BODY_READ_TIMEOUT_S = 30.0
"""A client that sends no part of its body for this long gets 408 (a half-sent body held a connection
forever)."""


METRICS_SAMPLE_TIMEOUT_S = 2.0
"""/metrics waits at most this long for the engine thread to sample the pool gauges (it does so between
steps); past it the scrape shows the previous sample, well inside Prometheus' default 10 s scrape timeout."""


def max_body_bytes_for(max_model_len: int) -> int:
    """The default request-body bound: BODY_BYTES_PER_TOKEN per context token, at least MIN_BODY_BYTES."""
    return max(MIN_BODY_BYTES, BODY_BYTES_PER_TOKEN * max_model_len)


def build_app(
    engine: AsyncEngine,
    *,
    model_name: str,
    api_key: str | None = None,
    max_body_bytes: int | None = None,
    body_read_timeout_s: float | None = None,
    allowed_origins: Sequence[str] = ("*",),
    chat_template: str | None = None,
    trust_request_chat_template: bool = False,
    stream_stall_timeout_s: float | None = None,
) -> FastAPI:
    """Args:
    stream_stall_timeout_s: abort a streamed request whose client takes no chunk for this long (None:
        STREAM_STALL_TIMEOUT_S).
    chat_template: the Jinja chat template of every chat request (None: the tokenizer's).
    trust_request_chat_template: accept a request's own `chat_template` (vLLM refuses it by default: a
        template is code the server runs, if sandboxed).
    allowed_origins: CORS origins browsers may call from (vLLM's default: any); empty: no CORS headers.
    max_body_bytes: larger request bodies get 413 before they are read whole (None: from max_model_len,
        `max_body_bytes_for`).
    body_read_timeout_s: 408 when no part of a request body arrives for this long (None:
        BODY_READ_TIMEOUT_S).
    """
    app = FastAPI(title="hyspec", docs_url=None, redoc_url=None)
    max_model_len = engine.engine.max_model_len
    app.state.ctx = ServerContext(
        engine=engine,
        model_name=model_name,
        created=int(time.time()),
        max_model_len=max_model_len,
        body_limit=max_body_bytes_for(max_model_len) if max_body_bytes is None else max_body_bytes,
        read_timeout_s=BODY_READ_TIMEOUT_S if body_read_timeout_s is None else body_read_timeout_s,
        stall_s=STREAM_STALL_TIMEOUT_S if stream_stall_timeout_s is None else stream_stall_timeout_s,
        chat_template=chat_template,
        trust_request_chat_template=trust_request_chat_template,
    )

    app.exception_handler(APIError)(_api_error)
    app.exception_handler(EngineDeadError)(_engine_dead)
    app.exception_handler(RequestValidationError)(_validation_error)
    app.exception_handler(StarletteHTTPException)(_http_error)

    _document_bodies(app)

    if api_key is not None:
        app.add_middleware(_BearerAuth, api_key=api_key)
    if allowed_origins:
        # added last, so outermost: a browser's preflight (no Authorization header) is answered before the key
        app.add_middleware(
            CORSMiddleware, allow_origins=list(allowed_origins), allow_methods=["*"], allow_headers=["*"]
        )

    # the route order is /openapi.json's path order; a handler's name is its operationId's prefix
    app.add_api_route("/health", health, methods=["GET"])
    app.add_api_route("/metrics", metrics, methods=["GET"])
    app.add_api_route("/version", version, methods=["GET"])
    app.add_api_route("/tokenize", tokenize, methods=["POST"])
    app.add_api_route("/detokenize", detokenize, methods=["POST"])
    app.add_api_route("/reset_prefix_cache", reset_prefix_cache, methods=["POST"])
    app.add_api_route("/v1/models", models, methods=["GET"])
    app.add_api_route("/v1/models/{model_id:path}", model, methods=["GET"])
    app.add_api_route(
        "/v1/completions",
        completions,
        methods=["POST"],
        openapi_extra=_body_of(CompletionRequest),
        responses=ERROR_RESPONSES,
    )
    app.add_api_route(
        "/v1/chat/completions",
        chat,
        methods=["POST"],
        openapi_extra=_body_of(ChatCompletionRequest),
        responses=ERROR_RESPONSES,
    )
    return app


async def _api_error(_: Request, e: APIError) -> JSONResponse:
    return JSONResponse(e.body(), status_code=e.status)


async def _engine_dead(_: Request, e: EngineDeadError) -> JSONResponse:
    # the engine thread has stopped (/health says so too): no request can be served until a restart
    return JSONResponse(APIError(503, str(e), type_="server_error").body(), status_code=503)


async def _validation_error(_: Request, e: RequestValidationError) -> JSONResponse:
    return JSONResponse(APIError(400, str(e)).body(), status_code=400)


async def _http_error(_: Request, e: StarletteHTTPException) -> JSONResponse:
    kind = "not_found_error" if e.status_code == 404 else "invalid_request_error"
    # keep the exception's headers: a 405 names the allowed methods in `Allow`
    return JSONResponse(
        APIError(e.status_code, str(e.detail), type_=kind).body(),
        status_code=e.status_code,
        headers=getattr(e, "headers", None),
    )


async def health(raw: Request) -> Response:
    if not server_context(raw).engine.is_alive():
        return JSONResponse(APIError(503, "engine is not running", type_="server_error").body(), 503)
    return JSONResponse({"status": "ok"})


async def metrics(raw: Request) -> Response:
    engine = server_context(raw).engine
    # the pool gauges are sampled on the engine thread, between steps (the pool is not thread-safe); a
    # stopped engine, or one in a step longer than the bound, leaves what was last recorded
    with contextlib.suppress(EngineDeadError, TimeoutError):
        await asyncio.wait_for(engine.call(engine.metrics.observe), METRICS_SAMPLE_TIMEOUT_S)
    return Response(engine.metrics.render(), media_type=CONTENT_TYPE_LATEST)


async def version() -> dict[str, str]:
    return {"version": _version()}


async def tokenize(raw: Request) -> Response:
    """vLLM's route: a `prompt` (text) or chat `messages` -> token ids. Chat is rendered by the renderer of
    /v1/chat/completions, with the same fields (`add_generation_prompt`, `continue_final_message`, `tools`,
    `tool_choice`, `chat_template_kwargs`, `chat_template`) and the same 400s: the count is the prompt
    tokens a chat completion of that body would have."""
    ctx = server_context(raw)
    body = await json_body(raw, ctx.body_limit, read_timeout_s=ctx.read_timeout_s)
    if not isinstance(body, dict):
        raise APIError(400, "expected a JSON object", param=None)
    ctx.check_model(body.get("model"))
    tok = ctx.tokenizer
    if "messages" in body:
        req = parse(TokenizeChatRequest, body)
        if req.add_special_tokens:
            raise APIError(
                400,
                "add_special_tokens=true is not supported with messages: the chat template's own special "
                "tokens are the prompt's, as in chat completions",
                param="add_special_tokens",
            )
        ids, _ = await render_chat_prompt(ctx, req)
        want_strs = bool(req.return_token_strs)
    elif isinstance(body.get("prompt"), str):
        special = body.get("add_special_tokens", True)  # vLLM's field, default as its completions
        if not isinstance(special, bool):
            raise APIError(400, "add_special_tokens must be a bool", param="add_special_tokens")
        want = body.get("return_token_strs", False)
        if want is not None and not isinstance(want, bool):
            raise APIError(400, "return_token_strs must be a bool", param="return_token_strs")
        want_strs = bool(want)
        ids = await asyncio.to_thread(lambda: tok.encode(body["prompt"], add_special_tokens=special))
    else:
        raise APIError(400, "expected a string 'prompt' or a 'messages' list", param="prompt")
    strs = _token_strs(tok, ids) if want_strs else None
    return JSONResponse(
        {"count": len(ids), "max_model_len": ctx.max_model_len, "tokens": ids, "token_strs": strs}
    )


def _token_strs(tok: Any, ids: list[int]) -> list[str]:
    """Each token's own string, as vLLM's `return_token_strs` gives it (the tokenizer's vocabulary entries;
    a tokenizer without them: each token decoded alone)."""
    convert = getattr(getattr(tok, "hf_tokenizer", tok), "convert_ids_to_tokens", None)
    if callable(convert):
        return [str(t) for t in convert(ids)]
    return [tok.decode([i], skip_special_tokens=False) for i in ids]


async def detokenize(raw: Request) -> Response:
    """vLLM's route: token ids -> text."""
    ctx = server_context(raw)
    body = await json_body(raw, ctx.body_limit, read_timeout_s=ctx.read_timeout_s)
    toks = body.get("tokens") if isinstance(body, dict) else None
    vocab = getattr(ctx.tokenizer, "vocab_size", None)
    if (
        not isinstance(toks, list)
        or not all(isinstance(t, int) and not isinstance(t, bool) and t >= 0 for t in toks)
        or (vocab is not None and any(t >= vocab for t in toks))
    ):
        raise APIError(400, "tokens: expected a list of token ids in the vocabulary", param="tokens")
    ctx.check_model(body.get("model"))
    return JSONResponse({"prompt": ctx.tokenizer.decode(toks)})


async def reset_prefix_cache(raw: Request) -> Response:
    # vLLM's admin route (behind the API key, like every route but /health)
    done = await server_context(raw).engine.call(lambda e: e.reset_prefix_cache())
    return JSONResponse({"reset": done})


async def models(raw: Request) -> dict[str, Any]:
    return {"object": "list", "data": [server_context(raw).card()]}


async def model(raw: Request, model_id: str) -> dict[str, Any]:
    ctx = server_context(raw)
    ctx.check_model(model_id)
    return ctx.card()


ERROR_RESPONSES: dict[int | str, dict[str, Any]] = {
    status: {"model": ErrorResponse, "description": what}
    for status, what in (
        (400, "invalid request (the message and `param` name the field)"),
        (401, "missing or wrong API key"),
        (404, "unknown model"),
        (413, "request body over --max-body-bytes"),
        (429, "waiting queue full"),
        (500, "the engine step failed"),
        (503, "the engine has stopped"),
    )
}
"""The OpenAI-style error answers of the generation routes, declared in /openapi.json."""


def _body_of(model: type[BaseModel]) -> dict[str, Any]:
    """openapi_extra declaring `model` as a route's JSON body (the routes parse it themselves, for errors
    that name the field)."""
    ref = {"$ref": f"#/components/schemas/{model.__name__}"}
    return {"requestBody": {"required": True, "content": {"application/json": {"schema": ref}}}}


def _document_bodies(app: FastAPI) -> None:
    """Adds the request models (and the models they use) to /openapi.json's components."""
    from fastapi.openapi.utils import get_openapi

    def openapi() -> dict[str, Any]:
        if app.openapi_schema is None:
            doc = get_openapi(title=app.title, version=app.version, routes=app.routes)
            comps = doc.setdefault("components", {}).setdefault("schemas", {})
            for model in (CompletionRequest, ChatCompletionRequest):
                schema = model.model_json_schema(ref_template="#/components/schemas/{model}")
                comps.update(schema.pop("$defs", {}))
                comps[model.__name__] = schema
            app.openapi_schema = doc
        return app.openapi_schema

    app.openapi = openapi  # type: ignore[method-assign]


_OPEN_PATHS = frozenset({"/health"})


class _BearerAuth:
    """401 for every route but /health without `Authorization: Bearer <api_key>`.

    /metrics and /openapi.json are covered too: they describe the deployment and its load. /health stays open
    for load balancers and orchestrators, which carry no key.

    A plain ASGI middleware: Starlette's `BaseHTTPMiddleware` (`@app.middleware`) hides the client's
    disconnect from `Request.is_disconnected()`, and a non-streamed request could then not be aborted.
    """

    def __init__(self, app: ASGIApp, *, api_key: str) -> None:
        self.app = app
        self.expected = f"Bearer {api_key}".encode()

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http" and scope["path"] not in _OPEN_PATHS:
            got = dict(scope["headers"]).get(b"authorization", b"")
            if not hmac.compare_digest(got, self.expected):
                err = APIError(
                    401, "missing or wrong API key", type_="authentication_error", code="invalid_api_key"
                )
                await JSONResponse(err.body(), status_code=401)(scope, receive, send)
                return
        await self.app(scope, receive, send)


def _version() -> str:
    """The installed hyspec-server version (the package metadata, one source with pyproject.toml)."""
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version("hyspec-server")
    except PackageNotFoundError:
        return "unknown"
