"""Serving under load, swept over `max_num_batched_tokens`: what default a user should get.

One run, one device: a Qwen3.5-9B-shaped random bf16 checkpoint (`bench_decode.build_checkpoint`), served by
`hyspec serve` (a subprocess per setting, every other engine argument at its default) and driven by
`hyspec bench serve` (random dataset, exact prompt lengths through the checkpoint's tokenizer, 128-1024
tokens in, `--output-len` out with ignore_eos, all requests queued at once, `--max-concurrency` in flight).

Results: benchmarks/results/<device>-serving-sweep.{json,md}: TTFT / TPOT / ITL percentiles and output
throughput per (budget, concurrency), and each setting's output throughput as a fraction of the best.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).parent))
from bench_decode import build_checkpoint


def _wait_healthy(url: str, proc: subprocess.Popen[bytes], timeout_s: float) -> None:
    t0 = time.monotonic()
    while time.monotonic() - t0 < timeout_s:
        if proc.poll() is not None:
            raise RuntimeError(f"hyspec serve exited with {proc.returncode}")
        try:
            with urllib.request.urlopen(url + "/health", timeout=2) as r:
                if r.status == 200:
                    return
        except OSError:
            time.sleep(1)
    raise RuntimeError(f"hyspec serve not healthy after {timeout_s} s")


def _bench(
    port: int, ckpt: Path, conc: int, a: argparse.Namespace, out_dir: Path, name: str
) -> dict[str, Any]:
    from hyspec_server.cli import main

    argv = [
        "bench", "serve", "--base-url", f"http://127.0.0.1:{port}", "--tokenizer", str(ckpt),
        "--dataset-name", "random", "--random-input-len", str(a.input_len),
        "--random-range-ratio", str(a.range_ratio), "--random-output-len", str(a.output_len),
        "--num-prompts", str(a.num_prompts), "--max-concurrency", str(conc), "--ignore-eos",
        "--seed", "0", "--disable-tqdm", "--save-result", "--result-dir", str(out_dir),
        "--result-filename", name,
    ]  # fmt: skip
    if main(argv) != 0:
        raise RuntimeError(f"bench serve failed for {name}")
    result: dict[str, Any] = json.loads((out_dir / name).read_text())
    return result


def _row(budget: int, conc: int, r: dict[str, Any], best: float) -> str:
    return (
        f"| {budget} | {conc} | {r['completed']} | {r['median_ttft_ms']:.0f} | {r['p99_ttft_ms']:.0f} | "
        f"{r['median_tpot_ms']:.1f} | {r['p99_itl_ms']:.1f} | {r['output_throughput']:.0f} | "
        f"{r['output_throughput'] / best:.2f} |"
    )


def _write(a: argparse.Namespace, device: str, runs: list[dict[str, Any]]) -> None:
    """The results so far (after every run: a sweep cut short still reports what it measured)."""
    concs = sorted({r["max_concurrency"] for r in runs})
    meta = {
        "device": torch.cuda.get_device_name(),
        "torch": torch.__version__,
        "args": vars(a) | {"out": str(a.out)},
    }
    (a.out / f"{device}-serving-sweep.json").write_text(json.dumps({"meta": meta, "runs": runs}, indent=1))
    lo, hi = round(a.input_len * (1 - a.range_ratio)), round(a.input_len * (1 + a.range_ratio))
    lines = [
        f"# Serving sweep over max_num_batched_tokens ({meta['device']})",
        "",
        f"Qwen3.5-9B-shaped random bf16 checkpoint ({a.layers} layers), `hyspec serve` with every other "
        f"argument at its default (CUDA graphs, prefix caching on, no speculation), `hyspec bench serve`: "
        f"{a.num_prompts} random prompts of {lo}-{hi} tokens, {a.output_len} output tokens (ignore_eos), all "
        f"queued at once, at most `conc` in flight.",
        "",
        "| max_num_batched_tokens | conc | done | TTFT p50 ms | TTFT p99 ms | TPOT p50 ms | ITL p99 ms | "
        "out tok/s | of best |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for conc in concs:
        best = max(r["output_throughput"] for r in runs if r["max_concurrency"] == conc)
        lines += [
            _row(r["max_num_batched_tokens"], conc, r, best) for r in runs if r["max_concurrency"] == conc
        ]
    (a.out / f"{device}-serving-sweep.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--budgets", default="512,2048,8192", help="max_num_batched_tokens values")
    p.add_argument("--concurrency", default="64,128")
    p.add_argument("--num-prompts", type=int, default=256)
    p.add_argument("--input-len", type=int, default=576)
    p.add_argument("--range-ratio", type=float, default=0.78)  # 576 * (1 -/+ 0.78): 127..1025
    p.add_argument("--output-len", type=int, default=256)
    p.add_argument("--layers", type=int, default=32)
    p.add_argument("--port", type=int, default=8765)
    p.add_argument("--out", type=Path, default=Path("benchmarks/results"))
    a = p.parse_args()
    device = torch.cuda.get_device_name().lower().replace(" ", "-")
    budgets = [int(x) for x in a.budgets.split(",")]
    concs = [int(x) for x in a.concurrency.split(",")]
    runs: list[dict[str, Any]] = []
    a.out.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory() as tmp:
        ckpt = Path(tmp) / "ckpt"
        build_checkpoint(ckpt, a.layers)
        torch.cuda.empty_cache()  # the server subprocess gets the whole GPU
        for budget in budgets:
            cmd = [sys.executable, "-m", "hyspec_server.cli", "serve", str(ckpt), "--port", str(a.port),
                   "--max-num-batched-tokens", str(budget)]  # fmt: skip
            t0 = time.perf_counter()
            proc = subprocess.Popen(
                cmd, env=dict(os.environ), stderr=open(a.out / f"serve-{budget}.log", "wb")
            )
            try:
                _wait_healthy(f"http://127.0.0.1:{a.port}", proc, 300)
                start_s = time.perf_counter() - t0
                for conc in concs:
                    r = _bench(a.port, ckpt, conc, a, Path(tmp), f"b{budget}-c{conc}.json")
                    runs.append(
                        {"max_num_batched_tokens": budget, "max_concurrency": conc, "startup_s": start_s, **r}
                    )
                    _write(a, device, runs)
                    print(json.dumps({k: runs[-1][k] for k in ("max_num_batched_tokens", "max_concurrency",
                          "median_ttft_ms", "output_throughput")}), flush=True)  # fmt: skip
            finally:
                proc.terminate()
                proc.wait(60)


if __name__ == "__main__":
    main()
