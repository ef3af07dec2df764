"""`hyspec bench latency` and `hyspec bench throughput` (flags in bench_cli.py): the engine offline, in
this process through `hyspec_server.LLM`, on random token ids (ignore_eos, greedy).

- `latency` times one batch end to end after warm-up iterations.
- `throughput` runs a random dataset through `LLM` at once and reports requests and tokens per second.
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from hyspec_server.bench_client import BenchError
from hyspec_server.bench_datasets import sample_len
from hyspec_server.bench_report import percentile
from hyspec_server.engine_flags import engine_kwargs

LATENCY_PERCENTILES = (10, 25, 50, 75, 90, 99)


def _make_llm(ns: argparse.Namespace) -> Any:
    from hyspec_server.llm import LLM  # the engine (and torch) only for the offline benchmarks

    return LLM(ns.model, **engine_kwargs(ns))


def _vocab_size(llm: Any) -> int:
    tok = llm.get_tokenizer()
    size = getattr(tok, "vocab_size", None)
    return int(size) if isinstance(size, int) and size > 0 else len(tok)


def _random_ids(rng: random.Random, vocab: int, n: int) -> dict[str, list[int]]:
    return {"prompt_token_ids": [rng.randrange(vocab) for _ in range(n)]}


def _greedy(max_tokens: int) -> Any:
    from hyspec_server.sampling_params import SamplingParams

    # every request generates exactly max_tokens tokens, whatever the model would stop at
    return SamplingParams(max_tokens=max_tokens, ignore_eos=True, temperature=0.0)


def bench_latency(ns: argparse.Namespace) -> int:
    for name in ("input_len", "output_len", "batch_size", "num_iters"):
        if getattr(ns, name) < 1:
            raise ValueError(f"--{name.replace('_', '-')} must be >= 1")
    if ns.num_iters_warmup < 0:
        raise ValueError("--num-iters-warmup must be >= 0")
    llm = _make_llm(ns)
    rng = random.Random(ns.seed or 0)
    vocab = _vocab_size(llm)
    prompts = [_random_ids(rng, vocab, ns.input_len) for _ in range(ns.batch_size)]
    params = _greedy(ns.output_len)

    def once() -> tuple[float, list[Any]]:
        t0 = time.perf_counter()
        outs = llm.generate(prompts, params, use_tqdm=False)
        return time.perf_counter() - t0, outs

    for _ in _iterations(ns.num_iters_warmup, "Warmup iterations", ns.disable_tqdm):
        once()
    latencies: list[float] = []
    outs: list[Any] = []
    for _ in _iterations(ns.num_iters, "Profiling iterations", ns.disable_tqdm):
        dt, got = once()
        latencies.append(dt)
        outs += got
    xs = sorted(latencies)
    result: dict[str, Any] = {
        "avg_latency": statistics.fmean(xs),
        "latencies": latencies,
        "percentiles": {str(p): percentile(xs, p) for p in LATENCY_PERCENTILES},
        "input_len": ns.input_len,
        "output_len": ns.output_len,
        "batch_size": ns.batch_size,
        "num_iters": ns.num_iters,
        "output_tokens_per_iter": sum(len(c.token_ids) for o in outs for c in o.outputs) / ns.num_iters,
        "spec_decode": _spec_summary(outs),
    }
    print(f"Avg latency: {result['avg_latency']:.4f} seconds")
    for p, v in result["percentiles"].items():
        print(f"{p}% percentile latency: {v:.4f} seconds")
    _print_spec(result["spec_decode"])
    _write_json(ns.output_json, result)
    return 0


def _iterations(n: int, desc: str, disable: bool) -> Any:
    if disable:
        return range(n)
    try:
        from tqdm import tqdm
    except ImportError:
        return range(n)
    return tqdm(range(n), desc=desc, dynamic_ncols=True)


def bench_throughput(ns: argparse.Namespace) -> int:
    for name in ("input_len", "output_len", "num_prompts"):
        if getattr(ns, name) < 1:
            raise ValueError(f"--{name.replace('_', '-')} must be >= 1")
    if not 0 <= ns.random_range_ratio < 1:
        raise ValueError("--random-range-ratio must be in [0, 1)")
    llm = _make_llm(ns)
    rng = random.Random(ns.seed or 0)
    vocab = _vocab_size(llm)
    prompts, params = [], []
    for _ in range(ns.num_prompts):
        prompts.append(_random_ids(rng, vocab, sample_len(rng, ns.input_len, ns.random_range_ratio)))
        params.append(_greedy(sample_len(rng, ns.output_len, ns.random_range_ratio)))
    t0 = time.perf_counter()
    outs = llm.generate(prompts, params, use_tqdm=not ns.disable_tqdm)
    elapsed = time.perf_counter() - t0
    prompt_tokens = sum(len(o.prompt_token_ids) for o in outs)
    output_tokens = sum(len(c.token_ids) for o in outs for c in o.outputs)
    total = prompt_tokens + output_tokens
    result: dict[str, Any] = {
        "elapsed_time": elapsed,
        "num_requests": len(outs),
        "total_num_tokens": total,
        "total_prompt_tokens": prompt_tokens,
        "total_output_tokens": output_tokens,
        "requests_per_second": len(outs) / elapsed,
        "tokens_per_second": total / elapsed,
        "output_tokens_per_second": output_tokens / elapsed,
        "spec_decode": _spec_summary(outs),
    }
    print(
        f"Throughput: {result['requests_per_second']:.2f} requests/s, "
        f"{result['tokens_per_second']:.2f} total tokens/s, "
        f"{result['output_tokens_per_second']:.2f} output tokens/s"
    )
    print(f"Total num prompt tokens:  {prompt_tokens}")
    print(f"Total num output tokens:  {output_tokens}")
    _print_spec(result["spec_decode"])
    _write_json(ns.output_json, result)
    return 0


def _spec_summary(outs: Sequence[Any]) -> dict[str, Any] | None:
    """Speculative decoding's totals over the outputs; None without speculation."""
    stats = [o.spec_stats for o in outs if o.spec_stats is not None]
    if not stats:
        return None
    drafts = sum(s.num_drafts for s in stats)
    accepted = sum(s.num_accepted_tokens for s in stats)
    return {
        "num_drafts": drafts,
        "num_draft_tokens": sum(s.num_draft_tokens for s in stats),
        "num_accepted_tokens": accepted,
        # tokens per verify round: the accepted drafts plus the target's own token
        "mean_accept_length": 1 + accepted / drafts if drafts else None,
    }


def _print_spec(spec: dict[str, Any] | None) -> None:
    if spec and spec["num_drafts"]:
        print(
            f"Speculative decoding: {spec['num_accepted_tokens']}/{spec['num_draft_tokens']} drafted tokens "
            f"accepted, {spec['mean_accept_length']:.2f} tokens per verify round"
        )


def _write_json(path: str | None, result: dict[str, Any]) -> None:
    if path is None:
        return
    try:
        Path(path).parent.mkdir(parents=True, exist_ok=True)
        Path(path).write_text(json.dumps(result, indent=2) + "\n")
    except OSError as e:
        raise BenchError(f"cannot write {path}: {e}") from e
    print(f"Results: {path}")
