"""Tool calling (Qwen `<tool_call>` blocks): parsing scripted outputs whole and streamed in every chunking,
and end to end over HTTP on the toy engine, where `tool_choice` "required" / a named function is enforced by
a grammar (the toy would never emit a call on its own), streamed and not, with the 400s naming the field."""

from __future__ import annotations

import json
import random
from collections.abc import Iterator
from typing import Any

import httpx
import jsonschema
import pytest
from hyspec_server.serve import ServerThread
from hyspec_server.tool_calls import END, START, ToolCallStream, parse_tool_calls, rename_rule
from hyspec_testing.server import toy_engine

WEATHER = {
    "type": "object",
    "properties": {"city": {"type": "string", "enum": ["Paris", "Oslo"]}, "days": {"type": "integer"}},
    "required": ["city", "days"],
}
ADD = {
    "type": "object",
    "properties": {"a": {"type": "integer"}, "b": {"type": "integer"}},
    "required": ["a", "b"],
}
TOOLS = [
    {"type": "function", "function": {"name": "get_weather", "parameters": WEATHER}},
    {"type": "function", "function": {"name": "add", "description": "a + b", "parameters": ADD}},
]
SCHEMAS = {"get_weather": WEATHER, "add": ADD}

SCRIPTS: list[tuple[str, str, list[tuple[str, dict[str, Any]]]]] = [
    ("plain text, no call", "plain text, no call", []),
    (
        "Let me look. <tool_call>\n"
        '{"name": "get_weather", "arguments": {"city": "Oslo", "days": 2}}\n</tool_call>',
        "Let me look. ",
        [("get_weather", {"city": "Oslo", "days": 2})],
    ),
    (
        '<tool_call>\n{"name": "add", "arguments": {"a": 1, "b": 2}}\n</tool_call>\n'
        '<tool_call>\n{"name": "add", "parameters": {"a": 3, "b": 4}}\n</tool_call>',
        "\n",
        [("add", {"a": 1, "b": 2}), ("add", {"a": 3, "b": 4})],
    ),
    ("<tool_call>\nnot json\n</tool_call> after", "<tool_call>\nnot json\n</tool_call> after", []),
    ('unclosed <tool_call>\n{"name": "add"', 'unclosed <tool_call>\n{"name": "add"', []),
    ("a <tool_cal> lookalike <", "a <tool_cal> lookalike <", []),
]


@pytest.mark.parametrize(("text", "content", "calls"), SCRIPTS)
def test_parse_whole_and_streamed_in_every_chunking(
    text: str, content: str, calls: list[tuple[str, dict[str, Any]]]
) -> None:
    got_content, got = parse_tool_calls(text)
    assert got_content == content
    assert [(c.name, json.loads(c.arguments)) for c in got] == calls
    assert len({c.id for c in got}) == len(got)
    rng = random.Random(len(text))
    for size in (1, 2, 3, 7, len(text) or 1):
        for _ in range(3):
            stream, cuts, i = ToolCallStream(), [], 0
            while i < len(text):
                step = rng.randint(1, size)
                cuts.append(text[i : i + step])
                i += step
            parts = [stream.push(piece) for piece in cuts] + [stream.push("", final=True)]
            assert "".join(p[0] for p in parts) == content
            assert [(c.name, json.loads(c.arguments)) for p in parts for c in p[1]] == calls


@pytest.fixture(scope="module")
def server() -> Iterator[ServerThread]:
    srv = ServerThread(toy_engine(max_len=1024), model_name="toy").start()
    yield srv
    srv.stop()


def _chat(**kw: Any) -> dict[str, Any]:
    return {"model": "toy", "messages": [{"role": "user", "content": "weather?"}], "max_tokens": 400, **kw}


def _check_calls(calls: list[dict[str, Any]], names: set[str]) -> None:
    assert calls
    for c in calls:
        assert c["type"] == "function" and c["id"].startswith("call_")
        assert c["function"]["name"] in names
        jsonschema.validate(json.loads(c["function"]["arguments"]), SCHEMAS[c["function"]["name"]])


@pytest.mark.parametrize("parallel", [True, False])
def test_required_and_named_tool_choice_give_valid_calls(server: ServerThread, parallel: bool) -> None:
    with httpx.Client(base_url=server.base_url, timeout=60) as c:
        for choice, names in (
            ("required", {"get_weather", "add"}),
            ({"type": "function", "function": {"name": "get_weather"}}, {"get_weather"}),
        ):
            r = c.post(
                "/v1/chat/completions",
                json=_chat(tools=TOOLS, tool_choice=choice, parallel_tool_calls=parallel, temperature=0),
            )
            assert r.status_code == 200, r.text
            ch = r.json()["choices"][0]
            calls = ch["message"]["tool_calls"]
            _check_calls(calls, names)
            # the toy model writes parallel calls until max_tokens cuts it off: complete calls are parsed,
            # and the reply says "length" (its last call may be half written), not "tool_calls"
            cut = r.json()["usage"]["completion_tokens"] == _chat()["max_tokens"]
            assert ch["finish_reason"] == ("length" if cut else "tool_calls"), ch
            if not parallel:
                assert len(calls) == 1 and not cut
            elif choice == "required":
                assert cut, "expected the parallel calls to run into max_tokens (the case above)"


def test_a_tool_named_like_a_grammar_rule_keeps_its_name(server: ServerThread) -> None:
    """A tool, a property and an enum value named "root" (the name of the grammar's entry rule, which the
    call grammar renames) are forced as they are spelled, not as the renamed rule."""
    schema = {
        "type": "object",
        "properties": {"root": {"type": "string", "enum": ["root", "x"]}},
        "required": ["root"],
    }
    tools = [{"type": "function", "function": {"name": "root", "parameters": schema}}]
    choice = {"type": "function", "function": {"name": "root"}}
    with httpx.Client(base_url=server.base_url, timeout=60) as c:
        body = _chat(tools=tools, tool_choice=choice, parallel_tool_calls=False, temperature=0)
        r = c.post("/v1/chat/completions", json=body)
    assert r.status_code == 200, r.text
    calls = r.json()["choices"][0]["message"]["tool_calls"]
    assert [t["function"]["name"] for t in calls] == ["root"]
    jsonschema.validate(json.loads(calls[0]["function"]["arguments"]), schema)


def test_tool_parameters_with_local_refs_are_forced(server: ServerThread) -> None:
    """Parameters whose schema refers to its own definitions (pydantic's `#/$defs/...`, the older
    `#/definitions/...`, `#` itself) are forced as written: the refs point into the parameters, which the
    call grammar nests inside its own schema (they were a 400, "Cannot find field '$defs'")."""
    unit = {
        "type": "object",
        "properties": {
            "unit": {"$ref": "#/$defs/Unit"},
            "days": {"$ref": "#/definitions/Days"},
            "const": {"$ref": "#/$defs/Unit"},  # a property named like a keyword
            "tag": {"type": "string", "const": "#/x"},
        },
        "required": ["unit", "days", "const", "tag"],
        "$defs": {"Unit": {"type": "string", "enum": ["c", "f"]}},
        "definitions": {"Days": {"type": "integer", "minimum": 1, "maximum": 9}},
    }
    tree = {
        "type": "object",
        "properties": {"kids": {"type": "array", "items": {"$ref": "#"}, "maxItems": 1}},
        "required": ["kids"],
    }
    schemas = {"unit": unit, "tree": tree}
    tools = [{"type": "function", "function": {"name": n, "parameters": p}} for n, p in schemas.items()]
    with httpx.Client(base_url=server.base_url, timeout=60) as c:
        for choice in ("required", {"type": "function", "function": {"name": "unit"}}):
            body = _chat(tools=tools, tool_choice=choice, parallel_tool_calls=False, temperature=0)
            r = c.post("/v1/chat/completions", json=body)
            assert r.status_code == 200, r.text
            (call,) = r.json()["choices"][0]["message"]["tool_calls"]
            fn = call["function"]
            jsonschema.validate(json.loads(fn["arguments"]), schemas[fn["name"]])


def test_a_block_nested_past_the_recursion_limit_is_text() -> None:
    """A `<tool_call>` block of JSON nested deeper than Python parses (a degenerate output) is no call: it
    stays in the content, whole and streamed (json.loads raised RecursionError: a 500, a cut stream)."""
    deep = START + "[" * 5000 + END
    assert parse_tool_calls("hi " + deep) == ("hi " + deep, [])
    stream = ToolCallStream()
    parts = [stream.push(deep[i : i + 7]) for i in range(0, len(deep), 7)] + [stream.push("", final=True)]
    assert "".join(p[0] for p in parts) == deep and not stream.calls
    # over HTTP: the toy writes such a block when a regex says so (tools "auto" parse the output)
    body = _chat(
        tools=TOOLS,
        max_tokens=1200,
        temperature=0,
        structured_outputs={"regex": "<tool_call>\\[{1100}</tool_call>"},
    )
    srv = ServerThread(toy_engine(max_len=2048), model_name="toy").start()
    try:
        with httpx.Client(base_url=srv.base_url, timeout=60) as c:
            r = c.post("/v1/chat/completions", json=body)
            assert r.status_code == 200, r.text
            msg = r.json()["choices"][0]["message"]
            assert msg["content"] == START + "[" * 1100 + END and not msg.get("tool_calls"), msg
            s = c.post("/v1/chat/completions", json={**body, "stream": True})
            assert s.status_code == 200 and s.text.endswith("data: [DONE]\n\n"), s.text[-300:]
            chunks = [json.loads(x[6:]) for x in s.text.splitlines() if x.startswith("data: {")]
            deltas = [ch["choices"][0]["delta"] for ch in chunks if ch["choices"]]
            assert "".join(d.get("content") or "" for d in deltas) == msg["content"]
    finally:
        srv.stop()


def test_rename_rule_renames_names_only() -> None:
    grammar = 'root ::= "root" [r\\]oot] root_1 root\nroot_1 ::= "\\"root\\"" (root)'
    assert rename_rule(grammar, "root", "call") == (
        'call ::= "root" [r\\]oot] root_1 call\nroot_1 ::= "\\"root\\"" (call)'
    )


def test_streamed_tool_calls(server: ServerThread) -> None:
    with httpx.Client(base_url=server.base_url, timeout=60) as c:
        body = _chat(tools=TOOLS, tool_choice="required", stream=True, temperature=0)
        r = c.post("/v1/chat/completions", json={**body, "stream_options": {"include_usage": True}})
        chunks = [json.loads(line[6:]) for line in r.text.splitlines() if line.startswith("data: {")]
        deltas = [ch["choices"][0] for ch in chunks if ch["choices"]]
        calls = [t for d in deltas for t in d["delta"].get("tool_calls", [])]
        assert [t["index"] for t in calls] == list(range(len(calls)))
        _check_calls(calls, {"get_weather", "add"})
        cut = chunks[-1]["usage"]["completion_tokens"] == body["max_tokens"]
        assert deltas[-1]["finish_reason"] == ("length" if cut else "tool_calls")
        whole = c.post("/v1/chat/completions", json={**body, "stream": False}).json()["choices"][0]
        assert whole["finish_reason"] == deltas[-1]["finish_reason"]
        strip = [(t["function"]["name"], t["function"]["arguments"]) for t in calls]
        assert strip == [
            (t["function"]["name"], t["function"]["arguments"]) for t in whole["message"]["tool_calls"]
        ]


def test_tool_choice_none_and_conversations_with_tool_results(server: ServerThread) -> None:
    with httpx.Client(base_url=server.base_url, timeout=60) as c:
        r = c.post("/v1/chat/completions", json=_chat(tools=TOOLS, tool_choice="none", max_tokens=5))
        msg = r.json()["choices"][0]["message"]
        assert "tool_calls" not in msg and isinstance(msg["content"], str)
        convo = [
            {"role": "user", "content": "weather in Oslo?"},
            {
                "role": "assistant",
                "content": None,
                "tool_calls": [
                    {
                        "id": "call_1",
                        "type": "function",
                        "function": {"name": "get_weather", "arguments": '{"city": "Oslo", "days": 1}'},
                    }
                ],
            },
            {"role": "tool", "tool_call_id": "call_1", "content": "sunny"},
        ]
        r = c.post("/v1/chat/completions", json={**_chat(tools=TOOLS, max_tokens=5), "messages": convo})
        assert r.status_code == 200, r.text


@pytest.mark.parametrize(
    ("extra", "param"),
    [
        ({"tools": [{"type": "function"}]}, "tools"),
        ({"tools": [{"type": "retrieval", "function": {"name": "x"}}]}, "tools"),
        ({"tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "nope"}}}, "tool_choice"),
        ({"tools": TOOLS, "tool_choice": "sometimes"}, "tool_choice"),
        ({"tool_choice": "required"}, "tool_choice"),
        (
            {"tools": TOOLS, "tool_choice": "required", "response_format": {"type": "json_object"}},
            "tool_choice",
        ),
        (
            {
                "tools": [{"type": "function", "function": {"name": "f", "parameters": {"type": "bogus"}}}],
                "tool_choice": "required",
            },
            "tools",
        ),
    ],
)
def test_bad_tools_are_400_naming_the_field(server: ServerThread, extra: dict[str, Any], param: str) -> None:
    with httpx.Client(base_url=server.base_url, timeout=60) as c:
        r = c.post("/v1/chat/completions", json=_chat(**extra))
        assert r.status_code == 400, r.text
        assert r.json()["error"]["param"] == param
        assert c.post("/v1/chat/completions", json=_chat(max_tokens=3)).status_code == 200


def _demo_calls(spec: str | None) -> list[list[dict[str, Any]]]:
    """The demo model's tool calls for a required and a named tool_choice, checked as they come back."""
    from hyspec_server import EngineArgs
    from hyspec_server.builder import build_engine
    from hyspec_server.default_model import default_model_dir

    cfg = None if spec is None else {"method": spec, "num_speculative_tokens": 3}
    args = EngineArgs(model=str(default_model_dir()), device="cpu", max_num_seqs=4, speculative_config=cfg)
    srv = ServerThread(build_engine(args), model_name="demo").start()
    got = []
    try:
        with httpx.Client(base_url=srv.base_url, timeout=120) as c:
            for choice, names in (
                ("required", {"get_weather", "add"}),
                ({"type": "function", "function": {"name": "add"}}, {"add"}),
            ):
                body = {
                    "model": "demo",
                    "messages": [{"role": "user", "content": "def add(a, b):"}],
                    "max_tokens": 200,
                    "temperature": 0,
                    "tools": TOOLS,
                    "tool_choice": choice,
                }
                r = c.post("/v1/chat/completions", json=body)
                assert r.status_code == 200, r.text
                ch = r.json()["choices"][0]
                cut = r.json()["usage"]["completion_tokens"] == body["max_tokens"]  # parallel calls run on
                assert ch["finish_reason"] == ("length" if cut else "tool_calls"), ch
                _check_calls(ch["message"]["tool_calls"], names)
                got.append([t["function"] for t in ch["message"]["tool_calls"]])
                s = c.post("/v1/chat/completions", json={**body, "stream": True})
                chunks = [json.loads(x[6:]) for x in s.text.splitlines() if x.startswith("data: {")]
                deltas = [x["choices"][0]["delta"] for x in chunks if x["choices"]]
                assert [t["function"] for d in deltas for t in d.get("tool_calls", [])] == got[-1]
    finally:
        srv.stop()
    return got


def test_demo_model_end_to_end() -> None:
    """The trained demo model (its template does not render tools; the grammar of a required or named
    tool_choice makes the call anyway): parsed calls validate, streamed deltas equal the whole response, and
    greedy calls are the same with its MTP speculation as without."""
    assert _demo_calls("mtp") == _demo_calls(None)
