"""Engine arguments as a vLLM user passes them: CLI flags generated from `EngineArgs`, vLLM's arguments that
hyspec lacks named in the error, defaults sized from memory (`max_num_seqs`, `max_model_len`,
`gpu_memory_utilization`), `dtype="auto"`, `tokenizer`, hub ids from the local cache, the start-up summary."""

from __future__ import annotations

import json
import logging
import shutil
from dataclasses import fields
from pathlib import Path
from typing import TYPE_CHECKING

import pytest
import torch
from hyspec_runner.config import ENGINE_DEFAULTS, EngineArgs, engine_args_from
from hyspec_runner.sizing import CPU_KV_CACHE_BYTES, memory_budget
from hyspec_runner.target import resolve_dtype
from hyspec_server import LLM, SamplingParams
from hyspec_server.builder import resolve_model_dir
from hyspec_server.cli import build_parser, main

if TYPE_CHECKING:
    from hyspec_server.serve import ServerThread

GREEDY = SamplingParams(max_tokens=4, temperature=0, ignore_eos=True)


def _serve_ns(*argv: str) -> dict[str, object]:
    return vars(build_parser().parse_args(["serve", *argv]))


def test_every_engine_argument_is_a_flag_with_its_default() -> None:
    ns = _serve_ns()
    for f in fields(EngineArgs):
        assert ns[f.name] == ENGINE_DEFAULTS[f.name], f.name
    # vLLM's and SGLang's other spellings land on the same field
    assert _serve_ns("--block-size", "32")["page_size"] == 32
    assert _serve_ns("--max-running-requests", "3")["max_num_seqs"] == 3
    assert _serve_ns("--no-enable-prefix-caching")["enable_prefix_caching"] is False
    assert _serve_ns("--gpu-memory-utilization", "0.5")["gpu_memory_utilization"] == 0.5
    # --help groups the flags as vLLM does, --max-num-seqs among the scheduler's
    text = build_parser()._subparsers._group_actions[0].choices["serve"].format_help()  # type: ignore[union-attr]
    assert "SchedulerConfig" in text and "CacheConfig" in text and "--max-num-seqs" in text


@pytest.mark.parametrize(
    ("argv", "named"),
    [
        (["--tensor-parallel-size", "2"], "--tensor-parallel-size"),
        (["-tp", "2"], "-tp"),
        (["--quantization=fp8"], "--quantization"),
        (["--kv-cache-dtype", "fp8"], "--kv-cache-dtype"),
    ],
)
def test_vllm_flags_hyspec_lacks_are_named(
    argv: list[str], named: str, capsys: pytest.CaptureFixture[str]
) -> None:
    with pytest.raises(SystemExit) as e:
        main(["serve", "/nowhere", *argv])
    assert e.value.code == 2
    err = capsys.readouterr().err
    assert named in err and "does not support" in err


def test_unknown_flag_is_argparse_error(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit):
        main(["serve", "--no-such-flag", "1"])
    assert "unrecognized arguments: --no-such-flag" in capsys.readouterr().err
    # beside a vLLM flag that is ignored, a stray word is still an error, not dropped unseen
    with pytest.raises(SystemExit):
        main(["generate", "/nowhere", "--disable-log-stats", "other-model"])
    assert "unrecognized arguments: other-model" in capsys.readouterr().err


@pytest.mark.parametrize(
    "flag",
    [
        ["--port", "-1"],
        ["--port", "70000"],
        ["--port", "abc"],
        ["--max-body-bytes", "-1"],
        ["--limit-concurrency", "0"],
        ["--stream-stall-timeout", "0"],
        ["--graceful-shutdown-timeout", "-5"],
    ],
)
def test_frontend_flags_out_of_range_are_argparse_errors(
    flag: list[str], capsys: pytest.CaptureFixture[str]
) -> None:
    with pytest.raises(SystemExit) as e:
        build_parser().parse_args(["serve", "m", *flag])
    assert e.value.code == 2
    assert f"argument {flag[0]}: expected" in capsys.readouterr().err


def test_llm_keywords_checked_against_engine_args() -> None:
    with pytest.raises(TypeError, match=r"tensor_parallel_size.*does not support"):
        engine_args_from(None, {"tensor_parallel_size": 2})
    with pytest.raises(TypeError, match="max_num_seq: unknown engine argument"):
        engine_args_from(None, {"max_num_seq": 2})
    with pytest.raises(ValueError, match="trust_remote_code"):
        engine_args_from(None, {"trust_remote_code": True})
    # vLLM arguments that change nothing here are accepted
    args = engine_args_from(None, {"disable_log_stats": True, "max_num_seqs": 3, "device": "cpu"})
    assert args.max_num_seqs == 3
    for bad, value in (("gpu_memory_utilization", 0.0), ("gpu_memory_utilization", 1.5), ("max_num_seqs", 0)):
        with pytest.raises(ValueError, match=bad):
            EngineArgs(device="cpu", **{bad: value})  # type: ignore[arg-type]


def test_defaults_on_cpu_and_startup_summary(tiny_lfm2: Path, caplog: pytest.LogCaptureFixture) -> None:
    with caplog.at_level(logging.INFO, logger="hyspec"):
        llm = LLM(str(tiny_lfm2), device="cpu")
    engine = llm.engine
    ckpt_len = json.loads((tiny_lfm2 / "config.json").read_text())["max_position_embeddings"]
    assert engine.max_model_len == ckpt_len
    assert engine.scheduler.config.max_num_seqs == 16  # the CPU default, which fits
    text = caplog.text
    assert "loaded" in text and "GiB of float32 weights" in text
    assert "maximum concurrency at max_model_len" in text
    assert "the CPU budget of" in text
    out = llm.generate(["hello"], GREEDY, use_tqdm=False)
    assert len(out[0].outputs[0].token_ids) == 4


def test_max_model_len_defaults_to_the_checkpoint(tiny_lfm2: Path, tmp_path: Path) -> None:
    ckpt = tmp_path / "long"
    shutil.copytree(tiny_lfm2, ckpt)
    cfg = json.loads((ckpt / "config.json").read_text())
    cfg["max_position_embeddings"] = 6000  # over the old 4096 cap
    (ckpt / "config.json").write_text(json.dumps(cfg))
    llm = LLM(str(ckpt), device="cpu", max_num_seqs=2)
    assert llm.engine.max_model_len == 6000
    with pytest.raises(ValueError, match="max_model_len=7000 is over the checkpoint's 6000"):
        LLM(str(ckpt), device="cpu", max_model_len=7000)


def test_a_huge_step_budget_sizes_buffers_for_steps_that_can_come(tiny_qwen3_5: Path) -> None:
    # 10**9 tokens per step sized 20 GB of batch buffers; a step can never hold more than every request's
    # whole context
    llm = LLM(
        str(tiny_qwen3_5), device="cpu", max_model_len=256, max_num_seqs=4, max_num_batched_tokens=10**7
    )
    runner = llm.engine.runner
    assert runner.backend.builder.buffers.max_tokens <= 4 * 256  # type: ignore[attr-defined]
    assert llm.engine.scheduler.config.max_num_batched_tokens == 10**7  # the budget itself is as given
    (o,) = llm.generate([{"prompt_token_ids": [5, 6, 7]}], SamplingParams(max_tokens=3, temperature=0))
    assert len(o.outputs[0].token_ids) == 3


def test_max_num_seqs_default_is_lowered_to_what_fits(tiny_qwen3_5: Path) -> None:
    # a budget for one request at full context plus the recurrent state of a few more: the default (16)
    # comes down, an explicit 16 is an error saying why
    small = LLM(str(tiny_qwen3_5), device="cpu", max_model_len=512, max_num_seqs=1, kv_cache_bytes=1 << 40)
    plan = small.engine.runner.pool.plan  # type: ignore[attr-defined]
    one = plan.total_bytes
    per_request = plan.total_bytes - plan.kv_bytes  # its state slot, snapshot slot, scratch and table row
    budget = one + 4 * per_request
    llm = LLM(str(tiny_qwen3_5), device="cpu", max_model_len=512, kv_cache_bytes=budget)
    n = llm.engine.scheduler.config.max_num_seqs
    assert 1 < n < 16
    assert llm.engine.runner.pool.plan.total_bytes <= budget  # type: ignore[attr-defined]
    got = llm.generate(["a b c", "d e"], GREEDY, use_tqdm=False)
    ref = small.generate(["a b c", "d e"], GREEDY, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in got] == [o.outputs[0].token_ids for o in ref]
    with pytest.raises(ValueError, match=r"max_num_seqs=16: one request at max_model_len=512 needs"):
        LLM(str(tiny_qwen3_5), device="cpu", max_model_len=512, max_num_seqs=16, kv_cache_bytes=budget)
    with pytest.raises(ValueError, match=r"needs .* GiB .* lower max_model_len"):
        LLM(str(tiny_qwen3_5), device="cpu", max_model_len=512, kv_cache_bytes=one // 2)


def test_gpu_budget_arithmetic(monkeypatch: pytest.MonkeyPatch) -> None:
    gib = 1 << 30
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda device=None: (60 * gib, 80 * gib))
    args = EngineArgs(device="cuda", gpu_memory_utilization=0.5)
    got = memory_budget(args, torch.device("cuda"), activations=gib)
    # 40 GiB allowed, 20 in use, 1 for activations and 0.5 of overhead
    assert got.bytes == 40 * gib - 20 * gib - gib - (512 << 20)
    assert not got.fixed and "gpu_memory_utilization=0.5" in got.source
    with pytest.raises(ValueError, match=r"gpu_memory_utilization: .* leaves nothing"):
        memory_budget(
            EngineArgs(device="cuda", gpu_memory_utilization=0.2), torch.device("cuda"), activations=0
        )
    fixed = memory_budget(EngineArgs(device="cuda", kv_cache_bytes=123), torch.device("cuda"), activations=0)
    assert fixed.bytes == 123 and fixed.fixed
    cpu = memory_budget(EngineArgs(device="cpu"), torch.device("cpu"), activations=0)
    assert cpu.bytes == CPU_KV_CACHE_BYTES


def test_step_budget_default_by_device() -> None:
    # the serving sweep's choice on GPUs (benchmarks/results/*-serving-sweep.md), small steps on the CPU
    assert EngineArgs(device="cuda").max_num_batched_tokens == 8192
    assert EngineArgs(device="cpu").max_num_batched_tokens == 512
    assert EngineArgs(device="cuda", max_num_batched_tokens=64).max_num_batched_tokens == 64
    assert ENGINE_DEFAULTS["max_num_batched_tokens"] is None


def test_device_takes_torch_device_strings_of_cpu_and_cuda(tiny_lfm2: Path) -> None:
    # an index where torch takes one; the CPU is one device, so "cpu:N" is stored as "cpu"
    for given, stored in (
        ("cpu", "cpu"),
        ("cpu:0", "cpu"),
        ("cuda", "cuda"),
        ("cuda:0", "cuda:0"),
        ("cuda:3", "cuda:3"),
    ):
        args = EngineArgs(model="x", device=given)
        assert args.device == stored
        assert args.max_num_batched_tokens == (512 if stored == "cpu" else 8192)  # the device's default
    for bad in ("cuda:abc", "cuda:-1", "cuda:0:1", "cpu:", "CPU", "mps", "meta", "", " cpu", 0, None):
        with pytest.raises(ValueError, match=r"^device must be 'auto' or a torch device string") as e:
            EngineArgs(model="x", device=bad)  # type: ignore[arg-type]
        assert repr(bad) in str(e.value)
    llm = LLM(str(tiny_lfm2), device="cpu:0", max_model_len=64)
    assert llm.engine.runner.device == torch.device("cpu")
    assert len(llm.generate(["hi"], GREEDY, use_tqdm=False)[0].outputs[0].token_ids) == 4
    llm.close()


def test_dtype_auto() -> None:
    cuda, cpu = torch.device("cuda"), torch.device("cpu")
    assert resolve_dtype("auto", cuda, "float16") == torch.float16
    assert resolve_dtype("auto", cuda, "bfloat16") == torch.bfloat16
    assert resolve_dtype("auto", cuda, "float32") == torch.bfloat16  # vLLM's choice
    assert resolve_dtype("auto", cuda, None) == torch.bfloat16
    assert resolve_dtype("auto", cpu, "bfloat16") == torch.float32
    assert resolve_dtype("float16", cpu, "bfloat16") == torch.float16


def _fake_hub_cache(root: Path, repo: str, ckpt: Path) -> None:
    base = root / ("models--" + repo.replace("/", "--"))
    commit = "0" * 40
    shutil.copytree(ckpt, base / "snapshots" / commit)
    (base / "refs").mkdir(parents=True)
    (base / "refs" / "main").write_text(commit)


def test_hub_id_from_the_local_cache(
    tiny_lfm2: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    import huggingface_hub.constants

    _fake_hub_cache(tmp_path, "acme/tiny-lfm2", tiny_lfm2)
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_CACHE", str(tmp_path))
    path = resolve_model_dir("acme/tiny-lfm2")
    assert (path / "config.json").is_file() and path.parent.name == "snapshots"
    llm = LLM("acme/tiny-lfm2", device="cpu", max_num_seqs=2)
    direct = LLM(str(tiny_lfm2), device="cpu", max_num_seqs=2)
    a = llm.generate(["hi there"], GREEDY, use_tqdm=False)[0].outputs[0].token_ids
    b = direct.generate(["hi there"], GREEDY, use_tqdm=False)[0].outputs[0].token_ids
    assert a == b
    with pytest.raises(ValueError, match=f"acme/missing.*local Hugging Face cache {tmp_path}"):
        resolve_model_dir("acme/missing")
    with pytest.raises(ValueError, match="not a checkpoint directory"):
        resolve_model_dir(str(tmp_path / "nope" / "deeper"))


def test_tokenizer_argument(tiny_lfm2: Path, tmp_path: Path) -> None:
    tok_dir = tmp_path / "tok"
    tok_dir.mkdir()
    for f in tiny_lfm2.iterdir():
        if f.name.startswith(("tokenizer", "special_tokens")):
            shutil.copy(f, tok_dir / f.name)
    llm = LLM(str(tiny_lfm2), device="cpu", max_num_seqs=2, tokenizer=str(tok_dir))
    assert llm.get_tokenizer().name_or_path == str(tok_dir)
    with pytest.raises(ValueError, match="tokenizer: cannot load"):
        LLM(str(tiny_lfm2), device="cpu", max_num_seqs=2, tokenizer=str(tmp_path / "empty"))


def test_chat_and_complete_are_subcommands(capsys: pytest.CaptureFixture[str]) -> None:
    for command in ("chat", "complete"):
        assert main([command, "--url", "http://127.0.0.1:9/v1", "-q", "hi"]) == 1
        assert "http://127.0.0.1:9/v1" in capsys.readouterr().err


def test_ignored_request_fields_are_logged(
    toy_server: ServerThread, caplog: pytest.LogCaptureFixture
) -> None:
    httpx = pytest.importorskip("httpx")
    body = {"prompt": "ab", "max_tokens": 2, "temperature": 0, "best_of_sorts": 3, "guided_whatever": {}}
    with caplog.at_level(logging.WARNING, logger="hyspec.api"):
        r = httpx.post(
            f"{toy_server.base_url}/v1/completions", json=body, headers={"Authorization": "Bearer test-key"}
        )
    assert r.status_code == 200
    assert "ignored: best_of_sorts, guided_whatever" in caplog.text


def test_close_frees_the_engine(tiny_lfm2: Path) -> None:
    import weakref

    with LLM(str(tiny_lfm2), device="cpu", max_num_seqs=2) as llm:
        model = weakref.ref(llm.engine.runner.model)  # type: ignore[attr-defined]
        assert llm.generate(["hi"], GREEDY, use_tqdm=False)[0].outputs[0].token_ids
    assert model() is None  # nothing kept the weights alive
    with pytest.raises(RuntimeError, match="closed"):
        llm.generate(["hi"], GREEDY, use_tqdm=False)
    llm.close()  # idempotent


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_three_llms_in_one_process_on_cuda() -> None:
    """Each LLM takes 40% of the GPU for its cache: the second and third fit only if close() freed the
    earlier ones; the default sizing (gpu_memory_utilization) then still sees the whole GPU free."""
    _, total = torch.cuda.mem_get_info()
    base = torch.cuda.memory_allocated()
    outs = []
    for _ in range(3):
        with LLM(device="cuda", kv_cache_bytes=int(total * 0.4), max_num_seqs=8) as llm:
            outs.append(llm.generate(["def f(x):"], GREEDY, use_tqdm=False)[0].outputs[0].token_ids)
        assert torch.cuda.memory_allocated() - base < 64 << 20
    assert outs[0] == outs[1] == outs[2]
    llm = LLM(device="cuda")  # defaults: 256 requests, the budget from gpu_memory_utilization
    try:
        assert llm.engine.scheduler.config.max_num_seqs == 256
        assert llm.engine.max_model_len == 4096
        assert llm.generate(["def f(x):"], GREEDY, use_tqdm=False)[0].outputs[0].token_ids == outs[0]
    finally:
        llm.close()


def test_bench_is_a_subcommand(capsys: pytest.CaptureFixture[str]) -> None:
    argv = ["bench", "serve", "--base-url", "http://127.0.0.1:9", "--model", "m", "--num-prompts", "2"]
    assert main([*argv, "--disable-tqdm"]) == 1  # every request failed: nothing to measure
    got = capsys.readouterr()
    assert "Failed requests:                         2" in got.out and "127.0.0.1:9" in got.err


@pytest.mark.parametrize("chat", [False, True], ids=["completions", "chat"])
def test_every_token_makes_a_stream_chunk(tiny_lfm2: Path, chat: bool) -> None:
    """A token with no text of its own (a random model's ids beyond the tokenizer, part of a character) still
    arrives as a chunk, as vLLM streams, so clients can time every token (`hyspec bench serve` does)."""
    httpx = pytest.importorskip("httpx")
    from hyspec_server.bench_client import _content
    from hyspec_server.builder import build_engine
    from hyspec_server.serve import ServerThread

    eng = build_engine(EngineArgs(model=str(tiny_lfm2), device="cpu", max_num_seqs=2))
    srv = ServerThread(eng, model_name="m").start()
    try:
        n = 24
        body: dict[str, object] = {
            "max_tokens": n,
            "temperature": 0,
            "ignore_eos": True,
            "stream": True,
            "return_token_ids": True,
        }
        if chat:
            body["messages"] = [{"role": "user", "content": "hello"}]
        else:
            body["prompt"] = "hello there"
        path = "/v1/chat/completions" if chat else "/v1/completions"
        with httpx.stream("POST", srv.base_url + path, json=body, timeout=60) as r:
            events = [json.loads(x[6:]) for x in r.iter_lines() if x.startswith("data: {")]
        steps = [e for e in events if e["choices"] and e["choices"][0].get("token_ids")]
        # every token is in a chunk (outputs the client has not read yet merge into one)
        assert sum(len(e["choices"][0]["token_ids"]) for e in steps) == n
        texts = [_content(e, chat) for e in steps[:-1]]
        assert None not in texts  # what the benchmark times: every token chunk but the finishing one
        assert "" in texts  # the tiny tokenizer has fewer entries than the model's vocabulary
    finally:
        srv.stop()


def test_prompts_get_the_tokenizers_special_tokens(tiny_lfm2: Path, tmp_path: Path) -> None:
    """Completions-style prompts are encoded as transformers encodes them by default (BOS where the tokenizer
    adds one), chat templates without a second BOS, as vLLM does."""
    from tokenizers import Tokenizer
    from tokenizers.processors import TemplateProcessing
    from transformers import AutoTokenizer

    ckpt = tmp_path / "bos"
    shutil.copytree(tiny_lfm2, ckpt)
    raw = Tokenizer.from_file(str(ckpt / "tokenizer.json"))
    bos = raw.token_to_id("<|endoftext|>")
    raw.post_processor = TemplateProcessing(
        single="<|endoftext|> $A", pair="<|endoftext|> $A $B", special_tokens=[("<|endoftext|>", bos)]
    )
    raw.save(str(ckpt / "tokenizer.json"))
    hf = AutoTokenizer.from_pretrained(str(ckpt), local_files_only=True)
    llm = LLM(str(ckpt), device="cpu", max_num_seqs=2)
    out = llm.generate(["hello world"], GREEDY, use_tqdm=False)[0]
    assert out.prompt_token_ids == hf("hello world")["input_ids"]
    assert out.prompt_token_ids[0] == bos
    conv = [{"role": "user", "content": "hi"}]
    (chat,) = llm.chat(conv, GREEDY, use_tqdm=False)
    text = hf.apply_chat_template(conv, tokenize=False, add_generation_prompt=True)
    assert chat.prompt_token_ids == hf(text, add_special_tokens=False)["input_ids"]
    # OpenAI content parts: their texts joined, the prompt of the plain string (as the HTTP server's chat)
    parts = [{"role": "user", "content": [{"type": "text", "text": "h"}, {"type": "text", "text": "i"}]}]
    (chat_parts,) = llm.chat(parts, GREEDY, use_tqdm=False)
    assert chat_parts.prompt_token_ids == chat.prompt_token_ids
    image = [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}]
    with pytest.raises(ValueError, match=r"^messages\[0\]\[0\]\.content: only text content parts"):
        llm.chat(image, GREEDY, use_tqdm=False)


TEMPLATE = (
    "{% for m in messages %}[{{ m['role'] }}]{{ m['content'] }}{% endfor %}"
    "{% if add_generation_prompt %}[assistant]{% endif %}"
)


def test_chat_template_argument(tiny_lfm2: Path) -> None:
    """vLLM's `chat_template`: `LLM.chat(chat_template=...)`, `hyspec serve --chat-template` for every
    request, a request's own only with --trust-request-chat-template."""
    httpx = pytest.importorskip("httpx")
    from hyspec_server.builder import build_engine
    from hyspec_server.serve import ServerThread

    conv = [{"role": "user", "content": "hi"}]
    llm = LLM(str(tiny_lfm2), device="cpu", max_num_seqs=2)
    tok = llm.engine.tokenizer
    want = tok.encode("[user]hi[assistant]", add_special_tokens=False)
    (out,) = llm.chat(conv, GREEDY, chat_template=TEMPLATE, use_tqdm=False)
    assert out.prompt_token_ids == want
    (plain,) = llm.chat(conv, GREEDY, use_tqdm=False)
    assert plain.prompt_token_ids != want  # the tokenizer's own template otherwise
    with pytest.raises(ValueError, match="chat_template"):
        llm.chat(conv, GREEDY, chat_template="", use_tqdm=False)
    body = {"messages": conv, "max_tokens": 2, "temperature": 0}
    for trust in (False, True):
        eng = build_engine(EngineArgs(model=str(tiny_lfm2), device="cpu", max_num_seqs=2))
        srv = ServerThread(eng, model_name="m", chat_template=TEMPLATE, trust_request_chat_template=trust)
        srv.start()
        try:
            r = httpx.post(srv.base_url + "/tokenize", json={"messages": conv})
            assert r.json()["tokens"] == want  # the server's template
            r = httpx.post(srv.base_url + "/v1/chat/completions", json={**body, "chat_template": "{{ 'x' }}"})
            if trust:
                assert r.status_code == 200 and r.json()["usage"]["prompt_tokens"] == len(tok.encode("x"))
            else:
                assert r.status_code == 400 and r.json()["error"]["param"] == "chat_template"
        finally:
            srv.stop()


def test_serve_chat_template_flag_reads_a_file(tmp_path: Path) -> None:
    from hyspec_server.cli import _template

    f = tmp_path / "t.jinja"
    f.write_text(TEMPLATE)
    assert _template(str(f)) == TEMPLATE and _template(TEMPLATE) == TEMPLATE and _template(None) is None
    ns = build_parser().parse_args(["serve", "--chat-template", str(f), "--trust-request-chat-template"])
    assert ns.chat_template == str(f) and ns.trust_request_chat_template


def test_dtype_spellings_as_vllm() -> None:
    """vLLM's `half` / `float` and a torch.dtype name the same dtypes; anything else names `dtype`."""
    assert EngineArgs(model="m", dtype="half").dtype == "float16"  # type: ignore[arg-type]
    assert EngineArgs(model="m", dtype="float").dtype == "float32"  # type: ignore[arg-type]
    assert EngineArgs(model="m", dtype=torch.bfloat16).dtype == "bfloat16"  # type: ignore[arg-type]
    with pytest.raises(ValueError, match=r"^dtype must be one of"):
        EngineArgs(model="m", dtype="float64")  # type: ignore[arg-type]
    args = build_parser().parse_args(["serve", "m", "--dtype", "half"])
    assert args.dtype == "half"
