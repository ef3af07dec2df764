"""Tool calling in the Qwen3.5 / Qwen3-Next chat format: `<tool_call>` blocks of JSON in the output.

Their chat templates render the request's `tools` and ask the model to answer a call as

    <tool_call>
    {"name": "get_weather", "arguments": {"city": "Paris"}}
    </tool_call>

`parse_tool_calls` turns the blocks of a finished output into OpenAI `tool_calls` (the text before the first
block is the message content); `ToolCallStream` does the same for a streamed output, holding back text that
may be the start of a block and emitting each call whole once its block closes. `tool_choice` "required" or a
named function is enforced by a grammar (`required_grammar`): the output must be such blocks, with a declared
name and arguments that validate against that function's JSON schema; "none" leaves the tools out.
"""

from __future__ import annotations

import json
import uuid
from dataclasses import dataclass
from typing import Any

START = "<tool_call>"
END = "</tool_call>"


@dataclass(frozen=True, slots=True)
class ToolCall:
    id: str
    name: str
    arguments: str  # JSON text, as OpenAI sends it

    def openai(self, index: int | None = None) -> dict[str, Any]:
        out: dict[str, Any] = {
            "id": self.id,
            "type": "function",
            "function": {"name": self.name, "arguments": self.arguments},
        }
        if index is not None:
            out["index"] = index
        return out


def _call(body: str) -> ToolCall | None:
    """One block's JSON as a call, or None when it is not a call."""
    try:
        obj = json.loads(body)
    except (ValueError, RecursionError):  # (output nested past Python's recursion limit is no call either)
        return None
    if not isinstance(obj, dict) or not isinstance(obj.get("name"), str):
        return None
    args = obj.get("arguments", obj.get("parameters", {}))
    text = args if isinstance(args, str) else json.dumps(args, ensure_ascii=False)
    return ToolCall(f"call_{uuid.uuid4().hex[:24]}", obj["name"], text)


def parse_tool_calls(text: str) -> tuple[str, list[ToolCall]]:
    """(content, calls) of a finished output; a block that is not a call stays in the content."""
    if START not in text:
        return text, []
    content = text[: text.index(START)]
    calls: list[ToolCall] = []
    rest = text[len(content) :]
    while START in rest:
        head, _, tail = rest.partition(START)
        body, closed, after = tail.partition(END)
        call = _call(body.strip()) if closed else None
        if call is None:
            content += head + START + body + closed
        else:
            content += head
            calls.append(call)
        rest = after
    content += rest
    return content, calls


class ToolCallStream:
    """Splits a streamed output into content deltas and whole tool calls."""

    def __init__(self) -> None:
        self._buf = ""
        self._in_call = False
        self.calls: list[ToolCall] = []

    def push(self, delta: str, *, final: bool = False) -> tuple[str, list[ToolCall]]:
        """The content safe to send now and the calls completed by this delta."""
        self._buf += delta
        content, done = "", []
        while True:
            if not self._in_call:
                at = self._buf.find(START)
                if at < 0:
                    keep = 0 if final else _partial_suffix(self._buf, START)
                    content += self._buf[: len(self._buf) - keep]
                    self._buf = self._buf[len(self._buf) - keep :]
                    break
                content += self._buf[:at]
                self._buf = self._buf[at + len(START) :]
                self._in_call = True
            end = self._buf.find(END)
            if end < 0:
                if final:  # an unclosed block is text
                    content += START + self._buf
                    self._buf = ""
                break
            call = _call(self._buf[:end].strip())
            if call is None:
                content += START + self._buf[: end + len(END)]
            else:
                done.append(call)
            self._buf = self._buf[end + len(END) :]
            self._in_call = False
        self.calls += done
        return content, done


def _partial_suffix(text: str, marker: str) -> int:
    """Length of the longest suffix of `text` that is a proper prefix of `marker`."""
    for k in range(min(len(marker) - 1, len(text)), 0, -1):
        if marker.startswith(text[-k:]):
            return k
    return 0


def template_message(role: str, content: str, m: Any) -> dict[str, Any]:
    """A chat message for the chat template, with an assistant's `tool_calls` (arguments as objects, which
    the Qwen templates serialise) and a tool result's `tool_call_id`."""
    out: dict[str, Any] = {"role": role, "content": content}
    if m.tool_calls:
        calls = []
        for i, c in enumerate(m.tool_calls):
            fn = c.get("function") if isinstance(c, dict) else None
            if not isinstance(fn, dict):
                want = "{'type': 'function', 'function': {'name': ..., 'arguments': ...}}"
                raise ValueError(f"tool_calls[{i}]: expected {want}, got {c!r}"[:300])
            fn = dict(fn)
            args = fn.get("arguments")
            if isinstance(args, str):
                try:
                    fn["arguments"] = json.loads(args)
                except (ValueError, RecursionError):
                    pass  # kept as the string it is (the template shows it as given)
            calls.append({**c, "function": fn})
        out["tool_calls"] = calls
    if m.tool_call_id is not None:
        out["tool_call_id"] = m.tool_call_id
    if m.name is not None:
        out["name"] = m.name
    return out


def check_tools(
    tools: list[dict[str, Any]] | None, tool_choice: Any
) -> tuple[list[dict[str, Any]], list[str]]:
    """Validated (tools, names the output must use: empty for "auto"/"none"); ValueError naming the field."""
    tools = tools or []
    names: list[str] = []
    for i, t in enumerate(tools):
        fn = t.get("function") if isinstance(t, dict) else None
        if t.get("type") != "function" or not isinstance(fn, dict) or not isinstance(fn.get("name"), str):
            raise ValueError(f"tools[{i}]: expected {{'type': 'function', 'function': {{'name': ..., ...}}}}")
        params = fn.get("parameters", {})
        if not isinstance(params, dict):
            raise ValueError(f"tools[{i}].function.parameters: expected a JSON schema object")
        names.append(fn["name"])
    if tool_choice is None or tool_choice in ("auto", "none"):
        return tools, []
    if tool_choice == "required":
        if not tools:
            raise ValueError("tool_choice: 'required' needs tools")
        return tools, names
    if isinstance(tool_choice, dict) and isinstance(tool_choice.get("function"), dict):
        name = tool_choice["function"].get("name")
        if name not in names:
            raise ValueError(f"tool_choice: function {name!r} is not among the tools {names}")
        return tools, [name]
    raise ValueError(
        f"tool_choice: expected 'auto', 'none', 'required' or a named function, got {tool_choice!r}"
    )


def rename_rule(grammar: str, old: str, new: str) -> str:
    """`grammar` (EBNF as xgrammar prints it) with the rule name `old` renamed `new` wherever it stands as
    a name: not inside a string literal or a character class, where a tool, property or enum value spelled
    like the rule must stay as it is."""
    out: list[str] = []
    i, n = 0, len(grammar)
    while i < n:
        c = grammar[i]
        if c in '"[':  # a literal or a class, with backslash escapes, copied as it is
            close, j = ('"' if c == '"' else "]"), i + 1
            while j < n and grammar[j] != close:
                j += 2 if grammar[j] == "\\" else 1
            out.append(grammar[i : j + 1])
            i = j + 1
        elif c.isalnum() or c == "_":
            j = i
            while j < n and (grammar[j].isalnum() or grammar[j] in "_-"):
                j += 1
            word = grammar[i:j]
            out.append(new if word == old else word)
            i = j
        else:
            out.append(c)
            i += 1
    return "".join(out)


# keywords whose values are JSON data, not schemas: a "$ref" key inside them is no reference
_DATA_KEYWORDS = frozenset({"const", "enum", "default", "examples"})
# keywords whose values map names to schemas: a name there is no keyword, whatever its spelling
_SCHEMA_MAPS = frozenset({"properties", "patternProperties", "$defs", "definitions", "dependentSchemas"})


def _rebase_refs(schema: Any, base: str, *, names: bool = False) -> Any:
    """A copy of a tool's parameters `schema` with each local `$ref` ("#" or "#/..."), which points into
    the parameters themselves, made to point into them at `base` (a JSON pointer with its "#"). `names`:
    `schema` maps names to schemas (the value of "properties" and the like)."""
    if isinstance(schema, list):
        return [_rebase_refs(s, base) for s in schema]
    if not isinstance(schema, dict):
        return schema
    if names:
        return {k: _rebase_refs(v, base) for k, v in schema.items()}
    out: dict[str, Any] = {}
    for k, v in schema.items():
        if k == "$ref" and isinstance(v, str) and v.startswith("#"):
            out[k] = base + v[1:]
        else:
            out[k] = v if k in _DATA_KEYWORDS else _rebase_refs(v, base, names=k in _SCHEMA_MAPS)
    return out


def required_grammar(tools: list[dict[str, Any]], names: list[str], *, parallel: bool) -> str:
    """EBNF for an output of `<tool_call>` blocks calling only `names` with valid arguments (one block, or
    one or more with `parallel`)."""
    import xgrammar as xgr

    from hyspec_server.structured import check_schema_supported, xgrammar_error

    by_name = {t["function"]["name"]: t["function"] for t in tools}
    unique = list(dict.fromkeys(names))
    for n in unique:  # a keyword the grammar would not enforce is refused, as in a response format
        check_schema_supported(by_name[n].get("parameters"), f"tools: function {n!r}'s parameters")
    try:
        variants = [
            {
                "type": "object",
                "properties": {
                    "name": {"const": n},
                    # the parameters' own refs ("#/$defs/...", as pydantic writes them) point into them:
                    # rebased to where they sit in this schema
                    "arguments": _rebase_refs(
                        by_name[n].get("parameters") or {"type": "object"},
                        ("#" if len(unique) == 1 else f"#/anyOf/{i}") + "/properties/arguments",
                    ),
                },
                "required": ["name", "arguments"],
                "additionalProperties": False,
            }
            for i, n in enumerate(unique)
        ]
        schema = variants[0] if len(variants) == 1 else {"anyOf": variants}
        call = str(xgr.Grammar.from_json_schema(json.dumps(schema), any_whitespace=False))
    except RecursionError as e:
        raise ValueError("tools: a function's parameters are nested too deeply") from e
    except RuntimeError as e:
        raise ValueError(
            f"tools: a function's parameters are not a usable JSON schema: {xgrammar_error(e)}"
        ) from e
    # the schema grammar's root becomes one rule of ours (its other rules are named root_..., basic_...)
    call = rename_rule(call, "root", "tool_call_json")
    block = f"block ::= {json.dumps(START + chr(10))} tool_call_json {json.dumps(chr(10) + END)}"
    root = 'root ::= block ("\\n" block)*' if parallel else "root ::= block"
    return "\n".join([root, block, call])
