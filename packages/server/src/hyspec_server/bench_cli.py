"""`hyspec bench serve | latency | throughput`, as `vllm bench serve | latency | throughput`.

- `serve` drives a running OpenAI-compatible server (hyspec's, vLLM's, any other) with streamed requests
  and reports TTFT, TPOT, ITL and end-to-end latency (mean, median, std, percentiles), request and token
  throughput and goodput under SLOs; `--save-result` writes them as JSON, with a PNG of latency CDFs and
  output throughput over time when matplotlib is installed. The workloads are in bench_datasets.py.
- `latency` times one batch end to end, offline through `hyspec_server.LLM`, after warm-up iterations.
- `throughput` runs a random dataset through `LLM` at once and reports requests and tokens per second.

This module holds the flags of the three commands, the entry point and the orchestration of `serve`. The
asyncio HTTP/SSE client is in bench_client.py (the standard library's asyncio: one HTTP/1.1 connection per
request, chunked transfer and server-sent events parsed there; one event loop holds hundreds of concurrent
streams without threads); the metrics, the table, the JSON and the plot of a `serve` run in
bench_report.py; `latency` and `throughput` in bench_offline.py.

`cli.py` owns the top-level parser: it calls `add_bench_command` on its subparsers and `run_bench` for
`hyspec bench ...`.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import os
import sys
import time
from collections.abc import Sequence
from typing import Any

from hyspec_server.bench_client import ENDPOINTS, BenchError, Client, TurnResult, first_model, join_url
from hyspec_server.bench_datasets import (
    DATASETS,
    Conversation,
    Lengths,
    arrival_times,
    code_dataset,
    load_tokenizer,
    multi_turn_dataset,
    random_dataset,
    shared_prefix_dataset,
)
from hyspec_server.bench_offline import bench_latency, bench_throughput
from hyspec_server.bench_report import (
    METRICS,
    SLO_METRICS,
    ServeRun,
    print_table,
    progress_bar,
    run_info,
    save,
    summarize,
)
from hyspec_server.engine_flags import add_engine_flags

DEFAULT_HOST = "localhost"
DEFAULT_PORT = 8000


# ----------------------------------------------------------------------------------------------- parser


def add_bench_command(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    """Adds "bench" to `sub` (the top-level subparsers), with subcommands serve, latency and throughput
    under `bench_command`."""
    bench = sub.add_parser(
        "bench",
        help="benchmark a running server (serve) or the engine offline (latency, throughput)",
        description="Benchmarks, as `vllm bench`: serve drives a running OpenAI-compatible server; latency "
        "and throughput run the engine in this process through hyspec_server.LLM.",
    )
    bs = bench.add_subparsers(dest="bench_command", required=True)
    _serve_flags(
        bs.add_parser(
            "serve",
            help="online benchmark of a running OpenAI-compatible server",
            description="Sends streamed requests to a running OpenAI-compatible server and reports TTFT, "
            "TPOT, ITL, end-to-end latency, throughput and goodput. Failed requests are counted; the exit "
            "status is 1 when none succeeded.",
        )
    )
    _latency_flags(
        bs.add_parser(
            "latency",
            help="offline latency of one batch",
            description="Times the generation of one batch of random prompts (ignore_eos, greedy), "
            "through hyspec_server.LLM in this process.",
        )
    )
    _throughput_flags(
        bs.add_parser(
            "throughput",
            help="offline throughput over a random dataset",
            description="Generates for every prompt of a random dataset at once (ignore_eos, greedy), "
            "through hyspec_server.LLM in this process, and reports requests and tokens per second.",
        )
    )


def _serve_flags(p: argparse.ArgumentParser) -> None:
    s = p.add_argument_group("Server")
    s.add_argument(
        "--backend",
        choices=sorted(ENDPOINTS),
        default="openai",
        help="openai (or vllm): the completions API; openai-chat: the chat completions API (default openai)",
    )
    s.add_argument(
        "--base-url",
        default=None,
        help="the server, e.g. http://localhost:8000 (default: http://HOST:PORT of --host and --port)",
    )
    s.add_argument(
        "--host", default=DEFAULT_HOST, help=f"the server's host, without --base-url (default {DEFAULT_HOST})"
    )
    s.add_argument(
        "--port",
        type=int,
        default=DEFAULT_PORT,
        help=f"the server's port, without --base-url (default {DEFAULT_PORT})",
    )
    s.add_argument(
        "--endpoint",
        default=None,
        help="the API path (default: /v1/completions, or /v1/chat/completions with --backend openai-chat)",
    )
    s.add_argument("--model", default=None, help="model to ask for (default: the first of /v1/models)")
    s.add_argument(
        "--api-key",
        default=None,
        help="bearer token (default: the HYSPEC_API_KEY, then the OPENAI_API_KEY environment variable)",
    )
    s.add_argument(
        "--tokenizer",
        default=None,
        help="a local tokenizer directory (transformers, offline): prompts of exactly the asked token "
        "lengths; without it lengths are approximate (the token counts reported are the server's)",
    )
    d = p.add_argument_group("Dataset")
    d.add_argument(
        "--dataset-name",
        choices=DATASETS,
        default="random",
        help="random: random words; shared-prefix: groups of prompts sharing a long prefix; multi-turn: "
        "chats resending their history each turn (needs --backend openai-chat); code: Python snippets to "
        "complete, cut from hyspec's own source files (no held-out split of the demo models' corpus ships "
        "with hyspec, and that corpus excludes hyspec's sources) (default random)",
    )
    d.add_argument("--num-prompts", type=int, default=1000, help="requests to send (default 1000)")
    d.add_argument(
        "--random-input-len", type=int, default=1024, help="tokens of each prompt or turn (default 1024)"
    )
    d.add_argument("--random-output-len", type=int, default=128, help="tokens to generate (default 128)")
    d.add_argument(
        "--random-range-ratio",
        type=float,
        default=0.0,
        help="lengths are uniform in [len * (1 - r), len * (1 + r)], 0 <= r < 1 (default 0)",
    )
    d.add_argument(
        "--shared-prefix-len", type=int, default=512, help="shared-prefix: tokens of the prefix (default 512)"
    )
    d.add_argument("--num-groups", type=int, default=8, help="shared-prefix: distinct prefixes (default 8)")
    d.add_argument("--num-turns", type=int, default=3, help="multi-turn: turns per conversation (default 3)")
    d.add_argument("--seed", type=int, default=0, help="seed of the dataset and the arrivals (default 0)")
    t = p.add_argument_group("Traffic")
    t.add_argument(
        "--request-rate",
        type=float,
        default=math.inf,
        help="requests (conversations, for multi-turn) per second, Poisson arrivals; inf sends all at once "
        "(default inf)",
    )
    t.add_argument(
        "--burstiness",
        type=float,
        default=1.0,
        help="shape of the gamma-distributed gaps: 1 Poisson, < 1 burstier, > 1 more even (default 1)",
    )
    t.add_argument(
        "--max-concurrency", type=int, default=None, help="most requests in flight (default: no bound)"
    )
    r = p.add_argument_group("Requests")
    r.add_argument(
        "--ignore-eos", action="store_true", help="send ignore_eos, so every output has its asked length"
    )
    r.add_argument("--temperature", type=float, default=0.0, help="sampling temperature (default 0, greedy)")
    r.add_argument(
        "--extra-body", type=_json_object, default=None, help="a JSON object merged into every request body"
    )
    o = p.add_argument_group("Results")
    o.add_argument(
        "--goodput",
        nargs="+",
        type=_slo,
        default=None,
        metavar="KEY:MS",
        help="SLOs for goodput, in ms, of ttft, tpot and e2el (e.g. ttft:500 tpot:50): the rate of "
        "requests meeting all of them",
    )
    o.add_argument(
        "--percentile-metrics",
        type=_metrics,
        default=METRICS,
        help=f"comma-separated metrics whose statistics are reported, of {','.join(METRICS)} (default all)",
    )
    o.add_argument(
        "--metric-percentiles",
        type=_percentiles,
        default=(90.0, 99.0),
        help="comma-separated percentiles to report (default 90,99)",
    )
    o.add_argument("--disable-tqdm", action="store_true", help="no progress bar")
    o.add_argument(
        "--save-result",
        action="store_true",
        help="write the results as JSON (and a PNG of the latency distributions, with matplotlib)",
    )
    o.add_argument(
        "--save-detailed",
        action="store_true",
        help="with --save-result: per-request lengths, latencies, errors and texts too",
    )
    o.add_argument("--result-dir", default=".", help="where --save-result writes (default .)")
    o.add_argument(
        "--result-filename",
        default=None,
        help="JSON file name (default: LABEL-RATEqps-concurrencyN-MODEL-DATE.json)",
    )
    o.add_argument("--label", default=None, help="names the results (default: the backend)")


def _latency_flags(p: argparse.ArgumentParser) -> None:
    b = p.add_argument_group("Benchmark")
    b.add_argument("--input-len", type=int, default=32, help="prompt tokens (default 32)")
    b.add_argument("--output-len", type=int, default=128, help="generated tokens (default 128)")
    b.add_argument("--batch-size", type=int, default=8, help="prompts in the batch (default 8)")
    b.add_argument("--num-iters-warmup", type=int, default=10, help="untimed iterations first (default 10)")
    b.add_argument("--num-iters", type=int, default=30, help="timed iterations (default 30)")
    b.add_argument("--output-json", default=None, help="write the results to this JSON file")
    b.add_argument("--disable-tqdm", action="store_true", help="no progress bar")
    _engine_flags(p)


def _throughput_flags(p: argparse.ArgumentParser) -> None:
    b = p.add_argument_group("Benchmark")
    b.add_argument("--dataset-name", choices=("random",), default="random", help="random token ids (default)")
    b.add_argument("--num-prompts", type=int, default=1000, help="prompts (default 1000)")
    b.add_argument("--input-len", type=int, default=128, help="prompt tokens (default 128)")
    b.add_argument("--output-len", type=int, default=128, help="generated tokens (default 128)")
    b.add_argument(
        "--random-range-ratio",
        type=float,
        default=0.0,
        help="lengths are uniform in [len * (1 - r), len * (1 + r)], 0 <= r < 1 (default 0)",
    )
    b.add_argument("--output-json", default=None, help="write the results to this JSON file")
    b.add_argument("--disable-tqdm", action="store_true", help="no progress bar")
    _engine_flags(p)


def _engine_flags(p: argparse.ArgumentParser) -> None:
    """`LLM(...)` arguments, passed only when given, so `LLM`'s defaults apply otherwise (`--model` left
    out: the embedded demo model and its speculation)."""
    add_engine_flags(p, model_help="", only_given=True)


def _json_object(text: str) -> dict[str, Any]:
    try:
        value = json.loads(text)
    except json.JSONDecodeError as e:
        raise argparse.ArgumentTypeError(f"not JSON: {e}") from e
    if not isinstance(value, dict):
        raise argparse.ArgumentTypeError("expected a JSON object")
    return value


def _slo(text: str) -> tuple[str, float]:
    key, sep, value = text.partition(":")
    if not sep or key not in SLO_METRICS:
        raise argparse.ArgumentTypeError(
            f"{text!r}: expected KEY:MS with KEY one of {', '.join(SLO_METRICS)}"
        )
    try:
        ms = float(value)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r}: {value!r} is not a number of ms") from None
    if not ms >= 0:
        raise argparse.ArgumentTypeError(f"{text!r}: the SLO must be >= 0 ms")
    return key, ms


def _metrics(text: str) -> tuple[str, ...]:
    names = tuple(x.strip() for x in text.split(","))
    if not names or not all(n in METRICS for n in names):
        raise argparse.ArgumentTypeError(
            f"{text!r}: expected some of {','.join(METRICS)}, separated by commas"
        )
    return tuple(m for m in METRICS if m in names)


def _percentiles(text: str) -> tuple[float, ...]:
    try:
        ps = tuple(float(x) for x in text.split(","))
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r}: expected numbers separated by commas") from None
    if not all(0 <= p <= 100 for p in ps):
        raise argparse.ArgumentTypeError(f"{text!r}: percentiles are in [0, 100]")
    return ps


# ------------------------------------------------------------------------------------------------ entry


def run_bench(ns: argparse.Namespace) -> int:
    """Runs `ns.bench_command`; returns the exit status: 0 done, 1 the benchmark could not run (or, for
    serve, no request succeeded), 2 bad arguments."""
    command: str = ns.bench_command
    try:
        if command == "serve":
            return _bench_serve(ns)
        if command == "latency":
            return bench_latency(ns)
        if command == "throughput":
            return bench_throughput(ns)
        raise ValueError(f"unknown bench command {command!r}")
    except (ValueError, TypeError) as e:
        _error(command, str(e))
        return 2
    except BenchError as e:
        _error(command, str(e))
        return 1
    except KeyboardInterrupt:
        _error(command, "interrupted")
        return 130


def _error(command: str, message: str) -> None:
    print(f"hyspec bench {command}: error: {' '.join(message.split())}", file=sys.stderr)


# ------------------------------------------------------------------------------------------ bench serve


def _bench_serve(ns: argparse.Namespace) -> int:
    _check_serve_args(ns)
    chat = ns.backend == "openai-chat"
    api_key = ns.api_key or os.environ.get("HYSPEC_API_KEY") or os.environ.get("OPENAI_API_KEY") or None
    base_url = ns.base_url or _host_url(ns.host, ns.port)
    url = join_url(base_url, ns.endpoint or ENDPOINTS[ns.backend])
    model = ns.model or first_model(join_url(base_url, "/v1/models"), api_key)
    convs = _serve_dataset(ns)
    schedule = arrival_times(len(convs), ns.request_rate, ns.burstiness, ns.seed)
    client = Client(url, api_key, _request_fields(ns, model), chat)
    print(
        f"Benchmarking {url} (model {model}): {ns.num_prompts} requests of the {ns.dataset_name} dataset, "
        f"request rate {ns.request_rate}, max concurrency {ns.max_concurrency or 'unbounded'}",
        file=sys.stderr,
    )
    run = asyncio.run(_run(client, convs, schedule, ns.max_concurrency, ns.disable_tqdm))
    result = summarize(run, dict(ns.goodput or []), ns.metric_percentiles, ns.percentile_metrics)
    result = {**run_info(ns, model, url), **result}
    print_table(result, ns.metric_percentiles, ns.percentile_metrics)
    if ns.save_result:
        save(result, run, ns)
    return 0 if result["completed"] else 1


def _check_serve_args(ns: argparse.Namespace) -> None:
    for name in ("num_prompts", "random_input_len", "random_output_len", "num_groups", "num_turns"):
        if getattr(ns, name) < 1:
            raise ValueError(f"--{name.replace('_', '-')} must be >= 1")
    if ns.base_url is None and not 0 < ns.port < 65536:
        raise ValueError(f"--port must be in [1, 65535], got {ns.port}")
    if ns.shared_prefix_len < 0:
        raise ValueError("--shared-prefix-len must be >= 0")
    if not 0 <= ns.random_range_ratio < 1:
        raise ValueError("--random-range-ratio must be in [0, 1)")
    if ns.max_concurrency is not None and ns.max_concurrency < 1:
        raise ValueError("--max-concurrency must be >= 1")
    if not ns.request_rate > 0 or not ns.burstiness > 0:
        raise ValueError("--request-rate and --burstiness must be > 0")
    if ns.dataset_name == "multi-turn" and ns.backend != "openai-chat":
        raise ValueError("the multi-turn dataset needs --backend openai-chat (it sends chat histories)")


def _host_url(host: str, port: int) -> str:
    return f"http://[{host}]:{port}" if ":" in host else f"http://{host}:{port}"


def _serve_dataset(ns: argparse.Namespace) -> list[Conversation]:
    lengths = Lengths(load_tokenizer(ns.tokenizer) if ns.tokenizer else None)
    common: dict[str, Any] = {
        "input_len": ns.random_input_len,
        "output_len": ns.random_output_len,
        "range_ratio": ns.random_range_ratio,
        "lengths": lengths,
        "seed": ns.seed,
    }
    n = ns.num_prompts
    if ns.dataset_name == "shared-prefix":
        return shared_prefix_dataset(n, ns.shared_prefix_len, ns.num_groups, **common)
    if ns.dataset_name == "multi-turn":
        return multi_turn_dataset(n, ns.num_turns, **common)
    if ns.dataset_name == "code":
        return code_dataset(n, **common)
    return random_dataset(n, **common)


def _request_fields(ns: argparse.Namespace, model: str) -> dict[str, Any]:
    """What every request body carries besides its prompt and length."""
    body: dict[str, Any] = {
        "model": model,
        "temperature": ns.temperature,
        "stream": True,
        # the final chunk then counts the tokens, as the server's tokenizer saw them
        "stream_options": {"include_usage": True},
    }
    if ns.ignore_eos:
        body["ignore_eos"] = True
    return {**body, **(ns.extra_body or {})}


# ----------------------------------------------------------------------------------------------- driver


async def _run(
    client: Client,
    convs: Sequence[Conversation],
    schedule: Sequence[float],
    max_concurrency: int | None,
    disable_tqdm: bool,
) -> ServeRun:
    total = sum(len(c.turns) for c in convs)
    gate = asyncio.Semaphore(max_concurrency or total)
    bar = None if disable_tqdm else progress_bar(total)
    t0 = time.perf_counter()

    async def conversation(conv: Conversation, at: float) -> list[TurnResult]:
        await asyncio.sleep(max(0.0, t0 + at - time.perf_counter()))
        history: list[dict[str, str]] = []
        out: list[TurnResult] = []
        for turn in conv.turns:
            if out and not out[-1].ok:
                # without the earlier answer there is no history to send
                out.append(TurnResult(input_len=turn.input_len, error="an earlier turn of its chat failed"))
            else:
                user = {"role": "user", "content": turn.text}
                async with gate:
                    out.append(await client.send([*history, user] if client.chat else turn.text, turn))
                history += [user, {"role": "assistant", "content": out[-1].text}]
            if bar is not None:
                bar.update(1)
        return out

    try:
        done = await asyncio.gather(*(conversation(c, at) for c, at in zip(convs, schedule)))
    finally:
        if bar is not None:
            bar.close()
    return ServeRun([r for rs in done for r in rs], t0, time.perf_counter() - t0)
