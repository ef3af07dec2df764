"""`hyspec_kernels.linear` (the few-rows Triton kernels) against cuBLAS (`F.linear`) at Qwen3.5-9B's
projection shapes, bf16, on a GPU.

    python tools/bench_linear.py [--rows 1,4,8,32] [--out DIR]

Each shape's weight is held in enough copies to exceed the L2 cache (a decode step reads every weight once
from HBM), and each timing is a CUDA graph of one call per copy, replayed (no launch overhead), best of 5.
Reports microseconds per call and the bandwidth reached (weight + input + output bytes), beside the GPU's
measured read bandwidth (a `sum` over 4 GiB). Writes `<out>/<device>-linear.json` and `.md`.
"""

from __future__ import annotations

import argparse
import json
from collections.abc import Callable
from pathlib import Path

import torch
import torch.nn.functional as F

# (name, out_features N, in_features K): the packed projections of a Qwen3.5-9B decoder step and its head
SHAPES = [
    ("GDN in_proj (qkvz + ba)", 12352, 4096),
    ("GDN out_proj", 4096, 4096),
    ("attention q + k + v", 12288, 4096),
    ("attention o_proj", 4096, 8192),
    ("MLP gate + up", 24576, 4096),
    ("MLP down", 4096, 12288),
    ("lm_head", 248320, 4096),
]
# how many of each a decode step runs (24 GDN layers, 8 attention layers, 32 MLPs, one head)
PER_STEP = {"GDN": 24, "attention": 8, "MLP": 32, "lm_head": 1}


def graph_ms(fn: Callable[[], object], calls: int) -> float:
    """Milliseconds per call of `fn` (which makes `calls` calls), from CUDA-graph replays."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        fn()  # compiles and warms outside the capture
    torch.cuda.current_stream().wait_stream(side)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        fn()
    best = float("inf")
    for _ in range(5):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(10):
            g.replay()
        end.record()
        torch.cuda.synchronize()
        best = min(best, start.elapsed_time(end) / 10 / calls)
    return best


def read_bandwidth() -> float:
    """TB/s of a `sum` over 4 GiB of bf16 (what a kernel that only reads can reach)."""
    big = torch.empty(4 << 30, dtype=torch.uint8, device="cuda").view(torch.bfloat16)
    return big.numel() * 2 / graph_ms(lambda: big.sum(dtype=torch.float32), 1) / 1e9


def time_pair(x: torch.Tensor, ws: list[torch.Tensor]) -> tuple[float, float]:
    """ms per call of cuBLAS and of the Triton path, one call per weight copy."""
    from hyspec_kernels import linear

    cublas = graph_ms(lambda: [F.linear(x, w) for w in ws], len(ws))
    triton = graph_ms(lambda: [linear(x, w, backend="triton") for w in ws], len(ws))
    return cublas, triton


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--rows", default="1,4,8,32")
    ap.add_argument("--out", type=Path, default=Path("benchmarks/results"))
    a = ap.parse_args()
    dev = torch.cuda.get_device_name()
    read_tb_s = read_bandwidth()
    rows_list = [int(r) for r in a.rows.split(",")]
    out: dict[str, object] = {"device": dev, "read_tb_s": read_tb_s, "rows": []}
    table = []
    step = {r: [0.0, 0.0] for r in rows_list}  # per row count: cuBLAS, Triton ms in one decode step
    for name, n, k in SHAPES:
        copies = max(1, min(16, (400 << 20) // (n * k * 2) + 1))
        ws = [torch.randn(n, k, device="cuda").bfloat16() for _ in range(copies)]
        count = next(v for key, v in PER_STEP.items() if name.startswith(key))
        for rows in rows_list:
            x = torch.randn(rows, k, device="cuda").bfloat16()
            nbytes = (n * k + rows * k + rows * n) * 2
            cublas, triton = time_pair(x, ws)
            step[rows][0] += count * cublas
            step[rows][1] += count * triton
            row = {
                "shape": name, "N": n, "K": k, "rows": rows,
                "cublas_us": cublas * 1e3, "triton_us": triton * 1e3,
                "cublas_tb_s": nbytes / cublas / 1e9, "triton_tb_s": nbytes / triton / 1e9,
            }  # fmt: skip
            out["rows"].append(row)  # type: ignore[attr-defined]
            table.append(
                f"| {name} | {n} x {k} | {rows} | {cublas * 1e3:.1f} | {row['cublas_tb_s']:.2f} | "
                f"{triton * 1e3:.1f} | {row['triton_tb_s']:.2f} | {cublas / triton:.2f}x |"
            )
            print(table[-1], flush=True)
        del ws
        torch.cuda.empty_cache()
    out["per_step_ms"] = {str(r): {"cublas": c, "triton": t} for r, (c, t) in step.items()}
    lines = [
        f"# Projections over few rows: hyspec_kernels.linear against cuBLAS ({dev})",
        "",
        f"`tools/bench_linear.py`, bf16, weights read from HBM (copies past L2), CUDA-graph replays, best of "
        f"5. Measured read bandwidth (a sum over 4 GiB): {read_tb_s:.2f} TB/s.",
        "",
        "| projection | N x K | rows | cuBLAS us | cuBLAS TB/s | Triton us | Triton TB/s | speed-up |",
        "| --- | --- | --- | --- | --- | --- | --- | --- |",
        *table,
        "",
        "All projections of one 9B decode step (24 GDN + 8 attention layers, 32 MLPs, the head), ms:",
        "",
        "| rows | cuBLAS | Triton |",
        "| --- | --- | --- |",
        *(f"| {r} | {c:.3f} | {t:.3f} |" for r, (c, t) in step.items()),
        "",
    ]
    a.out.mkdir(parents=True, exist_ok=True)
    stem = a.out / f"{dev.lower().replace(' ', '-')}-linear"
    stem.with_suffix(".md").write_text("\n".join(lines))
    stem.with_suffix(".json").write_text(json.dumps(out, indent=1))
    print("\n".join(lines[-6:]))


if __name__ == "__main__":
    main()
