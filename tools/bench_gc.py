"""Python's cyclic garbage collector during decoding: the engine's long-lived objects frozen or not (#18).

    python tools/bench_gc.py --out DIR [--batches 1,8,32] [--reps 3] [--new 128]

A collection of the oldest generation walks every object the process holds (an engine's modules, tensors,
graphs, requests): milliseconds, inside whichever engine step allocates the object that triggers it.
`gc.freeze()` after start-up moves what exists then into a permanent generation that collections skip.
This builds the shipped demo Qwen3.5's plain and MTP S=3 engines per batch size in one process and runs
them alternately with the collector's objects unfrozen (`gc.unfreeze()`, what the process had before) and
frozen (`gc.collect(); gc.freeze()`), timing each run's decode rate (`bench_decode.hyspec_decode`) and the
collections inside it (`gc.callbacks`: count and milliseconds per generation). Writes DIR/gc.json.
"""

from __future__ import annotations

import argparse
import gc
import json
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from tools.bench_decode import hyspec_decode, make_llm  # noqa: E402
from tools.bench_round import prompts  # noqa: E402

DEMO = ROOT / "packages/server/src/hyspec_server/demo_models/qwen3_5"


class Collections:
    """Every collection's generation and duration while installed (`gc.callbacks`)."""

    def __init__(self) -> None:
        self.events: list[tuple[int, float]] = []
        self._start = 0.0

    def __call__(self, phase: str, info: dict[str, Any]) -> None:
        if phase == "start":
            self._start = time.perf_counter()
        else:
            self.events.append((int(info["generation"]), time.perf_counter() - self._start))

    def summary(self) -> dict[str, Any]:
        out: dict[str, Any] = {}
        for g in (0, 1, 2):
            ms = [s * 1e3 for gen, s in self.events if gen == g]
            out[f"gen{g}"] = {"count": len(ms), "ms": sum(ms), "max_ms": max(ms, default=0.0)}
        return out


def run(llm: Any, rows: list[list[int]], new: int) -> dict[str, Any]:
    seen = Collections()
    gc.callbacks.append(seen)
    try:
        r = hyspec_decode(llm, rows, new)
    finally:
        gc.callbacks.remove(seen)
    return {"decode_tok_s": r["decode_tok_s"], "gc": seen.summary(), "objects": len(gc.get_objects())}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--batches", default="1,8,32")
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--new", type=int, default=128)
    a = ap.parse_args()
    from transformers import AutoTokenizer

    ps = prompts(AutoTokenizer.from_pretrained(str(DEMO)), 8, 128)
    res: dict[str, Any] = {"device": torch.cuda.get_device_name(), "new": a.new, "runs": {}}
    for b in (int(x) for x in a.batches.split(",")):
        rows = [ps[i % len(ps)] for i in range(b)]
        llms = {
            name: make_llm(DEMO, spec=spec, max_num_seqs=max(b, 8), max_len=400, kv_cache_bytes=2 << 30)
            for name, spec in (("plain", None), ("mtp", {"method": "mtp", "num_speculative_tokens": 3}))
        }
        for llm in llms.values():
            hyspec_decode(llm, rows, a.new)  # first use of every shape
        each: dict[str, list[dict[str, Any]]] = {}
        for _ in range(a.reps):
            for frozen in (False, True):
                gc.unfreeze()
                if frozen:
                    gc.collect()
                    gc.freeze()
                for name, llm in llms.items():
                    key = f"{name}/{'frozen' if frozen else 'unfrozen'}/b{b}"
                    each.setdefault(key, []).append(run(llm, rows, a.new))
        gc.unfreeze()
        for key, runs in each.items():
            rates = [r["decode_tok_s"] for r in runs]
            res["runs"][key] = {"decode_tok_s": statistics.median(rates), "each": runs}
            gen2 = [r["gc"]["gen2"] for r in runs]
            print(
                f"{key}: {statistics.median(rates):.0f} tok/s ({', '.join(f'{x:.0f}' for x in rates)}); "
                f"gen2 {[g['count'] for g in gen2]} x, {[round(g['ms'], 1) for g in gen2]} ms; "
                f"gen0+1 ms {[round(r['gc']['gen0']['ms'] + r['gc']['gen1']['ms'], 1) for r in runs]}",
                flush=True,
            )
        for llm in llms.values():
            llm.close()
    a.out.mkdir(parents=True, exist_ok=True)
    (a.out / "gc.json").write_text(json.dumps(res, indent=1))


if __name__ == "__main__":
    main()
