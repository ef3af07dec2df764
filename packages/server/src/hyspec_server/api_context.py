"""What the HTTP server's handlers share: the `ServerContext` that `build_app` stores on `app.state.ctx`."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from fastapi import Request

from hyspec_server.async_engine import AsyncEngine
from hyspec_server.metrics import EngineMetrics
from hyspec_server.protocol import APIError


@dataclass(frozen=True)
class ServerContext:
    """The server's engine and settings, built once by `build_app`; a handler reads it with `server_context`.

    Args:
    created: the models' `created` time (the server's start).
    max_model_len: the engine's context length.
    body_limit: request bodies larger than this get 413.
    read_timeout_s: 408 when no part of a request body arrives for this long, or the whole body not within
        `api_format.BODY_DEADLINE_READS` times it.
    stall_s: abort a streamed request whose client takes no chunk for this long.
    chat_template: the Jinja chat template of every chat request (None: the tokenizer's).
    trust_request_chat_template: accept a request's own `chat_template`.
    """

    engine: AsyncEngine
    model_name: str
    created: int
    max_model_len: int
    body_limit: int
    read_timeout_s: float
    stall_s: float
    chat_template: str | None
    trust_request_chat_template: bool

    @property
    def tokenizer(self) -> Any:
        return self.engine.tokenizer

    @property
    def metrics(self) -> EngineMetrics:
        return self.engine.metrics

    def card(self) -> dict[str, Any]:
        """The served model, as /v1/models lists it."""
        return {
            "id": self.model_name,
            "object": "model",
            "created": self.created,
            "owned_by": "hyspec",
            "max_model_len": self.max_model_len,
        }

    def check_model(self, name: object) -> None:
        """404 unless `name` (a request's `model`) is None or the served model; 400 when it is no string."""
        if name is not None and not isinstance(name, str):
            raise APIError(400, f"model: expected a string, got {type(name).__name__}", param="model")
        if name is not None and name != self.model_name:
            raise APIError(
                404,
                f"the model {name!r} does not exist; this server serves {self.model_name!r}",
                type_="not_found_error",
                param="model",
                code="model_not_found",
            )


def server_context(raw: Request) -> ServerContext:
    """The context of the app that `raw` arrived at."""
    ctx = raw.app.state.ctx
    assert isinstance(ctx, ServerContext)
    return ctx
