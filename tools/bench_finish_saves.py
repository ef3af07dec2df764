"""Host time of the prefix-cache saves in the step where a batch's requests finish (issue #18).

    python tools/bench_finish_saves.py [--device cuda|cpu] [--batch 8] [--spec mtp|none] [--reps 2]

The shipped demo Qwen3.5 generates `--new` tokens for `--batch` rows that all finish in one step; the
engine's `PoolMemory.save_prefixes` (the target's snapshots, then the drafter's `on_prefix_saves`) and the
scheduler's `finish` are timed call by call (wall, milliseconds; on CUDA nothing here waits for the device,
so these are host times). A batch-8 demo round takes about 1 ms on a lent H200's host: a finishing step's
saves show as one of the round-time outliers of `benchmarks/results/nvidia-h200-round-tail.md`.
"""

from __future__ import annotations

import argparse
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
DEMO = ROOT / "packages/server/src/hyspec_server/demo_models/qwen3_5"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--new", type=int, default=64)
    ap.add_argument("--spec", default="mtp", choices=["mtp", "none"])
    ap.add_argument("--reps", type=int, default=2)
    a = ap.parse_args()
    import torch
    from hyspec_server import LLM, EngineArgs, SamplingParams
    from hyspec_server.builder import build_engine
    from transformers import AutoTokenizer

    cuda = a.device == "cuda"
    spec = {"method": "mtp", "num_speculative_tokens": 3} if a.spec == "mtp" else None
    args = EngineArgs(
        model=str(DEMO),
        device=a.device,
        dtype="bfloat16" if cuda else "float32",
        max_model_len=400,
        max_num_seqs=max(8, a.batch),
        speculative_config=spec,
    )
    llm = LLM.from_engine(build_engine(args))
    tok = AutoTokenizer.from_pretrained(str(DEMO))
    prompts = [tok.encode("def fib(n):\n    " + f"x = {i}\n" * 3) for i in range(a.batch)]
    params = SamplingParams(temperature=0, max_tokens=a.new, ignore_eos=True)
    engine = llm.engine
    calls: list[tuple[str, float]] = []

    def timed(name: str, fn: Callable[..., Any]) -> Callable[..., Any]:
        def wrapper(*args: Any, **kwargs: Any) -> Any:
            t = time.perf_counter()
            try:
                return fn(*args, **kwargs)
            finally:
                calls.append((name, (time.perf_counter() - t) * 1e3))

        return wrapper

    memory = engine.runner.memory
    memory.save_prefixes = timed("save_prefixes", memory.save_prefixes)
    engine.scheduler.finish = timed("finish", engine.scheduler.finish)
    for f in getattr(memory, "followers", []):
        f.on_prefix_saves = timed("drafter on_prefix_saves", f.on_prefix_saves)
    print(torch.cuda.get_device_name() if cuda else "cpu", f"batch {a.batch}, {a.spec}", flush=True)
    for rep in range(a.reps + 1):
        calls.clear()
        llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
        # (the first run compiles and captures: not reported)
        if rep:
            shown = ", ".join(f"{n} {ms:.2f}" for n, ms in calls if ms > 0.02)
            print(f"run {rep}: {shown} (ms, in call order: the prompts' saves, then the finishing step's)")
    llm.close()


if __name__ == "__main__":
    main()
