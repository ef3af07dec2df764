"""Host cost of the primitives a speculative round is made of, on a GPU (what a round's host time buys).

    python tools/bench_host_primitives.py [--demo] [--batch 1]

Builds an engine with MTP (S = 3) on the shipped demo Qwen3.5, serves one request to warm it up, then times
on the host, the device idle before each call (a sync first, so no call waits on queued work), the median of
`--reps` calls:

- the replay of every CUDA graph the engine captured (the target's decode, verify, commit and tail graphs,
  each drafter proposal graph), beside the kernels a replay runs (torch.profiler over one replay);
- small host-to-device copies (pageable and pinned), a device-to-host copy into fresh and into kept pinned
  memory, an event record, a small torch op, a Triton launch.

Prints a table; `--out` also writes it as JSON.
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

sys.path.insert(0, str(Path(__file__).parent))
from bench_decode import make_llm

DEMO = Path(__file__).resolve().parent.parent / "packages/server/src/hyspec_server/demo_models/qwen3_5"


def host_time(fn: Callable[[], object], reps: int) -> float:
    """Median host seconds of `fn()` with the device idle before each call."""
    times = []
    for _ in range(reps):
        torch.cuda.synchronize()
        t = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t)
    torch.cuda.synchronize()
    return statistics.median(times)


def kernels_of(fn: Callable[[], object]) -> str:
    """Device operations one call of `fn` runs: kernels, copies and memsets."""
    from torch.profiler import ProfilerActivity, profile

    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        fn()
        torch.cuda.synchronize()
    ops = [e for e in prof.key_averages() if e.device_type.name == "CUDA"]
    copies = sum(e.count for e in ops if e.key.startswith("Memcpy"))
    sets = sum(e.count for e in ops if e.key.startswith("Memset"))
    kernels = sum(e.count for e in ops) - copies - sets
    return f"{kernels} kernels, {copies} copies, {sets} memsets"


def graphs_of(llm: Any) -> list[tuple[str, torch.cuda.CUDAGraph]]:
    """Every graph the engine captured, named by owner and key."""
    runner = llm.engine.runner
    found: list[tuple[str, torch.cuda.CUDAGraph]] = []

    def add(owner: str, graphs: Any) -> None:
        for key, cap in graphs._graphs.items():
            tag = f"{owner} {key.mode.name} b{key.batch_size}" + (
                f" D{key.verify_len}{' tree' if key.tree else ''}" if key.verify_len else ""
            )
            found.append((tag, cap.graph))
            if cap.commit is not None:
                found.append((tag + " commit", cap.commit.graph))
            if cap.tail is not None:
                found.append((tag + " tail", cap.tail.graph))

    add("target", runner.graphs)
    spec = getattr(runner, "spec", None)
    chain = None if spec is None else getattr(spec.drafter, "chain", None)
    if chain is not None:
        for s, r in chain.runners.items():
            add(f"proposal s={s}", r)
    return found


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--reps", type=int, default=200)
    ap.add_argument("--batch", type=int, default=1, help="the graphs timed: captured at this batch size")
    ap.add_argument("--out", type=Path, default=None)
    a = ap.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("bench_host_primitives: needs a CUDA GPU")
    rows: list[dict[str, Any]] = []

    def record(name: str, seconds: float, kernels: str | None = None) -> None:
        rows.append({"what": name, "host_us": round(seconds * 1e6, 2), "device_ops": kernels})
        k = "" if kernels is None else f"  {kernels}"
        print(f"{name:48s} {seconds * 1e6:9.1f} us{k}", flush=True)

    from hyspec_server import SamplingParams

    llm = make_llm(
        DEMO, spec={"method": "mtp", "num_speculative_tokens": 3}, max_num_seqs=max(8, a.batch), max_len=512
    )
    sp = SamplingParams(max_tokens=64, temperature=0, ignore_eos=True)
    llm.generate([{"prompt_token_ids": list(range(1, 65))}] * a.batch, sp)
    torch.cuda.synchronize()
    for name, graph in graphs_of(llm):
        if f" b{a.batch}" not in name or ("proposal" in name and "s=1" not in name):
            continue  # a proposal of s > 1 steps replayed on another's buffers reads out of bounds
        record(f"replay {name}", host_time(graph.replay, a.reps), kernels_of(graph.replay))

    dev = torch.device("cuda")
    from hyspec_statepool.transfer import to_device, write_into

    buf = torch.zeros(4096, dtype=torch.int64, device=dev)
    values = list(range(16))
    record(
        "to_device 16 ints (pageable)",
        host_time(lambda: to_device(values, dtype=torch.int64, device=dev), a.reps),
    )
    record("write_into 16 ints (pageable)", host_time(lambda: write_into(buf, values), a.reps))
    pinned = torch.tensor(values, dtype=torch.int64).pin_memory()
    record(
        "copy_ from kept pinned, 16 ints",
        host_time(lambda: buf[:16].copy_(pinned, non_blocking=True), a.reps),
    )
    src = torch.arange(16, dtype=torch.int64, device=dev)
    record(
        "to('cpu', non_blocking) fresh pinned", host_time(lambda: src.to("cpu", non_blocking=True), a.reps)
    )
    kept = torch.empty(16, dtype=torch.int64, pin_memory=True)
    record("copy_ into kept pinned (D2H)", host_time(lambda: kept.copy_(src, non_blocking=True), a.reps))

    def event() -> None:
        e = torch.cuda.Event()
        e.record(torch.cuda.current_stream(dev))

    record("Event() + record", host_time(event, a.reps))
    x = torch.zeros(64, device=dev)
    record("torch.add (64 floats)", host_time(lambda: torch.add(x, 1), a.reps))
    record(
        "torch.cat of 2 [1, 4] int64",
        host_time(lambda: torch.cat([src[:4][None], src[4:8][None]], dim=1), a.reps),
    )
    record("tensor.clone (16 ints)", host_time(src.clone, a.reps))
    from hyspec_spec_workers.tree import VerifyTree

    root, drafts, steps = src[:1], src[1:4][None], torch.tensor([3])
    record(
        "VerifyTree.chain (1 row, 3 drafts)", host_time(lambda: VerifyTree.chain(root, drafts, steps), a.reps)
    )
    from hyspec_kernels import advance_verify

    n, d = 1, 4
    i32 = dict(dtype=torch.int32, device=dev)
    args = dict(
        positions=torch.zeros(n * d, dtype=torch.int64, device=dev),
        kv_slots=torch.zeros(n * d, **i32),
        prefix_lens=torch.zeros(n, **i32),
        kv_lens=torch.zeros(n, **i32),
        q_lens=torch.zeros(n, **i32),
        cu_seqlens_q=torch.zeros(n + 1, **i32),
        has_initial_state=torch.zeros(n, dtype=torch.bool, device=dev),
        page_table=torch.zeros(n, 8, **i32),
        prefix=torch.zeros(n, **i32),
        input_ids=torch.zeros(n * d, dtype=torch.int64, device=dev),
        tokens=torch.zeros(n, d, dtype=torch.int64, device=dev),
        page_size=16,
    )
    record("advance_verify (checks + Triton launch)", host_time(lambda: advance_verify(**args), a.reps))
    if a.out is not None:
        a.out.write_text(json.dumps({"device": torch.cuda.get_device_name(), "rows": rows}, indent=1))


if __name__ == "__main__":
    main()
