"""Acceptance, speed and losslessness of every drafter on the demo models, HF transformers beside them.

    python tools/bench_demo.py --models DIR --out benchmarks/results [--device cuda|cpu] [--quick]

DIR holds `qwen3_5/` (target, built-in MTP), `qwen3_5-eagle3/`, `qwen3_5-dflash/`, `lfm2/`, `lfm2-eagle3/`
(a missing target is skipped; a config that fails is recorded and the run goes on). Prompts: N held-out files
(`tools.demo.corpus` validation split, evenly spaced, files under K/2 tokens skipped), each cut to its first
~K target tokens at a line break (`--prompts builtin`, also the recorded fallback: snippets held here). Then:

- acceptance, all prompts batched, greedy and temperature 0.7 (engine seed 0): chains S = 1..5 (dflash up to
  its block_size - 1: 1..5, 7, 15), trees at S = 3 (mtp, eagle3: topk 2 / 6 nodes, topk 4 / 8 nodes), adaptive
  S = 3; every decode round is recorded (drafts proposed, accepted); the metrics are defined in the .md;
- speed (CUDA graphs on cuda; batch 1 only on cpu) of plain, each drafter's chain S = 3, adaptive S = 3 and
  best tree (by greedy tokens per round) and the oracle drafter (`bench_decode.oracle_registry`: proposes the
  plain batch-1 continuation) at batch 1 (each prompt alone) and 8, 32 (prompts cycled), timed by
  `bench_decode.hyspec_decode`; losslessness: their greedy batch-1 outputs against plain's, prompt by prompt;
- HF `generate` (bf16 on cuda, fp32 on cpu), greedy: plain and `prompt_lookup_num_tokens=3` at batch 1 (first
  2 prompts), plain at batch 8 (left-padded).

Writes `<out>/<device>-demo.json`, `.md` and, when matplotlib imports, `.png`.
"""

from __future__ import annotations

import argparse
import importlib
import json
import re
import sys
import time
import traceback
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
try:
    import hyspec_server  # noqa: F401
except ImportError:  # not installed: the packages' sources (a GPU machine without the venv)
    sys.path[1:1] = [str(p) for p in sorted((ROOT / "packages").glob("*/src"))]

from tools.bench_decode import agreement, free, hf_decode, hyspec_decode, oracle_registry  # noqa: E402

DRAFTERS: dict[str, list[tuple[str, str | None]]] = {
    "qwen3_5": [("mtp", None), ("eagle3", "qwen3_5-eagle3"), ("dflash", "qwen3_5-dflash"), ("ngram", None)],
    "lfm2": [("eagle3", "lfm2-eagle3"), ("ngram", None)],
}
TREES = ((2, 6), (4, 8))  # (topk, num_draft_tokens) at depth SPEED_S
SPEED_S = 3
TEMP = 0.7
BUILTIN = """import os
import sys


def main(argv: list[str]) -> int:
    for path in argv[1:]:
        if not os.path.exists(path):
#%%
class Stack:
    def __init__(self) -> None:
        self.items: list[int] = []

    def push(self, x: int) -> None:
#%%
def count_words(text: str) -> dict[str, int]:
    counts: dict[str, int] = {}
    for word in text.split():
#%%
def fib(n: int) -> int:
    a, b = 0, 1
    for _ in range(n):
""".split("#%%\n")
T0 = time.perf_counter()


def log(msg: str) -> None:
    print(f"[{time.perf_counter() - T0:7.1f}s] {msg}", flush=True)


def version(name: str) -> str | None:
    try:
        return str(importlib.import_module(name).__version__)
    except Exception:
        return None


def cut(text: str, tok: Any, k: int) -> list[int]:
    """The first ~k tokens of `text`, ending at its last line break when that keeps at least half of them."""
    ids = tok.encode(text[: 16 * k])  # a long file's head is enough
    if len(ids) <= k:
        return list(ids)
    head = tok.decode(ids[:k], skip_special_tokens=False)
    nl = head.rfind("\n")
    return list(tok.encode(head[: nl + 1] if nl + 1 >= len(head) // 2 else head)[:k])


def corpus_prompts(tok: Any, n: int, k: int) -> list[list[int]]:
    """n validation files evenly spaced over the split (name order), walking past files under k/2 tokens."""
    from tools.demo import corpus

    _, val = corpus.split_sources(corpus.list_sources())
    out: list[list[int]] = []
    used: set[int] = set()
    for i in range(n):
        j = (i * len(val)) // n
        for c in [*range(j, len(val)), *range(j)]:
            if c not in used:
                used.add(c)
                ids = cut(corpus.read_text(val[c]), tok, k)
                if len(ids) >= k // 2:
                    out.append(ids)
                    break
    if len(out) < n:
        raise RuntimeError(
            f"only {len(out)} of {len(val)} validation files have >= {k // 2} tokens, wanted {n}"
        )
    return out


def build_prompts(a: argparse.Namespace, tok: Any, info: dict[str, Any]) -> list[list[int]]:
    if a.prompts == "corpus":
        try:
            info["source"] = "corpus (tools.demo.corpus validation split)"
            return corpus_prompts(tok, a.num_prompts, a.prompt_tokens)
        except Exception as e:  # recorded in the results; a smoke run without the corpus still runs
            info["source"] = f"builtin (fallback: corpus unavailable: {type(e).__name__}: {e})"
            log(f"WARNING: prompts: {info['source']}")
    else:
        info["source"] = "builtin (--prompts builtin)"
    return [cut(BUILTIN[i % len(BUILTIN)], tok, a.prompt_tokens) for i in range(a.num_prompts)]


def configs(method: str, draft: Path | None) -> list[dict[str, Any]]:
    """Every config of one drafter: 'role' is 'speed' (acceptance and speed), 'tree' (the best tree gets
    speed) or 'acc' (acceptance only); 'S' is the deepest draft position."""
    from hyspec_spec_workers.config import DEFAULT_CANDIDATE_STEPS

    base: dict[str, Any] = {"method": method} | ({"model": str(draft)} if draft else {})
    steps = [1, 2, 3, 4, 5]
    if method == "dflash" and draft is not None and (draft / "config.json").is_file():
        block = int(json.loads((draft / "config.json").read_text())["block_size"])
        steps = sorted({s for s in [*steps, 7, 15, block - 1] if s <= block - 1})
    s3 = min(SPEED_S, steps[-1])
    out = [
        {"spec": base | {"num_speculative_tokens": s}, "label": f"chain S={s}", "S": s, "role": "acc"}
        for s in steps
    ]
    out[steps.index(s3)]["role"] = "speed"
    cands = [c for c in DEFAULT_CANDIDATE_STEPS if c <= steps[-1]]
    ad = {"candidate_steps": cands} if cands != list(DEFAULT_CANDIDATE_STEPS) else True
    spec = base | {"num_speculative_tokens": s3, "adaptive": ad}
    out.append({"spec": spec, "label": f"adaptive S={s3}", "S": max(cands), "role": "speed"})
    if method in ("mtp", "eagle3"):
        for k, d in TREES:
            spec = base | {"num_speculative_tokens": SPEED_S, "topk": k, "num_draft_tokens": d}
            out.append(
                {"spec": spec, "label": f"tree S={SPEED_S} topk={k} D={d}", "S": SPEED_S, "role": "tree"}
            )
    return [c | {"method": method} for c in out]


def mismatches(ref: Sequence[Sequence[int]], got: Sequence[Sequence[int]]) -> dict[str, Any]:
    """Prompts whose output differs from the reference, and where each first differs."""
    diff = {
        str(i): agreement(r, g) for i, (r, g) in enumerate(zip(ref, got, strict=True)) if list(r) != list(g)
    }
    return {"mismatching_prompts": len(diff), "of": len(ref), "first_diff": diff}


class Bench:
    """One target: its prompts, plain references and every measurement (into `self.t`)."""

    def __init__(self, a: argparse.Namespace, name: str) -> None:
        from hyspec_server.tokenizer import HFTokenizer

        self.a, self.name, self.target = a, name, a.models / name
        self.t: dict[str, Any] = {"prompts": {}, "acceptance": [], "speed": {}, "hf": [], "errors": []}
        self.prompts = build_prompts(a, HFTokenizer(self.target), self.t["prompts"])
        self.t["prompts"]["lengths"] = [len(p) for p in self.prompts]
        self.max_len = max(len(p) for p in self.prompts) + a.new + 64
        self.big = max(a.batches[-1], len(self.prompts))  # max_num_seqs of an engine timed at every batch
        self.plain_batched: list[list[int]] = []
        self.ref: list[list[int]] = []  # plain greedy outputs at batch 1
        self.plain_engine: Any = None

    def llm(self, spec: dict[str, Any] | None, seqs: int, drafters: Any = None) -> Any:
        from hyspec_runner.config import EngineArgs
        from hyspec_server import LLM
        from hyspec_server.builder import build_engine

        args = EngineArgs(
            model=str(self.target),
            device=self.a.device,
            dtype="bfloat16" if self.a.device == "cuda" else "float32",
            max_model_len=self.max_len,
            max_num_seqs=seqs,
            max_num_batched_tokens=4096,
            speculative_config=spec,
            seed=0,
        )
        return LLM.from_engine(build_engine(args, drafters=drafters))

    def acceptance(self, llm: Any, temp: float, depth: int) -> dict[str, Any]:
        """All prompts batched; statistics of every decode round from the engine's verify outcomes."""
        from hyspec_server import SamplingParams

        eng = llm.engine
        rounds: list[tuple[int, int]] = []  # (drafts proposed, drafts accepted)
        inner = eng._append_verified

        def record(req: Any, ver: Any, now: float) -> bool:
            rounds.append((ver.num_drafts, ver.num_accepted))
            return bool(inner(req, ver, now))

        # temperature rows draw from the engine's shared generator (EngineArgs.seed): requests with their own
        # seed are verified one row at a time, several times slower
        params = SamplingParams(max_tokens=self.a.new, temperature=temp, ignore_eos=True)
        eng._append_verified = record
        try:
            outs = llm.generate([{"prompt_token_ids": p} for p in self.prompts], params)
        finally:
            del eng._append_verified
        drafted = [(d, n) for d, n in rounds if d > 0]
        pos = []
        for i in range(1, depth + 1):
            proposed = sum(1 for d, _ in drafted if min(d, depth) >= i)
            pos.append(sum(1 for _, n in drafted if n >= i) / proposed if proposed else None)
        return {
            "tokens_per_round": sum(n + 1 for _, n in drafted) / len(drafted) if drafted else None,
            "tokens_per_forward": sum(n + 1 for _, n in rounds) / len(rounds) if rounds else None,
            "drafted_round_frac": len(drafted) / len(rounds) if rounds else None,
            "rounds": len(rounds),
            "accept_rate_per_pos": pos,
            "tokens": [o.outputs[0].token_ids for o in outs],
        }

    def speed(self, label: str, llm: Any) -> dict[str, Any]:
        """Batch 1 (each prompt alone) then the prompts cycled to each larger batch; speed-up over plain."""
        a, new = self.a, self.a.new
        outs = [hyspec_decode(llm, [p], new) for p in self.prompts]
        rounds = sum(o.get("verify_rounds", 0) for o in outs)  # with drafts; tpr over all of them
        tpr = sum(o.get("verify_rounds", 0) * o.get("mean_accept_length", 0.0) for o in outs) / (rounds or 1)
        sp: dict[str, Any] = {
            "1": {
                "decode_tok_s": len(outs) * (new - 1) / sum((new - 1) / o["decode_tok_s"] for o in outs),
                "mean_accept_length": tpr or None,
            }
        }
        toks = [o["tokens"][0] for o in outs]
        if label == "plain":
            self.ref = toks
        else:
            sp["lossless_b1"] = mismatches(self.ref, toks)
        for b in a.batches[1:]:
            r = hyspec_decode(llm, [self.prompts[i % len(self.prompts)] for i in range(b)], new)
            sp[str(b)] = {
                k: r.get(k) or None for k in ("decode_tok_s", "steady_decode_tok_s", "mean_accept_length")
            }
        plain = sp if label == "plain" else self.t["speed"]["plain"]
        for b in a.batches:
            sp[str(b)]["speedup"] = sp[str(b)]["decode_tok_s"] / plain[str(b)]["decode_tok_s"]
        self.t["speed"][label] = sp
        log(
            f"  speed {label}: "
            + ", ".join(f"b{b} {sp[str(b)]['decode_tok_s']:.0f} tok/s" for b in a.batches)
        )
        return sp

    def measure(self, c: dict[str, Any], seqs: int, drafters: Any = None) -> tuple[dict[str, Any], Any]:
        """Builds the config's engine; greedy (and, with a real drafter, sampled) acceptance."""
        row = {k: v for k, v in c.items() if k != "spec"}
        row["spec"] = {k: v for k, v in c["spec"].items() if k != "model"}
        llm = self.llm(c["spec"], seqs, drafters)
        g = self.acceptance(llm, 0.0, c["S"])
        row["greedy_vs_plain_batched"] = mismatches(self.plain_batched, g.pop("tokens"))
        row["greedy"] = g
        if drafters is None:
            row["temp"] = self.acceptance(llm, TEMP, c["S"])
            del row["temp"]["tokens"]
        self.t["acceptance"].append(row)
        tpr = [row.get(m, {}).get("tokens_per_round") for m in ("greedy", "temp")]
        log(f"  {c['method']} {c['label']}: tokens per round greedy {tpr[0]}, temp {tpr[1]}")
        return row, llm

    def guarded(self, what: str, spec: dict[str, Any], fn: Callable[[], Any]) -> None:
        """Runs one config (its engine dropped on return, then freed); an exception is recorded."""
        t0 = time.perf_counter()
        try:
            fn()
        except Exception as e:
            self.t["errors"].append({"config": what, "spec": spec, "error": f"{type(e).__name__}: {e}"})
            log(f"  ERROR in {what}: {type(e).__name__}: {e}\n{traceback.format_exc(limit=-3)}")
        free()
        log(f"  {what}: {time.perf_counter() - t0:.1f}s")

    def run(self) -> dict[str, Any]:
        a, n, lens = self.a, len(self.prompts), self.t["prompts"]["lengths"]
        log(f"{self.name}: {n} prompts of {min(lens)}..{max(lens)} tokens")

        def plain() -> None:
            llm = self.llm(None, self.big)
            self.plain_batched = self.acceptance(llm, 0.0, 0)["tokens"]
            # the first timed pass of a fresh process runs slow (clocks, allocator, first-use kernels):
            # time plain twice and keep the second, so speed-ups compare warm runs
            self.speed("plain", llm)
            self.speed("plain", llm)
            self.plain_engine = llm

        self.guarded("plain", {}, plain)
        if not self.ref:
            return self.t
        for method, draft in DRAFTERS[self.name]:
            best: list[Any] = []  # [tokens per round, row, engine] of the best tree so far
            for c in configs(method, None if draft is None else a.models / draft):

                def one(c: dict[str, Any] = c) -> None:
                    row, llm = self.measure(c, n if c["role"] == "acc" else self.big)
                    tpr = row["greedy"]["tokens_per_round"] or 0.0
                    if c["role"] == "speed":
                        self.speed(f"{method} {c['label']}", llm)
                    elif c["role"] == "tree" and (not best or tpr > best[0]):
                        best[:] = [tpr, row, llm]  # kept (the previous best is dropped) for its speed run

                self.guarded(f"{method} {c['label']}", c["spec"], one)
            if best:
                label = f"{method} best tree ({best[1]['label']})"
                self.guarded(label, best[1]["spec"], lambda: self.speed(label, best.pop()))
                best.clear()
                free()
        oc = {"method": "oracle", "label": f"chain S={SPEED_S}", "S": SPEED_S, "role": "speed"}
        oc["spec"] = {"method": "ngram", "num_speculative_tokens": SPEED_S}

        def oracle() -> None:
            refs = [p + r for p, r in zip(self.prompts, self.ref, strict=True)]
            _, llm = self.measure(oc, self.big, oracle_registry(refs, SPEED_S))
            self.speed(f"oracle chain S={SPEED_S}", llm)

        self.guarded("oracle", oc["spec"], oracle)
        # plain once more at the end: its drift from the first plain figure is the run's timing noise
        self.guarded("plain again", {}, lambda: self.speed("plain again", self.plain_engine))
        self.plain_engine = None
        self.guarded("hf", {}, self.hf)
        return self.t

    def hf(self) -> None:
        """HF transformers `generate`, greedy: plain and prompt lookup at batch 1, plain at batch 8 (cuda)."""
        from transformers import AutoModelForCausalLM

        a = self.a
        dtype = torch.bfloat16 if a.device == "cuda" else torch.float32
        model = AutoModelForCausalLM.from_pretrained(str(self.target), dtype=dtype).to(a.device).eval()
        # hyspec runs with ignore_eos: HF must not stop at an end-of-text token either (a held-out prompt can
        # be a whole short file, whose greedy continuation starts with one)
        model.generation_config.eos_token_id = None
        pad = int(model.config.pad_token_id or 0)
        lookup = {"prompt_lookup_num_tokens": 3}
        variants = [("plain", 1, {}), ("prompt_lookup_num_tokens=3", 1, lookup)]
        variants += [("plain", b, {}) for b in a.batches[1:2]]
        for name, b, kw in variants:
            row: dict[str, Any] = {"variant": name, "batch": b}
            try:
                if b == 1:
                    outs = [
                        hf_decode(model, [p], a.new, pad=pad, device=a.device, **kw)
                        for p in self.prompts[: a.hf_prompts]
                    ]
                    row["decode_tok_s"] = len(outs) / sum(1 / o["decode_tok_s"] for o in outs)
                    row["greedy_agreement"] = [agreement(o["tokens"][0], r) for o, r in zip(outs, self.ref)]
                else:
                    rows = [self.prompts[i % len(self.prompts)] for i in range(b)]
                    row["decode_tok_s"] = hf_decode(model, rows, a.new, pad=pad, device=a.device)[
                        "decode_tok_s"
                    ]
                base = self.t["speed"]["plain"][str(b)]["decode_tok_s"]
                row["vs_hyspec_plain"] = row["decode_tok_s"] / base
            except Exception as e:
                row["error"] = f"{type(e).__name__}: {e}"
            log(f"  hf {name} batch {b}: {row.get('decode_tok_s', row.get('error'))}")
            self.t["hf"].append(row)


def f2(x: float | None) -> str:
    return "" if x is None else f"{x:.2f}"


def markdown(res: dict[str, Any]) -> str:
    s = res["settings"]
    graphs = "on" if s["device"] == "cuda" else "off (cpu)"
    lines = [
        f"# Demo models on {res['device']}",
        "",
        f"torch {res['torch']}, triton {res['triton']}, transformers {res['transformers']}, "
        f"fla {res['fla']}, causal_conv1d {res['causal_conv1d']}. Models `{s['models']}`, "
        f"{s['num_prompts']} prompts of <= {s['prompt_tokens']} tokens, {s['new']} new tokens each (EOS "
        f"ignored), {s['dtype']}, CUDA graphs {graphs}{', --quick' if s['quick'] else ''}; the whole run "
        f"took {res['total_s']:.0f} s. Produced by `tools/bench_demo.py`.",
        "",
        f"**Acceptance** (all prompts batched; greedy, and temperature {s['temperature']} drawn from the "
        "engine's generator, seed 0). tpr = tokens per round = (accepted drafts + 1 bonus) summed over "
        "the decode rounds that verified >= 1 draft / those rounds (the engine's "
        "`SpecDecodeStats.mean_accept_length`; prefill's token excluded). tpf = the same over every "
        "decode round, draftless ones too (n-gram misses, adaptive at 0 drafts). acc@i = rounds accepting "
        ">= i drafts / rounds proposing >= i (a tree's i is its depth). 'differ' = prompts whose greedy "
        "output differs from plain greedy at the same batch (bf16 verify blocks may round near-ties "
        "differently).",
        "",
        "**Speed**: decode tok/s as `bench_decode.hyspec_decode` (tokens after the first / first-to-last "
        "token time); batch 1 = each prompt alone (sum of tokens / sum of times), batch b = the prompts "
        "cycled to b rows; x = speed-up over plain hyspec at that batch; tpr at that batch; 'lossless b1' "
        "= prompts whose greedy batch-1 output differs from plain's (must be 0 up to bf16 near-ties).",
    ]
    for name, t in res["targets"].items():
        lines += [
            "",
            f"## {name}",
            "",
            f"Prompts: {t['prompts']['source']}; lengths {t['prompts']['lengths']}.",
        ]
        lines += ["", "| drafter | config | greedy tpr | tpf | temp tpr | tpf | greedy acc@1..S | differ |"]
        lines += ["| --- | --- | --- | --- | --- | --- | --- | --- |"]
        for r in t["acceptance"]:
            g, m, bv = r["greedy"], r.get("temp", {}), r["greedy_vs_plain_batched"]
            pos = " ".join("-" if x is None else f"{x:.2f}" for x in g["accept_rate_per_pos"])
            nums = [g["tokens_per_round"], g["tokens_per_forward"], m.get("tokens_per_round")]
            nums.append(m.get("tokens_per_forward"))
            cells = " | ".join(f2(x) for x in nums)
            lines.append(
                f"| {r['method']} | {r['label']} | {cells} | {pos} | {bv['mismatching_prompts']}/{bv['of']} |"
            )
        heads = " | ".join(f"b{b} tok/s | x | tpr" for b in s["batches"])
        lines += ["", f"| config | {heads} | lossless b1 |", "| --- " * (2 + 3 * len(s["batches"])) + "|"]
        for label, sp in t["speed"].items():
            cells = [
                f"{f2(sp[str(b)]['decode_tok_s'])} | {f2(sp[str(b)]['speedup'])} | "
                f"{f2(sp[str(b)]['mean_accept_length'])}"
                for b in s["batches"]
            ]
            lb = sp.get("lossless_b1")
            ok = "" if lb is None else f"{lb['mismatching_prompts']}/{lb['of']} differ"
            ok += f" (first diff at {lb['first_diff']})" if lb and lb["mismatching_prompts"] else ""
            lines.append(f"| {label} | " + " | ".join(cells) + f" | {ok} |")
        hf = f"HF transformers `generate`, greedy, batch 1 = first {s['hf_prompts']} prompts."
        lines += ["", f"{hf} {res['hf_note']}"]
        lines += ["", "| variant | batch | tok/s | vs hyspec plain | greedy agreement (tokens) | error |"]
        lines += ["| --- | --- | --- | --- | --- | --- |"]
        for r in t["hf"]:
            lines.append(
                f"| {r['variant']} | {r['batch']} | {f2(r.get('decode_tok_s'))} | "
                f"{f2(r.get('vs_hyspec_plain'))} | {r.get('greedy_agreement', '')} | {r.get('error', '')} |"
            )
        lines += [f"\nError in {e['config']} `{json.dumps(e['spec'])}`: `{e['error']}`" for e in t["errors"]]
    return "\n".join([*lines, "", res["png_note"], ""])


def plot(res: dict[str, Any], path: Path) -> str:
    """Tokens per round vs S (greedy chains) and speed-up vs batch; a note of what was written."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return "No plot: matplotlib is not importable."
    batches = res["settings"]["batches"]
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(15, 5))
    colors = {"mtp": "C0", "eagle3": "C1", "dflash": "C2", "ngram": "C3", "oracle": "C7"}
    for ls, (name, t) in zip(("-", "--", ":"), res["targets"].items()):
        for m in dict.fromkeys(r["method"] for r in t["acceptance"]):
            pts = sorted(
                (r["S"], r["greedy"]["tokens_per_round"])
                for r in t["acceptance"]
                if r["method"] == m and r["label"].startswith("chain") and r["greedy"]["tokens_per_round"]
            )
            if pts:
                ax1.plot(*zip(*pts), ls=ls, marker="o", color=colors.get(m), label=f"{name} {m}")
        for label, sp in t["speed"].items():
            if label != "plain":
                ys = [sp[str(b)]["speedup"] for b in batches]
                mk = "s" if "adaptive" in label else "^" if "tree" in label else "o"
                c = colors.get(label.split()[0])
                ax2.plot(batches, ys, ls=ls, marker=mk, color=c, label=f"{name} {label}")
    ax1.set(xlabel="draft length S (chain)", ylabel="tokens per round (greedy)", title="Acceptance")
    ax2.set(xlabel="batch", ylabel="speed-up over plain hyspec", title="Decode speed-up", xscale="log")
    ax2.set_xticks(batches, [str(b) for b in batches])
    ax2.axhline(1.0, color="grey", lw=0.8)
    ax1.grid(alpha=0.3)
    ax2.grid(alpha=0.3)
    ax1.legend(fontsize=7)
    ax2.legend(fontsize=6, loc="center left", bbox_to_anchor=(1.01, 0.5))
    fig.suptitle(f"hyspec demo models on {res['device']}")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    return f"Plot: `{path.name}` (left: tokens per round vs S, greedy chains; right: speed-up vs batch)."


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--models", type=Path, required=True)
    ap.add_argument("--out", type=Path, default=Path("benchmarks/results"))
    ap.add_argument(
        "--device", choices=("cuda", "cpu"), default="cuda" if torch.cuda.is_available() else "cpu"
    )
    ap.add_argument("--quick", action="store_true", help="4 prompts, 32 new tokens, 1 HF prompt")
    ap.add_argument("--prompts", choices=("corpus", "builtin"), default="corpus")
    ap.add_argument("--num-prompts", type=int, default=None, help="default 16 (--quick: 4)")
    ap.add_argument("--prompt-tokens", type=int, default=128)
    ap.add_argument("--new", type=int, default=None, help="new tokens per request; default 128 (--quick: 32)")
    ap.add_argument("--hf-prompts", type=int, default=None, help="HF batch-1 prompts; default 2 (--quick: 1)")
    ap.add_argument("--targets", nargs="+", default=list(DRAFTERS), choices=list(DRAFTERS))
    a = ap.parse_args()
    a.num_prompts = a.num_prompts or (4 if a.quick else 16)
    a.new = a.new or (32 if a.quick else 128)
    a.hf_prompts = a.hf_prompts or (1 if a.quick else 2)
    a.batches = [1, 8, 32] if a.device == "cuda" else [1]
    if a.device == "cpu":  # bench_decode's timers synchronise CUDA around each run: nothing to wait for here
        torch.cuda.synchronize = lambda *_, **__: None
    device = torch.cuda.get_device_name(0) if a.device == "cuda" else "cpu"
    res: dict[str, Any] = {"device": device, "slug": re.sub(r"[^A-Za-z0-9]+", "-", device).strip("-").lower()}
    res |= {k: version(k) for k in ("torch", "triton", "transformers", "fla", "causal_conv1d")}
    keys = ("models", "device", "quick", "num_prompts", "prompt_tokens", "new", "batches", "hf_prompts")
    res["settings"] = {k: str(getattr(a, k)) if k == "models" else getattr(a, k) for k in keys}
    res["settings"] |= {"dtype": "bfloat16" if a.device == "cuda" else "float32", "temperature": TEMP}
    res["settings"] |= {"trees_topk_nodes": TREES, "speed_S": SPEED_S}
    res["targets"] = {}
    gdn = "flash-linear-attention" if res["fla"] else "torch fallback (fla not importable)"
    conv = "causal_conv1d" if res["causal_conv1d"] else "torch fallback (causal_conv1d not importable)"
    res["hf_note"] = f"HF kernels: GDN {gdn}, conv {conv}."
    for name in a.targets:
        if (a.models / name / "config.json").is_file():
            res["targets"][name] = Bench(a, name).run()
        else:
            log(f"skipping {name}: no {a.models / name}/config.json")
    res["total_s"] = time.perf_counter() - T0
    a.out.mkdir(parents=True, exist_ok=True)
    stem = a.out / f"{res['slug']}-demo"
    res["png_note"] = plot(res, stem.with_suffix(".png"))
    stem.with_suffix(".json").write_text(json.dumps(res, indent=1) + "\n")
    md = markdown(res)
    stem.with_suffix(".md").write_text(md)
    print(md, flush=True)
    log(f"wrote {stem}.json, .md{', .png' if res['png_note'].startswith('Plot') else ''}")


if __name__ == "__main__":
    main()
