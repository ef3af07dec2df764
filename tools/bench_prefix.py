"""Prefix caching on the GPU: shared-prefix serving, multi-turn chat and zero hits, caching on and off.

One run, one device, one Qwen3.5-9B-shaped random bf16 checkpoint (`bench_decode.build_checkpoint`), the
engine as `LLM` / `hyspec serve` build it (CUDA graphs on). Every workload runs with
`enable_prefix_caching` off and on, in the same process, and the outputs of the two are compared token for
token (greedy).

- shared prefix: one request with an `--prefix`-token prefix and a distinct `--suffix`-token tail, then
  `--requests - 1` more with the same prefix arriving together; TTFT p50 / p99 over all and throughput.
- multi-turn chat: `--turns` turns, each prompt the previous prompt + its output + a new user message; TTFT
  per turn.
- zero hits: distinct random prompts arriving together; throughput (caching on must lose at most 2%).

Results: benchmarks/results/<device>-prefix-caching.{json,md}.
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).parent))
from bench_decode import build_checkpoint


def _engine(ckpt: Path, caching: bool, a: argparse.Namespace) -> Any:
    from hyspec_server import EngineArgs
    from hyspec_server.builder import build_engine

    return build_engine(
        EngineArgs(
            model=str(ckpt),
            device="cuda",
            max_model_len=a.max_model_len,
            max_num_seqs=a.requests,
            max_num_batched_tokens=a.budget,
            enable_prefix_caching=caching,
            prefix_cache_snapshot_interval=a.interval or a.budget,
        )
    )


def _run(eng: Any, prompts: list[list[int]], new: int) -> tuple[list[list[int]], list[float], float, int]:
    """All prompts arrive now; runs to completion -> (outputs, TTFTs in s, wall s, cached tokens)."""
    from hyspec_server import SamplingParams

    params = SamplingParams(max_tokens=new, temperature=0, ignore_eos=True)
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    ids = [eng.add_request(p, params) for p in prompts]
    first: dict[str, float] = {}
    done: dict[str, Any] = {}
    while eng.has_unfinished():
        for o in eng.step():
            if o.outputs[0].token_ids and o.request_id not in first:
                first[o.request_id] = time.perf_counter() - t0
            if o.finished:
                done[o.request_id] = o
    wall = time.perf_counter() - t0
    outs = [done[i].outputs[0].token_ids for i in ids]
    return outs, [first[i] for i in ids], wall, sum(done[i].num_cached_tokens for i in ids)


def _agreement(a: list[list[int]], b: list[list[int]]) -> str:
    """Requests with identical greedy outputs, and the mean share of tokens before the first difference."""
    same = sum(x == y for x, y in zip(a, b, strict=True))
    lead = []
    for x, y in zip(a, b, strict=True):
        n = next((i for i, (s, t) in enumerate(zip(x, y)) if s != t), min(len(x), len(y)))
        lead.append(n / max(1, len(x)))
    return f"{same}/{len(a)} identical, {statistics.mean(lead):.0%} of tokens before the first difference"


def _pct(xs: list[float], q: float) -> float:
    s = sorted(xs)
    return s[min(len(s) - 1, round(q * (len(s) - 1)))]


def workloads(eng: Any, a: argparse.Namespace) -> dict[str, Any]:
    rng = random.Random(0)

    def rand(n: int) -> list[int]:
        return [rng.randrange(10, 150000) for _ in range(n)]

    out: dict[str, Any] = {}
    # warm-up: graphs are captured at start-up; this loads the prefill kernels for long chunks
    _run(eng, [rand(a.budget + 7)], 4)
    eng.reset_prefix_cache()

    prefix = rand(a.prefix)
    prompts = [prefix + rand(a.suffix) for _ in range(a.requests)]
    o1, t1, w1, c1 = _run(eng, prompts[:1], a.new)
    o2, t2, w2, c2 = _run(eng, prompts[1:], a.new)
    ttft = t1 + t2
    tokens = sum(len(p) + a.new for p in prompts)
    out["shared_prefix"] = {
        "outputs": o1 + o2,
        "ttft_p50_s": _pct(ttft, 0.5),
        "ttft_p99_s": _pct(ttft, 0.99),
        "throughput_tok_s": tokens / (w1 + w2),
        "cached_tokens": c1 + c2,
        "prompt_tokens": sum(len(p) for p in prompts),
    }
    eng.reset_prefix_cache()

    history = rand(a.chat_system)
    turns = []
    outs = []
    for _ in range(a.turns):
        (o,), (t,), _, cached = _run(eng, [history], a.chat_new)
        turns.append({"prompt_tokens": len(history), "ttft_s": t, "cached_tokens": cached})
        outs.append(o)
        history = history + o + rand(a.chat_user)
    out["multi_turn"] = {"outputs": outs, "turns": turns}
    eng.reset_prefix_cache()

    distinct = [rand(a.zero_len) for _ in range(a.requests)]
    o, t, w, c = _run(eng, distinct, a.new)
    out["zero_hit"] = {
        "outputs": o,
        "throughput_tok_s": sum(len(p) + a.new for p in distinct) / w,
        "ttft_p50_s": _pct(t, 0.5),
        "cached_tokens": c,
    }
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", type=Path, default=Path("benchmarks/results"))
    ap.add_argument("--layers", type=int, default=32)
    ap.add_argument("--requests", type=int, default=64)
    ap.add_argument("--prefix", type=int, default=8192)
    ap.add_argument("--suffix", type=int, default=256)
    ap.add_argument("--new", type=int, default=32)
    ap.add_argument("--budget", type=int, default=2048, help="max_num_batched_tokens")
    ap.add_argument("--turns", type=int, default=8)
    ap.add_argument("--chat-system", type=int, default=2048)
    ap.add_argument("--chat-user", type=int, default=128)
    ap.add_argument("--chat-new", type=int, default=128)
    ap.add_argument("--zero-len", type=int, default=1024)
    ap.add_argument("--max-model-len", type=int, default=8704)
    ap.add_argument(
        "--interval",
        type=int,
        default=0,
        help="prefix_cache_snapshot_interval (0: the budget, so both runs cut prefills alike)",
    )
    a = ap.parse_args()
    device = torch.cuda.get_device_name().lower().replace(" ", "-")
    res: dict[str, Any] = {
        "device": torch.cuda.get_device_name(),
        "args": {k: str(v) for k, v in vars(a).items()},
    }
    with tempfile.TemporaryDirectory(prefix="hyspec-prefix-") as tmp:
        ckpt = Path(tmp) / "qwen3_5-9b-shaped"
        build_checkpoint(ckpt, a.layers)
        torch.cuda.empty_cache()
        for caching in (False, True):
            eng = _engine(ckpt, caching, a)
            res["on" if caching else "off"] = workloads(eng, a)
            del eng
            torch.cuda.empty_cache()
    on, off = res["on"], res["off"]
    same = {
        k: _agreement(on[k]["outputs"], off[k]["outputs"])
        for k in ("shared_prefix", "multi_turn", "zero_hit")
    }
    res["identical_outputs"] = same
    for side in (on, off):
        for k in side:
            side[k].pop("outputs")
    a.out.mkdir(parents=True, exist_ok=True)
    (a.out / f"{device}-prefix-caching.json").write_text(json.dumps(res, indent=1))
    sp_on, sp_off = on["shared_prefix"], off["shared_prefix"]
    mt_on, mt_off = on["multi_turn"]["turns"], off["multi_turn"]["turns"]
    lines = [
        f"# Prefix caching, {res['device']}, Qwen3.5-9B-shaped random bf16 ({a.layers} layers), one run",
        "",
        f"Budget {a.budget} tokens per step, snapshot interval {a.interval or a.budget}, CUDA graphs on. "
        f"Greedy outputs, caching on vs off: {same} (bf16: a prefill resumed from the cache runs other "
        "chunk shapes than one computed from token 0, and a random model's logits are near-ties).",
        "",
        f"## Shared prefix: {a.requests} requests, {a.prefix}-token shared prefix + {a.suffix} distinct "
        f"tokens, {a.new} new tokens each (one request first, the rest together)",
        "",
        "| caching | TTFT p50 | TTFT p99 | throughput (prompt + output tok/s) | hit rate |",
        "| --- | --- | --- | --- | --- |",
    ]
    for name, s in (("off", sp_off), ("on", sp_on)):
        lines.append(
            f"| {name} | {s['ttft_p50_s'] * 1e3:.0f} ms | {s['ttft_p99_s'] * 1e3:.0f} ms | "
            f"{s['throughput_tok_s']:.0f} | {s['cached_tokens'] / s['prompt_tokens']:.1%} |"
        )
    lines += [
        "",
        f"TTFT p50 {sp_off['ttft_p50_s'] / sp_on['ttft_p50_s']:.1f}x lower with caching on.",
        "",
        f"## Multi-turn chat: {a.turns} turns, {a.chat_system}-token system prompt, {a.chat_user}-token user "
        f"turns, {a.chat_new} new tokens per turn",
        "",
        "| turn | prompt tokens | TTFT off | TTFT on | cached tokens (on) |",
        "| --- | --- | --- | --- | --- |",
    ]
    for i, (t_on, t_off) in enumerate(zip(mt_on, mt_off, strict=True)):
        lines.append(
            f"| {i + 1} | {t_on['prompt_tokens']} | {t_off['ttft_s'] * 1e3:.0f} ms | "
            f"{t_on['ttft_s'] * 1e3:.0f} ms | {t_on['cached_tokens']} |"
        )
    lines += [
        "",
        f"Turn {a.turns} TTFT / turn 1 TTFT with caching on: "
        f"{mt_on[-1]['ttft_s'] / mt_on[0]['ttft_s']:.2f}x.",
        "",
        f"## Zero hits: {a.requests} distinct {a.zero_len}-token prompts together, {a.new} new tokens each",
        "",
        f"Throughput off {off['zero_hit']['throughput_tok_s']:.0f} tok/s, on "
        f"{on['zero_hit']['throughput_tok_s']:.0f} tok/s "
        f"({on['zero_hit']['throughput_tok_s'] / off['zero_hit']['throughput_tok_s']:.3f}x).",
    ]
    (a.out / f"{device}-prefix-caching.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
