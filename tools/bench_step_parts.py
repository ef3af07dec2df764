"""Host time of an engine step's parts, by kind of step: where requests finish, right after, ordinary (#18).

    python tools/bench_step_parts.py [--batches 8,32] [--runs 3] [--new 128]

The shipped demo Qwen3.5 with MTP S=3 on the GPU, corpus prompts, `--new` tokens a row (`ignore_eos`),
greedy, CUDA graphs. The engine's methods named in `PARTS` (scheduler, runner, pool memory, prefix cache,
state pool, drafter) are wrapped to add up their wall time per step (nested parts are inside their callers'
time; on CUDA nothing here waits for the device, so these are host times); each step is put in a kind:
"prefill" (longer than 8 ms without a finish: the prompts' steps), "finishing" (a request finished in it),
"after" (the step right after one) or "ordinary"; each part's mean per step of each kind is printed.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from collections import defaultdict
from collections.abc import Callable
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from tools.bench_decode import make_llm  # noqa: E402
from tools.bench_round import prompts  # noqa: E402

DEMO = ROOT / "packages/server/src/hyspec_server/demo_models/qwen3_5"
PARTS = (  # attribute paths from the engine; a path the tree does not have is skipped
    "scheduler.schedule", "runner.execute", "scheduler.finish", "runner.memory.save_prefixes",
    "runner.memory.free", "runner.memory.prefix_cache.save_many", "runner.memory.pool.states.copy_slots",
    "runner.memory.pool.states.apply_pending", "runner.memory.pool.kv.copy_page",
    "runner.spec.memory.save_prefixes", "runner.spec.feed.flush", "runner.spec.model_drafter.save_prefixes",
    "runner.spec.model_drafter.pairs.write", "runner.spec.model_drafter.kv.save",
    "runner.spec.memory.on_free",
    "runner.spec.run", "runner.backend.builder._build", "runner.backend.builder.rewrite.rewrite",
)  # fmt: skip


def wrap(root: Any, path: str, acc: dict[str, float]) -> bool:
    """Adds the wall time of `root.<path>(...)` calls to `acc[path]` (ms); False: no such path."""
    *head, name = path.split(".")
    obj = root
    for h in head:
        obj = getattr(obj, h, None)
        if obj is None:
            return False
    fn: Callable[..., Any] | None = getattr(obj, name, None)
    if fn is None:
        return False
    inner = fn

    def timed(*args: Any, **kwargs: Any) -> Any:
        t = time.perf_counter()
        try:
            return inner(*args, **kwargs)
        finally:
            acc[path] = acc.get(path, 0.0) + (time.perf_counter() - t) * 1e3

    setattr(obj, name, timed)
    return True


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--batches", default="8,32")
    ap.add_argument("--runs", type=int, default=3)
    ap.add_argument("--new", type=int, default=128)
    a = ap.parse_args()
    from hyspec_server import SamplingParams
    from transformers import AutoTokenizer

    ps = prompts(AutoTokenizer.from_pretrained(str(DEMO)), 8, 128)
    for b in (int(x) for x in a.batches.split(",")):
        spec = {"method": "mtp", "num_speculative_tokens": 3}
        llm = make_llm(DEMO, spec=spec, max_num_seqs=max(b, 8), max_len=a.new + 160, kv_cache_bytes=2 << 30)
        engine = llm.engine
        items = [{"prompt_token_ids": ps[i % len(ps)]} for i in range(b)]
        params = SamplingParams(max_tokens=a.new, temperature=0, ignore_eos=True)
        llm.generate(items, params, use_tqdm=False)  # compiles and captures: not reported
        acc: dict[str, float] = {}
        parts = [p for p in PARTS if wrap(engine, p, acc)]
        kinds: dict[str, list[tuple[float, dict[str, float]]]] = defaultdict(list)
        step, last_finished = engine.step, [False]

        def timed_step() -> Any:
            acc.clear()
            t = time.perf_counter()
            outs = step()
            ms = (time.perf_counter() - t) * 1e3
            fin = any(o.finished for o in outs)
            kind = (
                "prefill"
                if ms > 8 and not fin
                else "finishing"
                if fin
                else "after"
                if last_finished[0]
                else "ordinary"
            )
            last_finished[0] = fin
            kinds[kind].append((ms, dict(acc)))
            return outs

        engine.step = timed_step
        for _ in range(a.runs):
            llm.generate(items, params, use_tqdm=False)
        for kind, steps in kinds.items():
            ms = [m for m, _ in steps]
            print(
                f"== batch {b}, {kind}: {len(steps)} steps, mean {statistics.mean(ms):.3f} ms, "
                f"median {statistics.median(ms):.3f}"
            )
            for p in parts:
                each = [d.get(p, 0.0) for _, d in steps]
                if sum(each):
                    print(f"   {p:60s} {statistics.mean(each):.3f} ms")
        llm.close()


if __name__ == "__main__":
    main()
