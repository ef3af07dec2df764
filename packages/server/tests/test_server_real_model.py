"""The engine on a real tiny LFM2 checkpoint (short conv + attention): LLM, HTTP and CLI vs transformers."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import openai
import pytest
from hyspec_server import LLM, EngineArgs, LLMEngine, SamplingParams
from hyspec_server.builder import build_engine
from hyspec_server.cli import build_parser, main
from hyspec_server.serve import ServerThread
from hyspec_testing.hf_reference import hf_greedy

PROMPTS = ["Hello, my name is", "The capital of France is Paris and", "a"]
N = 10


@pytest.fixture(scope="module")
def engine(tiny_lfm2: Path) -> Iterator[LLMEngine]:
    # a small step budget so the longer prompts are prefilled in several chunks
    yield build_engine(
        EngineArgs(model=str(tiny_lfm2), max_num_seqs=4, max_num_batched_tokens=12, page_size=4)
    )


@pytest.fixture(scope="module")
def reference(tiny_lfm2: Path, engine: LLMEngine) -> list[list[int]]:
    return [hf_greedy(tiny_lfm2, engine.tokenizer.encode(p), N) for p in PROMPTS]


def test_llm_greedy_equals_transformers(engine: LLMEngine, reference: list[list[int]]) -> None:
    outs = LLM.from_engine(engine).generate(
        PROMPTS, SamplingParams(max_tokens=N, temperature=0, ignore_eos=True)
    )
    assert [o.outputs[0].token_ids for o in outs] == reference
    for o, p in zip(outs, PROMPTS):
        assert o.prompt == p and o.outputs[0].text == engine.tokenizer.decode(o.outputs[0].token_ids)
    engine.leak_check()


def test_http_greedy_equals_llm_and_chat_template_works(
    tiny_lfm2: Path, engine: LLMEngine, reference: list[list[int]]
) -> None:
    srv = ServerThread(engine, model_name="tiny").start()
    try:
        c = openai.OpenAI(base_url=srv.base_url + "/v1", api_key="none", max_retries=0)
        for p, ref in zip(PROMPTS, reference):
            r = c.completions.create(
                model="tiny",
                prompt=p,
                max_tokens=N,
                temperature=0,
                extra_body={"ignore_eos": True, "return_token_ids": True},
            )
            assert r.choices[0].model_extra is not None and r.choices[0].model_extra["token_ids"] == ref
        msgs = [{"role": "user", "content": "hi"}]
        want = hf_greedy(tiny_lfm2, engine.tokenizer.apply_chat_template(msgs), 6)
        r2 = c.chat.completions.create(
            model="tiny",
            messages=msgs,
            max_tokens=6,
            temperature=0,  # type: ignore[arg-type]
            extra_body={"ignore_eos": True, "return_token_ids": True},
        )
        assert r2.choices[0].model_extra is not None and r2.choices[0].model_extra["token_ids"] == want
        srv.wait_idle_and_leak_check()
    finally:
        srv.stop()


def test_preemption_with_a_tiny_kv_pool_keeps_greedy_outputs(tiny_lfm2: Path, engine: LLMEngine) -> None:
    params = SamplingParams(max_tokens=24, temperature=0, ignore_eos=True)
    prompts = [p * 2 for p in PROMPTS] + ["xyz", "0123456789"]
    ref = [o.outputs[0].token_ids for o in LLM.from_engine(engine).generate(prompts, params)]
    plan = engine.runner.memory.pool.plan  # type: ignore[attr-defined]
    fixed = plan.total_bytes - plan.kv_bytes
    # room for one request at max context plus a little: five requests cannot all run at once
    small = LLM(
        model=str(tiny_lfm2),
        max_num_seqs=5,
        max_model_len=80,
        page_size=4,
        max_num_batched_tokens=16,
        kv_cache_bytes=fixed + 26 * plan.kv_bytes_per_page,
    )
    assert small.engine.runner.memory.pool.plan.num_kv_pages < 5 * 21  # type: ignore[attr-defined]
    outs = small.generate(prompts, params)
    assert small.engine.scheduler.num_preemptions > 0
    assert [o.outputs[0].token_ids for o in outs] == ref
    small.leak_check()


def test_cli_generate_json_on_the_embedded_default(capsys: pytest.CaptureFixture[str]) -> None:
    from hyspec_server.default_model import default_model_dir

    assert main(["generate", "--prompt", "def f(x):", "--max-tokens", "5", "--ignore-eos", "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["token_ids"] == hf_greedy(default_model_dir(), out["prompt_token_ids"], 5)
    assert out["num_tokens"] == 5 and out["tokens_per_s"] > 0 and out["finish_reason"] == "length"
    assert out["spec_stats"]["num_drafts"] > 0  # the default speculates with its MTP layer
    # plain output is the prompt plus the text
    assert main(["generate", "--prompt", "Hi", "--max-tokens", "5", "--ignore-eos"]) == 0
    assert capsys.readouterr().out.startswith("Hi")
    assert main(["generate", "--speculative-config", '{"method": "mtp", "num_speculative_tokens": 0}']) == 2
    assert "speculative_config" in capsys.readouterr().err


def test_cli_serve_flags() -> None:
    ns = build_parser().parse_args(
        [
            "serve",
            "/m",
            "--host",
            "0.0.0.0",
            "--port",
            "9",
            "--api-key",
            "k",
            "--max-running-requests",
            "3",
            "--max-model-len",
            "64",
            "--enforce-eager",
            "--speculative-config",
            "null",
        ]
    )
    assert (ns.model, ns.host, ns.port, ns.api_key, ns.max_num_seqs, ns.max_model_len, ns.enforce_eager) == (
        "/m",
        "0.0.0.0",
        9,
        "k",
        3,
        64,
        True,
    )
    assert build_parser().parse_args(["serve"]).host == "127.0.0.1"


def test_serve_shutdown_settings_and_second_sigterm(tiny_lfm2: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    import signal

    import uvicorn
    from hyspec_server import serve as serve_module

    seen: list[uvicorn.Config] = []

    def fake_run(self: uvicorn.Server, sockets: Any = None) -> None:
        seen.append(self.config)

    monkeypatch.setattr(serve_module._Server, "run", fake_run)
    assert main(["serve", str(tiny_lfm2), "--graceful-shutdown-timeout", "3", "--max-num-seqs", "4"]) == 0
    assert main(["serve", str(tiny_lfm2), "--limit-concurrency", "7"]) == 0
    # a client that never reads cannot hold the exit past the grace period; connections are bounded
    assert seen[0].timeout_graceful_shutdown == 3 and seen[0].limit_concurrency == 2 * (4 + 1024)
    assert seen[1].timeout_graceful_shutdown == serve_module.GRACEFUL_SHUTDOWN_S
    assert seen[1].limit_concurrency == 7
    server = serve_module._Server(seen[1])
    server.handle_exit(signal.SIGTERM, None)
    assert server.should_exit and not server.force_exit  # the first SIGTERM drains
    server.handle_exit(signal.SIGTERM, None)
    assert server.force_exit  # the second exits at once
