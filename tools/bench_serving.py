"""Serving under load, swept over `max_num_batched_tokens`: what default a user should get.

One run, one device: a Qwen3.5-9B-shaped random bf16 checkpoint (`bench_decode.build_checkpoint`), served by
`hyspec serve` (a subprocess per setting, every other engine argument at its default) and driven by
`hyspec bench serve` (random dataset, exact prompt lengths through the checkpoint's tokenizer, 128-1024
tokens in, `--output-len` out with ignore_eos, all requests queued at once, `--max-concurrency` in flight).

Results: benchmarks/results/<device>-serving-sweep.{json,md}: TTFT / TPOT / ITL percentiles and output
throughput per (budget, concurrency), and each setting's output throughput as a fraction of the best.

With `--speculative-config` every server speculates (the checkpoint's random MTP head: drafts are mostly
rejected, but every decoding step verifies a block, so steps that also prefill show what a speculative step
costs); with `--sources A,B` (repository roots) each setting is served by each source tree in turn, its
`packages/*/src` first on the server's PYTHONPATH, so a change is measured against the tree before it in one
run (results `-serving-spec-ab` / `-serving-ab`).
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
        f"| {r['source']} | {budget} | {conc} | {r['completed']} | {r['median_ttft_ms']:.0f} | "
        f"{r['p99_ttft_ms']:.0f} | "
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
    stem = f"{device}-serving-{_suffix(a)}"
    (a.out / f"{stem}.json").write_text(json.dumps({"meta": meta, "runs": runs}, indent=1))
    lo, hi = round(a.input_len * (1 - a.range_ratio)), round(a.input_len * (1 + a.range_ratio))
    lines = [
        f"# Serving sweep over max_num_batched_tokens ({meta['device']})",
        "",
        f"Qwen3.5-9B-shaped random bf16 checkpoint ({a.layers} layers), `hyspec serve` with every other "
        f"argument at its default (CUDA graphs, prefix caching on, speculative config "
        f"{a.speculative_config or 'none'}), `hyspec bench serve`: "
        f"{a.num_prompts} random prompts of {lo}-{hi} tokens, {a.output_len} output tokens (ignore_eos), all "
        f"queued at once, at most `conc` in flight.",
        "",
        "| source | max_num_batched_tokens | conc | done | TTFT p50 ms | TTFT p99 ms | TPOT p50 ms | "
        "ITL p99 ms | out tok/s | of best |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for conc in concs:
        best = max(r["output_throughput"] for r in runs if r["max_concurrency"] == conc)
        lines += [
            _row(r["max_num_batched_tokens"], conc, r, best) for r in runs if r["max_concurrency"] == conc
        ]
    (a.out / f"{stem}.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


def _suffix(a: argparse.Namespace) -> str:
    """The results' name: `sweep` as before; `spec` with speculation; `ab` when several trees are served."""
    spec = "spec-" if a.speculative_config else ""
    return f"{spec}ab" if "," in a.sources else f"{spec}sweep"


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
    p.add_argument("--speculative-config", default=None, help="JSON, as `hyspec serve` takes it")
    p.add_argument("--sources", default="", help="comma-separated repository roots to serve from, in turn")
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
        sources = [Path(s) for s in a.sources.split(",") if s] or [None]
        for budget, source in ((b, s) for b in budgets for s in sources):
            cmd = [sys.executable, "-m", "hyspec_server.cli", "serve", str(ckpt), "--port", str(a.port),
                   "--max-num-batched-tokens", str(budget)]  # fmt: skip
            if a.speculative_config:
                cmd += ["--speculative-config", a.speculative_config]
            env = dict(os.environ)
            if source is not None:
                src = [str(p) for p in sorted((source / "packages").glob("*/src"))]
                env["PYTHONPATH"] = os.pathsep.join([*src, env.get("PYTHONPATH", "")])
            name = "" if source is None else source.name
            t0 = time.perf_counter()
            proc = subprocess.Popen(cmd, env=env, stderr=open(a.out / f"serve-{budget}{name}.log", "wb"))
            try:
                _wait_healthy(f"http://127.0.0.1:{a.port}", proc, 300)
                start_s = time.perf_counter() - t0
                for conc in concs:
                    r = _bench(a.port, ckpt, conc, a, Path(tmp), f"b{budget}-c{conc}{name}.json")
                    runs.append(
                        {
                            "source": str(source or "this tree"),
                            "max_num_batched_tokens": budget,
                            "max_concurrency": conc,
                            "startup_s": start_s,
                            **r,
                        }
                    )
                    _write(a, device, runs)
                    print(json.dumps({k: runs[-1][k] for k in ("max_num_batched_tokens", "max_concurrency",
                          "median_ttft_ms", "output_throughput")}), flush=True)  # fmt: skip
            finally:
                proc.terminate()
                proc.wait(60)


if __name__ == "__main__":
    main()
