"""`hyspec serve`, `generate`, `chat`, `complete`, `bench`, `draft-vocab`: the one command-line parser (the
clients', the benchmarks' and draft-vocab's flags are added by `client_cli.py`, `bench_cli.py` and
`draft_vocab_cli.py`; the benchmarks' client, report and offline
runs are in `bench_client.py`, `bench_report.py` and `bench_offline.py`).

Engine flags are generated from the `EngineArgs` fields (`engine_flags.py`), so a new engine argument is a
CLI flag with nothing to add here. A vLLM flag hyspec lacks is an error naming it.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from hyspec_runner.config import DEFAULT_SPECULATIVE_CONFIG, IGNORED_VLLM_ARGS, UNSUPPORTED_VLLM_ARGS

from hyspec_server.bench_cli import add_bench_command, run_bench
from hyspec_server.client_cli import add_client_commands, run_client
from hyspec_server.default_model import DEFAULT_NAME
from hyspec_server.draft_vocab_cli import add_draft_vocab_command, run_draft_vocab
from hyspec_server.engine_flags import add_engine_flags, engine_args
from hyspec_server.sampling_params import SamplingParams

# vLLM's short spellings of flags hyspec does not support
_VLLM_SHORT_FLAGS = {"-tp": "tensor_parallel_size", "-pp": "pipeline_parallel_size", "-q": "quantization"}


def _engine_flags(p: argparse.ArgumentParser) -> None:
    add_engine_flags(
        p,
        model_help=f"default: the shipped {DEFAULT_NAME} demo model with speculative config "
        f"{json.dumps(dict(DEFAULT_SPECULATIVE_CONFIG))}",
    )


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="hyspec", description="Serve hybrid LMs with speculative decoding.")
    parser.add_argument("--version", action="version", version=f"hyspec {_version()}")
    sub = parser.add_subparsers(dest="command", required=True)
    s = sub.add_parser("serve", help="OpenAI-compatible HTTP server")
    _engine_flags(s)
    f = s.add_argument_group("Frontend")
    f.add_argument("--host", default="127.0.0.1")
    f.add_argument("--port", type=_ranged(int, 0, 65535), default=8000)
    f.add_argument(
        "--api-key",
        default=os.environ.get("HYSPEC_API_KEY") or None,
        help="require 'Authorization: Bearer KEY' on every route but /health (/metrics too); default: the "
        "HYSPEC_API_KEY environment variable",
    )
    f.add_argument("--served-model-name", default=None)
    f.add_argument(
        "--allowed-origins",
        type=_origins,
        default=["*"],
        help='CORS origins as a JSON list (default ["*"], as vLLM); [] sends no CORS headers',
    )
    f.add_argument(
        "--chat-template",
        default=None,
        help="a Jinja chat template, or a file holding one, for every chat request (default: the "
        "tokenizer's)",
    )
    f.add_argument(
        "--trust-request-chat-template",
        action="store_true",
        help="accept a chat request's own chat_template (refused by default, as vLLM)",
    )
    f.add_argument(
        "--stream-stall-timeout",
        type=_ranged(float, 1e-3, None),
        default=None,
        help="abort a streamed request whose client takes no chunk for this many seconds (default 60)",
    )
    f.add_argument(
        "--graceful-shutdown-timeout",
        type=_ranged(int, 0, None),
        default=None,
        help="seconds SIGTERM waits for running requests (default 30); a second SIGTERM exits at once",
    )
    f.add_argument(
        "--limit-concurrency",
        type=_ranged(int, 1, None),
        default=None,
        help="most open connections; beyond it 503 (default 2 x (max-num-seqs + max-waiting))",
    )
    f.add_argument(
        "--max-body-bytes",
        type=_ranged(int, 1, None),
        default=None,
        help="larger request bodies get 413 (default: 64 bytes per token of max_model_len, at least 1 MiB)",
    )
    g = sub.add_parser("generate", help="generate once and print the text and tokens/s")
    _engine_flags(g)
    o = g.add_argument_group("Generation")
    o.add_argument("--prompt", default="Hello, my name is")
    o.add_argument("--max-tokens", type=int, default=32)
    o.add_argument("--temperature", type=float, default=0.0)
    o.add_argument("--top-p", type=float, default=1.0)
    o.add_argument("--top-k", type=int, default=-1)
    o.add_argument("--repetition-penalty", type=float, default=1.0)
    o.add_argument("--ignore-eos", action="store_true")
    o.add_argument("--json", action="store_true", help="print one JSON object with token ids and stats")
    add_client_commands(sub)  # `hyspec chat` / `hyspec complete` against a running server (client_cli.py)
    add_bench_command(sub)  # `hyspec bench serve|latency|throughput` (bench_cli.py)
    add_draft_vocab_command(sub)  # `hyspec draft-vocab` (draft_vocab_cli.py)
    return parser


def _ranged(kind: type[int] | type[float], low: float, high: float | None) -> Any:
    """An argparse type: `kind` within [low, high] (an argparse error, exit 2, otherwise)."""

    def parse(text: str) -> int | float:
        try:
            v = kind(text)
        except ValueError as e:
            raise argparse.ArgumentTypeError(f"expected {kind.__name__}, got {text!r}") from e
        if not low <= v <= (high if high is not None else float("inf")):
            bound = f"in [{low:g}, {high:g}]" if high is not None else f">= {low:g}"
            raise argparse.ArgumentTypeError(f"expected a value {bound}, got {text}")
        return v

    return parse


def _origins(text: str) -> list[str]:
    """An argparse type: `--allowed-origins`, a JSON list of origin strings."""
    try:
        value = json.loads(text)
    except ValueError:
        value = None
    if not isinstance(value, list) or not all(isinstance(o, str) for o in value):
        raise argparse.ArgumentTypeError(
            f'expected a JSON list of origins such as ["https://a.example"], got {text!r}'
        )
    return value


def _version() -> str:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version("hyspec-server")
    except PackageNotFoundError:
        return "unknown"


def _template(arg: str | None) -> str | None:
    """`--chat-template`: a file's text when the argument names a file, else the template itself. An
    argument with none of a template's characters is a path that is not there (a typo, a directory): a
    ValueError, as vLLM's, not a template that renders the path as every prompt."""
    if arg is None:
        return None
    path = Path(arg).expanduser()
    if path.is_file():
        return path.read_text()
    if not any(c in arg for c in "{}\n"):
        raise ValueError(f"chat_template: {arg!r} looks like a file path, but there is no such file")
    return arg


def _check_extra(parser: argparse.ArgumentParser, extra: list[str]) -> None:
    """Flags argparse did not know: vLLM's that hyspec lacks get an error saying so; vLLM's that change
    nothing here are logged and dropped; anything else is argparse's usual error."""
    unknown = []
    for token in extra:
        if not token.startswith("-"):
            continue
        name = _VLLM_SHORT_FLAGS.get(token) or token.lstrip("-").split("=", 1)[0].replace("-", "_")
        if name.startswith("no_") and name[3:] in IGNORED_VLLM_ARGS | set(UNSUPPORTED_VLLM_ARGS):
            name = name[3:]
        if name == "trust_remote_code":  # as `LLM(trust_remote_code=True)`: refused, saying why
            parser.error(
                f"{token}: hyspec runs its own implementation of each supported architecture and "
                "never executes a checkpoint's code; leave the flag out"
            )
        if name == "no_trust_remote_code":
            continue  # what hyspec always does
        if name in UNSUPPORTED_VLLM_ARGS:
            parser.error(f"{token}: a vLLM flag hyspec does not support: {UNSUPPORTED_VLLM_ARGS[name]}")
        if name in IGNORED_VLLM_ARGS:
            logging.getLogger("hyspec.cli").info("%s has no effect in hyspec; ignored", token)
            continue
        unknown.append(token)
    # the ignored flags take no value, so a loose word is never theirs (`model other` is no model)
    loose = [t for t in extra if not t.startswith("-")]
    if unknown or loose:
        parser.error(f"unrecognized arguments: {' '.join(unknown + loose)}")


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    ns, extra = parser.parse_known_args(argv)
    _check_extra(parser, extra)
    if ns.command in ("chat", "complete"):
        return run_client(ns)
    if ns.command == "bench":
        return run_bench(ns)
    if ns.command == "draft-vocab":
        return run_draft_vocab(ns)
    try:
        if ns.command == "serve":
            from hyspec_server.serve import serve

            logging.basicConfig(level=logging.INFO, format="%(levelname)s %(asctime)s %(name)s: %(message)s")
            serve(
                engine_args(ns),
                host=ns.host,
                port=ns.port,
                api_key=ns.api_key,
                served_model_name=ns.served_model_name,
                max_body_bytes=ns.max_body_bytes,
                limit_concurrency=ns.limit_concurrency,
                graceful_shutdown_s=ns.graceful_shutdown_timeout,
                allowed_origins=ns.allowed_origins,
                chat_template=_template(ns.chat_template),
                trust_request_chat_template=ns.trust_request_chat_template,
                stream_stall_timeout_s=ns.stream_stall_timeout,
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
    llm = LLM.from_engine(build_engine(engine_args(ns)))
    t0 = time.perf_counter()
    out = llm.generate([ns.prompt], params, use_tqdm=False)[0]
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
