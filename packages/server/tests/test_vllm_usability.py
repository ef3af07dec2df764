"""vLLM-compatible usability pieces: `LLM.chat`, `get_tokenizer`, `use_tqdm`, `trust_remote_code` refused,
vLLM's speculative method names, `/version`, `/tokenize`, `/detokenize`, an optional `model` field and the
API key from `HYSPEC_API_KEY`."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from hyspec_server import LLM, SamplingParams
from hyspec_server.cli import build_parser
from hyspec_server.serve import ServerThread
from hyspec_spec_workers.config import SpeculativeConfig
from hyspec_testing.server import toy_engine, toy_greedy

GREEDY = SamplingParams(max_tokens=6, temperature=0, ignore_eos=True)


def test_chat_one_conversation_and_many() -> None:
    llm = LLM.from_engine(toy_engine())
    conv = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "hi"}]
    ids = llm.engine.tokenizer.apply_chat_template(conv)
    (one,) = llm.chat(conv, GREEDY, use_tqdm=False)
    assert one.prompt_token_ids == ids
    assert one.outputs[0].token_ids == toy_greedy(ids, 6, ignore_eos=True)
    many = llm.chat([conv, [{"role": "user", "content": "yo"}]], GREEDY, use_tqdm=False)
    assert many[0].outputs[0].token_ids == one.outputs[0].token_ids
    assert len(many) == 2
    for bad in (
        [],
        [[]],
        [[{"content": "no role"}]],
        [{"role": "user"}],  # no content
        [{"role": "user", "content": None}],
        [{"role": None, "content": "hi"}],
        {"role": "user", "content": "hi"},  # a bare message, not a conversation
    ):
        with pytest.raises(ValueError, match="messages"):
            llm.chat(bad, GREEDY)  # type: ignore[arg-type]
    llm.leak_check()


def test_offline_generate_is_not_bounded_by_the_server_queue_and_names_the_bad_prompt() -> None:
    from hyspec_runner.config import EngineArgs

    llm = LLM.from_engine(toy_engine())
    bound = llm.engine.scheduler.config.max_waiting
    outs = llm.generate(
        [{"prompt_token_ids": [3, 4]}] * (bound + 5), SamplingParams(max_tokens=1), use_tqdm=False
    )
    assert len(outs) == bound + 5 and all(len(o.outputs[0].token_ids) == 1 for o in outs)
    with pytest.raises(ValueError, match=r"prompts\[1\]: prompt must have at least one token"):
        llm.generate([{"prompt_token_ids": [3]}, {"prompt_token_ids": []}], GREEDY, use_tqdm=False)
    llm.leak_check()
    assert EngineArgs(model="x", seed=None).seed == 0  # vLLM takes None
    for seed in (1.5, True, "a", -1, 2**64):
        with pytest.raises(ValueError, match="seed"):
            EngineArgs(model="x", seed=seed)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="enforce_eager"):
        EngineArgs(model="x", enforce_eager="no")  # type: ignore[arg-type]


def test_a_request_chat_template_that_fails_is_a_value_error() -> None:
    from hyspec_server.default_model import default_model_dir
    from hyspec_server.tokenizer import ChatOptions, HFTokenizer

    tok = HFTokenizer(default_model_dir())
    conv = [{"role": "user", "content": "hi"}]
    templates = (
        "{% for %}",
        "{{ foo.bar }}",
        "{{ 1 / 0 }}",  # the template's own code raises
        "{% for i in range(100000000) %}x{% endfor %}",  # past the sandbox's range limit
        "{{ 'a' * 10000000 }}",  # renders far more than the conversation: refused before tokenizing
    )
    for template in templates:
        with pytest.raises(ValueError, match="chat template failed"):
            tok.apply_chat_template(conv, options=ChatOptions(chat_template=template))
    assert tok.apply_chat_template(conv)  # the tokenizer still works


def test_get_tokenizer_and_progress_bar(capsys: pytest.CaptureFixture[str]) -> None:
    llm = LLM.from_engine(toy_engine())
    assert llm.get_tokenizer().encode("ab") == [97, 98]
    llm.generate(["abc", "de"], GREEDY, use_tqdm=True)
    assert "Processed prompts" in capsys.readouterr().err
    llm.generate(["abc"], GREEDY, use_tqdm=False)
    assert "Processed prompts" not in capsys.readouterr().err


def test_trust_remote_code_is_refused_before_anything_loads() -> None:
    with pytest.raises(ValueError, match="trust_remote_code"):
        LLM(model="/nonexistent", trust_remote_code=True)
    with pytest.raises(TypeError):
        LLM(model="/nonexistent", tensor_parallel_size=2)


def test_trust_remote_code_flag_is_refused_by_name(capsys: pytest.CaptureFixture[str]) -> None:
    from hyspec_server.cli import main

    with pytest.raises(SystemExit) as e:
        main(["serve", "/nowhere", "--trust-remote-code"])
    assert e.value.code == 2
    err = capsys.readouterr().err
    assert "--trust-remote-code" in err and "never executes" in err and "unrecognized" not in err
    # its negation is what hyspec does anyway: accepted (then /nowhere fails to load, naming model)
    assert main(["generate", "/nowhere", "--no-trust-remote-code"]) == 2
    assert "model: '/nowhere'" in capsys.readouterr().err


def test_model_tokenizer_take_paths_and_refuse_other_types(tmp_path: Path) -> None:
    from hyspec_runner.config import EngineArgs

    args = EngineArgs(model=tmp_path, tokenizer=tmp_path)  # type: ignore[arg-type]
    assert args.model == str(tmp_path) and args.tokenizer == str(tmp_path)
    for name in ("model", "tokenizer"):
        for bad in (5, "", ["m"]):
            with pytest.raises(ValueError, match=f"^{name} must be"):
                EngineArgs(**{name: bad})  # type: ignore[arg-type]


def test_allowed_origins_is_a_json_list_of_strings(capsys: pytest.CaptureFixture[str]) -> None:
    parse = build_parser().parse_args
    assert parse(["serve", "--allowed-origins", '["https://a.example"]']).allowed_origins == [
        "https://a.example"
    ]
    assert parse(["serve", "--allowed-origins", "[]"]).allowed_origins == []
    # a bare string would be split into one-letter origins
    for bad in ('"https://a.example"', "https://a.example", "[1]", "{}"):
        with pytest.raises(SystemExit):
            parse(["serve", "--allowed-origins", bad])
        assert "argument --allowed-origins: expected a JSON list" in capsys.readouterr().err


def test_sampling_params_of_the_wrong_length_say_one_per_prompt() -> None:
    llm = LLM.from_engine(toy_engine())
    for prompts, params in ((["a", "b", "c"], [GREEDY]), (["a"], [GREEDY, GREEDY]), (["a"], [])):
        with pytest.raises(ValueError, match=rf"one per prompt \({len(prompts)}\), got {len(params)}"):
            llm.generate(prompts, params, use_tqdm=False)
    outs = llm.generate(["a", "b"], (GREEDY, SamplingParams(max_tokens=2)), use_tqdm=False)
    assert [len(o.outputs[0].token_ids) for o in outs] == [6, 2]
    llm.leak_check()


@pytest.mark.parametrize(
    ("alias", "method"), [("qwen3_next_mtp", "mtp"), ("qwen3_5_mtp", "mtp"), ("mtp", "mtp")]
)
def test_vllm_method_names(alias: str, method: str) -> None:
    assert SpeculativeConfig.from_dict({"method": alias, "num_speculative_tokens": 2}).method == method


def test_eagle_is_eagle3() -> None:
    cfg = SpeculativeConfig.from_dict({"method": "eagle", "model": "/some/draft"})
    assert cfg.method == "eagle3" and cfg.model == "/some/draft"


def test_version_tokenize_detokenize_and_optional_model() -> None:
    import httpx

    srv = ServerThread(toy_engine(), model_name="toy").start()
    try:
        with httpx.Client(base_url=srv.base_url, timeout=30) as c:
            assert c.get("/version").json()["version"]
            r = c.post("/tokenize", json={"prompt": "héllo"}).json()
            assert r["tokens"] == list("héllo".encode()) and r["count"] == 6 and r["max_model_len"] == 256
            chat = c.post("/tokenize", json={"model": "toy", "messages": [{"role": "user", "content": "x"}]})
            assert chat.json()["tokens"] == list(b"user: x\nassistant:")
            assert r["token_strs"] is None and chat.json()["token_strs"] is None
            # vLLM's return_token_strs: one string per token, for a prompt and for messages
            strs = c.post("/tokenize", json={"prompt": "ab", "return_token_strs": True}).json()["token_strs"]
            assert strs == ["a", "b"]
            msgs = [{"role": "user", "content": "x"}]
            chat_strs = c.post("/tokenize", json={"messages": msgs, "return_token_strs": True}).json()
            assert "".join(chat_strs["token_strs"]) == "user: x\nassistant:"
            assert len(chat_strs["token_strs"]) == chat_strs["count"]
            assert c.post("/detokenize", json={"tokens": r["tokens"]}).json() == {"prompt": "héllo"}
            for path, body, param in (
                ("/detokenize", {"tokens": [1, -1]}, "tokens"),
                ("/detokenize", {"tokens": [10**9]}, "tokens"),
                ("/tokenize", {"prompt": 5}, "prompt"),
                ("/tokenize", {"prompt": "a", "return_token_strs": "yes"}, "return_token_strs"),
            ):
                bad = c.post(path, json=body)
                assert bad.status_code == 400 and bad.json()["error"]["param"] == param
            assert c.post("/tokenize", json={"model": "other", "prompt": "x"}).status_code == 404
            # `model` may be left out, as vLLM allows
            r = c.post("/v1/completions", json={"prompt": "ab", "max_tokens": 3, "temperature": 0})
            assert r.status_code == 200 and r.json()["model"] == "toy"
            r = c.post(
                "/v1/chat/completions", json={"messages": [{"role": "user", "content": "a"}], "max_tokens": 2}
            )
            assert r.status_code == 200
            assert c.post("/v1/completions", json={"model": "nope", "prompt": "a"}).status_code == 404
    finally:
        srv.stop()


def test_api_key_from_the_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("HYSPEC_API_KEY", "from-env")
    assert build_parser().parse_args(["serve"]).api_key == "from-env"
    assert build_parser().parse_args(["serve", "--api-key", "flag"]).api_key == "flag"
    monkeypatch.delenv("HYSPEC_API_KEY")
    assert build_parser().parse_args(["serve"]).api_key is None


def test_device_auto_resolves() -> None:
    import torch
    from hyspec_server import EngineArgs

    want = "cuda" if torch.cuda.is_available() else "cpu"
    assert EngineArgs(model="x").device == want == EngineArgs(model="x", device="auto").device
    with pytest.raises(ValueError, match="device"):
        EngineArgs(model="x", device="tpu")


def test_generation_config_defaults_fill_unset_fields(tmp_path: Path) -> None:
    import json

    from hyspec_server.builder import generation_defaults
    from hyspec_testing.tiny import build_tiny_checkpoint

    ckpt = build_tiny_checkpoint(tmp_path / "q", "qwen3_5", seed=0)
    assert dict(generation_defaults(ckpt)) == {}
    cfg = json.loads((ckpt / "generation_config.json").read_text())
    cfg.update({"temperature": 0.6, "top_p": 0.95, "top_k": 20, "do_sample": True})
    (ckpt / "generation_config.json").write_text(json.dumps(cfg))
    assert dict(generation_defaults(ckpt)) == {"temperature": 0.6, "top_p": 0.95, "top_k": 20}
    llm = LLM(model=str(ckpt))
    p = llm.get_default_sampling_params()
    assert (p.temperature, p.top_p, p.top_k) == (0.6, 0.95, 20)
    # over HTTP: a field the request leaves out takes the default, one it sets wins
    from hyspec_server.protocol import CompletionRequest

    req = CompletionRequest(model="m", prompt="x", top_p=0.5)
    sp = req.sampling_params(max_tokens=4, logprobs=None, seed=None, defaults=llm.engine.default_sampling)
    assert (sp.temperature, sp.top_p, sp.top_k) == (0.6, 0.5, 20)
    # vLLM's generation_config: "vllm" takes no defaults, a directory takes its generation_config.json
    llm.close()
    plain = LLM(model=str(ckpt), generation_config="vllm").get_default_sampling_params()
    assert (plain.temperature, plain.top_p, plain.top_k) == (1.0, 1.0, -1)
    other = tmp_path / "gen"
    other.mkdir()
    (other / "generation_config.json").write_text(json.dumps({**cfg, "temperature": 0.3}))
    assert LLM(model=str(ckpt), generation_config=other).get_default_sampling_params().temperature == 0.3
    for bad in (str(tmp_path / "missing"), "", 3):
        with pytest.raises(ValueError, match="generation_config"):
            LLM(model=str(ckpt), generation_config=bad)
    assert build_parser().parse_args(["serve", "--generation-config", "vllm"]).generation_config == "vllm"


def test_cli_version_and_model_card(capsys: pytest.CaptureFixture[str]) -> None:
    import httpx

    with pytest.raises(SystemExit) as e:
        build_parser().parse_args(["--version"])
    assert e.value.code == 0 and capsys.readouterr().out.startswith("hyspec ")
    srv = ServerThread(toy_engine(), model_name="org/toy").start()
    try:
        card = httpx.get(srv.base_url + "/v1/models/org/toy").json()
        assert card["id"] == "org/toy" and card["max_model_len"] == 256
        assert httpx.get(srv.base_url + "/v1/models/other").status_code == 404
    finally:
        srv.stop()


def test_chat_echo_starts_a_continued_reply_with_the_last_message() -> None:
    """vLLM's chat `echo`: a continued assistant message (add_generation_prompt false, continue_final_message
    true) comes back with its own text first, streamed as the first content; the reply's role is then the
    last message's. After a generation prompt the reply's role is "assistant" and a user's last message is
    not echoed."""
    import httpx

    conv = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "he"}]
    cont = {"messages": conv, "max_tokens": 3, "temperature": 0, "ignore_eos": True}
    cont |= {"add_generation_prompt": False, "continue_final_message": True}
    srv = ServerThread(toy_engine(), model_name="toy").start()
    try:
        url = srv.base_url + "/v1/chat/completions"
        plain = httpx.post(url, json=cont).json()["choices"][0]["message"]
        echoed = httpx.post(url, json={**cont, "echo": True}).json()["choices"][0]["message"]
        assert echoed == {"role": "assistant", "content": "he" + plain["content"]}
        lines = httpx.post(url, json={**cont, "echo": True, "stream": True}).text.split("\n\n")
        deltas = [json.loads(x[6:])["choices"][0]["delta"] for x in lines if x.startswith("data: {")]
        assert deltas[0] == {"role": "assistant", "content": ""} and deltas[1] == {"content": "he"}
        assert "".join(d.get("content", "") for d in deltas) == echoed["content"]
        user_last = {"messages": conv[:1], "max_tokens": 2, "echo": True}
        reply = httpx.post(url, json=user_last).json()["choices"][0]["message"]
        assert reply["role"] == "assistant" and not reply["content"].startswith("hi")
    finally:
        srv.stop()


def test_chat_template_options() -> None:
    import httpx

    llm = LLM.from_engine(toy_engine())
    conv = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "he"}]
    cases = {
        (True, False, None): b"user: hi\nassistant: he\nassistant:",
        (False, False, None): b"user: hi\nassistant: he\n",
        (False, True, None): b"user: hi\nassistant: he",
        (
            True,
            False,
            (("enable_thinking", False),),
        ): b"enable_thinking=False\nuser: hi\nassistant: he\nassistant:",
    }
    for (gen, cont, kw), want in cases.items():
        (o,) = llm.chat(
            conv,
            GREEDY,
            add_generation_prompt=gen,
            continue_final_message=cont,
            chat_template_kwargs=dict(kw) if kw else None,
            use_tqdm=False,
        )
        assert bytes(o.prompt_token_ids) == want
    with pytest.raises(ValueError, match="continue_final_message"):
        llm.chat(conv, GREEDY, continue_final_message=True)
    srv = ServerThread(toy_engine(), model_name="toy").start()
    try:
        body = {"messages": conv, "max_tokens": 2, "return_token_ids": True}
        r = httpx.post(
            srv.base_url + "/v1/chat/completions",
            json={
                **body,
                "add_generation_prompt": False,
                "continue_final_message": True,
                "chat_template_kwargs": {"x": 1},
            },
        )
        assert r.status_code == 200, r.text
        assert r.json()["usage"]["prompt_tokens"] == len(b"x=1\nuser: hi\nassistant: he")
        bad = httpx.post(srv.base_url + "/v1/chat/completions", json={**body, "continue_final_message": True})
        assert bad.status_code == 400 and bad.json()["error"]["param"] == "messages"
        # template variables named like the renderer's own arguments, malformed assistant tool calls and a
        # `model` that is no string are 400s naming the field, not server errors
        for extra, param in (
            ({"chat_template_kwargs": {"add_generation_prompt": False}}, "chat_template_kwargs"),
            ({"chat_template_kwargs": {"tools": [], "x": 1}}, "chat_template_kwargs"),
            ({"messages": [{"role": "assistant", "tool_calls": [{"function": [1]}]}]}, "messages"),
            ({"messages": [{"role": "assistant", "tool_calls": [{"function": "abc"}]}]}, "messages"),
            ({"model": 5}, "model"),
        ):
            bad = httpx.post(srv.base_url + "/v1/chat/completions", json={**body, **extra})
            assert bad.status_code == 400, (extra, bad.text)
            assert bad.json()["error"]["param"] == param, (extra, bad.json())
        bad = httpx.post(
            srv.base_url + "/tokenize",
            json={"messages": [{"role": "assistant", "tool_calls": [{"function": [1]}]}]},
        )
        assert bad.status_code == 400 and bad.json()["error"]["param"] == "messages", bad.text
        bad = httpx.post(srv.base_url + "/tokenize", json={"prompt": "hi", "model": [1]})
        assert bad.status_code == 400 and bad.json()["error"]["param"] == "model", bad.text
        assert httpx.post(srv.base_url + "/v1/chat/completions", json=body).status_code == 200
    finally:
        srv.stop()
    with pytest.raises(ValueError, match="chat_template_kwargs"):
        llm.chat(conv, GREEDY, chat_template_kwargs={"tokenize": True}, use_tqdm=False)
    for kwargs in (["a"], "a", {1: True}):
        with pytest.raises(ValueError, match="chat_template_kwargs"):
            llm.chat(conv, GREEDY, chat_template_kwargs=kwargs, use_tqdm=False)  # type: ignore[arg-type]
    for tools in ("get_weather", {"type": "function"}, [1]):
        with pytest.raises(ValueError, match="tools"):
            llm.chat(conv, GREEDY, tools=tools, use_tqdm=False)  # type: ignore[arg-type]


def test_a_chat_template_that_cannot_render_its_input_is_a_value_error() -> None:
    # the shipped demo model's real template (transformers' renderer): input nested past Python's recursion
    # limit is a ValueError (an HTTP 400), not a RecursionError
    from hyspec_server.default_model import default_model_dir
    from hyspec_server.tokenizer import ChatOptions, HFTokenizer

    tok = HFTokenizer(default_model_dir())
    deep: object = 1
    for _ in range(1500):
        deep = [deep]
    with pytest.raises(ValueError, match="nested too deeply"):
        tok.apply_chat_template(
            [{"role": "user", "content": "hi"}], options=ChatOptions(template_kwargs={"x": deep})
        )
    assert tok.apply_chat_template([{"role": "user", "content": "hi"}])  # the tokenizer still works


def test_cors_preflight_passes_before_the_api_key() -> None:
    import httpx

    srv = ServerThread(toy_engine(), model_name="toy", api_key="k").start()
    try:
        pre = httpx.options(
            srv.base_url + "/v1/completions",
            headers={"Origin": "https://app.example", "Access-Control-Request-Method": "POST"},
        )
        assert pre.status_code == 200 and pre.headers["access-control-allow-origin"] in (
            "*",
            "https://app.example",
        )
        r = httpx.get(
            srv.base_url + "/v1/models",
            headers={"Origin": "https://app.example", "Authorization": "Bearer k"},
        )
        assert r.status_code == 200 and "access-control-allow-origin" in r.headers
        assert (
            httpx.get(srv.base_url + "/v1/models", headers={"Origin": "https://app.example"}).status_code
            == 401
        )
    finally:
        srv.stop()


def test_a_port_in_use_fails_before_the_model_loads(capsys: pytest.CaptureFixture[str]) -> None:
    import socket

    from hyspec_server import EngineArgs
    from hyspec_server.cli import main
    from hyspec_server.serve import serve

    busy = socket.socket()
    busy.bind(("127.0.0.1", 0))
    busy.listen()
    port = busy.getsockname()[1]
    try:
        # the model directory does not exist: loading it is a ValueError, so OSError means bind came first
        with pytest.raises(OSError, match=f"127.0.0.1:{port}"):
            serve(EngineArgs(model="/nonexistent"), port=port)
        assert main(["serve", "/nonexistent", "--port", str(port)]) == 2
        assert f"127.0.0.1:{port}" in capsys.readouterr().err
    finally:
        busy.close()


def test_prompt_dicts_take_only_the_keys_hyspec_implements() -> None:
    from hyspec_server.engine import PROMPT_KEYS

    llm = LLM.from_engine(toy_engine())
    eng = llm.engine
    for bad, key in (
        ({"prompt_token_ids": [3, 4], "promt": "x"}, "promt"),  # a misspelt key beside a good one
        ({"prompt": "hi", "multi_modal_data": {"image": None}}, "multi_modal_data"),  # vLLM's, not served
        ({"prompt_token_ids": [3], "mm_processor_kwargs": {}}, "mm_processor_kwargs"),
        ({"prompt_tokens_ids": [3]}, "prompt_tokens_ids"),
    ):
        want = f"unknown key '{key}' in a prompt dict; the accepted keys are {', '.join(PROMPT_KEYS)}"
        with pytest.raises(ValueError, match=want):
            llm.generate(bad, GREEDY, use_tqdm=False)
        with pytest.raises(ValueError, match=rf"prompts\[1\]: unknown key '{key}'"):
            llm.generate(["ok", bad], GREEDY, use_tqdm=False)
        with pytest.raises(ValueError, match=want):
            eng.add_request(bad, GREEDY)  # the engine reads dicts the same way
    for bad, match in (
        ({}, "needs 'prompt'"),
        ({"cache_salt": "t"}, "needs 'prompt'"),
        ({"prompt": 5}, "^prompt: expected a string"),
        ({"prompt_token_ids": "3 4"}, "^prompt_token_ids must be a list of ints"),
        ({"prompt_token_ids": [3], "cache_salt": ""}, "^cache_salt"),
    ):
        with pytest.raises(ValueError, match=match):
            llm.generate(bad, GREEDY, use_tqdm=False)
    # every accepted key does what it says: both prompt and ids (vLLM's TokensPrompt) run the ids and report
    # the text; a dict reaches the engine directly too
    (o,) = llm.generate(
        {"prompt": "text", "prompt_token_ids": [3, 4], "cache_salt": "t"}, GREEDY, use_tqdm=False
    )
    assert o.prompt == "text" and o.prompt_token_ids == [3, 4]
    assert o.outputs[0].token_ids == toy_greedy([3, 4], 6, ignore_eos=True)
    (o,) = llm.generate({"prompt": "ab"}, GREEDY, use_tqdm=False)
    assert o.prompt == "ab" and o.prompt_token_ids == [97, 98]
    rid = eng.add_request({"prompt_token_ids": [3, 4], "cache_salt": "t"}, GREEDY)
    assert eng.requests[rid].cache_salt == "t" and eng.requests[rid].prompt_token_ids == [3, 4]
    eng.abort(rid)
    llm.leak_check()


def test_tokenize_messages_renders_as_chat_completions() -> None:
    import httpx

    conv = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "he"}]
    tools = [{"type": "function", "function": {"name": "get", "parameters": {"type": "object"}}}]
    srv = ServerThread(toy_engine(), model_name="toy").start()
    try:
        with httpx.Client(base_url=srv.base_url, timeout=30) as c:

            def both(extra: dict[str, object]) -> tuple[httpx.Response, httpx.Response]:
                body = {"messages": conv, **extra}
                tok = c.post("/tokenize", json=body)
                chat = c.post(
                    "/v1/chat/completions", json={**body, "max_tokens": 1, "return_token_ids": True}
                )
                return tok, chat

            for extra, want in (
                ({}, b"user: hi\nassistant: he\nassistant:"),
                ({"add_generation_prompt": False}, b"user: hi\nassistant: he\n"),
                (
                    {"add_generation_prompt": False, "continue_final_message": True},
                    b"user: hi\nassistant: he",
                ),
                ({"tools": tools}, b"tool: get\nuser: hi\nassistant: he\nassistant:"),
                ({"tools": tools, "tool_choice": "none"}, b"user: hi\nassistant: he\nassistant:"),
                (
                    {"chat_template_kwargs": {"enable_thinking": False}, "add_generation_prompt": False},
                    b"enable_thinking=False\nuser: hi\nassistant: he\n",
                ),
            ):
                tok, chat = both(extra)
                assert tok.status_code == 200 and chat.status_code == 200, (extra, tok.text, chat.text)
                assert tok.json()["tokens"] == list(want), extra
                assert tok.json()["count"] == chat.json()["usage"]["prompt_tokens"] == len(want), extra
            # what chat completions refuses, /tokenize refuses with the same status and param
            for extra, param in (
                ({"chat_template_kwargs": {"add_generation_prompt": False}}, "chat_template_kwargs"),
                ({"chat_template_kwargs": "x"}, "chat_template_kwargs"),
                ({"tools": [{"type": "function"}]}, "tools"),
                ({"tool_choice": "required"}, "tool_choice"),
                ({"continue_final_message": True}, "messages"),  # with add_generation_prompt's default
                ({"add_generation_prompt": "no"}, "add_generation_prompt"),
                ({"chat_template": "{{ messages }}"}, "chat_template"),  # the server does not trust them
                ({"messages": "hi"}, "messages"),
                ({"messages": []}, "messages"),
                ({"messages": [{"role": "wizard", "content": "x"}]}, "messages"),
            ):
                tok, chat = both(extra)
                assert tok.status_code == chat.status_code == 400, (extra, tok.text, chat.text)
                assert tok.json()["error"]["param"] == chat.json()["error"]["param"] == param, extra
            bad = c.post("/tokenize", json={"messages": conv, "add_special_tokens": True})
            assert bad.status_code == 400 and bad.json()["error"]["param"] == "add_special_tokens"
            ok = c.post("/tokenize", json={"messages": conv, "add_special_tokens": False})
            assert ok.json()["tokens"] == list(b"user: hi\nassistant: he\nassistant:")
    finally:
        srv.stop()


def test_truncate_prompt_tokens_keeps_the_last_tokens() -> None:
    """vLLM's `truncate_prompt_tokens`: a request runs its prompt's last k tokens (-1: the last
    max_model_len), exactly as if only those had been sent; anything else is a ValueError naming it."""
    llm = LLM.from_engine(toy_engine())
    ids = list(range(40, 70))
    (out,) = llm.generate(
        [{"prompt_token_ids": ids}],
        SamplingParams(max_tokens=6, temperature=0, ignore_eos=True, truncate_prompt_tokens=5),
        use_tqdm=False,
    )
    assert out.prompt_token_ids == ids[-5:]
    assert (
        out.outputs[0].token_ids
        == toy_greedy(ids[-5:], 6, ignore_eos=True)
        != toy_greedy(ids, 6, ignore_eos=True)
    )
    for k in (-1, 30, 100):  # no cut: the prompt is within k
        (same,) = llm.generate(
            [{"prompt_token_ids": ids}],
            SamplingParams(max_tokens=6, temperature=0, ignore_eos=True, truncate_prompt_tokens=k),
            use_tqdm=False,
        )
        assert same.prompt_token_ids == ids and same.outputs[0].token_ids == toy_greedy(
            ids, 6, ignore_eos=True
        )
    for bad in (0, -2, 1.5, True, "5"):
        with pytest.raises(ValueError, match="truncate_prompt_tokens"):
            SamplingParams(truncate_prompt_tokens=bad)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="truncate_prompt_tokens"):  # over max_model_len (256)
        llm.generate([{"prompt_token_ids": ids}], SamplingParams(truncate_prompt_tokens=257), use_tqdm=False)
    llm.leak_check()


def test_truncate_prompt_tokens_and_message_content_over_http() -> None:
    import httpx

    srv = ServerThread(toy_engine(), model_name="toy").start()
    try:
        with httpx.Client(base_url=srv.base_url, timeout=30) as c:
            prompt = list(range(40, 70))
            body = {"prompt": prompt, "max_tokens": 4, "temperature": 0, "ignore_eos": True}
            r = c.post("/v1/completions", json=body | {"truncate_prompt_tokens": 3})
            assert r.status_code == 200 and r.json()["usage"]["prompt_tokens"] == 3
            cut = bytes(toy_greedy(prompt[-3:], 4, ignore_eos=True)).decode()
            assert r.json()["choices"][0]["text"] == cut
            for extra, param in (
                ({"truncate_prompt_tokens": -5}, "truncate_prompt_tokens"),
                ({"truncate_prompt_tokens": 10**6}, "truncate_prompt_tokens"),
                ({"truncate_prompt_tokens": 3, "echo": True}, "echo"),
            ):
                bad = c.post("/v1/completions", json=body | extra)
                assert bad.status_code == 400 and bad.json()["error"]["param"] == param, bad.json()
            # a chat without max_tokens gets the room its truncated prompt leaves
            msgs = [{"role": "user", "content": "x" * 300}]  # over max_model_len (256) untruncated
            assert c.post("/v1/chat/completions", json={"messages": msgs}).status_code == 400
            r = c.post("/v1/chat/completions", json={"messages": msgs, "truncate_prompt_tokens": 250})
            assert r.status_code == 200 and r.json()["usage"]["prompt_tokens"] == 250
            assert r.json()["usage"]["completion_tokens"] <= 6
            bad = c.post("/v1/chat/completions", json={"messages": msgs, "truncate_prompt_tokens": 300})
            assert bad.status_code == 400 and bad.json()["error"]["param"] == "truncate_prompt_tokens"
            # as `LLM.chat`: a message without content is refused unless an assistant's with tool_calls
            for m in ({"role": "user"}, {"role": "user", "content": None}, {"role": "assistant"}):
                bad = c.post("/v1/chat/completions", json={"messages": [m], "max_tokens": 2})
                assert bad.status_code == 400 and bad.json()["error"]["param"] == "messages", bad.json()
    finally:
        srv.stop()


def test_guided_fields_constrain_and_unimplemented_output_fields_are_refused() -> None:
    """vLLM's earlier `guided_*` fields constrain as `structured_outputs` does (they used to be ignored:
    unconstrained output); vLLM fields that would change the output and that hyspec lacks are a 400 naming
    them, never ignored; `allowed_token_ids` and `bad_words` limit the output, a bad list is a 400 naming
    it."""
    import httpx

    srv = ServerThread(toy_engine(), model_name="toy").start()
    try:
        with httpx.Client(base_url=srv.base_url, timeout=30) as c:
            body: dict[str, object] = {"prompt": "ab", "max_tokens": 20, "temperature": 0}
            for extra, allowed in (
                ({"guided_choice": ["yes", "no"]}, {"yes", "no"}),
                ({"guided_regex": "[xyz]{3}"}, None),
            ):
                r = c.post("/v1/completions", json=body | extra)
                assert r.status_code == 200, r.json()
                text = r.json()["choices"][0]["text"]
                assert text in allowed if allowed else len(text) == 3 and set(text) <= set("xyz"), text
                same = c.post(
                    "/v1/completions",
                    json=body | {"structured_outputs": {k[7:]: v for k, v in extra.items()}},
                )
                assert same.json()["choices"][0]["text"] == text
            for extra, param in (
                ({"guided_regex": "[", "max_tokens": 3}, "guided_regex"),
                ({"guided_choice": []}, "guided_choice"),
                ({"guided_json": {"type": "object"}, "structured_outputs": {"regex": "a"}}, "guided_json"),
                ({"guided_json": {"type": "object"}, "guided_regex": "a"}, "guided_json"),
                ({"allowed_token_ids": []}, "allowed_token_ids"),
                ({"allowed_token_ids": [5, 10**6]}, "allowed_token_ids"),  # past the vocabulary
                ({"allowed_token_ids": "5"}, "allowed_token_ids"),
                ({"bad_words": [""]}, "bad_words"),
                ({"logits_processors": ["m.f"]}, "logits_processors"),
                ({"use_beam_search": True}, "use_beam_search"),
            ):
                bad = c.post("/v1/completions", json=body | extra)
                assert bad.status_code == 400 and bad.json()["error"]["param"] == param, (extra, bad.json())
            # their defaults (as vLLM's clients send them) are fine
            ok = c.post("/v1/completions", json=body | {"use_beam_search": False, "bad_words": []})
            assert ok.status_code == 200
            # vLLM's allowed_token_ids: only those tokens, in completions and chat
            only = {"allowed_token_ids": [ord("k"), ord("m")], "ignore_eos": True, "bad_words": ["mm"]}
            r = c.post("/v1/completions", json=body | only)
            text = r.json()["choices"][0]["text"]
            assert r.status_code == 200 and set(text) <= {"k", "m"} and "mm" not in text, r.json()
            r = c.post(
                "/v1/chat/completions",
                json={"messages": [{"role": "user", "content": "a"}], "max_tokens": 6} | only,
            )
            text = r.json()["choices"][0]["message"]["content"]
            assert r.status_code == 200 and set(text) <= {"k", "m"} and "mm" not in text, r.json()
            chat = c.post(
                "/v1/chat/completions",
                json={
                    "messages": [{"role": "user", "content": "a"}],
                    "max_tokens": 5,
                    "guided_choice": ["ok"],
                },
            )
            assert chat.status_code == 200 and chat.json()["choices"][0]["message"]["content"] == "ok"
    finally:
        srv.stop()


def test_completions_max_tokens_null_is_the_room_left() -> None:
    """vLLM's completions: `max_tokens` left out is 16; an explicit null is the room each prompt leaves in
    the context (per prompt of a batch); a prompt that leaves none is a 400 naming the prompt."""
    import httpx

    srv = ServerThread(toy_engine(), model_name="toy").start()
    try:
        with httpx.Client(base_url=srv.base_url, timeout=120) as c:
            base = {"temperature": 0, "ignore_eos": True}
            r = c.post("/v1/completions", json={**base, "prompt": "ab"}).json()
            assert r["usage"]["completion_tokens"] == 16
            body = {**base, "prompt": ["ab", "abcdef"], "max_tokens": None, "logprobs": 0}
            r = c.post("/v1/completions", json=body).json()
            assert r["usage"]["completion_tokens"] == (256 - 2) + (256 - 6), r["usage"]
            lengths = [
                len(ch["logprobs"]["tokens"]) for ch in sorted(r["choices"], key=lambda ch: ch["index"])
            ]
            assert lengths == [254, 250]
            full = c.post("/v1/completions", json={**base, "prompt": [1] * 256, "max_tokens": None})
            assert full.status_code == 400 and full.json()["error"]["param"] == "prompt"
    finally:
        srv.stop()


def test_completions_honour_add_special_tokens() -> None:
    """vLLM's `add_special_tokens` on /v1/completions: a text prompt gets the tokenizer's special tokens (a
    BOS here) by default and none with False (a client that wrote them into the text), as /tokenize counts."""
    import httpx
    from hyspec_testing.server import ByteTokenizer

    class BosTokenizer(ByteTokenizer):
        def encode(self, text: str, *, add_special_tokens: bool = True) -> list[int]:
            return ([2] if add_special_tokens else []) + super().encode(text)

    eng = toy_engine()
    eng.tokenizer = BosTokenizer()
    srv = ServerThread(eng, model_name="toy").start()
    try:
        with httpx.Client(base_url=srv.base_url, timeout=30) as c:
            for special, want in ((None, 3), (True, 3), (False, 2)):
                extra = {} if special is None else {"add_special_tokens": special}
                body = {"prompt": "ab", "max_tokens": 1, "temperature": 0, **extra}
                r = c.post("/v1/completions", json=body).json()
                assert r["usage"]["prompt_tokens"] == want, (special, r)
                counted = c.post("/tokenize", json={"prompt": "ab", **extra}).json()["count"]
                assert counted == want
            bad = c.post("/v1/completions", json={"prompt": "ab", "add_special_tokens": "no"})
            assert bad.status_code == 400 and bad.json()["error"]["param"] == "add_special_tokens"
    finally:
        srv.stop()


def test_token_strs_of_special_tokens_are_their_vocabulary_strings(tmp_path: Path) -> None:
    """/tokenize's `return_token_strs` with a Hugging Face tokenizer: each token's vocabulary string, the
    special ones included (`<|im_start|>`, not ""), as vLLM's `convert_ids_to_tokens` gives them."""
    from hyspec_server.api_server import _token_strs
    from hyspec_server.tokenizer import HFTokenizer
    from hyspec_testing.tiny_tokenizer import write_tokenizer

    write_tokenizer(tmp_path)
    tok = HFTokenizer(tmp_path)
    ids = tok.hf_tokenizer.convert_tokens_to_ids(["<|im_start|>"]) + tok.encode(
        "user", add_special_tokens=False
    )
    strs = _token_strs(tok, ids)
    assert strs[0] == "<|im_start|>" and len(strs) == len(ids)
    assert "".join(strs[1:]) == "".join(tok.hf_tokenizer.convert_ids_to_tokens(ids[1:]))


def test_echo_without_generation_scores_the_prompt() -> None:
    """vLLM's echo with max_tokens 0 (how evaluation harnesses score a text): the prompt alone comes back,
    with its logprobs (the first token's null), finish_reason "length", no completion tokens counted,
    streamed or not; max_tokens 0 without echo stays a 400."""
    import json

    import httpx

    srv = ServerThread(toy_engine(), model_name="toy").start()
    try:
        with httpx.Client(base_url=srv.base_url, timeout=30) as c:
            body = {"prompt": "abcd", "max_tokens": 0, "echo": True, "logprobs": 1, "temperature": 0}
            r = c.post("/v1/completions", json=body)
            assert r.status_code == 200, r.text
            (ch,) = r.json()["choices"]
            assert ch["text"] == "abcd" and ch["finish_reason"] == "length"
            lp = ch["logprobs"]
            assert lp["tokens"] == list("abcd") and lp["token_logprobs"][0] is None
            assert all(isinstance(x, float) for x in lp["token_logprobs"][1:])
            assert r.json()["usage"]["completion_tokens"] == 0 and r.json()["usage"]["prompt_tokens"] == 4
            # scoring agrees with a generating request's echoed prompt logprobs
            gen = c.post("/v1/completions", json={**body, "max_tokens": 2}).json()["choices"][0]["logprobs"]
            assert gen["token_logprobs"][:4] == lp["token_logprobs"]
            r = c.post(
                "/v1/completions", json={**body, "stream": True, "stream_options": {"include_usage": True}}
            )
            events = [json.loads(x[6:]) for x in r.text.splitlines() if x.startswith("data: {")]
            chunks = [e["choices"][0] for e in events if e["choices"]]
            assert "".join(x["text"] for x in chunks) == "abcd"
            assert [x["finish_reason"] for x in chunks][-1] == "length"
            assert events[-1]["usage"]["completion_tokens"] == 0
            no_lp = c.post("/v1/completions", json={"prompt": "ab", "max_tokens": 0, "echo": True}).json()
            assert no_lp["choices"][0]["text"] == "ab" and no_lp["choices"][0]["logprobs"] is None
            bad = c.post("/v1/completions", json={"prompt": "ab", "max_tokens": 0})
            assert bad.status_code == 400 and bad.json()["error"]["param"] == "max_tokens"
    finally:
        srv.stop()


def test_served_model_name_defaults_to_the_model_argument_as_given(
    tiny_lfm2: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """vLLM: "If not specified, the model name will be the same as the --model argument", so a client that
    sends the hub id or path it served (as it would to vLLM) is not answered 404."""
    from hyspec_server import serve as serve_module
    from hyspec_server.cli import main

    names: list[str] = []
    monkeypatch.setattr(
        serve_module._Server,
        "run",
        lambda self, sockets=None: names.append(self.config.app.state.ctx.model_name),
    )
    assert main(["serve", str(tiny_lfm2), "--port", "0"]) == 0
    assert main(["serve", str(tiny_lfm2), "--port", "0", "--served-model-name", "mine"]) == 0
    assert names == [str(tiny_lfm2), "mine"]


def test_chat_template_flag_naming_a_missing_file_is_an_error(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """A mistyped `--chat-template` path is refused (as vLLM's "looks like a file path" error), not served as
    a template whose whole text is the path."""
    from hyspec_server.cli import _template, main

    missing = tmp_path / "tmpl.jinja"
    with pytest.raises(ValueError, match="chat_template"):
        _template(str(missing))
    with pytest.raises(ValueError, match="chat_template"):
        _template(str(tmp_path))  # a directory is no template file either
    inline = "{% for m in messages %}{{ m.content }}{% endfor %}"
    assert _template(inline) == inline
    assert main(["serve", "/nonexistent", "--chat-template", str(missing)]) == 2
    assert str(missing) in capsys.readouterr().err
