"""The HTTP server's formatting and plumbing: reading and parsing request bodies, OpenAI's logprobs and usage
bodies, server-sent events and the guarded streaming and non-streaming reads of a `StreamGroup`."""

from __future__ import annotations

import asyncio
import dataclasses
import json
import logging
from collections.abc import AsyncIterator, Callable, Iterable, Sequence
from typing import Any, TypeVar

from fastapi import Request
from fastapi.responses import StreamingResponse
from pydantic import BaseModel, ValidationError
from starlette.requests import ClientDisconnect
from starlette.types import Message, Send

from hyspec_server.async_engine import StreamGroup
from hyspec_server.outputs import Logprob, RequestOutput
from hyspec_server.protocol import APIError
from hyspec_server.request import DeadEndError

_log = logging.getLogger("hyspec.api")

_M = TypeVar("_M", bound=BaseModel)
_DISCONNECT_POLL_S = 0.05


# the whole body must arrive within this many read timeouts: a client dribbling a byte now and then (each
# within the per-chunk timeout) would otherwise hold its connection for ever
BODY_DEADLINE_READS = 4


async def json_body(raw: Request, limit: int, *, read_timeout_s: float) -> Any:
    """The request's JSON, read in chunks: 413 once it passes `limit` bytes, 408 when a chunk takes longer
    than `read_timeout_s` to arrive or the whole body longer than `BODY_DEADLINE_READS` times that."""
    too_big = APIError(413, f"the request body is larger than {limit} bytes", code="request_too_large")
    declared = raw.headers.get("content-length", "")
    if declared.isdigit() and int(declared) > limit:
        raise too_big
    chunks: list[bytes] = []
    size = 0
    stream = raw.stream().__aiter__()
    loop = asyncio.get_running_loop()
    deadline = loop.time() + BODY_DEADLINE_READS * read_timeout_s
    while True:
        left = deadline - loop.time()
        try:
            if left <= 0:
                raise TimeoutError
            chunk = await asyncio.wait_for(stream.__anext__(), timeout=min(read_timeout_s, left))
        except StopAsyncIteration:
            break
        except ClientDisconnect as e:  # gone while sending its body: answered (to no one) without a traceback
            raise APIError(400, "the client disconnected before its request body arrived") from e
        except TimeoutError as e:
            raise APIError(
                408,
                f"the request body did not arrive in time ({read_timeout_s:g} s per part, "
                f"{BODY_DEADLINE_READS * read_timeout_s:g} s in all)",
                code="request_timeout",
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


def parse(model: type[_M], body: Any) -> _M:
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


def vllm_prompt_logprobs(out: RequestOutput, k: int) -> list[dict[str, dict[str, Any]] | None]:
    """vLLM's `prompt_logprobs`: None for the first prompt token, then per token {token id: {logprob, rank,
    decoded_token}}: the prompt's own token and the `k` most likely (ranks 1..k)."""
    assert out.prompt_logprobs is not None
    rows: list[dict[str, dict[str, Any]] | None] = []
    for tok, entries in zip(out.prompt_token_ids, out.prompt_logprobs, strict=True):
        if entries is None:
            rows.append(None)
            continue
        keep = {t: e for t, e in entries.items() if t == tok or (e.rank is not None and e.rank <= k)}
        rows.append(
            {str(t): {**dataclasses.asdict(e), "logprob": json_logprob(e.logprob)} for t, e in keep.items()}
        )
    return rows


def usage(
    per_prompt: Iterable[RequestOutput], every: Iterable[RequestOutput], *, generated: bool = True
) -> dict[str, Any]:
    """Prompt tokens once per prompt (its samples share it), completion tokens of every sample (none
    returned: `generated` False, echo without generation), and the prompt tokens the prefix cache
    supplied."""
    prompts = list(per_prompt)
    p = sum(len(o.prompt_token_ids) for o in prompts)
    c = sum(len(o.outputs[0].token_ids) for o in every) if generated else 0
    cached = sum(o.num_cached_tokens for o in prompts)
    return {
        "prompt_tokens": p,
        "completion_tokens": c,
        "total_tokens": p + c,
        "prompt_tokens_details": {"cached_tokens": cached},
    }


def chunk_usage(
    include: bool, continuous: bool, prompt_tokens: int, completion_tokens: int
) -> dict[str, Any]:
    """A streamed chunk's `usage` field: none without include_usage, null with it, and with vLLM's
    continuous_usage_stats the chunk's choice's usage so far (its prompt, the tokens it has sent)."""
    if not include:
        return {}
    if not continuous:
        return {"usage": None}
    total = prompt_tokens + completion_tokens
    return {
        "usage": {
            "prompt_tokens": prompt_tokens,
            "completion_tokens": completion_tokens,
            "total_tokens": total,
        }
    }


def sse(body: dict[str, Any]) -> str:
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


DONE = "data: [DONE]\n\n"  # the last event of every stream, a failed one too (as vLLM)


def event_stream(events: AsyncIterator[str], group: StreamGroup, *, stall_s: float) -> StreamingResponse:
    async def guarded() -> AsyncIterator[str]:
        try:
            async for e in events:
                yield e
        except APIError as e:
            yield sse(e.body()) + DONE
        except DeadEndError as e:
            yield sse(APIError(400, str(e), param=e.param).body()) + DONE
        except RuntimeError as e:
            yield sse(APIError(500, str(e), type_="server_error").body()) + DONE
        finally:
            # a disconnect cancels this generator; the aborts free the requests' memory
            group.abort()

    return _GuardedStream(guarded(), stall_s=stall_s, on_stall=group.abort)


async def collect(group: StreamGroup, raw: Request) -> list[RequestOutput]:
    """The final outputs, aborting every request of the group if the client goes away while they run."""
    task = asyncio.ensure_future(group.finals())
    try:
        while True:
            done, _ = await asyncio.wait({task}, timeout=_DISCONNECT_POLL_S)
            if done:
                try:
                    return task.result()
                except DeadEndError as e:
                    raise APIError(400, str(e), param=e.param) from e
                except RuntimeError as e:
                    raise APIError(500, str(e), type_="server_error") from e
            if await raw.is_disconnected():
                raise APIError(499, "client disconnected", type_="client_closed_request")
    finally:
        if not task.done():
            task.cancel()
        group.abort()


def _token_str(tok: Any, t: int, lp: Logprob | None = None, *, as_id: bool = False) -> str:
    """Token `t` decoded on its own: the engine's `decoded_token` when the entry has one; "token_id:<t>"
    with `as_id` (vLLM's `return_tokens_as_token_ids`)."""
    if as_id:
        return f"token_id:{t}"
    if lp is not None and lp.decoded_token is not None:
        return lp.decoded_token
    return str(tok.decode([t], skip_special_tokens=False))


# JSON has no -inf: a token a structured output's mask forbids has logprob -inf; vLLM's server reports it
# as this floor, and so does this one
LOGPROB_FLOOR = -9999.0


def json_logprob(v: float) -> float:
    return v if v >= LOGPROB_FLOOR else LOGPROB_FLOOR  # NaN too (v >= x is False)


def _by_logprob(d: dict[int, Logprob]) -> list[tuple[int, Logprob]]:
    return sorted(d.items(), key=lambda kv: -kv[1].logprob)


def completion_logprobs(
    tok: Any,
    ids: Sequence[int],
    lps: Sequence[dict[int, Logprob] | None],
    offset: int,
    *,
    as_ids: bool = False,
) -> tuple[dict[str, Any], int]:
    """OpenAI's completions `logprobs` for `ids`, whose text starts at `offset`; also the offset after them.

    `top_logprobs[i]` has the requested alternatives plus the chosen token (as vLLM reports it); tokens that
    decode to the same string keep the most likely one's logprob. A None entry (an echoed prompt's first
    token) is null in `token_logprobs` and `top_logprobs`. `as_ids`: tokens named "token_id:<id>" (the
    offsets then advance by those names, as vLLM's).
    """
    tokens = [
        _token_str(tok, t, None if d is None else d.get(t), as_id=as_ids)
        for t, d in zip(ids, lps, strict=True)
    ]
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
            top.setdefault(_token_str(tok, k, v, as_id=as_ids), json_logprob(v.logprob))
        tops.append(top)
    body = {
        "tokens": tokens,
        "token_logprobs": [
            None if d is None else json_logprob(d[t].logprob) for t, d in zip(ids, lps, strict=True)
        ],
        "top_logprobs": tops,
        "text_offset": offsets,
    }
    return body, offset


def join_logprobs(first: dict[str, Any] | None, then: dict[str, Any]) -> dict[str, Any]:
    """Two completions `logprobs` bodies as one, `first`'s tokens before `then`'s."""
    if first is None:
        return then
    return {key: first[key] + then[key] for key in then}


def chat_logprobs(
    tok: Any, ids: Sequence[int], lps: Sequence[dict[int, Logprob]], top_n: int, *, as_ids: bool = False
) -> list[dict[str, Any]]:
    """OpenAI's chat `logprobs.content`: each token with exactly `top_n` most likely alternatives; `as_ids`:
    tokens named "token_id:<id>" (and their bytes those of the name, as vLLM's).

    The engine's entry holds the top `top_n` plus the chosen token; when the chosen token is outside the top
    its logprob is below all of them, so the first `top_n` by logprob are the true top.
    """

    def entry(t: int, v: Logprob) -> dict[str, Any]:
        s = _token_str(tok, t, v, as_id=as_ids)
        return {"token": s, "logprob": json_logprob(v.logprob), "bytes": list(s.encode("utf-8"))}

    out = []
    for t, d in zip(ids, lps, strict=True):
        e = entry(t, d[t])
        e["top_logprobs"] = [entry(k, v) for k, v in _by_logprob(d)[:top_n]]
        out.append(e)
    return out
