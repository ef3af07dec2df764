"""Triton compiles after the start-up warm-up: what a served load still compiles inside its steps.

    python tools/bench_compiles.py [--speculative-config JSON] [--model DIR]

With an empty Triton cache (a temporary TRITON_CACHE_DIR, as on a fresh machine or container), builds an
engine as `hyspec serve` does (CUDA graphs, prefix caching, the start-up warm-up; the shipped demo Qwen3.5
unless `--model`), then serves two loads through the engine: 48 prompts of 127-1025 random tokens at once
(16 new tokens each), then 64 prompts of 1-1500 tokens arriving every third step while others decode (2-40
new tokens). Prints the compiles of the start-up (count, seconds, per kernel) and every compile while
serving with its specialization key and constexprs: each one is a stall of its step, 0.1-1.2 s on an H200.
"""

from __future__ import annotations

import argparse
import collections
import json
import os
import random
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

DEMO = Path(__file__).resolve().parent.parent / "packages/server/src/hyspec_server/demo_models/qwen3_5"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", default=str(DEMO))
    ap.add_argument("--speculative-config", default=None, help="JSON, as `hyspec serve` takes it")
    a = ap.parse_args()
    os.environ["TRITON_CACHE_DIR"] = tempfile.mkdtemp()  # before triton is imported
    import triton.runtime.jit as jit

    records: list[tuple[str, str, float, str, str]] = []  # (phase, kernel, seconds, key, constexprs)
    phase = ["start-up"]
    compile_fn = jit.JITFunction._do_compile

    def recorded(self: Any, *args: Any, **kwargs: Any) -> Any:
        t = time.perf_counter()
        out = compile_fn(self, *args, **kwargs)
        key = repr(args[0]) if args else ""
        constexprs = repr(args[3]) if len(args) > 3 else ""
        records.append((phase[0], self.fn.__name__, time.perf_counter() - t, key, constexprs))
        return out

    jit.JITFunction._do_compile = recorded  # type: ignore[method-assign]
    from hyspec_runner.config import EngineArgs
    from hyspec_server import SamplingParams
    from hyspec_server.builder import build_engine

    spec = json.loads(a.speculative_config) if a.speculative_config else None
    t0 = time.perf_counter()
    engine = build_engine(EngineArgs(model=a.model, speculative_config=spec))
    took = sum(r[2] for r in records)
    print(f"built and warmed up in {time.perf_counter() - t0:.1f} s: {len(records)} compiles, {took:.1f} s")
    phase[0] = "serving"
    rng = random.Random(0)
    vocab = engine.runner.vocab_size
    ids = iter(range(sys.maxsize))

    def add(num_tokens: int, new: int) -> None:
        params = SamplingParams(max_tokens=new, temperature=0, ignore_eos=True)
        prompt = [rng.randrange(1, vocab) for _ in range(num_tokens)]
        engine.add_request(prompt, params, request_id=f"load-{next(ids)}")

    for _ in range(48):
        add(rng.randint(127, 1025), 16)
    while engine.has_unfinished():
        engine.step()
    added = 0
    for i in range(400):
        if i % 3 == 0 and added < 64:
            add(rng.randint(1, 1500), rng.randint(2, 40))
            added += 1
        if engine.has_unfinished():
            engine.step()
    while engine.has_unfinished():
        engine.step()
    served = [r for r in records if r[0] == "serving"]
    print(f"compiles while serving: {len(served)}, {sum(r[2] for r in served):.1f} s")
    for _, name, seconds, key, constexprs in served:
        print(f"  {name:32s} {seconds:6.2f} s  key={key[:600]}\n      constexprs={constexprs[:300]}")
    per_kernel = collections.Counter(r[1] for r in records if r[0] == "start-up")
    print("start-up compiles per kernel:", dict(per_kernel))


if __name__ == "__main__":
    main()
