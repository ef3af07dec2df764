"""Speed of plain decoding and speculative rounds on the shipped demo Qwen3.5, at batch 1, 8 and 32.

    python tools/bench_round.py --label after --out DIR        # one tree's figures -> DIR/round-<label>.json
    python tools/bench_round.py --before DIR/round-before*.json --after DIR/round-after*.json --out RESULTS

Measures, with CUDA graphs, `bench_decode.hyspec_decode` (decode tok/s from first to last token, and the
steady figure over the steps in which every row decodes) for plain decoding, MTP S=3 (fixed length), adaptive
MTP S=3, an MTP tree (top-2, 6 nodes), the oracle drafter (`bench_decode.oracle_registry`: the plain run's own
continuation, every draft right; re-anchored on its own output, `bench_decode.reanchored`) and, adaptive, a
useless drafter (the oracle's tokens off by one: every draft wrong), plus the engine's measured costs (decode
step, round with 3 drafts). Greedy agreement with plain is reported beside every speculative figure. Which
hyspec runs is whatever `PYTHONPATH` holds, so two trees (before and after a change) are compared by running
this in one session, alternately and several times each (a host-bound step of ~1 ms varies by tens of percent
from one process to the next), then `--before ... --after ...`, which takes each figure's median over a tree's
runs and writes `<out>/<device>-round-compare.md` and `.json`, with a table of paired ratios (each after run
against the before run it alternated with, normalised by its own process's plain run).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path
from typing import Any

import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from tools.bench_decode import agreement, free, hyspec_decode, make_llm, oracle_registry, reanchored  # noqa: E402

BATCHES = (1, 8, 32)
S = 3
KV_BYTES = 2 << 30  # each engine's cache with --interleave (several engines in one process)
DEMO = ROOT / "packages/server/src/hyspec_server/demo_models"
CONFIGS: dict[str, dict[str, Any] | None] = {
    "plain": None,
    "mtp": {"method": "mtp", "num_speculative_tokens": S},
    "mtp-adaptive": {"method": "mtp", "num_speculative_tokens": S, "adaptive": True},
    # a tree of 6 nodes, depth 3, two children per node where the head is unsure (#18: <= 1.2x a chain round)
    "mtp-tree": {"method": "mtp", "num_speculative_tokens": S, "topk": 2, "num_draft_tokens": 6},
    # the trained heads at longer chains (the demo's greedy tokens per round: MTP 5.18 at S = 5, EAGLE-3 3.54
    # at S = 3; #18 asks the best drafter for >= 2.5x plain at batch 1)
    "mtp-s5": {"method": "mtp", "num_speculative_tokens": 5},
    "eagle3": {"method": "eagle3", "num_speculative_tokens": S, "model": str(DEMO / "qwen3_5-eagle3")},
    "oracle": {"method": "ngram", "num_speculative_tokens": S},
    # every draft wrong (`oracle_registry(..., wrong=True)`), adaptive: what a useless drafter costs
    "useless-adaptive": {"method": "ngram", "num_speculative_tokens": S, "adaptive": True},
}


def prompts(tok: Any, n: int, k: int) -> list[list[int]]:
    from tools.bench_demo import BUILTIN, corpus_prompts, cut

    try:
        return corpus_prompts(tok, n, k)
    except Exception:
        return [cut(BUILTIN[i % len(BUILTIN)], tok, k) for i in range(n)]


def _setup(a: argparse.Namespace) -> tuple[Path, list[list[int]], dict[str, Any]]:
    """This checkout's demo model (whichever tree runs it), the prompts, and the result's header."""
    import hyspec_server
    from transformers import AutoTokenizer

    path = ROOT / "packages/server/src/hyspec_server/demo_models/qwen3_5"
    tok = AutoTokenizer.from_pretrained(str(path))
    res: dict[str, Any] = {
        "hyspec": str(Path(hyspec_server.__file__).resolve().parent),
        "device": torch.cuda.get_device_name(),
        "new": a.new,
        "runs": {},
    }
    return path, prompts(tok, 8, a.prompt_tokens), res


def measure(a: argparse.Namespace) -> dict[str, Any]:
    path, ps, res = _setup(a)
    max_len = a.prompt_tokens + a.new + 16
    refs: dict[int, list[list[int]]] = {}
    for name, spec in CONFIGS.items():
        if a.configs and name not in a.configs.split(",") and name != "plain":
            continue  # (plain always: the others' agreement and the oracle's references come from it)
        for b in BATCHES:
            rows = [ps[i % len(ps)] for i in range(b)]
            drafters = None
            oracle_refs: list[list[int]] = []
            if name in ("oracle", "useless-adaptive"):
                # each row starts from the plain run's greedy continuation
                oracle_refs = [r + o for r, o in zip(rows, refs[b], strict=True)]
                drafters = oracle_registry(oracle_refs, S, wrong=name != "oracle")
            llm = make_llm(
                path, spec=spec, drafters=drafters, max_num_seqs=max(b, 8), max_len=max_len,
                max_num_batched_tokens=a.max_num_batched_tokens,
            )  # fmt: skip
            r = hyspec_decode(llm, rows, a.new)
            if name == "oracle":
                # then on its own: a row that parted from plain greedy at a bf16 near-tie drafts nothing more
                r = reanchored(llm, rows, a.new, oracle_refs, r)
            r["agreement"] = (
                None
                if name == "plain"
                else sum(agreement(x, y) for x, y in zip(r["tokens"], refs[b], strict=True)) / (b * a.new)
            )
            if name == "plain":
                refs[b] = r["tokens"]
            del r["tokens"]
            res["runs"][f"{name}/b{b}"] = r
            print(name, b, {k: v for k, v in r.items() if "tok_s" in k or k in ("mean_accept_length",)})
            free(llm)
    return res


def measure_interleaved(a: argparse.Namespace) -> dict[str, Any]:
    """`measure`, with every config's engine of one batch size built side by side in this process (each
    with a bounded cache) and their runs alternated `a.interleave` times: plain, then each config, then
    plain again... A host-bound step of ~1 ms drifts by tens of percent over a minute on a lent machine;
    alternating puts every config under the same drift. Each figure is the median over the repetitions;
    `*_each` keep every run and `speed_up_each` each run against the plain run of its repetition. An
    adaptive engine serves its repetitions one after the other, as a long-running server does (its later
    requests start from the evidence of the earlier ones): `first_*` is its first run alone."""
    path, ps, res = _setup(a)
    res["interleave"] = a.interleave
    max_len = a.prompt_tokens + a.new + 16
    names = [n for n in CONFIGS if not a.configs or n in a.configs.split(",") or n == "plain"]
    for b in BATCHES:
        rows = [ps[i % len(ps)] for i in range(b)]

        def make(spec: dict[str, Any] | None, drafters: Any = None) -> Any:
            return make_llm(
                path, spec=spec, drafters=drafters, max_num_seqs=max(b, 8), max_len=max_len,
                kv_cache_bytes=KV_BYTES, max_num_batched_tokens=a.max_num_batched_tokens,
            )  # fmt: skip

        llms = {"plain": make(None)}
        first = {"plain": hyspec_decode(llms["plain"], rows, a.new)}
        ref = first["plain"]["tokens"]
        for name in names[1:]:
            refs: list[list[int]] = []
            drafters = None
            if name in ("oracle", "useless-adaptive"):
                refs = [r + o for r, o in zip(rows, ref, strict=True)]
                drafters = oracle_registry(refs, S, wrong=name != "oracle")
            llms[name] = make(CONFIGS[name], drafters)
            first[name] = hyspec_decode(llms[name], rows, a.new)
            if name == "oracle":
                first[name] = reanchored(llms[name], rows, a.new, refs, first[name])
        each: dict[str, list[dict[str, Any]]] = {n: [] for n in llms}
        for _ in range(a.interleave):
            for name, llm in llms.items():
                each[name].append(hyspec_decode(llm, rows, a.new))
        for name in llms:
            last = each[name][-1]
            rates = [r["decode_tok_s"] for r in each[name]]
            plain_rates = [r["decode_tok_s"] for r in each["plain"]]
            out = {k: v for k, v in last.items() if k != "tokens"}
            out["decode_tok_s"] = statistics.median(rates)
            out["decode_tok_s_each"] = rates
            out["speed_up_each"] = [x / p for x, p in zip(rates, plain_rates, strict=True)]
            out["speed_up_median"] = statistics.median(out["speed_up_each"])
            out["first_decode_tok_s"] = first[name]["decode_tok_s"]
            for k in ("oracle_followed", "oracle_reanchored_to_own_output"):
                if k in first[name]:
                    out[k] = first[name][k]
            out["agreement"] = (
                None
                if name == "plain"
                else sum(agreement(x, y) for x, y in zip(last["tokens"], ref, strict=True)) / (b * a.new)
            )
            res["runs"][f"{name}/b{b}"] = out
            print(
                name,
                b,
                f"median {out['decode_tok_s']:.0f} tok/s, x{out['speed_up_median']:.2f} plain",
                flush=True,
            )
        for llm in llms.values():
            llm.close()  # frees its GPU memory now (the next batch size builds its engines)
        llms.clear()
    return res


def median_runs(files: list[Path]) -> dict[str, Any]:
    """One result whose numeric figures are the medians over several runs of one tree."""
    runs = [json.loads(p.read_text()) for p in files]
    out: dict[str, Any] = {**runs[0], "num_runs": len(runs), "runs": {}}
    for key, first in runs[0]["runs"].items():
        merged: dict[str, Any] = dict(first)
        for name, v in first.items():
            if isinstance(v, (int, float)) and not isinstance(v, bool):
                merged[name] = statistics.median(r["runs"][key][name] for r in runs)
        ms = first.get("measured_ms") or {}
        merged["measured_ms"] = {
            k: None if v is None else statistics.median(r["runs"][key]["measured_ms"][k] for r in runs)
            for k, v in ms.items()
        }
        merged["decode_tok_s_each"] = [r["runs"][key]["decode_tok_s"] for r in runs]
        out["runs"][key] = merged
    return out


def speed_up(run: dict[str, Any], plain_tok_s: float) -> float:
    """A run's speed-up over plain: interleaved runs, the median of each repetition's own ratio (the plot's
    and the printed figure); else its tok/s over the plain run's."""
    return float(run.get("speed_up_median") or run["decode_tok_s"] / plain_tok_s)


def compare(before: dict[str, Any], after: dict[str, Any], title: str) -> str:
    lines = [
        f"# {title}: before / after ({after['device']})",
        "",
        f"Demo Qwen3.5 (shipped), greedy, {after['new']} new tokens per row, CUDA graphs, bf16; both trees "
        f"measured in one session on one GPU (`tools/bench_round.py`), {before['num_runs']} and "
        f"{after['num_runs']} runs alternately, medians. tok/s: first-to-last-token decode rate "
        "(steady: steps where every row decodes); speed-up against the same tree's plain run (interleaved: "
        "the median of each repetition's ratio); predicted: what the measured round costs predict "
        "(`predicted`); accept: mean "
        "tokens per round with drafts; agree: share of tokens equal to plain greedy.",
        "",
        "| run | before tok/s | after tok/s | after / before | before steady | after steady | "
        "speed-up before | speed-up after | predicted after | accept before | accept after | agree after | "
        "round(3) ms before | round(3) ms after | decode ms after | first token ms after |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]

    def f(x: Any, d: int = 1) -> str:
        return "-" if x is None else f"{x:.{d}f}"

    for key, a in after["runs"].items():
        b = before["runs"].get(key, {})
        batch = key.split("/")[1]
        pa = after["runs"][f"plain/{batch}"]["decode_tok_s"]
        pb = before["runs"].get(f"plain/{batch}", {}).get("decode_tok_s")
        ma, mb = a.get("measured_ms", {}), b.get("measured_ms", {})
        name = key.split("/")[0]
        plain_run = after["runs"][f"plain/{batch}"]
        pred = None if name == "plain" else predicted(name, a, plain_run, int(batch[1:]))
        lines.append(
            f"| {key} | {f(b.get('decode_tok_s'))} | {f(a['decode_tok_s'])} | "
            f"{f(a['decode_tok_s'] / b['decode_tok_s'] if b else None, 2)}x | "
            f"{f(b.get('steady_decode_tok_s'))} | {f(a.get('steady_decode_tok_s'))} | "
            f"{f(speed_up(b, pb) if b and pb else None, 2)}x | {f(speed_up(a, pa), 2)}x | "
            f"{f(pred, 2)}{'x' if pred else ''} | "
            f"{f(b.get('mean_accept_length'), 2)} | {f(a.get('mean_accept_length'), 2)} | "
            f"{f(a.get('agreement'), 3)} | {f(mb.get('round_with_3_drafts'), 2)} | "
            f"{f(ma.get('round_with_3_drafts'), 2)} | {f(ma.get('decode'), 2)} | "
            f"{f(a.get('first_token_ms'), 1)} |"
        )
    return "\n".join(lines) + "\n"


def paired(before: list[dict[str, Any]], after: list[dict[str, Any]]) -> str:
    """Each after run against the before run it alternated with (the i-th of each), on figures taken within
    one process: a speed-up (the run against its own process's plain run) and a round's cost in plain steps
    of that process (round(3) ms / (batch / plain tok/s)). A process-level slowdown (the machine, not the
    code) moves a run and its plain run together, so these ratios keep a change visible where the medians
    of raw tok/s drown it; the plain rows show how far whole processes moved."""
    if len(before) != len(after):
        return ""
    lines = [
        "## Paired, within-process figures",
        "",
        f"{len(after)} pairs (after run i against before run i). Speed-up ratio: (after's speed-up over its "
        "own plain run) / (before's); round ratio: (after's round(3) in its own plain steps) / (before's). "
        "Medians over the pairs, and in how many pairs after is better. Plain: after / before tok/s, what "
        "the processes alone moved.",
        "",
        "| run | speed-up ratio (median) | better in | round(3) in plain steps, before -> after (medians) "
        "| round ratio (median) | better in |",
        "|---|---|---|---|---|---|",
    ]
    for key in after[0]["runs"]:
        batch = int(key.split("/")[1][1:])
        sp, rr, rb, ra = [], [], [], []
        for b, a in zip(before, after, strict=True):
            if key not in b["runs"]:
                break
            pb, pa = (
                b["runs"][f"plain/b{batch}"]["decode_tok_s"],
                a["runs"][f"plain/b{batch}"]["decode_tok_s"],
            )
            xb, xa = b["runs"][key], a["runs"][key]
            plain = key.startswith("plain/")
            sp.append(pa / pb if plain else (xa["decode_tok_s"] / pa) / (xb["decode_tok_s"] / pb))
            mb, ma = (xb.get("measured_ms") or {}), (xa.get("measured_ms") or {})
            if mb.get("round_with_3_drafts") and ma.get("round_with_3_drafts"):
                rb.append(mb["round_with_3_drafts"] / (1e3 * batch / pb))
                ra.append(ma["round_with_3_drafts"] / (1e3 * batch / pa))
                rr.append(ra[-1] / rb[-1])
        if not sp:
            continue
        better = sum(x > 1 for x in sp)
        rounds = (
            f"{statistics.median(rb):.2f} -> {statistics.median(ra):.2f} | {statistics.median(rr):.2f} | "
            f"{sum(x < 1 for x in rr)} of {len(rr)}"
            if rr
            else "- | - | -"
        )
        lines.append(f"| {key} | {statistics.median(sp):.2f} | {better} of {len(sp)} | {rounds} |")
    return "\n".join(lines) + "\n"


def predicted(name: str, run: dict[str, Any], plain: dict[str, Any], batch: int) -> float | None:
    """The speed-up a run's measured round costs predict: tokens per round x the plain run's step (batch /
    its steady tok/s, every row decoding, where measured) / the engine's measured round with S drafts. None
    for adaptive runs (their rounds are not their steps) and runs that drafted no round."""
    ms = run.get("measured_ms") or {}
    round_ms = ms.get(f"round_with_{(CONFIGS[name] or {}).get('num_speculative_tokens', S)}_drafts")
    fixed = not (CONFIGS[name] or {}).get("adaptive")
    if not (fixed and run.get("verify_rounds") and run.get("mean_accept_length") and round_ms):
        return None
    step_ms = 1e3 * batch / (plain.get("steady_decode_tok_s") or plain["decode_tok_s"])
    return float(run["mean_accept_length"] * step_ms / round_ms)


def plot(after: dict[str, Any], path: Path) -> str:
    """Speed-up over plain against batch size for every speculative run (interleaved runs: the median over
    the repetitions of each one's ratio to its plain run), with the speed-up its measured
    round costs predict drawn beside it: tokens per round x the plain run's step (batch / its steady tok/s)
    / the engine's measured round with S drafts. Adaptive runs, and runs that drafted no round, have none."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return "No plot: matplotlib is not importable."
    runs = after["runs"]
    fig, ax = plt.subplots(figsize=(8, 5))
    for c, name in enumerate(n for n in CONFIGS if n != "plain"):
        if f"{name}/b{BATCHES[0]}" not in runs:
            continue
        meas, pred = [], []
        for b in BATCHES:
            r, p = runs[f"{name}/b{b}"], runs[f"plain/b{b}"]
            # interleaved runs: the median of each repetition's own ratio (what the tables report)
            meas.append(speed_up(r, p["decode_tok_s"]))
            pred.append(predicted(name, r, p, b))
        ax.plot(BATCHES, meas, marker="o", color=f"C{c}", label=f"{name} measured")
        pts = [(b, y) for b, y in zip(BATCHES, pred, strict=True) if y is not None]
        if pts:
            ax.plot(*zip(*pts), ls="--", marker="x", color=f"C{c}", label=f"{name} predicted by round costs")
    ax.axhline(1.0, color="grey", lw=0.8)
    ax.set(xscale="log", xlabel="batch", ylabel="decode speed-up over plain hyspec", title=after["device"])
    ax.set_xticks(BATCHES, [str(b) for b in BATCHES])
    ax.grid(alpha=0.3)
    ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    return f"![speed-up vs batch]({path.name})"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", type=Path, default=Path("benchmarks/results"))
    ap.add_argument("--label", default="run")
    ap.add_argument("--new", type=int, default=128)
    ap.add_argument("--configs", help=f"a comma-separated subset of {list(CONFIGS)}, plain included")
    ap.add_argument("--prompt-tokens", type=int, default=128)
    ap.add_argument("--before", nargs="+", type=Path, help="result files of the tree before the change")
    ap.add_argument("--after", nargs="+", type=Path, help="result files of the tree after it")
    ap.add_argument("--title", default="The speculative round", help="what changed (the report's title)")
    ap.add_argument("--name", default="round-compare", help="report file name: <device>-<name>.md/.json/.png")
    ap.add_argument("--replot", type=Path, help="a compare JSON: draw its after tree's plot again and stop")
    ap.add_argument(
        "--max-num-batched-tokens",
        type=int,
        default=None,
        help="the engines' step budget (default: the engine's own; 2048 before 2026-11-30: at batch 32 the "
        "second half of the prompts then prefilled inside the decode window)",
    )
    ap.add_argument(
        "--interleave", type=int, default=0, help="R > 0: engines side by side, runs alternated R times"
    )
    a = ap.parse_args()
    a.out.mkdir(parents=True, exist_ok=True)
    if a.replot:
        print(plot(json.loads(a.replot.read_text())["after"], a.replot.with_suffix(".png")))
        return
    if a.before or a.after:
        if not (a.before and a.after):
            raise SystemExit("--before and --after go together")
        before, after = median_runs(a.before), median_runs(a.after)
        dev = after["device"].lower().replace(" ", "-")
        figure = plot(after, a.out / f"{dev}-{a.name}.png")
        pairs = paired(
            [json.loads(p.read_text()) for p in a.before], [json.loads(p.read_text()) for p in a.after]
        )
        report = compare(before, after, a.title) + "\n" + pairs + "\n" + figure + "\n"
        (a.out / f"{dev}-{a.name}.md").write_text(report)
        both = {"before": before, "after": after}
        (a.out / f"{dev}-{a.name}.json").write_text(json.dumps(both, indent=1))
        return
    res = measure_interleaved(a) if a.interleave else measure(a)
    (a.out / f"round-{a.label}.json").write_text(json.dumps(res, indent=1))


if __name__ == "__main__":
    main()
