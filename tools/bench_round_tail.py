"""Where a decode window's time goes, step by step: the steps in which requests finish against the rest (#18).

    python tools/bench_round_tail.py --label after --out DIR [--batches 8,32] [--runs 3]
    python tools/bench_round_tail.py --report DIR/tail-before.json DIR/tail-after.json --out RESULTS

The shipped demo Qwen3.5, plain and MTP S=3 engines side by side in one process (each with a bounded cache),
corpus prompts, `--new` tokens a row (`ignore_eos`), greedy, CUDA graphs; their runs alternate. Every engine
step is timed as the user sees it (wall), with how many requests it finished and the host time of its
prefix-cache saves (`PoolMemory.save_prefixes`) and of the scheduler's `finish`; the decode window is
`bench_decode.hyspec_decode`'s (first token to last). The engine's cost model (`costs.at(batch)`: its round
with 3 drafts and its plain step, what the adaptive length and the plots' "predicted" lines use) is read after
each run. A speed-up predicted from the median steps is set beside the measured one. Which hyspec runs is
whatever `PYTHONPATH` holds: two trees are compared by running this once for each in one session, then
`--report` over both JSON files.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from tools.bench_decode import agreement, make_llm  # noqa: E402
from tools.bench_round import prompts  # noqa: E402

DEMO = ROOT / "packages/server/src/hyspec_server/demo_models/qwen3_5"
ENGINES: dict[str, dict[str, Any] | None] = {
    "plain": None,
    "mtp": {"method": "mtp", "num_speculative_tokens": 3},
}


class StepLog:
    """Wraps one engine's `step`, prefix saves and `finish` to log every step of a run."""

    def __init__(self, engine: Any) -> None:
        self.steps: list[dict[str, float]] = []
        self._save = self._finish = 0.0
        memory = engine.runner.memory
        memory.save_prefixes = self._timed(memory.save_prefixes, "_save")
        engine.scheduler.finish = self._timed(engine.scheduler.finish, "_finish")
        inner = engine.step

        def step() -> Any:
            self._save = self._finish = 0.0
            t = time.monotonic()
            outs = inner()
            t1 = time.monotonic()
            self.steps.append({
                "start": t, "end": t1, "outputs": len(outs),
                "finished": sum(1 for o in outs if o.finished),
                "save_ms": self._save * 1e3, "finish_ms": self._finish * 1e3,
            })  # fmt: skip
            return outs

        engine.step = step

    def _timed(self, fn: Callable[..., Any], attr: str) -> Callable[..., Any]:
        def wrapper(*args: Any, **kwargs: Any) -> Any:
            t = time.monotonic()
            try:
                return fn(*args, **kwargs)
            finally:
                setattr(self, attr, getattr(self, attr) + time.monotonic() - t)

        return wrapper


def one_run(llm: Any, log: StepLog, rows: list[list[int]], new: int) -> dict[str, Any]:
    from hyspec_server import SamplingParams

    log.steps.clear()
    torch.cuda.synchronize()
    outs = llm.generate(
        [{"prompt_token_ids": p} for p in rows],
        SamplingParams(max_tokens=new, temperature=0, ignore_eos=True),
        use_tqdm=False,
    )
    first = min(o.metrics.first_token_time or 0.0 for o in outs)
    last = max(o.metrics.finished_time or 0.0 for o in outs)
    # the window's steps: from the one that produced the first token's successor to the last finish
    inside = [s for s in log.steps if s["start"] >= first - 1e-6 and s["end"] <= last + 1e-6]
    ms = [(s["end"] - s["start"]) * 1e3 for s in inside]
    fin = [m for m, s in zip(ms, inside, strict=True) if s["finished"]]
    follows = [bool(i and inside[i - 1]["finished"]) for i in range(len(ms))]  # a step right after a finish
    after = [m for m, s, f in zip(ms, inside, follows, strict=True) if f and not s["finished"]]
    rest = [m for m, s, f in zip(ms, inside, follows, strict=True) if not (f or s["finished"])]
    window_ms = (last - first) * 1e3
    longest = sorted(range(len(ms)), key=lambda i: -ms[i])[:5]
    res: dict[str, Any] = {
        "window_ms": window_ms,
        "tok_s": len(rows) * (new - 1) / (last - first),
        "steps": len(ms),
        "busy_ms": sum(ms),
        "median_step_ms": statistics.median(ms),
        "median_other_step_ms": statistics.median(rest) if rest else None,
        "finishing_steps": len(fin),
        "finishing_ms": sum(fin),
        "after_finish_ms": sum(after),
        "after_finish_steps": len(after),
        "save_ms": sum(s["save_ms"] for s in inside),
        "finish_ms": sum(s["finish_ms"] for s in inside),
        "longest": [
            {
                "ms": ms[i],
                "finished": inside[i]["finished"],
                "outputs": inside[i]["outputs"],
                "after_finish": follows[i],
                "save_ms": inside[i]["save_ms"],
            }
            for i in longest
        ],
        "first_steps_ms": ms[:4],  # the window's first rounds (a drafter's first proposal after a prefill)
        "tokens": [o.outputs[0].token_ids for o in outs],
    }
    spec = llm.engine.runner.spec
    if spec is not None:
        c = spec.costs.at(len(rows))
        res["model_round3_ms"] = c.round_s(3) * 1e3 if c.ready else None
        res["model_plain_ms"] = c.decode_s() * 1e3
        stats = [o.spec_stats for o in outs if o.spec_stats is not None]
        drafts = sum(s.num_drafts for s in stats)
        res["tokens_per_round"] = 1 + sum(s.num_accepted_tokens for s in stats) / drafts if drafts else 1.0
    return res


def measure(a: argparse.Namespace) -> dict[str, Any]:
    import hyspec_server
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(DEMO))
    ps = prompts(tok, 8, a.prompt_tokens)
    res: dict[str, Any] = {
        "label": a.label,
        "hyspec": str(Path(hyspec_server.__file__).resolve().parent),
        "device": torch.cuda.get_device_name(),
        "new": a.new,
        "runs": {},
    }
    for b in (int(x) for x in a.batches.split(",")):
        rows = [ps[i % len(ps)] for i in range(b)]
        llms, logs = {}, {}
        for name, spec in ENGINES.items():
            llms[name] = make_llm(
                DEMO, spec=spec, max_num_seqs=max(b, 8), max_len=a.prompt_tokens + a.new + 16,
                kv_cache_bytes=2 << 30, max_num_batched_tokens=a.max_num_batched_tokens,
            )  # fmt: skip
            logs[name] = StepLog(llms[name].engine)
            one_run(llms[name], logs[name], rows, a.new)  # compiles and captures: not reported
        each: dict[str, list[dict[str, Any]]] = {n: [] for n in llms}
        for _ in range(a.runs):
            for name, llm in llms.items():
                each[name].append(one_run(llm, logs[name], rows, a.new))
        ref = each["plain"][0]["tokens"]
        for name, runs in each.items():
            for r in runs:
                toks = r.pop("tokens")
                r["agreement"] = sum(agreement(x, y) for x, y in zip(toks, ref, strict=True)) / (b * a.new)
            res["runs"][f"{name}/b{b}"] = runs
            shown = [f"{r['tok_s']:.0f} tok/s, finishing {r['finishing_ms']:.1f} ms" for r in runs]
            print(name, b, shown, flush=True)
        for llm in llms.values():
            llm.close()
    return res


def report(files: list[Path], out: Path) -> None:
    results = [json.loads(p.read_text()) for p in files]
    device = results[0]["device"]
    lines = [
        f"# Decode windows step by step: the finishing steps ({device})",
        "",
        "`tools/bench_round_tail.py` (demo Qwen3.5, plain and MTP S=3 side by side in one process, runs "
        f"alternated, {results[0]['new']} new tokens a row, greedy, CUDA graphs). Per run: the first-to-last "
        "token window; the steps in which requests finished (their wall time, and the host time of their "
        "prefix-cache saves inside it); the steps right after them; the median of the other steps; the "
        "engine's cost model after the run; the speed-up predicted from the median steps "
        "(tokens a round x plain median step / MTP median step) beside the measured one (MTP tok/s / the "
        "plain run of the same repetition).",
        "",
        "| tree | engine | batch | run | tok/s | window ms | steps | finishing steps (ms) | saves ms "
        "| after-finish steps (ms) | median other step ms | 5 longest (F finishing, A after) "
        "| model round(3) / plain ms | tok/round | measured / predicted x | agreement |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for res in results:
        for key, runs in res["runs"].items():
            name, b = key.split("/b")
            for i, r in enumerate(runs):
                longest = " ".join(
                    f"{x['ms']:.2f}{'F' if x['finished'] else ''}{'A' if x['after_finish'] else ''}"
                    for x in r["longest"]
                )
                model = pred = "-"
                if name != "plain":
                    p = res["runs"][f"plain/b{b}"][i]
                    if r.get("model_round3_ms") is not None:
                        model = f"{r['model_round3_ms']:.2f} / {r['model_plain_ms']:.2f}"
                    predicted = r["tokens_per_round"] * p["median_step_ms"] / r["median_step_ms"]
                    pred = f"{r['tok_s'] / p['tok_s']:.2f} / {predicted:.2f}"
                lines.append(
                    f"| {res['label']} | {name} | {b} | {i} | {r['tok_s']:.0f} | {r['window_ms']:.1f} | "
                    f"{r['steps']} | {r['finishing_steps']} ({r['finishing_ms']:.1f}) | {r['save_ms']:.1f} | "
                    f"{r['after_finish_steps']} ({r['after_finish_ms']:.1f}) | "
                    f"{r['median_other_step_ms']:.3f} | "
                    f"{longest} | {model} | {r.get('tokens_per_round', 1.0):.2f} | {pred} | "
                    f"{r['agreement']:.3f} |"
                )
    out.mkdir(parents=True, exist_ok=True)
    slug = device.lower().replace("nvidia ", "nvidia-").split()[0]
    (out / f"{slug}-round-tail-steps.md").write_text("\n".join(lines) + "\n")
    (out / f"{slug}-round-tail-steps.json").write_text(json.dumps(results, indent=1) + "\n")
    print("\n".join(lines))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--label", default="this")
    ap.add_argument("--batches", default="8,32")
    ap.add_argument("--runs", type=int, default=3)
    ap.add_argument("--new", type=int, default=128)
    ap.add_argument("--prompt-tokens", type=int, default=128)
    ap.add_argument(
        "--max-num-batched-tokens",
        type=int,
        default=2048,
        help="the engines' step budget (0: the engine's default; 2048: at batch 32 the second half of the "
        "prompts prefills inside the window)",
    )
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--report", type=Path, nargs="*")
    a = ap.parse_args()
    a.max_num_batched_tokens = a.max_num_batched_tokens or None
    if a.report:
        report(a.report, a.out)
        return
    res = measure(a)
    a.out.mkdir(parents=True, exist_ok=True)
    (a.out / f"tail-{a.label}.json").write_text(json.dumps(res, indent=1) + "\n")


if __name__ == "__main__":
    main()
