"""Request fields whose combinations the server once got wrong: a JSON schema's property order, explicit
`max_tokens: null` with `min_tokens`, and a forced tool call beside a `guided_*` constraint."""

from __future__ import annotations

import json
from typing import Any

import httpx
import pytest
from hyspec_server import StructuredOutputsParams
from hyspec_server.serve import ServerThread

AUTH = {"Authorization": "Bearer test-key"}

# properties listed out of alphabetical order: the output must keep this order (OpenAI's and vLLM's), the
# model writes "zeta" (say, a reasoning field) before "alpha" (the answer)
ORDERED_SCHEMA: dict[str, Any] = {
    "type": "object",
    "properties": {"zeta": {"type": "integer", "enum": [1]}, "alpha": {"type": "integer", "enum": [2]}},
    "required": ["zeta", "alpha"],
    "additionalProperties": False,
}


def _post(srv: ServerThread, path: str, body: dict[str, Any]) -> httpx.Response:
    return httpx.post(srv.base_url + path, json=body, headers=AUTH, timeout=60)


def test_schema_keys_keep_their_order_in_the_constraint_key() -> None:
    swapped = {**ORDERED_SCHEMA, "properties": dict(reversed(ORDERED_SCHEMA["properties"].items()))}
    a, b = StructuredOutputsParams(json=ORDERED_SCHEMA), StructuredOutputsParams(json=swapped)
    assert a.key != b.key  # different property orders are different constraints
    assert a.key == StructuredOutputsParams(json=json.dumps(ORDERED_SCHEMA)).key


@pytest.mark.parametrize(
    ("path", "extra"),
    [
        (
            "/v1/chat/completions",
            {
                "response_format": {
                    "type": "json_schema",
                    "json_schema": {"name": "o", "schema": ORDERED_SCHEMA},
                }
            },
        ),
        ("/v1/completions", {"structured_outputs": {"json": ORDERED_SCHEMA}}),
        ("/v1/completions", {"guided_json": ORDERED_SCHEMA}),
    ],
    ids=["chat-response-format", "completions-structured-outputs", "guided-json"],
)
def test_json_schema_outputs_follow_the_schemas_property_order(
    toy_server: ServerThread, path: str, extra: dict[str, Any]
) -> None:
    body: dict[str, Any] = {"model": "toy", "max_tokens": 60, "temperature": 0, **extra}
    if "chat" in path:
        body["messages"] = [{"role": "user", "content": "x"}]
    else:
        body["prompt"] = "x"
    r = _post(toy_server, path, body)
    assert r.status_code == 200, r.text
    ch = r.json()["choices"][0]
    text = ch["message"]["content"] if "chat" in path else ch["text"]
    assert list(json.loads(text)) == ["zeta", "alpha"], text


def test_completions_max_tokens_null_checks_min_tokens_against_the_room_left(
    toy_server: ServerThread,
) -> None:
    # an explicit null is the room the prompt leaves (256 - 5 here), not the default 16
    base = {"model": "toy", "prompt": "hello", "max_tokens": None, "temperature": 0, "ignore_eos": True}
    r = _post(toy_server, "/v1/completions", {**base, "min_tokens": 40})
    assert r.status_code == 200, r.text
    assert r.json()["usage"]["completion_tokens"] == 251
    r = _post(toy_server, "/v1/completions", {**base, "prompt": ["a", "bc"], "min_tokens": 40, "n": 2})
    assert r.status_code == 200, r.text
    assert [c["finish_reason"] for c in r.json()["choices"]] == ["length"] * 4
    # past the room: a 400 naming min_tokens (and which prompt of a batch), never a 500
    r = _post(toy_server, "/v1/completions", {**base, "min_tokens": 252})
    assert r.status_code == 400, r.text
    assert r.json()["error"]["param"] == "min_tokens"
    r = _post(toy_server, "/v1/completions", {**base, "prompt": ["a", "x" * 220], "min_tokens": 100})
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["param"] == "min_tokens" and err["message"].startswith("prompt[1]: "), err
    # left out, max_tokens is still 16 and bounds min_tokens
    r = _post(
        toy_server,
        "/v1/completions",
        {k: v for k, v in base.items() if k != "max_tokens"} | {"min_tokens": 17},
    )
    assert r.status_code == 400 and r.json()["error"]["param"] == "min_tokens", r.text


@pytest.mark.parametrize(
    ("extra", "param"),
    [
        ({"guided_json": {"type": "object"}}, "tool_choice"),
        ({"guided_regex": "a+"}, "tool_choice"),
        ({"guided_choice": ["a", "b"]}, "tool_choice"),
        ({"response_format": {"type": "json_object"}}, "tool_choice"),
    ],
)
def test_a_forced_tool_call_is_never_silently_combined_with_another_constraint(
    toy_server: ServerThread, extra: dict[str, Any], param: str
) -> None:
    tools = [{"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}]
    body = {
        "model": "toy",
        "messages": [{"role": "user", "content": "x"}],
        "max_tokens": 8,
        "tools": tools,
        "tool_choice": "required",
        **extra,
    }
    r = _post(toy_server, "/v1/chat/completions", body)
    assert r.status_code == 400, r.text
    assert r.json()["error"]["param"] == param
    # the same constraint without a forced call is served
    r = _post(toy_server, "/v1/chat/completions", {**body, "tool_choice": "auto"})
    assert r.status_code == 200, r.text


def test_chat_stream_last_chunk_names_the_stop_reason(toy_server: ServerThread) -> None:
    """vLLM's chat chunks carry `stop_reason` (the stop token id or string that ended a choice), as the
    non-streamed reply does: the same value on the last streamed chunk, None on the others."""
    base = {"model": "toy", "messages": [{"role": "user", "content": "hi"}], "temperature": 0}
    first = _post(toy_server, "/v1/chat/completions", {**base, "max_tokens": 4, "return_token_ids": True})
    assert first.status_code == 200, first.text
    stop_id = first.json()["choices"][0]["token_ids"][1]  # the greedy reply's second token
    body = {**base, "max_tokens": 4, "stop_token_ids": [stop_id]}
    whole = _post(toy_server, "/v1/chat/completions", body).json()["choices"][0]
    assert (whole["finish_reason"], whole["stop_reason"]) == ("stop", stop_id)
    with httpx.stream(
        "POST", toy_server.base_url + "/v1/chat/completions", json={**body, "stream": True}, headers=AUTH
    ) as r:
        lines = [x.removeprefix("data: ") for x in r.iter_lines() if x.startswith("data: ")]
    assert lines[-1] == "[DONE]"
    choices = [c for x in lines[:-1] for c in json.loads(x)["choices"]]
    assert [c["stop_reason"] for c in choices] == [None] * (len(choices) - 1) + [stop_id]
    assert choices[-1]["finish_reason"] == "stop"
