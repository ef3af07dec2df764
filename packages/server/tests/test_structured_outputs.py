"""Structured outputs (xgrammar): every constrained output parses and validates, greedy and sampled, mixed in
one batch with unconstrained requests (whose outputs must not change), through `LLM`, the HTTP server, and on
real tiny checkpoints with speculative decoding (greedy output identical with and without a drafter); bad
constraints are a clear ValueError / 400 naming the field and disturb nobody else.
"""

from __future__ import annotations

import json
import re
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import httpx
import jsonschema
import pytest
from hyspec_runner.speculative import DrafterContext, DrafterRegistry
from hyspec_server import LLM, EngineArgs, SamplingParams, StructuredOutputsParams
from hyspec_server.builder import build_engine
from hyspec_server.engine import EngineStepError
from hyspec_server.serve import ServerThread
from hyspec_spec_workers.drafter import Drafter
from hyspec_testing.server import toy_engine, toy_greedy
from hyspec_testing.spec import DRAFTER_CASES, DrafterCase, ForcedDrafter, build_case_checkpoints

SCHEMA: dict[str, Any] = {
    "type": "object",
    "properties": {
        # (no maxLength: xgrammar 0.2.8's length-bounded string rule lets raw control characters through)
        "name": {"type": "string", "pattern": "^[A-Za-z]{1,8}$"},
        "age": {"type": "integer", "minimum": 0, "maximum": 150},
        "tags": {"type": "array", "items": {"enum": ["a", "b"]}, "maxItems": 3},
    },
    "required": ["name", "age", "tags"],
    "additionalProperties": False,
}
REGEX = r"[a-z]{3}-\d{2,4}"
CHOICES = ["yes", "no", 'maybe "so"']
GRAMMAR = 'root ::= "(" num ("+" num)* ")"\nnum ::= [1-9] [0-9]?'


def _check(so: StructuredOutputsParams, text: str) -> None:
    """Raises unless `text` satisfies the constraint."""
    if so.json is not None:
        schema = so.json if isinstance(so.json, dict) else json.loads(so.json)
        jsonschema.validate(json.loads(text), schema)
    elif so.json_object:
        assert isinstance(json.loads(text), dict), text
    elif so.regex is not None:
        assert re.fullmatch(so.regex, text), text
    elif so.choice is not None:
        assert text in so.choice, text
    else:
        assert re.fullmatch(r"\([1-9][0-9]?(\+[1-9][0-9]?)*\)", text), text


CONSTRAINTS = [
    StructuredOutputsParams(json=SCHEMA),
    StructuredOutputsParams(json=json.dumps(SCHEMA)),
    StructuredOutputsParams(json_object=True),
    StructuredOutputsParams(regex=REGEX),
    StructuredOutputsParams(choice=CHOICES),
    StructuredOutputsParams(grammar=GRAMMAR),
]


@pytest.mark.parametrize("so", CONSTRAINTS, ids=lambda so: so.key[0])
def test_constrained_outputs_parse_greedy_and_sampled_mixed_with_free_requests(
    so: StructuredOutputsParams,
) -> None:
    llm = LLM.from_engine(toy_engine(seqs=8))
    prompts = [[65 + i, 66, 67 + 2 * i] for i in range(6)]
    free = SamplingParams(max_tokens=12, temperature=0, ignore_eos=True)
    params = [
        SamplingParams(max_tokens=200, temperature=0.0 if i % 2 else 1.0, seed=i, structured_outputs=so)
        if i < 4
        else free
        for i in range(6)
    ]
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params)
    completed = 0
    for p, prm, o in zip(prompts, params, outs, strict=True):
        c = o.outputs[0]
        if prm.structured_outputs is None:
            assert c.token_ids == toy_greedy(p, 12, ignore_eos=True)  # its neighbours' masks never touch it
        elif c.finish_reason == "stop":
            _check(so, c.text)
            completed += 1
        else:
            # the toy's walk through an open-ended constraint (a JSON object) may run out of tokens: the text
            # must still be a prefix the constraint allows (a fresh matcher takes every token)
            assert c.finish_reason == "length", c.text
            state = llm.engine.grammars.new_state(so)
            for t in c.token_ids:
                state.accept(t)
    assert completed >= (0 if so.json_object else 2)
    llm.leak_check()


def test_ignore_eos_still_stops_when_the_constraint_is_complete() -> None:
    llm = LLM.from_engine(toy_engine())
    so = StructuredOutputsParams(choice=["ok"])
    (o,) = llm.generate(
        [{"prompt_token_ids": [1, 2]}],
        SamplingParams(max_tokens=50, temperature=0, ignore_eos=True, structured_outputs=so),
    )
    assert o.outputs[0].text == "ok" and o.outputs[0].finish_reason == "stop"
    assert len(o.outputs[0].token_ids) == 3  # "o", "k", then the stop token the grammar ends with


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({}, "exactly one"),
        ({"regex": "a", "choice": ["a"]}, "exactly one"),
        ({"json": "{not json"}, "structured_outputs.json"),
        ({"json": 5}, "structured_outputs.json"),
        ({"choice": []}, "structured_outputs.choice"),
        ({"choice": ["a", ""]}, "structured_outputs.choice"),
        ({"regex": ""}, "structured_outputs.regex"),
        ({"json_object": "yes"}, "json_object"),
    ],
)
def test_bad_constraints_are_value_errors_naming_the_field(kwargs: dict[str, Any], match: str) -> None:
    with pytest.raises(ValueError, match=match):
        StructuredOutputsParams(**kwargs)


@pytest.mark.parametrize(
    ("so", "match"),
    [
        (StructuredOutputsParams(regex="(ab"), "structured_outputs.regex"),
        (StructuredOutputsParams(grammar="root ::= "), "structured_outputs.grammar"),
        (StructuredOutputsParams(json={"type": "nonsense-type"}), "structured_outputs.json"),
        # xgrammar refuses an infinite bound with an error of no text
        (StructuredOutputsParams(json={"type": "integer", "minimum": 1e400}), "structured_outputs.json"),
        # compile, but no token can start them (an empty character class)
        (StructuredOutputsParams(regex="[^\\x00-\\U0010FFFF]"), "allows no token"),
        (StructuredOutputsParams(grammar="root ::= [^\\x00-\\U0010FFFF]"), "allows no token"),
    ],
)
def test_constraints_that_do_not_compile_lose_nothing(so: StructuredOutputsParams, match: str) -> None:
    llm = LLM.from_engine(toy_engine())
    good = SamplingParams(max_tokens=5, temperature=0, ignore_eos=True)
    with pytest.raises(ValueError, match=match):
        llm.generate(
            [{"prompt_token_ids": [3, 4]}, {"prompt_token_ids": [5]}],
            [good, SamplingParams(max_tokens=5, structured_outputs=so)],
        )
    llm.leak_check()  # the request queued before the bad one was aborted and freed
    (o,) = llm.generate([{"prompt_token_ids": [3, 4]}], good)
    assert o.outputs[0].token_ids == toy_greedy([3, 4], 5, ignore_eos=True)


# schema keywords xgrammar compiles without enforcing (the output need not satisfy them), each with an output
# its grammar would have allowed that the schema refuses
IGNORED_KEYWORDS: list[tuple[str, dict[str, Any], str | None]] = [
    ("uniqueItems", {"type": "array", "items": {"type": "integer"}, "uniqueItems": True}, "[1, 1]"),
    ("contains", {"type": "array", "items": {"type": "integer"}, "contains": {"const": 1}}, "[2]"),
    ("not", {"type": "string", "not": {"const": "a"}}, '"a"'),
    ("if", {"type": "string", "if": {"const": "a"}, "then": {"minLength": 2}}, '"a"'),
    (
        "dependentRequired",
        {
            "type": "object",
            "properties": {"a": {"type": "integer"}, "b": {"type": "integer"}},
            "dependentRequired": {"a": ["b"]},
        },
        '{"a": 1}',
    ),
    ("allOf", {"allOf": [{"type": "integer"}, {"minimum": 3}]}, "1"),
    # (a remote reference: xgrammar warns and allows any value; no document to validate against)
    ("$ref", {"$ref": "https://example.com/schema.json"}, None),
]


@pytest.mark.parametrize(
    ("keyword", "schema", "invalid"), IGNORED_KEYWORDS, ids=[k[0] for k in IGNORED_KEYWORDS]
)
def test_schema_keywords_xgrammar_ignores_are_refused(
    keyword: str, schema: dict[str, Any], invalid: str | None
) -> None:
    """A keyword the backend would compile away (its grammar allows `invalid`, which the schema refuses) is a
    ValueError naming it, as vLLM's xgrammar backend refuses the features it lacks, not a constraint that
    silently lets invalid JSON through; nested in a property or a $defs entry too. A property merely named
    like one ("not") is no keyword."""
    if invalid is not None:
        with pytest.raises(jsonschema.ValidationError):
            jsonschema.validate(json.loads(invalid), schema)  # (the case is one: the schema refuses it)
    llm = LLM.from_engine(toy_engine())
    for so in (
        StructuredOutputsParams(json=schema),
        StructuredOutputsParams(json={"type": "object", "properties": {"p": schema}}),
        StructuredOutputsParams(
            json={"$defs": {"d": schema}, "type": "array", "items": {"$ref": "#/$defs/d"}}
        ),
    ):
        with pytest.raises(
            ValueError, match=rf"structured_outputs\.json: .*{re.escape(keyword)}.*not supported"
        ):
            llm.generate([{"prompt_token_ids": [3, 4]}], SamplingParams(max_tokens=5, structured_outputs=so))
    named = {"type": "object", "properties": {"not": {"type": "integer"}, "if": {"const": "not"}}}
    (o,) = llm.generate(
        [{"prompt_token_ids": [3, 4]}],
        SamplingParams(max_tokens=5, structured_outputs=StructuredOutputsParams(json=named)),
    )
    assert o.outputs[0].finish_reason in ("stop", "length")  # served
    llm.leak_check()
    srv = ServerThread(toy_engine(), model_name="toy").start()
    try:
        with httpx.Client(base_url=srv.base_url, timeout=60) as c:
            chat = {"model": "toy", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 5}
            rf = {"type": "json_schema", "json_schema": {"name": "p", "schema": schema}}
            tool = {
                "type": "function",
                "function": {"name": "f", "parameters": {"type": "object", "properties": {"x": schema}}},
            }
            for extra, param in (
                ({"response_format": rf}, "response_format"),
                ({"guided_json": schema}, "guided_json"),
                ({"tools": [tool], "tool_choice": "required"}, "tools"),
            ):
                r = c.post("/v1/chat/completions", json={**chat, **extra})
                assert r.status_code == 400 and r.json()["error"]["param"] == param, (extra, r.text)
                assert keyword in r.json()["error"]["message"], r.text
    finally:
        srv.stop()


def _nested_schema(depth: int) -> dict[str, Any]:
    schema: dict[str, Any] = {"type": "object"}
    for _ in range(depth):
        schema = {"type": "object", "properties": {"a": schema}}
    return schema


def test_schemas_nested_too_deeply_are_value_errors_and_400s() -> None:
    """A schema nested past Python's recursion limit (a dict deepcopied, a JSON text parsed) is a ValueError
    naming the field, a 400 over HTTP (it was a RecursionError: a 500, where the request body itself, nested
    less than the schema's text, passed the server's own depth check)."""
    deep_text = '{"type": "array", "items": ' * 3000 + "{}" + "}" * 3000
    for kwargs in ({"json": _nested_schema(1000)}, {"json": deep_text}):
        with pytest.raises(ValueError, match=r"structured_outputs\.json: the schema is nested too deeply"):
            StructuredOutputsParams(**kwargs)
    srv = ServerThread(toy_engine(), model_name="toy").start()
    try:
        with httpx.Client(base_url=srv.base_url, timeout=60) as c:
            body = {"model": "toy", "prompt": "x", "max_tokens": 5}
            chat = {"model": "toy", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 5}
            deep = _nested_schema(300)  # the body passes its check; the schema's copy recursed too deep
            rf = {"type": "json_schema", "json_schema": {"name": "p", "schema": deep}}
            for path, extra, param in (
                ("/v1/completions", {"structured_outputs": {"json": deep}}, "structured_outputs"),
                ("/v1/completions", {"structured_outputs": {"json": deep_text}}, "structured_outputs"),
                ("/v1/completions", {"guided_json": deep_text}, "guided_json"),
                ("/v1/chat/completions", {"response_format": rf}, "response_format"),
            ):
                r = c.post(path, json={**(chat if "chat" in path else body), **extra})
                assert r.status_code == 400 and r.json()["error"]["param"] == param, (path, param, r.text)
                assert "nested too deeply" in r.json()["error"]["message"], r.text
            assert c.post("/v1/completions", json=body).status_code == 200  # the server is unharmed
    finally:
        srv.stop()


def test_http_response_format_and_structured_outputs() -> None:
    srv = ServerThread(toy_engine(), model_name="toy").start()
    try:
        with httpx.Client(base_url=srv.base_url, timeout=60) as c:
            chat = {"model": "toy", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 200}
            r = c.post(
                "/v1/chat/completions",
                json={
                    **chat,
                    "response_format": {
                        "type": "json_schema",
                        "json_schema": {"name": "p", "schema": SCHEMA, "strict": True},
                    },
                },
            )
            assert r.status_code == 200, r.text
            jsonschema.validate(json.loads(r.json()["choices"][0]["message"]["content"]), SCHEMA)
            r = c.post("/v1/chat/completions", json={**chat, "response_format": {"type": "json_object"}})
            assert isinstance(json.loads(r.json()["choices"][0]["message"]["content"]), dict)
            r = c.post("/v1/chat/completions", json={**chat, "response_format": {"type": "text"}})
            assert r.status_code == 200
            body = {"model": "toy", "prompt": "x", "max_tokens": 50, "temperature": 0}
            r = c.post("/v1/completions", json={**body, "structured_outputs": {"choice": CHOICES}})
            assert r.json()["choices"][0]["text"] in CHOICES
            r = c.post(
                "/v1/completions", json={**body, "structured_outputs": {"regex": REGEX}, "stream": True}
            )
            text = "".join(
                json.loads(line[6:])["choices"][0]["text"]
                for line in r.text.splitlines()
                if line.startswith("data: {") and json.loads(line[6:])["choices"]
            )
            assert re.fullmatch(REGEX, text), text
            # logprobs beside a constraint: forbidden tokens' -inf is reported as vLLM's floor (valid JSON)
            for stream in (False, True):
                r = c.post(
                    "/v1/completions",
                    json={**body, "structured_outputs": {"choice": CHOICES}, "logprobs": 5, "stream": stream},
                )
                assert r.status_code == 200, r.text
                bodies = (
                    [r.json()]
                    if not stream
                    else [json.loads(x[6:]) for x in r.text.splitlines() if x.startswith("data: {")]
                )
                lps = [
                    v
                    for b in bodies
                    for ch in b["choices"]
                    if ch.get("logprobs")
                    for top in ch["logprobs"]["top_logprobs"]
                    for v in top.values()
                ]
                assert lps and all(-9999.0 <= v <= 0.0 for v in lps), lps
            for extra, param in (
                ({"structured_outputs": {"regex": "[^\\x00-\\U0010FFFF]"}}, "structured_outputs"),
                ({"structured_outputs": {"regex": "(ab"}}, "structured_outputs"),
                ({"structured_outputs": {"regex": "a", "json": {}}}, "structured_outputs"),
                ({"structured_outputs": {"bogus": 1}}, "structured_outputs"),
                ({"response_format": {"type": "json_schema"}}, "response_format"),
                ({"response_format": {"type": "xml"}}, "response_format"),
                (
                    {
                        "response_format": {
                            "type": "json_schema",
                            "json_schema": {"schema": {"type": "nonsense"}},
                        }
                    },
                    "response_format",
                ),
            ):
                r = c.post("/v1/completions", json={**body, **extra})
                assert r.status_code == 400, (extra, r.text)
                assert r.json()["error"]["param"] == param, (extra, r.json())
            assert c.post("/v1/completions", json=body).status_code == 200  # the server is unharmed
    finally:
        srv.stop()


@pytest.fixture(scope="module")
def qwen_ckpt(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from hyspec_testing.tiny import build_tiny_checkpoint

    return build_tiny_checkpoint(tmp_path_factory.mktemp("so") / "qwen3_5", "qwen3_5", seed=0)


@pytest.mark.parametrize(
    "spec",
    [None, {"method": "ngram", "num_speculative_tokens": 3}, {"method": "mtp", "num_speculative_tokens": 3}],
    ids=["plain", "ngram", "mtp"],
)
def test_real_tokenizer_with_speculation_greedy_identical(
    qwen_ckpt: Path, spec: dict[str, Any] | None
) -> None:
    prompts = [{"prompt_token_ids": [5 + i, 9, 17, 33, 5 + i, 9]} for i in range(3)]
    constrained = [
        SamplingParams(max_tokens=40, temperature=0, structured_outputs=so)
        for so in (CONSTRAINTS[3], CONSTRAINTS[4], CONSTRAINTS[5])
    ]
    free = SamplingParams(max_tokens=10, temperature=0, ignore_eos=True)

    def run(s: dict[str, Any] | None) -> list[tuple[str, list[int]]]:
        llm = LLM(model=str(qwen_ckpt), max_num_seqs=4, speculative_config=s)
        outs = llm.generate(prompts * 2, constrained + [free] * 3)
        llm.leak_check()
        return [(o.outputs[0].text, o.outputs[0].token_ids) for o in outs]

    got = run(spec)
    for (text, ids), prm in zip(got[:3], constrained, strict=True):
        assert prm.structured_outputs is not None
        assert len(ids) < 40  # regex, choice and grammar all complete well within the budget
        _check(prm.structured_outputs, text)
    if spec is not None:
        assert got == run(None)


@pytest.mark.parametrize("tree", [False, True], ids=["chain", "tree"])
def test_drafts_under_a_constraint_are_cut_masked_and_lossless(qwen_ckpt: Path, tree: bool) -> None:
    prompts = [{"prompt_token_ids": [5 + i, 9, 17, 33, 5 + i, 9]} for i in range(4)]
    params = [
        SamplingParams(max_tokens=40, temperature=0, structured_outputs=so)
        for so in (CONSTRAINTS[3], CONSTRAINTS[4], CONSTRAINTS[5], CONSTRAINTS[2])
    ]
    plain = LLM(model=str(qwen_ckpt), max_num_seqs=4, speculative_config=None)
    want = plain.generate(prompts, params)
    refs = [p["prompt_token_ids"] + o.outputs[0].token_ids for p, o in zip(prompts, want, strict=True)]
    made: list[ForcedDrafter] = []
    vocab = json.loads((qwen_ckpt / "config.json").read_text())["vocab_size"]

    def build(ctx: DrafterContext) -> Drafter:
        made.append(ForcedDrafter(refs, ctx.config.max_num_speculative_tokens, vocab, tree=tree))
        return made[-1]

    method = "mtp" if tree else "ngram"
    spec: dict[str, Any] = {"method": method, "num_speculative_tokens": 3}
    if tree:
        spec["topk"] = 2
    eng = build_engine(
        EngineArgs(model=str(qwen_ckpt), max_num_seqs=4, speculative_config=spec),
        drafters=DrafterRegistry({method: build}),
    )
    got = LLM.from_engine(eng).generate(prompts, params)
    assert [o.outputs[0].token_ids for o in got] == [o.outputs[0].token_ids for o in want]
    stats = [o.spec_stats for o in got]
    assert sum(s.num_accepted_tokens for s in stats if s) > 0  # constrained rows did accept drafts
    assert made[0].calls > 0
    eng.leak_check()


SO_CASES = (
    DrafterCase("plain-lfm2", "lfm2", {}),
    *DRAFTER_CASES,
    DrafterCase("ngram", "qwen3_5", {"method": "ngram", "num_speculative_tokens": 3}),
)


@pytest.fixture(scope="module")
def case_checkpoints(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    return build_case_checkpoints(tmp_path_factory.mktemp("so-cases"), SO_CASES)


@pytest.mark.parametrize("case", SO_CASES, ids=[c.name for c in SO_CASES])
def test_every_architecture_and_drafter_at_batch_1_and_8(
    case: DrafterCase, case_checkpoints: dict[str, Path]
) -> None:
    target = case_checkpoints[case.arch]
    draft = None if case.draft is None else str(case_checkpoints[f"{case.draft}@{case.arch}"])
    spec = case.speculative_config(draft) or None
    prompts = [{"prompt_token_ids": [5 + i, 9, 17, 33, 5 + i, 9]} for i in range(8)]
    sos = [CONSTRAINTS[3], CONSTRAINTS[4], CONSTRAINTS[5], None]
    params = [
        SamplingParams(max_tokens=30, temperature=0, ignore_eos=so is None, structured_outputs=so)
        for so in sos * 2
    ]

    def run(s: dict[str, Any] | None, seqs: int) -> list[list[int]]:
        llm = LLM(model=str(target), max_num_seqs=seqs, speculative_config=s)
        outs = llm.generate(prompts[: 8 if seqs > 1 else 4], params[: 8 if seqs > 1 else 4])
        llm.leak_check()
        for o, prm in zip(outs, params, strict=False):
            if prm.structured_outputs is not None:
                assert o.outputs[0].finish_reason == "stop", (case.name, o.outputs[0].text)
                _check(prm.structured_outputs, o.outputs[0].text)
        return [o.outputs[0].token_ids for o in outs]

    for seqs in (1, 8):
        want = run(None, seqs)
        if spec is not None:
            assert run(spec, seqs) == want, (case.name, seqs)


def test_logit_bias_with_speculation_is_lossless(qwen_ckpt: Path) -> None:
    prompts = [{"prompt_token_ids": [5 + i, 9, 17, 33, 5 + i, 9]} for i in range(4)]
    free = LLM(model=str(qwen_ckpt), max_num_seqs=4).generate(
        prompts, SamplingParams(max_tokens=20, temperature=0, ignore_eos=True)
    )
    # ban a token each free output uses, and favour another a little
    bias = {o.outputs[0].token_ids[3]: -100.0 for o in free} | {50: 0.5}
    params = SamplingParams(max_tokens=20, temperature=0, ignore_eos=True, logit_bias=bias)
    want = LLM(model=str(qwen_ckpt), max_num_seqs=4).generate(prompts, params)
    changed = [o.outputs[0].token_ids for o in want] != [o.outputs[0].token_ids for o in free]
    assert changed  # the bias matters
    for spec in (
        {"method": "ngram", "num_speculative_tokens": 3},
        {"method": "mtp", "num_speculative_tokens": 3, "topk": 2},
    ):
        got = LLM(model=str(qwen_ckpt), max_num_seqs=4, speculative_config=spec).generate(prompts, params)
        assert [o.outputs[0].token_ids for o in got] == [o.outputs[0].token_ids for o in want], spec


def test_min_tokens_with_speculation_is_lossless(qwen_ckpt: Path) -> None:
    prompts = [{"prompt_token_ids": [5 + i, 9, 17, 33, 5 + i, 9]} for i in range(4)]
    plain = LLM(model=str(qwen_ckpt), max_num_seqs=4)
    eos = min(plain.engine.tokenizer.eos_token_ids)
    # EOS favoured so strongly it would come first: min_tokens alone holds it back
    params = SamplingParams(max_tokens=20, temperature=0, min_tokens=7, logit_bias={eos: 100.0})
    want = plain.generate(prompts, params)
    assert all(len(o.outputs[0].token_ids) == 8 and o.outputs[0].token_ids[-1] == eos for o in want)
    for spec in (
        {"method": "ngram", "num_speculative_tokens": 3},
        {"method": "mtp", "num_speculative_tokens": 3},
        {"method": "mtp", "num_speculative_tokens": 3, "topk": 2},
    ):
        got = LLM(model=str(qwen_ckpt), max_num_seqs=4, speculative_config=spec).generate(prompts, params)
        assert [o.outputs[0].token_ids for o in got] == [o.outputs[0].token_ids for o in want], spec


@pytest.mark.parametrize("spec", [None, {"method": "mtp", "num_speculative_tokens": 3}], ids=["plain", "mtp"])
def test_min_tokens_past_the_constraint_end_finishes_at_the_end(qwen_ckpt: Path, spec: Any) -> None:
    """min_tokens longer than the constraint allows: once the constraint is complete its end tokens are all
    it allows, so it ends the request there (holding them back too left no token: token 0 was sampled and
    the engine step raised). A free request beside it is unharmed."""
    llm = LLM(model=str(qwen_ckpt), max_num_seqs=4, speculative_config=spec)
    so = StructuredOutputsParams(choice=["yes", "no"])
    bound = SamplingParams(max_tokens=12, temperature=0, min_tokens=10, structured_outputs=so)
    free = SamplingParams(max_tokens=12, temperature=0, ignore_eos=True)
    out = llm.generate([{"prompt_token_ids": [5, 9, 17]}, {"prompt_token_ids": [5, 9, 17]}], [bound, free])
    assert out[0].outputs[0].text in ("yes", "no") and out[0].outputs[0].finish_reason == "stop"
    assert len(out[1].outputs[0].token_ids) == 12
    llm.leak_check()


def test_min_tokens_holds_back_eos_where_the_constraint_could_go_on() -> None:
    """A constraint that is complete but could go on ("a+" after one "a": more "a" or its end, EOS):
    min_tokens holds EOS back while the constraint allows another token, as vLLM's min_tokens does under a
    grammar (EOS was never held back under a constraint, so a request favouring EOS ended after one token
    with min_tokens 4). The constraint's end still comes once min_tokens is reached."""
    llm = LLM.from_engine(toy_engine(seqs=8))
    a, eos = ord("a"), 256  # the toy's byte token for "a" and its EOS
    for so in (StructuredOutputsParams(regex="a+"), StructuredOutputsParams(grammar='root ::= "a"+')):
        params = SamplingParams(
            max_tokens=10, temperature=0, min_tokens=4, logit_bias={eos: 100.0}, structured_outputs=so
        )
        (out,) = llm.generate([{"prompt_token_ids": [65, 66]}], params)
        assert out.outputs[0].token_ids == [a] * 4 + [eos], so
        assert out.outputs[0].text == "aaaa" and out.outputs[0].finish_reason == "stop"
    llm.leak_check()


@pytest.mark.parametrize(
    "spec",
    [None, {"method": "ngram", "num_speculative_tokens": 3}, {"method": "mtp", "num_speculative_tokens": 3}],
    ids=["plain", "ngram", "mtp"],
)
def test_min_tokens_under_an_open_constraint_with_speculation(qwen_ckpt: Path, spec: Any) -> None:
    """min_tokens holds EOS back under a constraint that could go on, at every verify node too: each output
    has at least min_tokens tokens before its EOS, matches the regex, and a drafter changes nothing."""
    prompts = [{"prompt_token_ids": [5 + i, 9, 17, 33, 5 + i, 9]} for i in range(3)]
    llm = LLM(model=str(qwen_ckpt), max_num_seqs=4, speculative_config=spec)
    eos = min(llm.engine.tokenizer.eos_token_ids)
    so = StructuredOutputsParams(regex="[a-z]+")
    params = SamplingParams(
        max_tokens=20, temperature=0, min_tokens=6, logit_bias={eos: 100.0}, structured_outputs=so
    )
    got = llm.generate(prompts, params)
    for o in got:
        c = o.outputs[0]
        assert len(c.token_ids) == 7 and c.token_ids[-1] == eos, c.token_ids
        assert c.finish_reason == "stop"
        _check(so, c.text)
    if spec is not None:
        want = LLM(model=str(qwen_ckpt), max_num_seqs=4).generate(prompts, params)
        assert [o.outputs[0].token_ids for o in got] == [o.outputs[0].token_ids for o in want]
    llm.leak_check()


@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_min_tokens_gives_way_to_a_constraint_that_needs_a_stop_token(temperature: float) -> None:
    """A constraint whose next token can only be one of the request's stop_token_ids, before min_tokens is
    reached: min_tokens holding it back left no token (token 0 was sampled, the grammar refused it and the
    step failed, aborting the other request too). The constraint wins, as it does for its own end tokens:
    the stop token is sampled and ends the request; the free request beside it is unharmed."""
    llm = LLM.from_engine(toy_engine(seqs=8))
    a = ord("a")  # the toy tokenizer's byte token for "a"
    bound = SamplingParams(
        max_tokens=5,
        temperature=temperature,
        seed=1,
        min_tokens=3,
        stop_token_ids=[a],
        structured_outputs=StructuredOutputsParams(choice=["a"]),
    )
    free = SamplingParams(max_tokens=5, temperature=0, ignore_eos=True)
    out = llm.generate([{"prompt_token_ids": [65, 66]}, {"prompt_token_ids": [70, 71]}], [bound, free])
    assert out[0].outputs[0].token_ids == [a] and out[0].outputs[0].finish_reason == "stop"
    assert out[0].outputs[0].stop_reason == a
    assert out[1].outputs[0].token_ids == toy_greedy([70, 71], 5, ignore_eos=True)
    llm.leak_check()


def test_xgrammar_errors_name_the_field_not_the_library_source() -> None:
    """A regex xgrammar refuses: the ValueError names the field and carries xgrammar's message without its
    C++ source path; a choice with a lone surrogate (no UTF-8 exists for it) is a ValueError too."""
    from hyspec_server.structured import xgrammar_error

    err = RuntimeError("[12:00:01] /project/cpp/regex_converter.cc:94: Regex parsing error at position 3")
    assert xgrammar_error(err) == "Regex parsing error at position 3"
    assert xgrammar_error(RuntimeError("/a/b.cc:7: bad")) == "bad"
    assert xgrammar_error(RuntimeError("")) == "RuntimeError"
    llm = LLM.from_engine(toy_engine())
    for so, field in (
        (StructuredOutputsParams(regex="(?<=a)b"), "regex"),
        (StructuredOutputsParams(choice=["\ud800"]), "choice"),
    ):
        with pytest.raises(ValueError, match=f"structured_outputs.{field}") as info:
            llm.generate([{"prompt_token_ids": [3]}], SamplingParams(max_tokens=3, structured_outputs=so))
        assert ".cc:" not in str(info.value)
    llm.leak_check()


def _run_to_idle(eng: Any) -> tuple[dict[str, Any], list[EngineStepError]]:
    """Steps `eng` until idle -> (every request's latest output by id, the step errors), delivering a failed
    step's outputs of the other requests as a server does."""
    latest: dict[str, Any] = {}
    errors: list[EngineStepError] = []
    while eng.has_unfinished():
        try:
            outs = eng.step()
        except EngineStepError as e:
            errors.append(e)
            outs = e.step_outputs
        latest.update({o.request_id: o for o in outs})
    return latest, errors


def test_a_request_failing_after_its_step_is_aborted_alone(qwen_ckpt: Path) -> None:
    """A request whose bookkeeping after the model step raises is aborted alone: the engine reports it with
    the step's outputs of the others, which go on to their normal ends; over HTTP the engine thread lives."""
    from hyspec_server.request import Request

    eng = build_engine(EngineArgs(model=str(qwen_ckpt), max_num_seqs=4, max_model_len=64))
    params = SamplingParams(max_tokens=6, temperature=0, ignore_eos=True)
    good = eng.add_request([5, 9, 17], params)
    bad = eng.add_request([6, 9, 17], params)
    append = Request.append_tokens  # every engine append goes through it

    def poisoned(self: Request, token_ids: Sequence[int], **kw: Any) -> bool:
        if self.request_id == bad and len(self.output_token_ids) == 2:
            raise RuntimeError("bookkeeping failed")
        return append(self, token_ids, **kw)

    Request.append_tokens = poisoned  # type: ignore[method-assign]
    try:
        latest, errors = _run_to_idle(eng)
    finally:
        Request.append_tokens = append  # type: ignore[method-assign]
    assert [e.request_ids for e in errors] == [[bad]]
    assert [o.request_id for o in errors[0].step_outputs] == [good]
    assert len(latest[good].outputs[0].token_ids) == 6
    eng.leak_check()
    # over HTTP: the failing request gets an error, the engine thread serves the next one
    srv = ServerThread(
        build_engine(EngineArgs(model=str(qwen_ckpt), max_num_seqs=4, max_model_len=64)), model_name="q"
    ).start()

    def poisoned_prompt(self: Request, token_ids: Sequence[int], **kw: Any) -> bool:
        if self.prompt_token_ids[0] == 6:
            raise RuntimeError("bookkeeping failed")
        return append(self, token_ids, **kw)

    Request.append_tokens = poisoned_prompt  # type: ignore[method-assign]
    try:
        with httpx.Client(base_url=srv.base_url, timeout=30) as c:
            body = {"model": "q", "max_tokens": 4, "temperature": 0}
            assert c.post("/v1/completions", json={**body, "prompt": [6, 9, 17]}).status_code >= 400
            assert c.post("/v1/completions", json={**body, "prompt": [5, 9, 17]}).status_code == 200
            assert srv.async_engine.is_alive()
    finally:
        Request.append_tokens = append  # type: ignore[method-assign]
        srv.stop()


def test_grammar_compile_does_not_stall_other_streams() -> None:
    """While a constrained request's grammar compiles (held here until the test says so), a running stream
    keeps getting tokens: compiling happens off the engine thread. Compiled on the engine thread, the
    stream would stop, the compile would never be released and the request would fail."""
    import threading

    eng = toy_engine(max_len=4096, seqs=4)
    real = eng.grammars.compile
    started, progressed = threading.Event(), threading.Event()
    held = [True]

    def slow_compile(params: StructuredOutputsParams) -> Any:
        if held[0]:
            held[0] = False
            started.set()
            assert progressed.wait(timeout=20), "the running stream stopped while a grammar compiled"
        return real(params)

    eng.grammars.compile = slow_compile  # type: ignore[method-assign]
    srv = ServerThread(eng, model_name="toy").start()
    errors: list[BaseException] = []

    def constrained() -> None:
        try:
            body = {
                "model": "toy",
                "prompt": "x",
                "max_tokens": 20,
                "structured_outputs": {"choice": CHOICES},
            }
            r = httpx.post(srv.base_url + "/v1/completions", json=body, timeout=60)
            assert r.status_code == 200 and r.json()["choices"][0]["text"] in CHOICES, r.text
        except BaseException as e:  # reported on the main thread
            errors.append(e)

    try:
        body = {"model": "toy", "prompt": "go", "max_tokens": 3000, "ignore_eos": True, "stream": True}
        after = 0
        side = threading.Thread(target=constrained)
        with httpx.stream("POST", srv.base_url + "/v1/completions", json=body, timeout=60) as r:
            for line in r.iter_lines():
                if not line.startswith("data: {"):
                    continue
                if not side.is_alive() and not started.is_set() and after == 0:
                    side.start()
                if started.is_set():
                    after += 1
                    if after == 20:
                        progressed.set()  # 20 chunks arrived while the compile was held
        side.join(timeout=30)
        assert progressed.is_set() and not errors, errors
    finally:
        srv.stop()


@pytest.mark.parametrize("tree", [False, True], ids=["chain", "tree"])
def test_drafts_past_the_completed_constraint_end_at_its_stop_token(qwen_ckpt: Path, tree: bool) -> None:
    # ignore_eos: only the constraint's completion (its stop token) ends these requests
    prompts = [{"prompt_token_ids": [5 + i, 9, 17, 33]} for i in range(3)]
    params = SamplingParams(
        max_tokens=40,
        temperature=0,
        ignore_eos=True,
        structured_outputs=StructuredOutputsParams(choice=CHOICES),
    )
    plain = LLM(model=str(qwen_ckpt), max_num_seqs=4, speculative_config=None)
    want = plain.generate(prompts, params)
    assert all(o.outputs[0].finish_reason == "stop" for o in want)
    # the drafts go on past the stop token with what the model, unconstrained, says next
    free = SamplingParams(max_tokens=4, temperature=0, ignore_eos=True)
    refs = []
    for p, o in zip(prompts, want, strict=True):
        done = p["prompt_token_ids"] + o.outputs[0].token_ids
        (more,) = plain.generate([{"prompt_token_ids": done}], free)
        refs.append(done + more.outputs[0].token_ids)
    vocab = json.loads((qwen_ckpt / "config.json").read_text())["vocab_size"]

    def build(ctx: DrafterContext) -> Drafter:
        return ForcedDrafter(refs, ctx.config.max_num_speculative_tokens, vocab, perfect=True, tree=tree)

    method = "mtp" if tree else "ngram"
    spec: dict[str, Any] = {"method": method, "num_speculative_tokens": 3, **({"topk": 2} if tree else {})}
    eng = build_engine(
        EngineArgs(model=str(qwen_ckpt), max_num_seqs=4, speculative_config=spec),
        drafters=DrafterRegistry({method: build}),
    )
    got = LLM.from_engine(eng).generate(prompts, params)
    assert [o.outputs[0].token_ids for o in got] == [o.outputs[0].token_ids for o in want]
    for o in got:
        st = o.spec_stats
        assert st is not None and st.num_accepted_tokens > 0
        # each round emits its accepted drafts and one more token: none went past the stop token
        assert st.num_accepted_tokens + st.num_drafts <= len(o.outputs[0].token_ids), st
    eng.leak_check()


def test_allowed_token_ids_that_cannot_begin_the_constraint_are_refused() -> None:
    """`allowed_token_ids` with a constraint none of them can begin would leave the first step nothing to
    sample (it failed that step: HTTP 500): a ValueError naming `allowed_token_ids` (HTTP 400, chat's forced
    tool call and response_format included) before anything is queued; ids that can begin it are served
    and hold both masks."""
    llm = LLM.from_engine(toy_engine())
    choice = StructuredOutputsParams(choice=["abc"])
    for so in (choice, StructuredOutputsParams(json_object=True)):
        with pytest.raises(ValueError, match="allowed_token_ids"):
            llm.generate(
                [{"prompt_token_ids": [3]}], SamplingParams(structured_outputs=so, allowed_token_ids=[5])
            )
    llm.leak_check()
    both = SamplingParams(
        max_tokens=8, temperature=0, structured_outputs=choice, allowed_token_ids=list(b"abc")
    )
    (o,) = llm.generate([{"prompt_token_ids": [3]}], both)
    assert o.outputs[0].text == "abc"
    srv = ServerThread(toy_engine(), model_name="toy").start()
    try:
        with httpx.Client(base_url=srv.base_url, timeout=60) as c:
            body = {"prompt": "x", "max_tokens": 5, "allowed_token_ids": [5]}
            chat = {
                "messages": [{"role": "user", "content": "hi"}],
                "max_tokens": 5,
                "allowed_token_ids": [5],
            }
            tool = {"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}
            for path, extra in (
                ("/v1/completions", {**body, "structured_outputs": {"choice": ["abc"]}}),
                ("/v1/completions", {**body, "response_format": {"type": "json_object"}}),
                ("/v1/chat/completions", {**chat, "tools": [tool], "tool_choice": "required"}),
            ):
                r = c.post(path, json=extra)
                assert r.status_code == 400, (path, r.text)
                assert r.json()["error"]["param"] == "allowed_token_ids", r.text
            ok = c.post(
                "/v1/completions",
                json={
                    **body,
                    "structured_outputs": {"choice": ["abc"]},
                    "allowed_token_ids": list(b"abc"),
                    "temperature": 0,
                },
            )
            assert ok.status_code == 200 and ok.json()["choices"][0]["text"] == "abc"
    finally:
        srv.stop()


def test_allowed_token_ids_that_stop_continuing_the_constraint_end_that_request_alone() -> None:
    """`allowed_token_ids` that can begin the constraint but not go on with it leave a later step nothing to
    sample: that request ends alone with an error naming `allowed_token_ids` (HTTP 400, streamed or not; it
    was a 500, "engine step failed"), the others are served."""
    dead = SamplingParams(
        max_tokens=8,
        temperature=0,
        structured_outputs=StructuredOutputsParams(choice=["abc"]),
        allowed_token_ids=[ord("a")],  # "a" begins "abc", nothing allowed goes on with it
    )
    eng = toy_engine()
    eng.add_request({"prompt_token_ids": [3]}, dead, request_id="dead")
    eng.add_request({"prompt_token_ids": [4]}, SamplingParams(max_tokens=6, ignore_eos=True), request_id="ok")
    # a dead end where the token sampled from all -inf logits (0) happens to continue the constraint
    zero = SamplingParams(
        max_tokens=8,
        temperature=0,
        structured_outputs=StructuredOutputsParams(choice=["a\x00", "ab"]),
        allowed_token_ids=[ord("a")],
    )
    eng.add_request({"prompt_token_ids": [5]}, zero, request_id="zero")
    latest, errors = _run_to_idle(eng)
    assert sorted(rid for e in errors for rid in e.request_ids) == ["dead", "zero"]
    for e in errors:
        assert all(d.param == "allowed_token_ids" for d in e.dead_ends.values()) and e.dead_ends
    assert latest["ok"].finished and len(latest["ok"].outputs[0].token_ids) == 6
    eng.leak_check()
    srv = ServerThread(toy_engine(), model_name="toy").start()
    try:
        with httpx.Client(base_url=srv.base_url, timeout=60) as c:
            body = {
                "prompt": "x",
                "max_tokens": 8,
                "temperature": 0,
                "structured_outputs": {"choice": ["abc"]},
                "allowed_token_ids": [ord("a")],
            }
            r = c.post("/v1/completions", json=body)
            assert r.status_code == 400 and r.json()["error"]["param"] == "allowed_token_ids", r.text
            streamed = c.post("/v1/completions", json={**body, "stream": True}).text
            assert '"param":"allowed_token_ids"' in streamed.replace(" ", ""), streamed
            assert streamed.endswith("data: [DONE]\n\n"), streamed  # the error event, then the end
            ok = c.post("/v1/completions", json={"prompt": "x", "max_tokens": 4, "ignore_eos": True})
            assert ok.status_code == 200 and ok.json()["usage"]["completion_tokens"] == 4
    finally:
        srv.stop()


def test_a_prompt_filling_the_context_is_the_prompts_fault() -> None:
    """A prompt that alone fills max_model_len is refused naming the prompt, whatever max_tokens asks."""
    srv = ServerThread(toy_engine(max_len=64), model_name="toy").start()
    try:
        with httpx.Client(base_url=srv.base_url, timeout=60) as c:
            r = c.post("/v1/completions", json={"prompt": [3] * 80, "max_tokens": 4})
            assert r.status_code == 400 and r.json()["error"]["param"] == "prompt", r.text
            r = c.post("/v1/completions", json={"prompt": [3] * 40, "max_tokens": 40})
            assert r.status_code == 400 and r.json()["error"]["param"] == "max_tokens", r.text
    finally:
        srv.stop()
