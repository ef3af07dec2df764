"""The OpenAI-compatible HTTP server: /v1/completions, /v1/chat/completions, /v1/models, /health, /metrics.

Handlers parse and validate the body themselves (so malformed JSON and wrong types are 400, not FastAPI's
422), hand the request to the `AsyncEngine` and stream its outputs as server-sent events. Every prompt of
a batch and every sample of `n` / `best_of` is its own engine request, queued all or nothing and read as one
`StreamGroup`. A client that disconnects (streaming or not) aborts all of them, which frees their memory
before the next step.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import hmac
import json
import logging
import time
import uuid
from collections.abc import AsyncIterator, Callable, Iterable, Sequence
from typing import Any, TypeVar

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.middleware.cors import CORSMiddleware
from fastapi.responses import JSONResponse, Response, StreamingResponse
from prometheus_client import CONTENT_TYPE_LATEST
from pydantic import BaseModel, ValidationError
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from hyspec_server.async_engine import AddError, AsyncEngine, EngineDeadError, StreamGroup
from hyspec_server.engine import TokensPrompt
from hyspec_server.outputs import Logprob, RequestOutput
from hyspec_server.protocol import (
    MAX_LOGPROBS,
    MAX_N,
    APIError,
    ChatCompletionRequest,
    ChatMessage,
    CompletionRequest,
    ErrorResponse,
    derived_seed,
)
from hyspec_server.sampling_params import SamplingParams, StructuredOutputsParams
from hyspec_server.scheduler import QueueFullError
from hyspec_server.tokenizer import ChatOptions
from hyspec_server.tool_calls import ToolCallStream, parse_tool_calls, required_grammar, template_message

_log = logging.getLogger("hyspec.api")

_M = TypeVar("_M", bound=BaseModel)
_DISCONNECT_POLL_S = 0.05
_SAMPLING_FIELDS = set(SamplingParams.__dataclass_fields__)


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
    created = int(time.time())
    max_model_len = engine.engine.max_model_len
    body_limit = max_body_bytes_for(max_model_len) if max_body_bytes is None else max_body_bytes
    read_timeout = BODY_READ_TIMEOUT_S if body_read_timeout_s is None else body_read_timeout_s
    stall_s = STREAM_STALL_TIMEOUT_S if stream_stall_timeout_s is None else stream_stall_timeout_s

    @app.exception_handler(APIError)
    async def _api_error(_: Request, e: APIError) -> JSONResponse:
        return JSONResponse(e.body(), status_code=e.status)

    @app.exception_handler(RequestValidationError)
    async def _validation_error(_: Request, e: RequestValidationError) -> JSONResponse:
        return JSONResponse(APIError(400, str(e)).body(), status_code=400)

    @app.exception_handler(StarletteHTTPException)
    async def _http_error(_: Request, e: StarletteHTTPException) -> JSONResponse:
        kind = "not_found_error" if e.status_code == 404 else "invalid_request_error"
        # keep the exception's headers: a 405 names the allowed methods in `Allow`
        return JSONResponse(
            APIError(e.status_code, str(e.detail), type_=kind).body(),
            status_code=e.status_code,
            headers=getattr(e, "headers", None),
        )

    _document_bodies(app)

    if api_key is not None:
        app.add_middleware(_BearerAuth, api_key=api_key)
    if allowed_origins:
        # added last, so outermost: a browser's preflight (no Authorization header) is answered before the key
        app.add_middleware(
            CORSMiddleware, allow_origins=list(allowed_origins), allow_methods=["*"], allow_headers=["*"]
        )

    def check_model(name: str | None) -> None:
        if name is not None and name != model_name:
            raise APIError(
                404,
                f"the model {name!r} does not exist; this server serves {model_name!r}",
                type_="not_found_error",
                param="model",
                code="model_not_found",
            )

    async def submit(
        items: list[tuple[str | list[int] | TokensPrompt, SamplingParams, str]],
        *,
        per_prompt: int,
        batch: bool,
    ) -> StreamGroup:
        """Queues every (prompt, sample) request or none of them."""
        bound = engine.engine.scheduler.config.max_waiting
        if len(items) > bound:
            # they all wait before the next step, so the bounded queue can never take them
            raise APIError(
                400,
                f"this call needs {len(items)} engine requests (prompts x samples), over the server's queue "
                f"bound {bound}",
                param="n" if per_prompt > 1 else "prompt",
            )
        try:
            return await engine.add_many(items)
        except AddError as e:
            if isinstance(e.cause, QueueFullError):
                raise APIError(429, str(e.cause), type_="rate_limit_error", code="queue_full") from e
            if isinstance(e.cause, ValueError):
                msg = str(e.cause)
                if batch:
                    msg = f"prompt[{e.index // per_prompt}]: {msg}"
                raise APIError(400, msg, param="max_tokens" if "max_tokens" in msg else "prompt") from e
            raise

    async def compile_constraint(
        req: CompletionRequest | ChatCompletionRequest, params: SamplingParams
    ) -> None:
        """Compiles the request's constraint on a worker thread (a large schema would stall every stream on
        the engine thread; the engine then finds it in the compiler's cache); 400 when it does not compile."""
        so = params.structured_outputs
        if so is None:
            return
        try:
            await asyncio.to_thread(engine.engine.grammars.compile, so)
        except ValueError as e:
            param = "structured_outputs" if req.structured_outputs is not None else "response_format"
            if (
                isinstance(req, ChatCompletionRequest)
                and req.tools
                and req.tool_choice not in (None, "auto", "none")
            ):
                param = "tools"
            raise APIError(400, str(e), param=param) from e

    def check_token_ids(prompts: list[str | list[int]]) -> None:
        vocab = getattr(engine.tokenizer, "vocab_size", None)
        for i, p in enumerate(prompts):
            if isinstance(p, list) and any(t < 0 or (vocab is not None and t >= vocab) for t in p):
                where = f"prompt[{i}]" if len(prompts) > 1 else "prompt"
                bound = "an int >= 0" if vocab is None else f"in [0, {vocab}) for this model"
                raise APIError(400, f"{where}: token ids must be {bound}", param="prompt")

    @app.get("/health")
    async def health() -> Response:
        if not engine.is_alive():
            return JSONResponse(APIError(503, "engine is not running", type_="server_error").body(), 503)
        return JSONResponse({"status": "ok"})

    @app.get("/metrics")
    async def metrics() -> Response:
        # the pool gauges are sampled on the engine thread, between steps (the pool is not thread-safe); a
        # stopped engine, or one in a step longer than the bound, leaves what was last recorded
        with contextlib.suppress(EngineDeadError, TimeoutError):
            await asyncio.wait_for(engine.call(engine.metrics.observe), METRICS_SAMPLE_TIMEOUT_S)
        return Response(engine.metrics.render(), media_type=CONTENT_TYPE_LATEST)

    @app.get("/version")
    async def version() -> dict[str, str]:
        return {"version": _version()}

    @app.post("/tokenize")
    async def tokenize(raw: Request) -> Response:
        """vLLM's route: a `prompt` (text) or chat `messages` -> token ids."""
        body = await _json_body(raw, body_limit, read_timeout_s=read_timeout)
        if not isinstance(body, dict):
            raise APIError(400, "expected a JSON object", param=None)
        check_model(body.get("model"))
        tok = engine.tokenizer
        if isinstance(body.get("messages"), list):
            try:
                messages = [ChatMessage.model_validate(m) for m in body["messages"]]
                conv = [template_message(m.role, m.text(), m) for m in messages]
                opts = ChatOptions(chat_template=chat_template)
                ids = await asyncio.to_thread(lambda: tok.apply_chat_template(conv, options=opts))
            except (ValueError, ValidationError) as e:
                raise APIError(400, f"messages: {e}", param="messages") from e
        elif isinstance(body.get("prompt"), str):
            special = body.get("add_special_tokens", True)  # vLLM's field, default as its completions
            if not isinstance(special, bool):
                raise APIError(400, "add_special_tokens must be a bool", param="add_special_tokens")
            ids = await asyncio.to_thread(lambda: tok.encode(body["prompt"], add_special_tokens=special))
        else:
            raise APIError(400, "expected a string 'prompt' or a 'messages' list", param="prompt")
        return JSONResponse(
            {"count": len(ids), "max_model_len": max_model_len, "tokens": ids, "token_strs": None}
        )

    @app.post("/detokenize")
    async def detokenize(raw: Request) -> Response:
        """vLLM's route: token ids -> text."""
        body = await _json_body(raw, body_limit, read_timeout_s=read_timeout)
        toks = body.get("tokens") if isinstance(body, dict) else None
        vocab = getattr(engine.tokenizer, "vocab_size", None)
        if (
            not isinstance(toks, list)
            or not all(isinstance(t, int) and not isinstance(t, bool) and t >= 0 for t in toks)
            or (vocab is not None and any(t >= vocab for t in toks))
        ):
            raise APIError(400, "tokens: expected a list of token ids in the vocabulary", param="tokens")
        check_model(body.get("model"))
        return JSONResponse({"prompt": engine.tokenizer.decode(toks)})

    @app.post("/reset_prefix_cache")
    async def reset_prefix_cache() -> Response:
        # vLLM's admin route (behind the API key, like every route but /health)
        done = await engine.call(lambda e: e.reset_prefix_cache())
        return JSONResponse({"reset": done})

    card = {
        "id": model_name,
        "object": "model",
        "created": created,
        "owned_by": "hyspec",
        "max_model_len": max_model_len,
    }

    @app.get("/v1/models")
    async def models() -> dict[str, Any]:
        return {"object": "list", "data": [card]}

    @app.get("/v1/models/{model_id:path}")
    async def model(model_id: str) -> dict[str, Any]:
        check_model(model_id)
        return card

    @app.post("/v1/completions", openapi_extra=_body_of(CompletionRequest), responses=ERROR_RESPONSES)
    async def completions(raw: Request) -> Response:
        req = _parse(CompletionRequest, await _json_body(raw, body_limit, read_timeout_s=read_timeout))
        check_model(req.model)
        req.check_common()
        if req.suffix:
            raise APIError(400, "suffix is not supported", param="suffix")
        prompts = req.prompts()
        check_token_ids(prompts)
        n = req.num_choices
        best_of = n if req.best_of is None else req.best_of
        if not n <= best_of <= MAX_N:
            raise APIError(400, f"best_of must be an int in [n={n}, {MAX_N}], got {best_of}", param="best_of")
        if best_of > n and req.stream:
            raise APIError(400, "best_of > n cannot be streamed", param="best_of")
        if req.logprobs is not None and not 0 <= req.logprobs <= MAX_LOGPROBS:
            raise APIError(400, f"logprobs must be an int in [0, {MAX_LOGPROBS}]", param="logprobs")
        echo = bool(req.echo)
        # echo with logprobs: the prompt's tokens lead the logprobs too (OpenAI's), so every sample scores
        # its prompt (prompt logprobs)
        echo_lp = echo and req.logprobs is not None
        # best_of ranks its samples by cumulative logprob, which needs the chosen tokens' logprobs
        engine_lp = req.logprobs if best_of == n else (req.logprobs or 0)
        max_tokens = 16 if req.max_tokens is None else req.max_tokens
        samples = _samples(
            req,
            best_of,
            max_tokens=max_tokens,
            logprobs=engine_lp,
            engine=engine,
            # echo's prompt logprobs and vLLM's prompt_logprobs field share one scoring of the prompt
            prompt_logprobs=_most(req.logprobs if echo_lp else None, req.prompt_logprobs),
        )
        await compile_constraint(req, samples[0])
        rid = f"cmpl-{uuid.uuid4().hex}"
        # text prompts are tokenized here, on a worker thread: on the engine thread a long one would stall
        # every running stream
        ready: list[str | list[int] | TokensPrompt] = [
            TokensPrompt(p, await asyncio.to_thread(engine.tokenizer.encode, p), req.cache_salt)
            if isinstance(p, str)
            else TokensPrompt(None, p, req.cache_salt)
            for p in prompts
        ]
        items = [(p, samples[j], f"{rid}-{i}-{j}") for i, p in enumerate(ready) for j in range(best_of)]
        group = await submit(items, per_prompt=best_of, batch=len(prompts) > 1)
        tok = engine.tokenizer
        skip = req.skip_special_tokens
        echoed = [
            (p if isinstance(p, str) else tok.decode(p, skip_special_tokens=skip)) if echo else ""
            for p in prompts
        ]

        def choice(
            index: int, out: RequestOutput, text: str, start: int, offset: int, *, prompt: bool = False
        ) -> tuple[dict[str, Any], int]:
            """The choice for tokens [start:] of `out`; also the text offset after them. `prompt`: the
            logprobs start with the prompt's (echo), at text offsets from 0."""
            c = out.outputs[0]
            ch: dict[str, Any] = {
                "index": index,
                "text": text,
                "logprobs": None,
                "finish_reason": c.finish_reason if out.finished else None,
                "stop_reason": c.stop_reason if out.finished else None,
            }
            if req.logprobs is not None and c.logprobs is not None:
                ch["logprobs"], offset = _completion_logprobs(
                    tok, c.token_ids[start:], c.logprobs[start:], offset
                )
                if prompt:
                    ch["logprobs"] = _join_logprobs(echo_logprobs(out), ch["logprobs"])
            if req.return_token_ids:
                ch["token_ids"] = c.token_ids[start:]
            return ch, offset

        def echo_logprobs(out: RequestOutput) -> dict[str, Any] | None:
            """The echoed prompt's completions logprobs (its first token has none: null, as OpenAI's)."""
            if out.prompt_logprobs is None:
                return None
            return _completion_logprobs(tok, out.prompt_token_ids, out.prompt_logprobs, 0)[0]

        def body(choices: list[dict[str, Any]], **extra: Any) -> dict[str, Any]:
            return {
                "id": rid,
                "object": "text_completion",
                "created": int(time.time()),
                "model": model_name,
                "choices": choices,
                **extra,
            }

        if req.stream:
            # best_of == n here: item k is choice k
            no_usage = {"usage": None} if req.include_usage else {}

            async def events() -> AsyncIterator[str]:
                sent = [0] * len(items)
                offsets = [len(echoed[k // n]) for k in range(len(items))]
                last: dict[int, RequestOutput] = {}
                if echo and not echo_lp:
                    for k in range(len(items)):
                        ch = {"index": k, "text": echoed[k // n], "logprobs": None, "finish_reason": None}
                        yield _sse(body([ch], **no_usage))
                async for k, out in group.outputs():
                    if echo_lp and k not in last:
                        # prompt logprobs exist once it is prefilled: the echo waits for the first output
                        ch = {
                            "index": k,
                            "text": echoed[k // n],
                            "logprobs": echo_logprobs(out),
                            "finish_reason": None,
                        }
                        yield _sse(body([ch], **no_usage))
                    last[k] = out
                    # a chunk for every step that made tokens, text or not (as vLLM): a token that is
                    # part of a character still arrives, and clients time it
                    if out.delta_token_ids or out.delta_text or out.finished:
                        ch, offsets[k] = choice(k, out, out.delta_text, sent[k], offsets[k])
                        sent[k] = len(out.outputs[0].token_ids)
                        yield _sse(body([ch], **no_usage))
                if req.include_usage:
                    yield _sse(
                        body([], usage=_usage([last[k] for k in range(0, len(items), n)], last.values()))
                    )
                yield "data: [DONE]\n\n"

            return _event_stream(events(), group, stall_s=stall_s)
        outs = await _collect(group, raw)
        choices: list[dict[str, Any]] = []
        for i in range(len(prompts)):
            mine = outs[i * best_of : (i + 1) * best_of]
            if best_of > n:
                mine = sorted(mine, key=lambda o: -(o.outputs[0].cumulative_logprob or 0.0))[:n]
            for j, out in enumerate(mine):
                text = echoed[i] + out.outputs[0].text
                ch = choice(i * n + j, out, text, 0, len(echoed[i]), prompt=echo_lp)[0]
                if req.prompt_logprobs is not None:
                    ch["prompt_logprobs"] = _vllm_prompt_logprobs(out, req.prompt_logprobs)
                choices.append(ch)
        # every generated token counts, best_of's discarded samples too (as OpenAI bills them)
        return JSONResponse(body(choices, usage=_usage(outs[::best_of], outs)))

    @app.post(
        "/v1/chat/completions", openapi_extra=_body_of(ChatCompletionRequest), responses=ERROR_RESPONSES
    )
    async def chat(raw: Request) -> Response:
        req = _parse(ChatCompletionRequest, await _json_body(raw, body_limit, read_timeout_s=read_timeout))
        check_model(req.model)
        req.check_common()
        forced = req.check_chat()
        try:
            messages = [template_message(m.role, m.text(), m) for m in req.messages]
        except ValueError as e:
            raise APIError(400, str(e), param="messages") from e
        tok = engine.tokenizer
        tools = req.tools if req.parses_tools else None
        try:
            if req.chat_template is not None and not trust_request_chat_template:
                raise APIError(
                    400,
                    "chat_template in a request is refused: start the server with --chat-template, or with "
                    "--trust-request-chat-template to allow request templates (as vLLM)",
                    param="chat_template",
                )
            options = ChatOptions(
                req.add_generation_prompt,
                req.continue_final_message,
                req.chat_template_kwargs,
                req.chat_template or chat_template,
            )
            prompt_ids: list[int] = await asyncio.to_thread(
                tok.apply_chat_template, messages, tools=tools, options=options
            )
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
        if req.top_logprobs is not None:
            if not req.logprobs:
                raise APIError(400, "top_logprobs needs logprobs=true", param="top_logprobs")
            if not 0 <= req.top_logprobs <= MAX_LOGPROBS:
                raise APIError(
                    400, f"top_logprobs must be an int in [0, {MAX_LOGPROBS}]", param="top_logprobs"
                )
        top_n = req.top_logprobs or 0
        logprobs = top_n if req.logprobs else None
        n = req.num_choices
        lp_prompt = req.prompt_logprobs
        samples = _samples(
            req, n, max_tokens=max_tokens, logprobs=logprobs, engine=engine, prompt_logprobs=lp_prompt
        )
        if forced:
            # tool_choice "required" or a named function: the output must be calls (a grammar)
            assert req.tools is not None
            try:
                ebnf = await asyncio.to_thread(
                    required_grammar, req.tools, forced, parallel=req.parallel_tool_calls
                )
            except ValueError as e:
                raise APIError(400, str(e), param="tools") from e
            so = StructuredOutputsParams(grammar=ebnf)
            samples = [dataclasses.replace(s, structured_outputs=so) for s in samples]
        await compile_constraint(req, samples[0])
        rid = f"chatcmpl-{uuid.uuid4().hex}"
        prompt = TokensPrompt(None, prompt_ids, req.cache_salt)
        group = await submit(
            [(prompt, samples[j], f"{rid}-{j}") for j in range(n)], per_prompt=n, batch=False
        )

        def lp(out: RequestOutput, start: int) -> dict[str, Any] | None:
            c = out.outputs[0]
            if c.logprobs is None:
                return None
            return {"content": _chat_logprobs(tok, c.token_ids[start:], c.logprobs[start:], top_n)}

        if req.stream:
            base: dict[str, Any] = {"id": rid, "object": "chat.completion.chunk", "model": model_name}
            if req.include_usage:
                base["usage"] = None

            def chunk(choices: list[dict[str, Any]], **extra: Any) -> str:
                return _sse({**base, "created": int(time.time()), "choices": choices, **extra})

            async def events() -> AsyncIterator[str]:
                for k in range(n):
                    hello = {"role": "assistant", "content": ""}
                    yield chunk([{"index": k, "delta": hello, "logprobs": None, "finish_reason": None}])
                sent = [0] * n
                last: dict[int, RequestOutput] = {}
                calls = [ToolCallStream() for _ in range(n)]
                async for k, out in group.outputs():
                    last[k] = out
                    if out.delta_token_ids or out.delta_text or out.finished:
                        c = out.outputs[0]
                        # tokens without text yet still make a chunk ("content": ""), a bare finish none
                        has = out.delta_text or not out.finished
                        delta: dict[str, Any] = {"content": out.delta_text} if has else {}
                        finish: str | None = c.finish_reason if out.finished else None
                        if req.parses_tools:
                            text, done = calls[k].push(out.delta_text, final=out.finished)
                            delta = {"content": text} if text else {}
                            if done:
                                first = len(calls[k].calls) - len(done)
                                delta["tool_calls"] = [x.openai(first + i) for i, x in enumerate(done)]
                            if out.finished and calls[k].calls:
                                finish = "tool_calls"
                            if not delta and not out.finished:
                                continue
                        ch: dict[str, Any] = {
                            "index": k,
                            "delta": delta,
                            "logprobs": lp(out, sent[k]),
                            "finish_reason": finish,
                        }
                        if req.return_token_ids:
                            ch["token_ids"] = c.token_ids[sent[k] :]
                        sent[k] = len(c.token_ids)
                        yield chunk([ch])
                if req.include_usage:
                    yield chunk([], usage=_usage([last[0]], last.values()))
                yield "data: [DONE]\n\n"

            return _event_stream(events(), group, stall_s=stall_s)
        outs = await _collect(group, raw)
        choices: list[dict[str, Any]] = []
        for k, out in enumerate(outs):
            c = out.outputs[0]
            message: dict[str, Any] = {"role": "assistant", "content": c.text}
            finish: str | None = c.finish_reason
            if req.parses_tools:
                content, found = parse_tool_calls(c.text)
                if found:
                    message = {
                        "role": "assistant",
                        "content": content if content.strip() else None,
                        "tool_calls": [x.openai() for x in found],
                    }
                    finish = "tool_calls"
            ch: dict[str, Any] = {
                "index": k,
                "message": message,
                "logprobs": lp(out, 0),
                "finish_reason": finish,
                "stop_reason": c.stop_reason,
            }
            if req.return_token_ids:
                ch["token_ids"] = c.token_ids
            choices.append(ch)
        body = {
            "id": rid,
            "object": "chat.completion",
            "created": int(time.time()),
            "model": model_name,
            "choices": choices,
            "usage": _usage(outs[:1], outs),
        }
        if req.prompt_logprobs is not None:  # vLLM's place for them in chat: the response
            body["prompt_logprobs"] = _vllm_prompt_logprobs(outs[0], req.prompt_logprobs)
        return JSONResponse(body)

    return app


ERROR_RESPONSES: dict[int | str, dict[str, Any]] = {
    status: {"model": ErrorResponse, "description": what}
    for status, what in (
        (400, "invalid request (the message and `param` name the field)"),
        (401, "missing or wrong API key"),
        (404, "unknown model"),
        (413, "request body over --max-body-bytes"),
        (429, "waiting queue full"),
        (500, "the engine step failed"),
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


async def _json_body(raw: Request, limit: int, *, read_timeout_s: float = BODY_READ_TIMEOUT_S) -> Any:
    """The request's JSON, read in chunks: 413 once it passes `limit` bytes, 408 when a chunk takes longer
    than `read_timeout_s` to arrive."""
    too_big = APIError(413, f"the request body is larger than {limit} bytes", code="request_too_large")
    declared = raw.headers.get("content-length", "")
    if declared.isdigit() and int(declared) > limit:
        raise too_big
    chunks: list[bytes] = []
    size = 0
    stream = raw.stream().__aiter__()
    while True:
        try:
            chunk = await asyncio.wait_for(stream.__anext__(), timeout=read_timeout_s)
        except StopAsyncIteration:
            break
        except TimeoutError as e:
            raise APIError(
                408, f"the request body did not arrive within {read_timeout_s:g} s", code="request_timeout"
            ) from e
        size += len(chunk)
        if size > limit:
            raise too_big
        chunks.append(chunk)
    data = b"".join(chunks)
    try:
        body = json.loads(data)
        # a lone surrogate ("\\ud800") parses but is no text: it would fail later, deep in the engine
        json.dumps(body, ensure_ascii=False).encode("utf-8")
        return body
    except UnicodeEncodeError as e:
        raise APIError(400, f"the request body holds a string that is not valid Unicode: {e.reason}") from e
    except RecursionError as e:
        raise APIError(400, "the request body is nested too deeply") from e
    except ValueError as e:  # JSONDecodeError, UnicodeDecodeError, an integer beyond int_max_str_digits
        raise APIError(400, f"the request body is not valid JSON: {e}") from e


def _parse(model: type[_M], body: Any) -> _M:
    if not isinstance(body, dict):
        raise APIError(400, "the request body must be a JSON object")
    try:
        parsed = model.model_validate(body)
    except ValidationError as e:
        err = e.errors()[0]
        loc = ".".join(str(p) for p in err["loc"]) or None
        # OpenAI's `param` is the request field; the full location (union branch, index) is in the message
        param = str(err["loc"][0]) if err["loc"] else None
        raise APIError(400, f"{loc}: {err['msg']}", param=param) from e
    ignored = sorted(set(body) - set(model.model_fields))
    if ignored:
        # said, never silently dropped (as vLLM logs them)
        _log.warning("fields present in the request but ignored: %s", ", ".join(map(str, ignored)))
    return parsed


def _most(a: int | None, b: int | None) -> int | None:
    return b if a is None else a if b is None else max(a, b)


def _vllm_prompt_logprobs(out: RequestOutput, k: int) -> list[dict[str, dict[str, Any]] | None]:
    """vLLM's `prompt_logprobs`: None for the first prompt token, then per token {token id: {logprob, rank,
    decoded_token}}: the prompt's own token and the `k` most likely (ranks 1..k)."""
    assert out.prompt_logprobs is not None
    rows: list[dict[str, dict[str, Any]] | None] = []
    for tok, entries in zip(out.prompt_token_ids, out.prompt_logprobs, strict=True):
        if entries is None:
            rows.append(None)
            continue
        keep = {t: e for t, e in entries.items() if t == tok or (e.rank is not None and e.rank <= k)}
        rows.append({str(t): dataclasses.asdict(e) for t, e in keep.items()})
    return rows


def _samples(
    req: CompletionRequest | ChatCompletionRequest,
    count: int,
    *,
    max_tokens: int,
    logprobs: int | None,
    engine: AsyncEngine,
    prompt_logprobs: int | None = None,
) -> list[SamplingParams]:
    """The parameters of samples 0..count-1 (sample j seeded `derived_seed(seed, j)`), with the checkpoint's
    defaults for fields the request leaves out; 400 naming the field."""
    defaults = engine.engine.default_sampling
    try:
        return [
            req.sampling_params(
                max_tokens=max_tokens,
                logprobs=logprobs,
                seed=derived_seed(req.seed, j),
                defaults=defaults,
                prompt_logprobs=prompt_logprobs,
            )
            for j in range(count)
        ]
    except ValueError as e:
        first = str(e).split(" ", 1)[0]
        raise APIError(400, str(e), param=first if first in _SAMPLING_FIELDS else None) from e


def _usage(per_prompt: Iterable[RequestOutput], every: Iterable[RequestOutput]) -> dict[str, Any]:
    """Prompt tokens once per prompt (its samples share it), completion tokens of every sample, and the
    prompt tokens the prefix cache supplied."""
    prompts = list(per_prompt)
    p = sum(len(o.prompt_token_ids) for o in prompts)
    c = sum(len(o.outputs[0].token_ids) for o in every)
    cached = sum(o.num_cached_tokens for o in prompts)
    return {
        "prompt_tokens": p,
        "completion_tokens": c,
        "total_tokens": p + c,
        "prompt_tokens_details": {"cached_tokens": cached},
    }


def _version() -> str:
    """The installed hyspec-server version (the package metadata, one source with pyproject.toml)."""
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version("hyspec-server")
    except PackageNotFoundError:
        return "unknown"


def _sse(body: dict[str, Any]) -> str:
    return f"data: {json.dumps(body)}\n\n"


class _StalledClient(Exception):
    pass


class _GuardedStream(StreamingResponse):
    """An SSE response that gives up on a client that stopped reading: a chunk the connection does not take
    within `stall_s` (the socket's buffers are full) aborts the request, whose outputs would otherwise wait in
    memory for as long as the socket stays open."""

    def __init__(self, content: AsyncIterator[str], *, stall_s: float, on_stall: Callable[[], None]) -> None:
        super().__init__(content, media_type="text/event-stream")
        self._stall_s = stall_s
        self._on_stall = on_stall

    async def stream_response(self, send: Send) -> None:
        async def timed(message: Message) -> None:
            try:
                await asyncio.wait_for(send(message), self._stall_s)
            except TimeoutError:
                self._on_stall()
                raise _StalledClient from None

        try:
            await super().stream_response(timed)
        except _StalledClient:
            _log.warning("aborted a streamed request: its client took nothing for %.0f s", self._stall_s)
            closer = getattr(self.body_iterator, "aclose", None)
            if closer is not None:
                await closer()


def _event_stream(events: AsyncIterator[str], group: StreamGroup, *, stall_s: float) -> StreamingResponse:
    async def guarded() -> AsyncIterator[str]:
        try:
            async for e in events:
                yield e
        except APIError as e:
            yield _sse(e.body())
        except RuntimeError as e:
            yield _sse(APIError(500, str(e), type_="server_error").body())
        finally:
            # a disconnect cancels this generator; the aborts free the requests' memory
            group.abort()

    return _GuardedStream(guarded(), stall_s=stall_s, on_stall=group.abort)


async def _collect(group: StreamGroup, raw: Request) -> list[RequestOutput]:
    """The final outputs, aborting every request of the group if the client goes away while they run."""
    task = asyncio.ensure_future(group.finals())
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
        group.abort()


def _token_str(tok: Any, t: int, lp: Logprob | None = None) -> str:
    """Token `t` decoded on its own: the engine's `decoded_token` when the entry has one."""
    if lp is not None and lp.decoded_token is not None:
        return lp.decoded_token
    return str(tok.decode([t], skip_special_tokens=False))


def _by_logprob(d: dict[int, Logprob]) -> list[tuple[int, Logprob]]:
    return sorted(d.items(), key=lambda kv: -kv[1].logprob)


def _completion_logprobs(
    tok: Any, ids: Sequence[int], lps: Sequence[dict[int, Logprob] | None], offset: int
) -> tuple[dict[str, Any], int]:
    """OpenAI's completions `logprobs` for `ids`, whose text starts at `offset`; also the offset after them.

    `top_logprobs[i]` has the requested alternatives plus the chosen token (as vLLM reports it); tokens that
    decode to the same string keep the most likely one's logprob. A None entry (an echoed prompt's first
    token) is null in `token_logprobs` and `top_logprobs`.
    """
    tokens = [_token_str(tok, t, None if d is None else d.get(t)) for t, d in zip(ids, lps, strict=True)]
    offsets = []
    for s in tokens:
        offsets.append(offset)
        offset += len(s)
    tops: list[dict[str, float] | None] = []
    for d in lps:
        if d is None:
            tops.append(None)
            continue
        top: dict[str, float] = {}
        for k, v in _by_logprob(d):
            top.setdefault(_token_str(tok, k, v), v.logprob)
        tops.append(top)
    body = {
        "tokens": tokens,
        "token_logprobs": [None if d is None else d[t].logprob for t, d in zip(ids, lps, strict=True)],
        "top_logprobs": tops,
        "text_offset": offsets,
    }
    return body, offset


def _join_logprobs(first: dict[str, Any] | None, then: dict[str, Any]) -> dict[str, Any]:
    """Two completions `logprobs` bodies as one, `first`'s tokens before `then`'s."""
    if first is None:
        return then
    return {key: first[key] + then[key] for key in then}


def _chat_logprobs(
    tok: Any, ids: Sequence[int], lps: Sequence[dict[int, Logprob]], top_n: int
) -> list[dict[str, Any]]:
    """OpenAI's chat `logprobs.content`: each token with exactly `top_n` most likely alternatives.

    The engine's entry holds the top `top_n` plus the chosen token; when the chosen token is outside the top
    its logprob is below all of them, so the first `top_n` by logprob are the true top.
    """

    def entry(t: int, v: Logprob) -> dict[str, Any]:
        s = _token_str(tok, t, v)
        return {"token": s, "logprob": v.logprob, "bytes": list(s.encode("utf-8"))}

    out = []
    for t, d in zip(ids, lps, strict=True):
        e = entry(t, d[t])
        e["top_logprobs"] = [entry(k, v) for k, v in _by_logprob(d)[:top_n]]
        out.append(e)
    return out
