"""`hyspec serve` and `hyspec generate`. The only place that parses command-line arguments."""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from collections.abc import Sequence

from hyspec_server.config import ENGINE_DEFAULTS, EngineArgs
from hyspec_server.default_model import DEFAULT_NAME, DEFAULT_SPECULATIVE_CONFIG
from hyspec_server.sampling_params import SamplingParams
from hyspec_server.speculative import parse_speculative_config


def _engine_flags(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "model",
        nargs="?",
        default=None,
        help=f"checkpoint directory (HF layout); default: the shipped {DEFAULT_NAME} demo model with "
        f"speculative config {json.dumps(dict(DEFAULT_SPECULATIVE_CONFIG))}",
    )
    d = ENGINE_DEFAULTS
    p.add_argument("--device", default=d["device"], help="auto (the GPU when there is one), cpu or cuda")
    p.add_argument("--dtype", default=d["dtype"], choices=["auto", "float32", "bfloat16", "float16"])
    p.add_argument(
        "--max-model-len", type=int, default=d["max_model_len"], help="context length (prompt + output)"
    )
    p.add_argument(
        "--max-num-seqs", "--max-running-requests", dest="max_num_seqs", type=int, default=d["max_num_seqs"]
    )
    p.add_argument(
        "--max-num-batched-tokens",
        type=int,
        default=d["max_num_batched_tokens"],
        help="token budget of one step",
    )
    p.add_argument("--enforce-eager", action="store_true", help="no CUDA graphs")
    p.add_argument(
        "--speculative-config",
        default=None,
        help='JSON, vLLM style, e.g. \'{"method": "ngram", "num_speculative_tokens": 3}\'',
    )
    p.add_argument("--seed", type=int, default=d["seed"])
    p.add_argument(
        "--enable-prefix-caching",
        action=argparse.BooleanOptionalAction,
        default=d["enable_prefix_caching"],
        help="reuse cached KV pages and state snapshots of shared prefixes (default on)",
    )
    p.add_argument(
        "--prefix-cache-snapshot-interval",
        type=int,
        default=d["prefix_cache_snapshot_interval"],
        help="prefill tokens between state snapshots (a multiple of the page size)",
    )
    p.add_argument(
        "--prefix-cache-snapshot-fraction",
        type=float,
        default=d["prefix_cache_snapshot_fraction"],
        help="state slots for snapshots, as a fraction of --max-num-seqs",
    )


def _engine_args(ns: argparse.Namespace, **extra: object) -> EngineArgs:
    return EngineArgs(
        model=ns.model,
        device=ns.device,
        dtype=ns.dtype,
        max_model_len=ns.max_model_len,
        max_num_seqs=ns.max_num_seqs,
        max_num_batched_tokens=ns.max_num_batched_tokens,
        enforce_eager=ns.enforce_eager,
        speculative_config=parse_speculative_config(ns.speculative_config),
        seed=ns.seed,
        enable_prefix_caching=ns.enable_prefix_caching,
        prefix_cache_snapshot_interval=ns.prefix_cache_snapshot_interval,
        prefix_cache_snapshot_fraction=ns.prefix_cache_snapshot_fraction,
        **extra,  # type: ignore[arg-type]
    )


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="hyspec", description="Serve hybrid LMs with speculative decoding.")
    parser.add_argument("--version", action="version", version=f"hyspec {_version()}")
    sub = parser.add_subparsers(dest="command", required=True)
    s = sub.add_parser("serve", help="OpenAI-compatible HTTP server")
    _engine_flags(s)
    s.add_argument("--host", default="127.0.0.1")
    s.add_argument("--port", type=int, default=8000)
    s.add_argument(
        "--api-key",
        default=os.environ.get("HYSPEC_API_KEY") or None,
        help="require 'Authorization: Bearer KEY' on every route but /health (/metrics too); default: the "
        "HYSPEC_API_KEY environment variable",
    )
    s.add_argument("--served-model-name", default=None)
    s.add_argument(
        "--allowed-origins",
        type=json.loads,
        default=["*"],
        help='CORS origins as a JSON list (default ["*"], as vLLM); [] sends no CORS headers',
    )
    s.add_argument(
        "--graceful-shutdown-timeout",
        type=int,
        default=None,
        help="seconds SIGTERM waits for running requests (default 30); a second SIGTERM exits at once",
    )
    s.add_argument(
        "--limit-concurrency",
        type=int,
        default=None,
        help="most open connections; beyond it 503 (default 2 x (max-num-seqs + max-waiting))",
    )
    s.add_argument(
        "--max-body-bytes",
        type=int,
        default=None,
        help="larger request bodies get 413 (default: 64 bytes per token of max_model_len, at least 1 MiB)",
    )
    s.add_argument("--max-waiting", type=int, default=1024, help="bound of the queue; beyond it: 429")
    g = sub.add_parser("generate", help="generate once and print the text and tokens/s")
    _engine_flags(g)
    g.add_argument("--prompt", default="Hello, my name is")
    g.add_argument("--max-tokens", type=int, default=32)
    g.add_argument("--temperature", type=float, default=0.0)
    g.add_argument("--top-p", type=float, default=1.0)
    g.add_argument("--top-k", type=int, default=-1)
    g.add_argument("--repetition-penalty", type=float, default=1.0)
    g.add_argument("--ignore-eos", action="store_true")
    g.add_argument("--json", action="store_true", help="print one JSON object with token ids and stats")
    return parser


def _version() -> str:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version("hyspec-server")
    except PackageNotFoundError:
        return "unknown"


def main(argv: Sequence[str] | None = None) -> int:
    ns = build_parser().parse_args(argv)
    try:
        if ns.command == "serve":
            from hyspec_server.serve import serve

            args = _engine_args(ns, max_waiting=ns.max_waiting)
            serve(
                args,
                host=ns.host,
                port=ns.port,
                api_key=ns.api_key,
                served_model_name=ns.served_model_name,
                max_body_bytes=ns.max_body_bytes,
                limit_concurrency=ns.limit_concurrency,
                graceful_shutdown_s=ns.graceful_shutdown_timeout,
                allowed_origins=ns.allowed_origins,
            )
            return 0
        return _generate(ns)
    except (ValueError, OSError) as e:
        # bad arguments, or a port already in use (bound before the model loads)
        print(f"hyspec: error: {e}", file=sys.stderr)
        return 2


def _generate(ns: argparse.Namespace) -> int:
    from hyspec_server.builder import build_engine
    from hyspec_server.llm import LLM

    params = SamplingParams(
        max_tokens=ns.max_tokens,
        temperature=ns.temperature,
        top_p=ns.top_p,
        top_k=ns.top_k,
        repetition_penalty=ns.repetition_penalty,
        ignore_eos=ns.ignore_eos,
        seed=ns.seed,
    )
    llm = LLM.from_engine(build_engine(_engine_args(ns)))
    t0 = time.perf_counter()
    out = llm.generate([ns.prompt], params)[0]
    dt = time.perf_counter() - t0
    c = out.outputs[0]
    rate = len(c.token_ids) / dt if dt > 0 else 0.0
    if ns.json:
        stats = out.spec_stats
        print(
            json.dumps(
                {
                    "model": ns.model,
                    "prompt": ns.prompt,
                    "text": c.text,
                    "token_ids": c.token_ids,
                    "prompt_token_ids": out.prompt_token_ids,
                    "finish_reason": c.finish_reason,
                    "num_tokens": len(c.token_ids),
                    "seconds": dt,
                    "tokens_per_s": rate,
                    "spec_stats": None
                    if stats is None
                    else {
                        "num_drafts": stats.num_drafts,
                        "num_draft_tokens": stats.num_draft_tokens,
                        "num_accepted_tokens": stats.num_accepted_tokens,
                        "mean_accept_length": stats.mean_accept_length,
                    },
                }
            )
        )
    else:
        print(ns.prompt + c.text)
        spec = ""
        if out.spec_stats is not None and out.spec_stats.num_drafts:
            s = out.spec_stats
            spec = (
                f", speculation: {s.num_accepted_tokens}/{s.num_draft_tokens} drafts accepted, "
                f"{s.mean_accept_length:.2f} tokens per round"
            )
        print(
            f"[{len(c.token_ids)} tokens in {dt:.3f} s, {rate:.1f} tokens/s, "
            f"finish: {c.finish_reason}{spec}; "
            f"temperature {ns.temperature}, top_p {ns.top_p}, top_k {ns.top_k}, "
            f"repetition_penalty {ns.repetition_penalty}]",
            file=sys.stderr,
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
