"""`hyspec bench serve | latency | throughput` (bench_cli.py, bench_client.py, bench_report.py,
bench_offline.py, bench_datasets.py).

`serve` runs against a live toy server on 127.0.0.1 (byte tokenizer: a prompt's token count is its UTF-8
length, so the server's usage can be checked exactly); latency and throughput run tiny checkpoints on the
CPU."""

from __future__ import annotations

import argparse
import json
import math
import random
import socket
import sys
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from hyspec_server import bench_report
from hyspec_server.bench_cli import add_bench_command, run_bench
from hyspec_server.bench_client import TurnResult, _SSEParser
from hyspec_server.bench_datasets import (
    Lengths,
    arrival_times,
    code_dataset,
    code_files,
    multi_turn_dataset,
    random_dataset,
    shared_prefix_dataset,
)
from hyspec_server.bench_report import ServeRun, percentile
from hyspec_server.default_model import default_model_dir
from hyspec_server.engine_flags import engine_kwargs
from hyspec_server.serve import ServerThread

API_KEY = "test-key"
METRICS = ("ttft", "tpot", "itl", "e2el")


def parser() -> argparse.ArgumentParser:
    # the shape cli.py gives it: one top-level parser, subcommands under `command`
    p = argparse.ArgumentParser(prog="hyspec")
    add_bench_command(p.add_subparsers(dest="command", required=True))
    return p


def bench(argv: list[str]) -> int:
    return run_bench(parser().parse_args(["bench", *argv]))


def serve_flags(srv: ServerThread, out: Path, *extra: str) -> list[str]:
    return [
        "serve",
        "--base-url",
        srv.base_url,
        "--api-key",
        API_KEY,
        "--disable-tqdm",
        "--save-result",
        "--save-detailed",
        "--result-dir",
        str(out),
        "--result-filename",
        "r.json",
        *extra,
    ]


def result(out: Path) -> dict[str, Any]:
    data: dict[str, Any] = json.loads((out / "r.json").read_text())
    return data


def assert_ordered_percentiles(res: dict[str, Any]) -> None:
    for m in METRICS:
        assert 0 <= res[f"median_{m}_ms"] <= res[f"p90_{m}_ms"] <= res[f"p99_{m}_ms"], m


def free_url() -> str:
    # a port that was free a moment ago and has nobody listening now
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    return f"http://127.0.0.1:{port}"


# ------------------------------------------------------------------------------------------------ serve


def test_serve_random_counts_what_the_server_counts(
    toy_server: ServerThread, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    # no --model: the first of /v1/models
    args = ["--num-prompts", "8", "--max-concurrency", "4", "--random-input-len", "12"]
    args += ["--random-output-len", "16", "--ignore-eos", "--goodput", "ttft:60000", "tpot:60000"]
    assert bench(serve_flags(toy_server, tmp_path, *args)) == 0
    res = result(tmp_path)
    assert (res["completed"], res["failed"], res["model_id"]) == (8, 0, "toy")
    assert res["token_counts_from_usage"]
    assert res["total_output_tokens"] == 8 * 16 and res["output_lens"] == [16] * 8
    # the byte tokenizer: the server's prompt tokens are the prompts' UTF-8 bytes
    prompts = random_dataset(8, 12, 16, 0.0, Lengths(), seed=0)
    assert res["input_lens"] == [len(c.turns[0].text.encode()) for c in prompts]
    assert res["total_input_tokens"] == sum(res["input_lens"])
    assert_ordered_percentiles(res)
    assert 0 < res["request_goodput"] <= res["request_throughput"]
    assert res["request_throughput"] == pytest.approx(8 / res["duration"])
    assert res["output_throughput"] == pytest.approx(8 * 16 / res["duration"])
    assert 1 <= res["peak_concurrent_requests"] <= 4
    # at most a gap between each two of the 16 tokens (a chunk can carry several), within the latency
    for itls, ttft, e2el in zip(res["itls"], res["ttfts"], res["e2els"]):
        # a busy client may get every token in one chunk (outputs waiting for a reader merge): no gap then
        assert len(itls) <= 15 and ttft + sum(itls) <= e2el
    assert res["peak_output_throughput"] >= res["output_throughput"] * (1 - 1e-9)
    out = capsys.readouterr().out
    assert "Serving Benchmark Result" in out and "P99 TPOT (ms):" in out and "Request goodput" in out


def test_goodput_counts_only_requests_within_the_slos(toy_server: ServerThread, tmp_path: Path) -> None:
    args = ["--num-prompts", "4", "--random-input-len", "4", "--random-output-len", "4", "--ignore-eos"]
    assert bench(serve_flags(toy_server, tmp_path, *args, "--goodput", "e2el:0")) == 0
    res = result(tmp_path)
    assert res["completed"] == 4 and res["request_goodput"] == 0.0
    assert res["goodput_slos_ms"] == {"e2el": 0.0}


def test_serve_shared_prefix(toy_server: ServerThread, tmp_path: Path) -> None:
    args = ["--dataset-name", "shared-prefix", "--shared-prefix-len", "10", "--num-groups", "2"]
    args += ["--num-prompts", "8", "--max-concurrency", "4", "--random-input-len", "4"]
    args += ["--random-output-len", "8", "--ignore-eos", "--model", "toy"]
    assert bench(serve_flags(toy_server, tmp_path, *args)) == 0
    res = result(tmp_path)
    assert (res["completed"], res["failed"], res["total_output_tokens"]) == (8, 0, 64)
    assert_ordered_percentiles(res)


def test_shared_prefix_groups_share_their_prefix() -> None:
    convs = shared_prefix_dataset(12, 6, 3, 4, 8, 0.0, Lengths(), seed=1)
    texts = [c.turns[0].text for c in convs]
    prefixes = {" ".join(t.split()[:6]) for t in texts}
    assert len(prefixes) == 3 and len(set(texts)) == 12
    assert all(c.turns[0].input_len == 10 for c in convs)


def test_serve_multi_turn_resends_the_history(toy_server: ServerThread, tmp_path: Path) -> None:
    args = ["--backend", "openai-chat", "--dataset-name", "multi-turn", "--num-turns", "3"]
    args += ["--num-prompts", "8", "--max-concurrency", "4", "--random-input-len", "4"]
    args += ["--random-output-len", "8", "--ignore-eos"]
    assert bench(serve_flags(toy_server, tmp_path, *args)) == 0
    res = result(tmp_path)
    assert (res["completed"], res["failed"], res["total_output_tokens"]) == (8, 0, 64)
    assert_ordered_percentiles(res)
    # conversations of 3, 3 and 2 turns: a later turn's prompt holds the earlier turns and answers
    lens = res["input_lens"]
    for first in (0, 3, 6):
        assert lens[first + 1] > lens[first] + 8
    assert lens[2] > lens[1] + 8 and lens[5] > lens[4] + 8
    assert res["url"].endswith("/v1/chat/completions")


def test_multi_turn_needs_the_chat_backend(capsys: pytest.CaptureFixture[str]) -> None:
    assert bench(["serve", "--dataset-name", "multi-turn", "--model", "x"]) == 2
    assert "openai-chat" in capsys.readouterr().err


def test_multi_turn_dataset_splits_the_turns() -> None:
    convs = multi_turn_dataset(8, 3, 4, 8, 0.0, Lengths(), seed=0)
    assert [len(c.turns) for c in convs] == [3, 3, 2]


def test_serve_code_dataset(toy_server: ServerThread, tmp_path: Path) -> None:
    args = ["--dataset-name", "code", "--num-prompts", "4", "--random-input-len", "16"]
    args += ["--random-output-len", "4", "--ignore-eos", "--base-url", toy_server.base_url + "/v1"]
    # a base URL ending in /v1 works as well as one without
    assert bench(serve_flags(toy_server, tmp_path, *args)) == 0
    res = result(tmp_path)
    assert (res["completed"], res["total_output_tokens"]) == (4, 16)


@pytest.mark.parametrize(
    "dataset", [[], ["--backend", "openai-chat", "--dataset-name", "multi-turn", "--num-turns", "3"]]
)
def test_rejected_requests_are_counted_and_exit_1(
    dataset: list[str], toy_server: ServerThread, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    # multi-turn: a chat's later turns fail with its first (never sent), and still count
    args = ["--num-prompts", "8", "--max-concurrency", "4", "--random-input-len", "4", *dataset]
    args += ["--model", "toy", "--api-key", "wrong"]
    assert bench(serve_flags(toy_server, tmp_path, *args)) == 1
    res = result(tmp_path)
    assert (res["completed"], res["failed"]) == (0, 8)
    assert res["first_error"].startswith("HTTP 401") and "API key" in res["first_error"]
    assert "First error: HTTP 401" in capsys.readouterr().out


def test_unreachable_server_fails_every_request(tmp_path: Path) -> None:
    args = ["serve", "--base-url", free_url(), "--model", "m", "--num-prompts", "3", "--disable-tqdm"]
    args += ["--random-input-len", "4", "--save-result", "--result-dir", str(tmp_path)]
    assert bench(args) == 1
    (path,) = tmp_path.glob("openai-infqps-concurrencyinf-m-*.json")
    res = json.loads(path.read_text())
    assert (res["completed"], res["failed"]) == (0, 3)
    assert "Connect" in res["first_error"] or "refused" in res["first_error"]


def test_no_model_without_the_model_list(
    toy_server: ServerThread, capsys: pytest.CaptureFixture[str]
) -> None:
    argv = ["serve", "--base-url", toy_server.base_url, "--api-key", "wrong", "--num-prompts", "1"]
    assert bench(argv) == 1
    err = capsys.readouterr().err
    assert "/v1/models: HTTP 401: missing or wrong API key" in err


def test_host_and_port_as_vllm(toy_server: ServerThread, tmp_path: Path) -> None:
    # vLLM's --host / --port name the server when --base-url is not given
    args = ["--host", toy_server.host, "--port", str(toy_server.port), "--num-prompts", "2"]
    args += ["--random-input-len", "4", "--random-output-len", "4", "--model", "toy"]
    flags = serve_flags(toy_server, tmp_path, *args)
    i = flags.index("--base-url")
    assert bench(flags[:i] + flags[i + 2 :]) == 0
    res = result(tmp_path)
    assert res["completed"] == 2 and res["url"] == toy_server.base_url + "/v1/completions"


def test_bad_port_is_an_error_naming_it(capsys: pytest.CaptureFixture[str]) -> None:
    assert bench(["serve", "--model", "m", "--port", "70000"]) == 2
    assert "--port" in capsys.readouterr().err


def test_percentile_metrics_choose_the_reported_metrics(
    toy_server: ServerThread, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    args = ["--num-prompts", "2", "--random-input-len", "4", "--random-output-len", "4", "--ignore-eos"]
    args += ["--percentile-metrics", "ttft,e2el", "--metric-percentiles", "50,95"]
    assert bench(serve_flags(toy_server, tmp_path, *args)) == 0
    res = result(tmp_path)
    for m in ("ttft", "e2el"):
        assert {f"mean_{m}_ms", f"median_{m}_ms", f"std_{m}_ms", f"p50_{m}_ms", f"p95_{m}_ms"} <= set(res)
    assert not [k for k in res if k.endswith(("_tpot_ms", "_itl_ms"))]
    out = capsys.readouterr().out
    assert "P95 TTFT (ms):" in out and "P95 E2EL (ms):" in out and "TPOT" not in out and "ITL" not in out


def test_bad_percentile_metrics_are_an_argument_error() -> None:
    with pytest.raises(SystemExit):
        parser().parse_args(["bench", "serve", "--percentile-metrics", "ttft,latency"])


def test_poisson_arrivals_end_to_end(toy_server: ServerThread, tmp_path: Path) -> None:
    args = ["--num-prompts", "6", "--request-rate", "40", "--seed", "3", "--random-input-len", "4"]
    args += ["--random-output-len", "4", "--ignore-eos"]
    assert bench(serve_flags(toy_server, tmp_path, *args)) == 0
    res = result(tmp_path)
    schedule = arrival_times(6, 40.0, 1.0, seed=3)
    assert res["completed"] == 6 and res["request_rate"] == 40.0
    # no request started before its arrival time
    assert all(s >= at - 1e-3 for s, at in zip(res["start_times"], schedule))


def test_256_concurrent_streams(toy_server: ServerThread, tmp_path: Path) -> None:
    args = ["--num-prompts", "256", "--max-concurrency", "256", "--random-input-len", "2"]
    args += ["--random-output-len", "2", "--ignore-eos"]
    assert bench(serve_flags(toy_server, tmp_path, *args)) == 0
    res = result(tmp_path)
    assert (res["completed"], res["total_output_tokens"]) == (256, 512)
    # the toy engine runs 32 at a time; the others were open and waiting
    assert res["peak_concurrent_requests"] > 32


def test_without_matplotlib_a_note_and_no_plot(
    toy_server: ServerThread,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
) -> None:
    monkeypatch.setitem(sys.modules, "matplotlib", None)  # import raises ImportError
    args = ["--num-prompts", "2", "--random-input-len", "4", "--random-output-len", "4"]
    assert bench(serve_flags(toy_server, tmp_path, *args)) == 0
    assert (tmp_path / "r.json").is_file() and not (tmp_path / "r.png").exists()
    notes = [line for line in capsys.readouterr().out.splitlines() if line.startswith("Note:")]
    assert len(notes) == 1 and "not installed" in notes[0]


def test_plot_with_matplotlib(toy_server: ServerThread, tmp_path: Path) -> None:
    pytest.importorskip("matplotlib")
    args = ["--num-prompts", "4", "--random-input-len", "4", "--random-output-len", "6", "--ignore-eos"]
    assert bench(serve_flags(toy_server, tmp_path, *args)) == 0
    assert (tmp_path / "r.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


# -------------------------------------------------------------------------------- schedule and datasets


def test_arrival_schedule_is_reproducible() -> None:
    a = arrival_times(200, 10.0, 1.0, seed=7)
    assert a == arrival_times(200, 10.0, 1.0, seed=7)
    assert a != arrival_times(200, 10.0, 1.0, seed=8)
    assert a[0] == 0.0 and a == sorted(a)
    # Poisson at 10/s: mean gap 0.1 s (199 exponential gaps: within a few standard errors)
    assert a[-1] / 199 == pytest.approx(0.1, rel=0.25)
    assert arrival_times(5, math.inf, 1.0, seed=0) == [0.0] * 5
    # burstiness > 1 spreads the gaps more evenly around the same mean
    gaps = np.diff(arrival_times(2000, 10.0, 8.0, seed=0))
    assert gaps.mean() == pytest.approx(0.1, rel=0.1) and gaps.std() < 0.05


def test_random_lengths_follow_the_range_ratio() -> None:
    convs = random_dataset(300, 20, 10, 0.5, Lengths(), seed=0)
    ins = [c.turns[0].input_len for c in convs]
    outs = [c.turns[0].output_len for c in convs]
    assert min(ins) == 10 and max(ins) == 30 and 5 <= min(outs) and max(outs) <= 15
    assert all(len(c.turns[0].text.split()) == c.turns[0].input_len for c in convs)


def test_a_tokenizer_gives_exact_lengths() -> None:
    tok = pytest.importorskip("transformers").AutoTokenizer.from_pretrained(
        str(default_model_dir()), local_files_only=True
    )
    lengths = Lengths(tok)
    for conv in random_dataset(10, 30, 4, 0.3, lengths, seed=0) + code_dataset(5, 40, 4, 0.0, lengths, 0):
        turn = conv.turns[0]
        assert len(tok.encode(turn.text, add_special_tokens=False)) == turn.input_len


def test_shared_prefix_with_a_tokenizer_gives_exact_lengths() -> None:
    tok = pytest.importorskip("transformers").AutoTokenizer.from_pretrained(
        str(default_model_dir()), local_files_only=True
    )
    convs = shared_prefix_dataset(40, 20, 3, 10, 4, 0.3, Lengths(tok), seed=0)
    ids = [tok.encode(c.turns[0].text, add_special_tokens=False) for c in convs]
    # the suffix's first word is tokenized after the prefix's space, as the server sees the whole prompt
    assert [len(x) for x in ids] == [c.turns[0].input_len for c in convs]
    # and the groups' prefixes are whole token prefixes, what a prefix cache shares
    assert len({tuple(x[:20]) for x in ids}) == 3


def test_a_tokenizer_that_cannot_load_is_an_argument_error(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    pytest.importorskip("transformers")
    for path in (tmp_path / "missing", tmp_path):  # no such directory; a directory with no tokenizer
        argv = ["serve", "--model", "m", "--base-url", free_url(), "--tokenizer", str(path)]
        assert bench([*argv, "--num-prompts", "1", "--disable-tqdm"]) == 2
        err = capsys.readouterr().err
        assert "error: --tokenizer: no tokenizer can be loaded from" in err and str(path) in err


def test_code_prompts_come_from_hyspec_sources() -> None:
    files = code_files()
    assert any(p.name == "bench_datasets.py" for p in files)
    convs = code_dataset(6, 50, 8, 0.0, Lengths(), seed=0)
    sources = "\n".join(p.read_text() for p in files)
    for c in convs:
        text = c.turns[0].text
        assert text.rstrip("\n").splitlines()[0] in sources and len(text) >= 50 * 4 - 100


def test_peak_output_throughput_is_the_busiest_second() -> None:
    def req(*times: float, tokens: int) -> TurnResult:
        return TurnResult(input_len=1, output_len=tokens, ok=True, chunk_times=list(times))

    # 2 tokens a chunk; the busiest second, [0.1, 1.1), holds 3 chunks where whole-second bins hold 2
    run = ServeRun([req(0.1, 0.5, 2.6, tokens=6), req(1.0, 1.5, tokens=4)], t0=0.0, duration=3.0)
    assert bench_report._peak_output_throughput(run) == pytest.approx(6.0)
    assert bench_report._output_timeline(run) == pytest.approx([4.0, 4.0, 2.0])
    # a run shorter than the window: its mean
    short = ServeRun([req(0.1, 0.2, tokens=5)], t0=0.0, duration=0.5)
    assert bench_report._peak_output_throughput(short) == pytest.approx(10.0)


def test_sse_parser_joins_pieces() -> None:
    p = _SSEParser()
    assert p.feed(b'data: {"a"') == []
    assert p.feed(b": 1}\r\n\r\ndata: [DO") == ['{"a": 1}']
    assert p.feed(b"NE]\n\n: comment\n\n") == ["[DONE]"]


def test_percentile_is_numpys_linear() -> None:
    rng = random.Random(0)
    xs = sorted(rng.random() for _ in range(37))
    for p in (0, 10, 50, 90, 99, 100):
        assert percentile(xs, p) == pytest.approx(float(np.percentile(xs, p)))
    assert percentile([], 50) == 0.0


def test_bad_slo_is_an_argument_error() -> None:
    with pytest.raises(SystemExit):
        parser().parse_args(["bench", "serve", "--goodput", "latency:3"])


# ---------------------------------------------------------------------------------- latency, throughput


def test_engine_flags_reach_llm_only_when_given() -> None:
    spec = '{"method": "ngram", "num_speculative_tokens": 2}'
    argv = ["bench", "latency", "--device", "cpu", "--max-num-seqs", "4", "--enforce-eager"]
    ns = parser().parse_args([*argv, "--speculative-config", spec])
    assert ns.model is None
    assert engine_kwargs(ns) == {
        "device": "cpu",
        "max_num_seqs": 4,
        "enforce_eager": True,
        "speculative_config": spec,
    }


def test_latency_on_a_tiny_checkpoint(
    tiny_lfm2: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    out = tmp_path / "latency.json"
    argv = ["latency", "--model", str(tiny_lfm2), "--device", "cpu", "--input-len", "8", "--output-len", "4"]
    argv += ["--batch-size", "2", "--num-iters-warmup", "1", "--num-iters", "3", "--output-json", str(out)]
    assert bench([*argv, "--disable-tqdm"]) == 0
    res = json.loads(out.read_text())
    assert len(res["latencies"]) == 3 and res["avg_latency"] > 0
    ps = [res["percentiles"][k] for k in ("10", "25", "50", "75", "90", "99")]
    assert ps == sorted(ps) and min(res["latencies"]) <= ps[0] and ps[-1] <= max(res["latencies"])
    assert res["output_tokens_per_iter"] == 2 * 4 and res["spec_decode"] is None
    assert "Avg latency:" in capsys.readouterr().out


def test_throughput_on_a_tiny_checkpoint(tiny_qwen3_5: Path, tmp_path: Path) -> None:
    out = tmp_path / "throughput.json"
    argv = ["throughput", "--model", str(tiny_qwen3_5), "--device", "cpu", "--num-prompts", "5"]
    argv += ["--input-len", "6", "--output-len", "3", "--output-json", str(out), "--disable-tqdm"]
    assert bench(argv) == 0
    res = json.loads(out.read_text())
    assert res["num_requests"] == 5
    assert (res["total_prompt_tokens"], res["total_output_tokens"]) == (5 * 6, 5 * 3)
    assert res["total_num_tokens"] == 5 * 9
    assert res["tokens_per_second"] == pytest.approx(5 * 9 / res["elapsed_time"])
    assert res["requests_per_second"] == pytest.approx(5 / res["elapsed_time"])


def test_throughput_with_speculation_reports_acceptance(tiny_qwen3_5: Path, tmp_path: Path) -> None:
    out = tmp_path / "throughput.json"
    argv = ["throughput", "--model", str(tiny_qwen3_5), "--device", "cpu", "--num-prompts", "3"]
    argv += ["--input-len", "6", "--output-len", "5", "--output-json", str(out), "--disable-tqdm"]
    argv += ["--speculative-config", '{"method": "ngram", "num_speculative_tokens": 2}']
    assert bench(argv) == 0
    res = json.loads(out.read_text())
    assert res["total_output_tokens"] == 15 and res["spec_decode"] is not None


def test_bad_lengths_exit_2(capsys: pytest.CaptureFixture[str]) -> None:
    assert bench(["throughput", "--num-prompts", "0"]) == 2
    assert "--num-prompts" in capsys.readouterr().err
