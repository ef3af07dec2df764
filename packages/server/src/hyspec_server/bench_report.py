"""What `hyspec bench serve` (bench_cli.py) makes of a run: the metrics (vLLM's result fields), the printed
table, and with `--save-result` the JSON and a PNG of the latency CDFs and output throughput over time
(when matplotlib is installed).
"""

from __future__ import annotations

import argparse
import importlib
import json
import math
import statistics
from collections.abc import Sequence
from dataclasses import dataclass
from datetime import datetime
from pathlib import Path
from typing import Any

from hyspec_server.bench_client import BenchError, TurnResult

SLO_METRICS = ("ttft", "tpot", "e2el")
METRICS = ("ttft", "tpot", "itl", "e2el")
"""The latency metrics whose statistics can be reported (`--percentile-metrics`)."""


@dataclass
class ServeRun:
    """Every request's result, in dataset order, and the wall time of the run."""

    results: list[TurnResult]
    t0: float
    duration: float


def progress_bar(total: int) -> Any:
    try:
        from tqdm import tqdm
    except ImportError:
        return None
    return tqdm(total=total, desc="Requests", dynamic_ncols=True)


# ---------------------------------------------------------------------------------------------- metrics


def summarize(
    run: ServeRun, slos: dict[str, float], percentiles: Sequence[float], metrics: Sequence[str] = METRICS
) -> dict[str, Any]:
    """vLLM's result fields: counts, throughputs, goodput and each of `metrics`' statistics in ms."""
    ok = [r for r in run.results if r.ok]
    dt = max(run.duration, 1e-9)
    out_tokens = sum(r.output_len for r in ok)
    in_tokens = sum(r.input_len for r in ok)
    errors = [r.error for r in run.results if not r.ok]
    result: dict[str, Any] = {
        "duration": run.duration,
        "completed": len(ok),
        "failed": len(errors),
        "first_error": _first_error(run.results),
        "total_input_tokens": in_tokens,
        "total_output_tokens": out_tokens,
        "token_counts_from_usage": all(r.usage for r in ok),
        "request_throughput": len(ok) / dt,
        "request_goodput": sum(_meets(r, slos) for r in ok) / dt if slos else None,
        "goodput_slos_ms": slos or None,
        "output_throughput": out_tokens / dt,
        "total_token_throughput": (in_tokens + out_tokens) / dt,
        "peak_output_throughput": _peak_output_throughput(run),
        "peak_concurrent_requests": _peak_concurrency(run.results),
    }
    for name, values in _latency_series(ok).items():
        if name not in metrics:
            continue
        result.update(_stats(name, [v * 1000 for v in values], percentiles))
    return result


def _first_error(results: Sequence[TurnResult]) -> str | None:
    """The error of the failure that came first (turns skipped after a failed one were never sent)."""
    sent = sorted((r for r in results if not r.ok and r.end), key=lambda r: r.end)
    return sent[0].error if sent else next((r.error for r in results if not r.ok), None)


def _latency_series(ok: Sequence[TurnResult]) -> dict[str, list[float]]:
    """Seconds: TTFT and e2e latency per request, TPOT per request of 2+ tokens, every inter-chunk gap."""
    return {
        "ttft": [r.ttft for r in ok],
        "tpot": [t for r in ok if (t := r.tpot) is not None],
        "itl": [g for r in ok for g in r.itls],
        "e2el": [r.latency for r in ok],
    }


def _stats(name: str, ms: Sequence[float], percentiles: Sequence[float]) -> dict[str, float]:
    xs = sorted(ms)
    out = {
        f"mean_{name}_ms": statistics.fmean(xs) if xs else 0.0,
        f"median_{name}_ms": percentile(xs, 50),
        f"std_{name}_ms": statistics.pstdev(xs) if xs else 0.0,
    }
    for p in percentiles:
        out[f"p{p:g}_{name}_ms"] = percentile(xs, p)
    return out


def percentile(sorted_xs: Sequence[float], p: float) -> float:
    """The p-th percentile of sorted values, interpolated linearly between ranks (numpy's default)."""
    if not sorted_xs:
        return 0.0
    k = (len(sorted_xs) - 1) * p / 100
    lo = math.floor(k)
    hi = min(lo + 1, len(sorted_xs) - 1)
    return sorted_xs[lo] + (sorted_xs[hi] - sorted_xs[lo]) * (k - lo)


def _meets(r: TurnResult, slos: dict[str, float]) -> bool:
    got = {"ttft": r.ttft, "tpot": r.tpot or 0.0, "e2el": r.latency}
    return all(got[k] * 1000 <= ms for k, ms in slos.items())


def _peak_concurrency(results: Sequence[TurnResult]) -> int:
    # ends sort before starts at the same instant: a request that ends as another starts is not overlap
    edges = sorted((t, d) for r in results if r.end for t, d in ((r.start, 1), (r.end, -1)))
    running = peak = 0
    for _, d in edges:
        running += d
        peak = max(peak, running)
    return peak


def _token_events(run: ServeRun) -> list[tuple[float, float]]:
    """(seconds from the start, tokens) of every content chunk, in time order. A chunk can carry several
    tokens (speculative decoding commits a few at once, a busy server sends what piled up), so each
    request's token count is spread evenly over its chunks."""
    events = [
        (t - run.t0, r.output_len / len(r.chunk_times)) for r in run.results if r.ok for t in r.chunk_times
    ]
    return sorted(events)


def _peak_output_throughput(run: ServeRun, window_s: float = 1.0) -> float:
    """Most output tokens/s over any `window_s` of the run (the whole run when it is shorter)."""
    events = _token_events(run)
    window = min(window_s, max(run.duration, 1e-9))
    best = inside = 0.0
    first = 0
    for t, k in events:
        inside += k
        while events[first][0] <= t - window:
            inside -= events[first][1]
            first += 1
        best = max(best, inside)
    return best / window


def _output_timeline(run: ServeRun, bin_s: float = 1.0) -> list[float]:
    """Output tokens per second in consecutive `bin_s` bins from the start (the last one as long as what
    is left of the run)."""
    n = max(1, math.ceil(run.duration / bin_s))
    tokens = [0.0] * n
    for t, k in _token_events(run):
        tokens[min(n - 1, int(t / bin_s))] += k
    widths = [bin_s] * (n - 1) + [max(run.duration - (n - 1) * bin_s, 1e-9)]
    return [k / w for k, w in zip(tokens, widths)]


# ----------------------------------------------------------------------------------------------- report


def run_info(ns: argparse.Namespace, model: str, url: str) -> dict[str, Any]:
    return {
        "date": datetime.now().strftime("%Y%m%d-%H%M%S"),
        "backend": ns.backend,
        "label": ns.label or ns.backend,
        "url": url,
        "model_id": model,
        "tokenizer_id": ns.tokenizer,
        "dataset_name": ns.dataset_name,
        "num_prompts": ns.num_prompts,
        # JSON has no infinity
        "request_rate": ns.request_rate if math.isfinite(ns.request_rate) else "inf",
        "burstiness": ns.burstiness,
        "max_concurrency": ns.max_concurrency,
        "ignore_eos": ns.ignore_eos,
        "random_input_len": ns.random_input_len,
        "random_output_len": ns.random_output_len,
        "random_range_ratio": ns.random_range_ratio,
        "seed": ns.seed,
    }


_SECTIONS = (
    ("ttft", "Time to First Token", "TTFT"),
    ("tpot", "Time per Output Token (excl. 1st token)", "TPOT"),
    ("itl", "Inter-token Latency", "ITL"),
    ("e2el", "End-to-end Latency", "E2EL"),
)


def print_table(res: dict[str, Any], percentiles: Sequence[float], metrics: Sequence[str] = METRICS) -> None:
    def row(label: str, value: Any) -> None:
        text = f"{value:.2f}" if isinstance(value, float) else str(value)
        print(f"{label:<40} {text:<10}")

    print("{s:{c}^50}".format(s=" Serving Benchmark Result ", c="="))
    row("Successful requests:", res["completed"])
    row("Failed requests:", res["failed"])
    row("Maximum request concurrency:", res["max_concurrency"] or "unbounded")
    row("Request rate configured (RPS):", res["request_rate"])
    row("Benchmark duration (s):", res["duration"])
    row("Total input tokens:", res["total_input_tokens"])
    row("Total generated tokens:", res["total_output_tokens"])
    row("Request throughput (req/s):", res["request_throughput"])
    if res["request_goodput"] is not None:
        row("Request goodput (req/s):", res["request_goodput"])
    row("Output token throughput (tok/s):", res["output_throughput"])
    row("Peak output token throughput (tok/s):", res["peak_output_throughput"])
    row("Peak concurrent requests:", res["peak_concurrent_requests"])
    row("Total token throughput (tok/s):", res["total_token_throughput"])
    for key, title, short in _SECTIONS:
        if key not in metrics:
            continue
        print("{s:{c}^50}".format(s=title, c="-"))
        row(f"Mean {short} (ms):", res[f"mean_{key}_ms"])
        row(f"Median {short} (ms):", res[f"median_{key}_ms"])
        for p in percentiles:
            row(f"P{p:g} {short} (ms):", res[f"p{p:g}_{key}_ms"])
    print("=" * 50)
    if res["first_error"]:
        print(f"First error: {res['first_error']}")
    if res["completed"] and not res["token_counts_from_usage"]:
        print("Note: the server sent no usage; output tokens were counted as content chunks")


def save(result: dict[str, Any], run: ServeRun, ns: argparse.Namespace) -> None:
    out = dict(result)
    if ns.save_detailed:
        out.update(_details(run))
    name = ns.result_filename or _default_filename(result)
    path = Path(ns.result_dir) / name
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(out, indent=2) + "\n")
    except OSError as e:
        raise BenchError(f"cannot write {path}: {e}") from e
    print(f"Results: {path}")
    note = _plot(run, result, path.with_suffix(".png"))
    print(note)


def _details(run: ServeRun) -> dict[str, Any]:
    rs = run.results
    return {
        "input_lens": [r.input_len for r in rs],
        "output_lens": [r.output_len for r in rs],
        "start_times": [r.start - run.t0 if r.start else None for r in rs],
        "ttfts": [r.ttft if r.ok else None for r in rs],
        "tpots": [r.tpot if r.ok else None for r in rs],
        "itls": [r.itls for r in rs],
        "e2els": [r.latency if r.ok else None for r in rs],
        "errors": [r.error for r in rs],
        "generated_texts": [r.text for r in rs],
    }


def _default_filename(result: dict[str, Any]) -> str:
    model = str(result["model_id"]).replace("/", "_")
    concurrency = result["max_concurrency"] or "inf"
    rate = result["request_rate"]
    return f"{result['label']}-{rate}qps-concurrency{concurrency}-{model}-{result['date']}.json"


def _plot(run: ServeRun, result: dict[str, Any], path: Path) -> str:
    """Latency CDFs and output throughput over time into `path`; the line to print either way."""
    try:
        mpl = importlib.import_module("matplotlib")
    except ImportError:
        return (
            "Note: matplotlib is not installed, so no plot (pip install matplotlib for a PNG of the results)"
        )
    mpl.use("Agg")  # no display needed
    plt = importlib.import_module("matplotlib.pyplot")
    fig = plt.figure(figsize=(15, 8))
    grid = fig.add_gridspec(2, 3)
    cells = [grid[0, 0], grid[0, 1], grid[0, 2], grid[1, 0]]
    series = _latency_series([r for r in run.results if r.ok])
    for cell, (key, title, short) in zip(cells, _SECTIONS):
        ax = fig.add_subplot(cell)
        xs = sorted(v * 1000 for v in series[key])
        if xs:
            # the step function of the empirical CDF, from 0 at the smallest value
            ax.plot([xs[0], *xs], [0.0, *((i + 1) / len(xs) for i in range(len(xs)))], drawstyle="steps-post")
        of = "inter-token gaps" if key == "itl" else "requests"
        ax.set(title=f"{short}: {title}", xlabel="ms", ylabel=f"fraction of {of}", ylim=(0, 1.02))
        ax.grid(alpha=0.3)
    ax = fig.add_subplot(grid[1, 1:])
    # about 60 points over a short run, one a second over a long one
    bin_s = 1.0 if run.duration >= 60 else max(run.duration / 60, 1e-3)
    timeline = _output_timeline(run, bin_s)
    ax.plot([(i + 0.5) * bin_s for i in range(len(timeline))], timeline, marker=".")
    ax.set(
        title=f"Output token throughput ({bin_s:.3g} s bins)",
        xlabel="seconds from the start",
        ylabel="tokens/s",
        ylim=(0, None),
    )
    ax.grid(alpha=0.3)
    fig.suptitle(
        f"{result['model_id']} at {result['url']}: {result['dataset_name']}, {result['completed']} requests, "
        f"rate {result['request_rate']}, concurrency {result['max_concurrency'] or 'unbounded'}"
    )
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return f"Plot: {path}"
