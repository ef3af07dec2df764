"""Host cost of a CUDA-graph replay against how many other graphs the process holds (a lead, not a benchmark
of hyspec itself).

    python tools/bench_graph_launch.py [--nodes 120] [--others 0,16,64,256] [--reps 2000]

Why: on a lent H200 a host-bound plain engine of the demo model ran about 30% slower once another engine
(with its own CUDA graphs) had been built in the same process (`benchmarks/results/
nvidia-h200-round-moved-decode.md`; not Python's garbage collector), and a speculative engine that drafts
nothing runs its plain steps slower than a plain engine does. If a replay's host time grows with the graphs
alive in the process (or with where they were last uploaded), both follow. This captures one graph of
`--nodes` small kernels, times `replay()` (host time per call, device synced every 50), then captures
`--others` more graphs of the same size in their own memory pools, replays each once (as engines' other
graphs run) and times the first graph again. Prints one line per count of other graphs.
"""

from __future__ import annotations

import argparse
import time

import torch


def capture(nodes: int, x: torch.Tensor) -> torch.cuda.CUDAGraph:
    """A graph of `nodes` tiny elementwise kernels on `x` (each one a kernel node)."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(3):
            y = x
            for _ in range(nodes):
                y = y * 1.0001
    torch.cuda.current_stream().wait_stream(side)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        y = x
        for _ in range(nodes):
            y = y * 1.0001
    return g


def host_us(g: torch.cuda.CUDAGraph, reps: int) -> float:
    """Mean host microseconds of one `replay()` call."""
    for _ in range(20):
        g.replay()
    torch.cuda.synchronize()
    total = 0.0
    for i in range(reps):
        t = time.perf_counter()
        g.replay()
        total += time.perf_counter() - t
        if i % 50 == 49:
            torch.cuda.synchronize()  # the queue never fills: host time per launch, not back-pressure
    torch.cuda.synchronize()
    return total / reps * 1e6


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--nodes", type=int, default=120, help="kernels per graph (the demo decode graph: ~120)")
    ap.add_argument("--others", default="0,16,64,256", help="counts of other graphs to hold, ascending")
    ap.add_argument("--reps", type=int, default=2000)
    a = ap.parse_args()
    x = torch.zeros(1024, device="cuda")
    g = capture(a.nodes, x)
    others: list[torch.cuda.CUDAGraph] = []
    xs: list[torch.Tensor] = []
    print(f"{torch.cuda.get_device_name()}, {a.nodes} kernels per graph")
    for n in (int(c) for c in a.others.split(",")):
        while len(others) < n:
            xs.append(torch.zeros(1024, device="cuda"))
            others.append(capture(a.nodes, xs[-1]))
            others[-1].replay()
        torch.cuda.synchronize()
        print(f"other graphs {n:5d}: replay {host_us(g, a.reps):7.1f} us host per call")


if __name__ == "__main__":
    main()
