"""The generation routes, /v1/completions and /v1/chat/completions, and what turns their requests into
engine requests (`SamplingParams`, constraints, the all-or-nothing submission of a `StreamGroup`)."""

from __future__ import annotations

import asyncio
import dataclasses
import time
import uuid
from collections.abc import AsyncIterator, Sequence
from typing import Any

from fastapi import Request
from fastapi.responses import JSONResponse, Response

from hyspec_server.api_context import ServerContext, server_context
from hyspec_server.api_format import (
    DONE,
    chat_logprobs,
    chunk_usage,
    collect,
    completion_logprobs,
    event_stream,
    join_logprobs,
    json_body,
    parse,
    sse,
    usage,
    vllm_prompt_logprobs,
)
from hyspec_server.async_engine import AddError, AsyncEngine, StreamGroup
from hyspec_server.engine import TokensPrompt
from hyspec_server.outputs import RequestOutput
from hyspec_server.protocol import (
    MAX_LOGPROBS,
    MAX_N,
    APIError,
    ChatCompletionRequest,
    ChatPromptFields,
    CompletionRequest,
    derived_seed,
)
from hyspec_server.sampling_params import SamplingParams, StructuredOutputsParams
from hyspec_server.scheduler import QueueFullError
from hyspec_server.tokenizer import ChatOptions
from hyspec_server.tool_calls import ToolCallStream, parse_tool_calls, required_grammar, template_message

_SAMPLING_FIELDS = set(SamplingParams.__dataclass_fields__)


def _field_named(message: str) -> str | None:
    """The sampling field a ValueError's message names first ("stop: ...", "max_tokens must ..."), if any."""
    first = message.split(" ", 1)[0].rstrip(":")
    return first if first in _SAMPLING_FIELDS else None


async def completions(raw: Request) -> Response:
    ctx = server_context(raw)
    req = parse(CompletionRequest, await json_body(raw, ctx.body_limit, read_timeout_s=ctx.read_timeout_s))
    ctx.check_model(req.model)
    req.check_common()
    if req.suffix:
        raise APIError(400, "suffix is not supported", param="suffix")
    prompts = req.prompts()
    _check_token_ids(ctx, prompts)
    n = req.num_choices
    best_of = n if req.best_of is None else req.best_of
    if not n <= best_of <= MAX_N:
        raise APIError(400, f"best_of must be an int in [n={n}, {MAX_N}], got {best_of}", param="best_of")
    if best_of > n and req.stream:
        raise APIError(400, "best_of > n cannot be streamed", param="best_of")
    if req.echo and req.truncate_prompt_tokens is not None:
        # the echo would show the prompt as sent, the logprobs and the output its truncated tokens
        raise APIError(400, "echo cannot be combined with truncate_prompt_tokens", param="echo")
    if req.logprobs is not None and not 0 <= req.logprobs <= MAX_LOGPROBS:
        raise APIError(400, f"logprobs must be an int in [0, {MAX_LOGPROBS}]", param="logprobs")
    echo = bool(req.echo)
    # echo with logprobs: the prompt's tokens lead the logprobs too (OpenAI's), so every sample scores
    # its prompt (prompt logprobs)
    echo_lp = echo and req.logprobs is not None
    # best_of ranks its samples by cumulative logprob, which needs the chosen tokens' logprobs
    engine_lp = req.logprobs if best_of == n else (req.logprobs or 0)
    # vLLM's echo without generation: echo with max_tokens 0 returns the prompt alone (with its logprobs:
    # how evaluation harnesses score a text); one token is generated and dropped
    prompt_only = echo and req.max_tokens == 0
    # vLLM's: an explicit null is the room each prompt leaves in the context (left out: 16); None here,
    # resolved per prompt below (`_to_the_context_end`), so min_tokens is checked against that room
    to_the_end = req.max_tokens is None and "max_tokens" in req.model_fields_set
    max_tokens: int | None = (
        1 if prompt_only else None if to_the_end else 16 if req.max_tokens is None else req.max_tokens
    )
    samples = _samples(
        req,
        best_of,
        max_tokens=max_tokens,
        logprobs=engine_lp,
        engine=ctx.engine,
        # echo's prompt logprobs and vLLM's prompt_logprobs field share one scoring of the prompt
        prompt_logprobs=_most(req.logprobs if echo_lp else None, req.prompt_logprobs),
    )
    await _compile_constraint(ctx, req, samples[0])
    rid = f"cmpl-{uuid.uuid4().hex}"
    # text prompts are tokenized here, on a worker thread: on the engine thread a long one would stall
    # every running stream
    ready: list[TokensPrompt] = [
        TokensPrompt(
            p,
            await asyncio.to_thread(ctx.tokenizer.encode, p, add_special_tokens=req.add_special_tokens),
            req.cache_salt,
        )
        if isinstance(p, str)
        else TokensPrompt(None, p, req.cache_salt)
        for p in prompts
    ]
    per_prompt = [samples] * len(ready)
    if to_the_end:
        per_prompt = [_to_the_context_end(ctx, samples, p, i, len(ready)) for i, p in enumerate(ready)]
    items = [(p, per_prompt[i][j], f"{rid}-{i}-{j}") for i, p in enumerate(ready) for j in range(best_of)]
    group = await _submit(ctx, items, per_prompt=best_of, batch=len(prompts) > 1)
    tok = ctx.tokenizer
    skip = req.skip_special_tokens
    echoed = [
        (p if isinstance(p, str) else tok.decode(p, skip_special_tokens=skip)) if echo else ""
        for p in prompts
    ]

    def choice(
        index: int, out: RequestOutput, text: str, start: int, offset: int, *, prompt: bool = False
    ) -> tuple[dict[str, Any], int]:
        """The choice for tokens [start:] of `out`; also the text offset after them. `prompt`: the
        logprobs start with the prompt's (echo), at text offsets from 0. Echo without generation: no
        generated token, finished by its length (0)."""
        c = out.outputs[0]
        if prompt_only:
            start = len(c.token_ids)
        ch: dict[str, Any] = {
            "index": index,
            "text": text,
            "logprobs": None,
            "finish_reason": ("length" if prompt_only else c.finish_reason) if out.finished else None,
            "stop_reason": None if prompt_only else c.stop_reason if out.finished else None,
        }
        if req.logprobs is not None and c.logprobs is not None:
            ch["logprobs"], offset = completion_logprobs(
                tok, c.token_ids[start:], c.logprobs[start:], offset, as_ids=req.return_tokens_as_token_ids
            )
            if prompt:
                ch["logprobs"] = join_logprobs(echo_logprobs(out), ch["logprobs"])
        if req.return_token_ids:
            ch["token_ids"] = c.token_ids[start:]
        return ch, offset

    def after_echo(i: int, out: RequestOutput) -> int:
        """The text offset of prompt i's first generated token: after its echoed text, or after its tokens'
        names when they are logprobs' tokens (`return_tokens_as_token_ids`: offsets count on, as vLLM's)."""
        if echo_lp and req.return_tokens_as_token_ids:
            return sum(len(f"token_id:{t}") for t in out.prompt_token_ids)
        return len(echoed[i])

    def echo_logprobs(out: RequestOutput) -> dict[str, Any] | None:
        """The echoed prompt's completions logprobs (its first token has none: null, as OpenAI's)."""
        if out.prompt_logprobs is None:
            return None
        # the engine scored the prompt with max(logprobs, prompt_logprobs) alternatives: echo's are
        # `logprobs`' count (plus the prompt's own token), as the generated tokens'
        k = req.logprobs or 0
        lps = [
            None
            if d is None
            else {t: e for t, e in d.items() if t == own or (e.rank is not None and e.rank <= k)}
            for own, d in zip(out.prompt_token_ids, out.prompt_logprobs, strict=True)
        ]
        return completion_logprobs(tok, out.prompt_token_ids, lps, 0, as_ids=req.return_tokens_as_token_ids)[
            0
        ]

    def body(choices: list[dict[str, Any]], **extra: Any) -> dict[str, Any]:
        return {
            "id": rid,
            "object": "text_completion",
            "created": int(time.time()),
            "model": ctx.model_name,
            "choices": choices,
            **extra,
        }

    if req.stream:
        # best_of == n here: item k is choice k

        def live(prompt_tokens: int, sent_tokens: int) -> dict[str, Any]:
            """A chunk's usage field (`chunk_usage`): its choice's prompt and the tokens it has sent."""
            return chunk_usage(req.include_usage, req.continuous_usage, prompt_tokens, sent_tokens)

        async def events() -> AsyncIterator[str]:
            sent = [0] * len(items)
            offsets = [len(echoed[k // n]) for k in range(len(items))]
            last: dict[int, RequestOutput] = {}
            if echo and not echo_lp:
                for k in range(len(items)):
                    ch = {"index": k, "text": echoed[k // n], "logprobs": None, "finish_reason": None}
                    # echo refuses truncate_prompt_tokens: the prompt as sent is the one run
                    yield sse(body([ch], **live(len(ready[k // n].token_ids), 0)))
            async for k, out in group.outputs():
                if echo_lp and k not in last:
                    # prompt logprobs exist once it is prefilled: the echo waits for the first output
                    offsets[k] = after_echo(k // n, out)
                    ch = {
                        "index": k,
                        "text": echoed[k // n],
                        "logprobs": echo_logprobs(out),
                        "finish_reason": None,
                    }
                    # the echo carries no generated token
                    yield sse(body([ch], **live(len(out.prompt_token_ids), 0)))
                last[k] = out
                # a chunk for every step that made tokens, text or not (as vLLM): a token that is
                # part of a character still arrives, and clients time it
                if prompt_only and out.finished:
                    yield sse(
                        body([choice(k, out, "", 0, offsets[k])[0]], **live(len(out.prompt_token_ids), 0))
                    )
                elif not prompt_only and (out.delta_token_ids or out.delta_text or out.finished):
                    ch, offsets[k] = choice(k, out, out.delta_text, sent[k], offsets[k])
                    sent[k] = len(out.outputs[0].token_ids)
                    yield sse(body([ch], **live(len(out.prompt_token_ids), sent[k])))
            if req.include_usage:
                counts = usage(
                    [last[k] for k in range(0, len(items), n)], last.values(), generated=not prompt_only
                )
                yield sse(body([], usage=counts))
            yield DONE

        return event_stream(events(), group, stall_s=ctx.stall_s)
    outs = await collect(group, raw)
    choices: list[dict[str, Any]] = []
    for i in range(len(prompts)):
        mine = outs[i * best_of : (i + 1) * best_of]
        if best_of > n:
            mine = sorted(mine, key=lambda o: -(o.outputs[0].cumulative_logprob or 0.0))[:n]
        for j, out in enumerate(mine):
            text = echoed[i] + ("" if prompt_only else out.outputs[0].text)
            ch = choice(i * n + j, out, text, 0, after_echo(i, out), prompt=echo_lp)[0]
            if req.prompt_logprobs is not None:
                ch["prompt_logprobs"] = vllm_prompt_logprobs(out, req.prompt_logprobs)
            choices.append(ch)
    # every generated token counts, best_of's discarded samples too (as OpenAI bills them)
    return JSONResponse(body(choices, usage=usage(outs[::best_of], outs, generated=not prompt_only)))


async def chat(raw: Request) -> Response:
    ctx = server_context(raw)
    req = parse(
        ChatCompletionRequest, await json_body(raw, ctx.body_limit, read_timeout_s=ctx.read_timeout_s)
    )
    ctx.check_model(req.model)
    req.check_common()
    prompt_ids, forced = await render_chat_prompt(ctx, req)
    req.check_forced(forced)
    tok = ctx.tokenizer
    max_tokens = req.max_completion_tokens if req.max_completion_tokens is not None else req.max_tokens
    if max_tokens is None:
        try:  # the room left by the prompt as the request runs it
            ran = SamplingParams(truncate_prompt_tokens=req.truncate_prompt_tokens).truncate(
                prompt_ids, ctx.max_model_len
            )
        except ValueError as e:
            raise APIError(400, str(e), param="truncate_prompt_tokens") from e
        max_tokens = ctx.max_model_len - len(ran)
        if max_tokens < 1:
            raise APIError(
                400,
                f"the prompt ({len(prompt_ids)} tokens) fills the context max_model_len={ctx.max_model_len}",
                param="messages",
            )
    if req.top_logprobs is not None:
        if not req.logprobs:
            raise APIError(400, "top_logprobs needs logprobs=true", param="top_logprobs")
        if not 0 <= req.top_logprobs <= MAX_LOGPROBS:
            raise APIError(400, f"top_logprobs must be an int in [0, {MAX_LOGPROBS}]", param="top_logprobs")
    top_n = req.top_logprobs or 0
    logprobs = top_n if req.logprobs else None
    n = req.num_choices
    lp_prompt = req.prompt_logprobs
    # the budget's field as the client sent it: the OpenAI SDK sends max_completion_tokens, and a 400 about
    # the budget names that field, not max_tokens
    budget = "max_tokens" if req.max_completion_tokens is None else "max_completion_tokens"
    try:
        samples = _samples(
            req, n, max_tokens=max_tokens, logprobs=logprobs, engine=ctx.engine, prompt_logprobs=lp_prompt
        )
    except APIError as e:
        raise _budget_named(e, budget) from e
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
    await _compile_constraint(ctx, req, samples[0])
    rid = f"chatcmpl-{uuid.uuid4().hex}"
    prompt = TokensPrompt(None, prompt_ids, req.cache_salt)
    try:
        group = await _submit(
            ctx,
            [(prompt, samples[j], f"{rid}-{j}") for j in range(n)],
            per_prompt=n,
            batch=False,
            prompt_param="messages",
        )
    except APIError as e:
        raise _budget_named(e, budget) from e

    def lp(out: RequestOutput, start: int) -> dict[str, Any] | None:
        c = out.outputs[0]
        if c.logprobs is None:
            return None
        as_ids = req.return_tokens_as_token_ids
        return {"content": chat_logprobs(tok, c.token_ids[start:], c.logprobs[start:], top_n, as_ids=as_ids)}

    role, echoed = req.reply_role, req.echoed_text()
    if req.stream:
        base: dict[str, Any] = {"id": rid, "object": "chat.completion.chunk", "model": ctx.model_name}
        # the prompt as the requests run it (truncate_prompt_tokens), for chunks before their first output
        num_prompt = len(samples[0].truncate(prompt_ids, ctx.max_model_len))

        def chunk(choices: list[dict[str, Any]], sent_tokens: int = 0, **extra: Any) -> str:
            """A chunk of `choices` (one, whose choice has sent `sent_tokens` tokens, or none with `extra`'s
            usage); its usage field is `chunk_usage`'s."""
            live = chunk_usage(req.include_usage, req.continuous_usage, num_prompt, sent_tokens)
            return sse({**base, "created": int(time.time()), "choices": choices, **live, **extra})

        no_stop = {"stop_reason": None}  # every chunk has vLLM's fields; the last one names its stop

        async def events() -> AsyncIterator[str]:
            for k in range(n):
                hello = {"role": role, "content": ""}
                yield chunk(
                    [{"index": k, "delta": hello, "logprobs": None, "finish_reason": None, **no_stop}]
                )
            if echoed:
                for k in range(n):
                    echo = {"content": echoed}
                    yield chunk(
                        [{"index": k, "delta": echo, "logprobs": None, "finish_reason": None, **no_stop}]
                    )
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
                            finish = calls_finish_reason(c.finish_reason)
                        if not delta and not out.finished:
                            continue
                    ch: dict[str, Any] = {
                        "index": k,
                        "delta": delta,
                        "logprobs": lp(out, sent[k]),
                        "finish_reason": finish,
                        # as vLLM's chunks: the stop string or token id that ended the choice, on its last one
                        "stop_reason": c.stop_reason if out.finished else None,
                    }
                    if req.return_token_ids:
                        ch["token_ids"] = c.token_ids[sent[k] :]
                    sent[k] = len(c.token_ids)
                    yield chunk([ch], sent[k])
            if req.include_usage:
                yield chunk([], usage=usage([last[0]], last.values()))
            yield DONE

        return event_stream(events(), group, stall_s=ctx.stall_s)
    outs = await collect(group, raw)
    choices: list[dict[str, Any]] = []
    for k, out in enumerate(outs):
        c = out.outputs[0]
        message: dict[str, Any] = {"role": role, "content": echoed + c.text}
        finish: str | None = c.finish_reason
        if req.parses_tools:
            content, found = parse_tool_calls(c.text)
            if found:
                content = echoed + content
                message = {
                    "role": role,
                    "content": content if content.strip() else None,
                    "tool_calls": [x.openai() for x in found],
                }
                finish = calls_finish_reason(finish)
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
        "model": ctx.model_name,
        "choices": choices,
        "usage": usage(outs[:1], outs),
    }
    if req.prompt_logprobs is not None:  # vLLM's place for them in chat: the response
        body["prompt_logprobs"] = vllm_prompt_logprobs(outs[0], req.prompt_logprobs)
    return JSONResponse(body)


def _budget_named(e: APIError, field: str) -> APIError:
    """`e` with `field` for max_tokens where it names max_tokens (the samples' and the engine's name for a
    chat's budget, which may have come as max_completion_tokens); `e` itself otherwise."""
    if e.param != "max_tokens" or field == "max_tokens":
        return e
    return APIError(e.status, e.message.replace("max_tokens", field), type_=e.type, param=field, code=e.code)


def calls_finish_reason(engine_reason: str | None) -> str | None:
    """The finish reason of a reply holding tool calls, streamed or whole: "tool_calls", except that a reply
    cut off by max_tokens stays "length" (its last call may be half written)."""
    return engine_reason if engine_reason == "length" else "tool_calls"


async def render_chat_prompt(ctx: ServerContext, req: ChatPromptFields) -> tuple[list[int], list[str]]:
    """The prompt token ids of a request's conversation, through the chat template (the server's, or the
    request's own when the server trusts those) with its tools and template options, and the function names
    a grammar must force (`ChatPromptFields.check_tools`). The one renderer of /v1/chat/completions and
    /tokenize; an input it cannot render is a 400 naming the field. Renders on a worker thread: a long
    conversation never holds the event loop."""
    forced = req.check_tools()
    try:
        messages = [template_message(m.role, m.text(), m) for m in req.messages]
    except ValueError as e:
        raise APIError(400, str(e), param="messages") from e
    tools = req.tools if req.parses_tools else None
    if req.chat_template is not None and not ctx.trust_request_chat_template:
        raise APIError(
            400,
            "chat_template in a request is refused: start the server with --chat-template, or with "
            "--trust-request-chat-template to allow request templates (as vLLM)",
            param="chat_template",
        )
    try:
        options = ChatOptions(
            req.add_generation_prompt,
            req.continue_final_message,
            req.chat_template_kwargs,
            req.chat_template or ctx.chat_template,
        )
        prompt_ids: list[int] = await asyncio.to_thread(
            ctx.tokenizer.apply_chat_template, messages, tools=tools, options=options
        )
    except ValueError as e:
        field = "chat_template_kwargs" if str(e).startswith("chat_template_kwargs") else "messages"
        if req.chat_template is not None and str(e).startswith(("the chat template", "chat_template")):
            field = "chat_template"  # the request's own template failed, not its messages
        raise APIError(400, str(e), param=field) from e
    return prompt_ids, forced


async def _submit(
    ctx: ServerContext,
    items: Sequence[tuple[str | list[int] | TokensPrompt, SamplingParams, str]],
    *,
    per_prompt: int,
    batch: bool,
    prompt_param: str = "prompt",
) -> StreamGroup:
    """Queues every (prompt, sample) request or none of them; an error of the prompt names
    `prompt_param` (a chat's rendered prompt is its messages)."""
    bound = ctx.engine.engine.scheduler.config.max_waiting
    if len(items) > bound:
        # they all wait before the next step, so the bounded queue can never take them
        raise APIError(
            400,
            f"this call needs {len(items)} engine requests (prompts x samples), over the server's queue "
            f"bound {bound}",
            param="n" if per_prompt > 1 else "prompt",
        )
    try:
        return await ctx.engine.add_many(items)
    except AddError as e:
        if isinstance(e.cause, QueueFullError):
            raise APIError(429, str(e.cause), type_="rate_limit_error", code="queue_full") from e
        if isinstance(e.cause, ValueError):
            msg = str(e.cause)
            param = _field_named(msg) or ("max_tokens" if "max_tokens" in msg else prompt_param)
            if batch:
                msg = f"prompt[{e.index // per_prompt}]: {msg}"
            raise APIError(400, msg, param=param) from e
        raise


async def _compile_constraint(
    ctx: ServerContext, req: CompletionRequest | ChatCompletionRequest, params: SamplingParams
) -> None:
    """Compiles the request's constraint on a worker thread (a large schema would stall every stream on
    the engine thread; the engine then finds it in the compiler's cache); 400 when it does not compile."""
    so = params.structured_outputs
    if so is None:
        return
    try:
        await asyncio.to_thread(ctx.engine.engine.grammars.compile, so)
    except ValueError as e:
        param = "structured_outputs" if req.structured_outputs is not None else "response_format"
        guided = req.guided()
        if guided:
            param = f"guided_{next(iter(guided))}"
        if (
            isinstance(req, ChatCompletionRequest)
            and req.tools
            and req.tool_choice not in (None, "auto", "none")
        ):
            param = "tools"
        raise APIError(400, str(e), param=param) from e


def _check_token_ids(ctx: ServerContext, prompts: list[str | list[int]]) -> None:
    vocab = getattr(ctx.tokenizer, "vocab_size", None)
    for i, p in enumerate(prompts):
        if isinstance(p, list) and any(t < 0 or (vocab is not None and t >= vocab) for t in p):
            where = f"prompt[{i}]" if len(prompts) > 1 else "prompt"
            bound = "an int >= 0" if vocab is None else f"in [0, {vocab}) for this model"
            raise APIError(400, f"{where}: token ids must be {bound}", param="prompt")


def _to_the_context_end(
    ctx: ServerContext, samples: list[SamplingParams], prompt: TokensPrompt, index: int, num_prompts: int
) -> list[SamplingParams]:
    """`samples` with max_tokens the room `prompt` (a TokensPrompt, prompt `index` of the call) leaves in
    the context as it runs (truncated as they ask); 400 when it leaves none, or less than min_tokens."""
    ran = samples[0].truncate(prompt.token_ids, ctx.max_model_len)
    room = ctx.max_model_len - len(ran)
    if room < 1:
        where = "prompt" if num_prompts == 1 else "a prompt"
        raise APIError(
            400,
            f"{where} ({len(prompt.token_ids)} tokens) fills the context max_model_len={ctx.max_model_len}",
            param="prompt",
        )
    try:
        return [dataclasses.replace(s, max_tokens=room) for s in samples]
    except ValueError as e:  # min_tokens over the room left
        msg = str(e) if num_prompts == 1 else f"prompt[{index}]: {e}"
        raise APIError(400, msg, param=_field_named(str(e))) from e


def _samples(
    req: CompletionRequest | ChatCompletionRequest,
    count: int,
    *,
    max_tokens: int | None,
    logprobs: int | None,
    engine: AsyncEngine,
    prompt_logprobs: int | None = None,
) -> list[SamplingParams]:
    """The parameters of samples 0..count-1 (sample j seeded `derived_seed(seed, j)`), with the checkpoint's
    defaults for fields the request leaves out; 400 naming the field."""
    defaults = engine.engine.default_sampling
    try:
        samples = [
            req.sampling_params(
                max_tokens=max_tokens,
                logprobs=logprobs,
                seed=derived_seed(req.seed, j),
                defaults=defaults,
                prompt_logprobs=prompt_logprobs,
            )
            for j in range(count)
        ]
        # the engine checks it again when it takes each request; here the 400 names the field, before
        # anything is queued (the samples differ only in their seeds)
        samples[0].check_vocab(engine.engine.runner.vocab_size)
        return samples
    except ValueError as e:
        raise APIError(400, str(e), param=_field_named(str(e))) from e


def _most(a: int | None, b: int | None) -> int | None:
    return b if a is None else a if b is None else max(a, b)
