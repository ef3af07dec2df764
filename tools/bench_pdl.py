"""Programmatic dependent launch on and off, on a GPU: hyspec's own kernels back to back in a CUDA graph.

    python tools/bench_pdl.py [--layers 32] [--small 0,4,10] [--out DIR]

A decode step of a 9B-shaped MLP stack, one token: per layer `add_rms_norm`, the gate + up projection
(4096 -> 2 x 12288, `linear`), `silu_and_mul`, the down projection (12288 -> 4096) and `--small` extra
`rms_norm`s standing for the other small kernels of a layer (gating, conv, rotary, norms), at `--rows`
tokens a step. The same calls are captured three times, with `HYSPEC_PDL=early`, `wait` and `0` (PDL is
chosen at launch, so at capture), and replayed alternately; outputs are compared bit for bit. Reports
microseconds per step and per kernel saved (early against off). Writes `<out>/<device>-pdl.json` and `.md`.
"""

from __future__ import annotations

import argparse
import json
import os
from collections.abc import Callable
from pathlib import Path

import torch
from hyspec_kernels import add_rms_norm, linear, rms_norm, silu_and_mul

H, F = 4096, 12288


def capture(fn: Callable[[], torch.Tensor]) -> tuple[torch.cuda.CUDAGraph, torch.Tensor]:
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        fn()  # compiles and warms up outside the capture
    torch.cuda.current_stream().wait_stream(side)
    torch.cuda.synchronize()
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        out = fn()
    return g, out


def replay_us(g: torch.cuda.CUDAGraph, reps: int = 20) -> float:
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(reps):
        g.replay()
    end.record()
    end.synchronize()
    return 1e3 * start.elapsed_time(end) / reps


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--layers", type=int, default=32)
    ap.add_argument("--small", default="0,4,10")
    ap.add_argument("--rounds", type=int, default=7)
    ap.add_argument("--rows", default="1,8,32", help="tokens per step (decode batch sizes)")
    ap.add_argument("--out", type=Path, default=Path("benchmarks/results"))
    a = ap.parse_args()
    dev = torch.device("cuda")
    gen = torch.Generator(device=dev).manual_seed(0)

    def randn(*shape: int) -> torch.Tensor:
        return (torch.randn(*shape, generator=gen, device=dev) * 0.02).to(torch.bfloat16)

    layers = [(randn(2 * F, H), randn(H, F), 1 + randn(H)) for _ in range(a.layers)]
    rows = []
    for small, m in [(int(s), int(m)) for m in a.rows.split(",") for s in a.small.split(",")]:
        x0, r0 = randn(m, H) * 50, randn(m, H) * 50

        def step(small: int = small) -> torch.Tensor:
            x, res = x0, r0
            for w_in, w_out, norm in layers:
                h, res = add_rms_norm(x, res, norm, 1e-6)
                for _ in range(small):
                    h = rms_norm(h, norm, 1e-6)
                gu = linear(h, w_in)
                x = linear(silu_and_mul(gu[:, :F], gu[:, F:]), w_out)
            return x + res

        graphs = {}
        for flag in ("early", "wait", "0"):
            os.environ["HYSPEC_PDL"] = flag
            graphs[flag] = capture(step)
        os.environ.pop("HYSPEC_PDL")
        times: dict[str, list[float]] = {flag: [] for flag in graphs}
        for _ in range(a.rounds):
            for flag in graphs:
                times[flag].append(replay_us(graphs[flag][0]))
        same = all(torch.equal(graphs[f][1], graphs["0"][1]) for f in graphs)
        kernels = a.layers * (4 + small)
        off, on, wait = (sorted(times[f])[a.rounds // 2] for f in ("0", "early", "wait"))
        row = {
            "rows": m, "layers": a.layers, "small_per_layer": small, "kernels": kernels, "pdl_off_us": off,
            "pdl_on_us": on, "pdl_wait_only_us": wait, "saved_us_per_kernel": (off - on) / kernels,
            "speedup": off / on, "speedup_wait_only": off / wait, "identical": same,
        }  # fmt: skip
        print(json.dumps(row), flush=True)
        rows.append(row)
    name = torch.cuda.get_device_name().lower().replace(" ", "-")
    a.out.mkdir(parents=True, exist_ok=True)
    device = torch.cuda.get_device_name()
    (a.out / f"{name}-pdl.json").write_text(json.dumps({"device": device, "rows": rows}))
    lines = [
        f"# PDL on against off, hyspec kernels in one CUDA graph ({torch.cuda.get_device_name()})",
        "",
        "| rows | kernels / step | PDL off us | PDL on us | saved per kernel us | speed-up "
        "| wait-only speed-up "
        "| bit-identical |",
        "| --- | --- | --- | --- | --- | --- | --- | --- |",
    ]
    for r in rows:
        lines.append(
            f"| {r['rows']} | {r['kernels']} | {r['pdl_off_us']:.1f} | {r['pdl_on_us']:.1f} "
            f"| {r['saved_us_per_kernel']:.2f} | {r['speedup']:.3f}x | {r['speedup_wait_only']:.3f}x "
            f"| {r['identical']} |"
        )
    (a.out / f"{name}-pdl.md").write_text("\n".join(lines) + "\n")


if __name__ == "__main__":
    main()
