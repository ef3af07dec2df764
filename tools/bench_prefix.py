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
- MTP chat: a multi-turn chat on the shipped demo Qwen3.5 with its trained MTP head, caching off, on, and on
  with the drafter's own prefix cache off: acceptance per turn (a hit must resume the draft KV, not zeros).

Each chat runs once unmeasured first with other tokens (a first turn at a new length loads kernels; that
cold chat's TTFTs are kept in the JSON as `turns_cold`).

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

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from tools.bench_decode import build_checkpoint  # noqa: E402


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


def _chat(eng: Any, system: list[int], users: list[list[int]], new: int) -> tuple[list[Any], list[list[int]]]:
    """A chat: each turn's prompt is the previous prompt + its output + the next user message -> per-turn
    records (prompt tokens, TTFT, cached tokens, drafts and accepted drafts) and outputs."""
    history = list(system)
    turns: list[Any] = []
    outs: list[list[int]] = []
    for user in [*users, []]:
        st = eng.stats
        drafts, accepted = st.spec_num_draft_tokens, st.spec_num_accepted_tokens
        (o,), (t,), _, cached = _run(eng, [history], new)
        turns.append(
            {
                "prompt_tokens": len(history),
                "ttft_s": t,
                "cached_tokens": cached,
                "draft_tokens": st.spec_num_draft_tokens - drafts,
                "accepted_tokens": st.spec_num_accepted_tokens - accepted,
            }
        )
        outs.append(o)
        history = history + o + user
    return turns, outs


def mtp_chat(a: argparse.Namespace) -> dict[str, Any]:
    """Multi-turn chat on the shipped demo Qwen3.5 with its trained MTP head (S=3): caching off, on, and on
    with the drafter's own cache off (its KV for cached tokens as zeros, as before drafter snapshots)."""
    from hyspec_server import EngineArgs
    from hyspec_server.builder import build_engine
    from hyspec_spec_workers.draft_kv import DraftKV
    from transformers import AutoTokenizer

    from tools.bench_demo import BUILTIN, corpus_prompts, cut

    path = ROOT / "packages/server/src/hyspec_server/demo_models/qwen3_5"
    tok = AutoTokenizer.from_pretrained(str(path))
    n = a.mtp_turns
    try:
        docs = corpus_prompts(tok, n, a.mtp_system)
    except Exception:
        docs = [cut(BUILTIN, tok, a.mtp_system)] * n
    system, users = docs[0], [d[: a.mtp_user] for d in docs[1:]]
    out: dict[str, Any] = {}
    saved = DraftKV.save
    for name in ("off", "on", "on, drafter cache off"):
        if name == "on, drafter cache off":
            DraftKV.save = lambda self, *args, **kw: False  # type: ignore[method-assign]
        try:
            eng = build_engine(
                EngineArgs(
                    model=str(path),
                    device="cuda",
                    max_model_len=4096,
                    max_num_seqs=8,
                    enable_prefix_caching=name != "off",
                    prefix_cache_snapshot_interval=a.budget,
                    max_num_batched_tokens=a.budget,
                    speculative_config={"method": "mtp", "num_speculative_tokens": 3},
                )
            )
            _chat(eng, system[::-1], users[::-1], a.mtp_new)  # warm-up chat (other tokens): kernels loaded
            eng.reset_prefix_cache()
            turns, outs = _chat(eng, system, users, a.mtp_new)
            out[name] = {"turns": turns, "outputs": outs}
            del eng
            torch.cuda.empty_cache()
        finally:
            DraftKV.save = saved  # type: ignore[method-assign]
    return out


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

    cold, _ = _chat(eng, rand(a.chat_system), [rand(a.chat_user) for _ in range(a.turns - 1)], a.chat_new)
    eng.reset_prefix_cache()
    turns, outs = _chat(eng, rand(a.chat_system), [rand(a.chat_user) for _ in range(a.turns - 1)], a.chat_new)
    out["multi_turn"] = {"outputs": outs, "turns": turns, "turns_cold": cold}
    eng.reset_prefix_cache()

    # repeated with new prompts (the host's speed drifts by tens of percent within minutes): the best run
    # of each engine is compared, every run is kept
    runs = []
    for _ in range(a.zero_repeats):
        distinct = [rand(a.zero_len) for _ in range(a.requests)]
        o, t, w, c = _run(eng, distinct, a.new)
        runs.append((o, sum(len(p) + a.new for p in distinct) / w, t, c))
    out["zero_hit"] = {
        "outputs": runs[0][0],
        "throughput_tok_s": max(r[1] for r in runs),
        "throughput_tok_s_each": [r[1] for r in runs],
        "ttft_p50_s": _pct(runs[0][2], 0.5),
        "cached_tokens": sum(r[3] for r in runs),
    }
    return out


def zero_hit_ab(ckpt: Path, a: argparse.Namespace) -> dict[str, Any]:
    """Zero hits with both engines alive at once (each with its own fixed KV budget), alternating run by run
    (and which goes first, round by round) on the same fresh prompts: the host's drift hits both alike, the
    medians are compared."""
    from hyspec_server import EngineArgs
    from hyspec_server.builder import build_engine

    engines = {
        caching: build_engine(
            EngineArgs(
                model=str(ckpt),
                device="cuda",
                max_model_len=a.zero_len + a.new + 16,
                max_num_seqs=a.requests,
                max_num_batched_tokens=a.budget,
                enable_prefix_caching=caching,
                prefix_cache_snapshot_interval=a.interval or a.budget,
                kv_cache_bytes=12 << 30,
            )
        )
        for caching in (False, True)
    }
    rng = random.Random(1)
    each: dict[str, list[float]] = {"off": [], "on": []}
    for r in range(a.ab_rounds + 1):
        prompts = [[rng.randrange(10, 150000) for _ in range(a.zero_len)] for _ in range(a.requests)]
        # the order alternates round by round: a run that always goes second (after the other engine's
        # garbage, on a device the other just warmed) would carry a bias of its own
        order = list(engines.items())[:: 1 if r % 2 else -1]
        for caching, eng in order:
            _, _, wall, cached = _run(eng, prompts, a.new)
            assert cached == 0
            if r:  # round 0 warms both
                each["on" if caching else "off"].append(sum(len(p) + a.new for p in prompts) / wall)
    med = {k: statistics.median(v) for k, v in each.items()}
    # a round's two runs share the host's state of the moment (its speed drifts by tens of percent between
    # rounds): the ratio within each round, and its median, is the steadier figure
    pairs = [on / off for on, off in zip(each["on"], each["off"], strict=True)]
    return {
        "throughput_tok_s_each": each,
        "median_tok_s": med,
        "on_over_off": med["on"] / med["off"],
        "on_over_off_each_round": pairs,
        "on_over_off_median_of_rounds": statistics.median(pairs),
        "on_over_off_best": max(each["on"]) / max(each["off"]),
    }


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
    ap.add_argument("--zero-repeats", type=int, default=3)
    ap.add_argument(
        "--ab-only",
        type=int,
        default=0,
        dest="ab_rounds",
        help="only the zero-hit A/B: this many alternating rounds with both engines alive",
    )
    ap.add_argument("--max-model-len", type=int, default=8704)
    ap.add_argument("--mtp-turns", type=int, default=6, help="MTP chat on the demo model: turns (0: skip)")
    ap.add_argument("--mtp-system", type=int, default=1024)
    ap.add_argument("--mtp-user", type=int, default=64)
    ap.add_argument("--mtp-new", type=int, default=96)
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
        if a.ab_rounds:
            ab = zero_hit_ab(ckpt, a)
            res["zero_hit_ab"] = ab
            a.out.mkdir(parents=True, exist_ok=True)
            (a.out / f"{device}-prefix-caching-zero-hit-ab.json").write_text(json.dumps(res, indent=1))
            lines = [
                f"# Prefix caching with zero hits, {res['device']}, Qwen3.5-9B-shaped random bf16, one run",
                "",
                f"{a.requests} distinct {a.zero_len}-token prompts together, {a.new} new tokens each; the "
                f"engines with caching off and on alive at once, alternating for {a.ab_rounds} rounds on the "
                "same fresh prompts (after one warm-up round each).",
                "",
                "| caching | median tok/s | every round |",
                "| --- | --- | --- |",
            ]
            for k in ("off", "on"):
                runs = [round(x) for x in ab["throughput_tok_s_each"][k]]
                lines.append(f"| {k} | {ab['median_tok_s'][k]:.0f} | {runs} |")
            lines += [
                "",
                f"On / off: {ab['on_over_off']:.3f}x (medians); median of the rounds' on / off ratios "
                f"{ab['on_over_off_median_of_rounds']:.3f}x (each round: "
                f"{[round(x, 3) for x in ab['on_over_off_each_round']]}); best run on / best run off "
                f"{ab['on_over_off_best']:.3f}x.",
            ]
            (a.out / f"{device}-prefix-caching-zero-hit-ab.md").write_text("\n".join(lines) + "\n")
            print("\n".join(lines))
            return
        for caching in (False, True):
            eng = _engine(ckpt, caching, a)
            res["on" if caching else "off"] = workloads(eng, a)
            del eng
            torch.cuda.empty_cache()
    if a.mtp_turns:
        res["mtp_chat"] = mtp_chat(a)
    on, off = res["on"], res["off"]
    same = {
        k: _agreement(on[k]["outputs"], off[k]["outputs"])
        for k in ("shared_prefix", "multi_turn", "zero_hit")
    }
    res["identical_outputs"] = same
    mtp = res.get("mtp_chat")
    if mtp:
        mtp_same = _agreement(mtp["on"]["outputs"], mtp["off"]["outputs"])
        for side in mtp.values():
            side.pop("outputs")
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
    cold = on["multi_turn"]["turns_cold"]
    lines += [
        "",
        f"Turn {a.turns} TTFT / turn 1 TTFT with caching on: "
        f"{mt_on[-1]['ttft_s'] / mt_on[0]['ttft_s']:.2f}x (the unmeasured first chat, kernels loading: "
        f"{cold[-1]['ttft_s'] / cold[0]['ttft_s']:.2f}x).",
        "",
        f"## Zero hits: {a.requests} distinct {a.zero_len}-token prompts together, {a.new} new tokens each",
        "",
        f"Throughput, best of {a.zero_repeats} runs with new prompts each: off "
        f"{off['zero_hit']['throughput_tok_s']:.0f} tok/s, on {on['zero_hit']['throughput_tok_s']:.0f} tok/s "
        f"({on['zero_hit']['throughput_tok_s'] / off['zero_hit']['throughput_tok_s']:.3f}x); every run: off "
        f"{[round(x) for x in off['zero_hit']['throughput_tok_s_each']]}, on "
        f"{[round(x) for x in on['zero_hit']['throughput_tok_s_each']]}.",
    ]
    if mtp:
        lines += [
            "",
            f"## MTP chat: shipped demo Qwen3.5 + its trained MTP head (S=3), {a.mtp_turns} turns, "
            f"{a.mtp_system}-token first prompt, {a.mtp_user}-token user turns, {a.mtp_new} new tokens "
            "per turn",
            "",
            f"Greedy outputs caching on vs off: {mtp_same}. Accepted drafts / drafts per turn (turns 2.. "
            "resume from the cache):",
            "",
            "| turn | prompt tokens | cached (on) | off | on | on, drafter cache off | TTFT off | TTFT on |",
            "| --- | --- | --- | --- | --- | --- | --- | --- |",
        ]
        zero = mtp["on, drafter cache off"]["turns"]
        rows = zip(mtp["off"]["turns"], mtp["on"]["turns"], zero, strict=True)
        for i, (t_off, t_on, t_zero) in enumerate(rows):

            def rate(t: dict[str, Any]) -> str:
                return f"{t['accepted_tokens'] / max(1, t['draft_tokens']):.1%}"

            lines.append(
                f"| {i + 1} | {t_on['prompt_tokens']} | {t_on['cached_tokens']} | {rate(t_off)} "
                f"| {rate(t_on)} | {rate(t_zero)} | {t_off['ttft_s'] * 1e3:.1f} ms "
                f"| {t_on['ttft_s'] * 1e3:.1f} ms |"
            )
    (a.out / f"{device}-prefix-caching.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
