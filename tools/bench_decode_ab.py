"""Plain decode of two source trees side by side on one GPU: step time, kernels per step, greedy agreement.

    python tools/bench_decode_ab.py --before OLD_REPO --after . --rounds 2 --out benchmarks/results

Builds the random Qwen3.5-9B-shaped checkpoint of `bench_decode.py` once, then runs each tree in its own
process (its `packages/*/src` on `PYTHONPATH`), alternating before / after for `--rounds` rounds, so that the
host's drift between processes hits both alike. Each process measures, with CUDA graphs, the plain decode
step at batch 1 and 32 after a 512-token prompt ((time of a `--new` + 2-token generate - time of a 2-token
one) / `--new`, median of 3), and at batch 1 the CUDA kernels per step and their summed time (torch.profiler,
a 34-token run minus a 2-token run), and the first 34 greedy tokens. Writes `<out>/<device>-decode-ab.json`
and `.md` (one row per process, and the agreement of each tree's tokens with the first before-run's).

`--demo` runs the shipped demo Qwen3.5 (21.6M parameters: a host-bound step) instead, with no roofline;
`--batches` picks the batch sizes (default 1 and 32). `--worker` is the per-process entry (internal).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(Path(__file__).parent))

PROMPT = 512
DEMO = ROOT / "packages/server/src/hyspec_server/demo_models/qwen3_5"


def _generate(llm: Any, prompts: list[dict[str, Any]], n: int) -> Any:
    from hyspec_server import SamplingParams

    params = SamplingParams(max_tokens=n, temperature=0, ignore_eos=True)
    return llm.generate(prompts, params, use_tqdm=False)


def _timed(llm: Any, prompts: list[dict[str, Any]], n: int) -> float:
    torch.cuda.synchronize()
    t = time.perf_counter()
    _generate(llm, prompts, n)
    torch.cuda.synchronize()
    return time.perf_counter() - t


def _kernels(llm: Any, prompts: list[dict[str, Any]], n: int) -> tuple[int, float, list[int]]:
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        out = _generate(llm, prompts, n)
        torch.cuda.synchronize()
    events = [e for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA]
    return len(events), sum(e.device_time_total for e in events), list(out[0].outputs[0].token_ids)


def worker(ckpt: Path, max_len: int, new: int, batches: list[int]) -> dict[str, Any]:
    from bench_decode import make_llm

    llm = make_llm(ckpt, spec=None, max_num_seqs=max(batches), max_len=max_len)
    res: dict[str, Any] = {}
    for batch in batches:
        prompts = [
            {"prompt_token_ids": [(i * 7 + j * 13) % 1000 + 5 for i in range(PROMPT)]} for j in range(batch)
        ]
        _timed(llm, prompts, 8)  # warm-up
        steps = sorted((_timed(llm, prompts, new + 2) - _timed(llm, prompts, 2)) / new for _ in range(3))
        res[f"b{batch}_step_ms"] = round(steps[1] * 1e3, 3)
        res[f"b{batch}_tok_s"] = round(batch / steps[1], 1)
        if batch == 1:
            n_long, t_long, tokens = _kernels(llm, prompts, 34)
            n_short, t_short, _ = _kernels(llm, prompts, 2)
            res["b1_kernels_per_step"] = round((n_long - n_short) / 32, 1)
            res["b1_kernel_ms_per_step"] = round((t_long - t_short) / 32 / 1e3, 3)
            res["b1_tokens"] = tokens
    llm.close()
    return res


def _run_tree(tree: Path, ckpt: Path, max_len: int, new: int, batches: str) -> dict[str, Any]:
    paths = sorted(str(p) for p in (tree / "packages").glob("*/src"))
    # the tree's packages, then whatever else the path held (the GPU machine's wheels), no other tree's
    keep = [x for x in os.environ.get("PYTHONPATH", "").split(os.pathsep) if x and "/packages/" not in x]
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(paths + keep))
    cmd = [
        sys.executable,
        __file__,
        "--worker",
        "--ckpt",
        str(ckpt),
        "--max-len",
        str(max_len),
        "--new",
        str(new),
        "--batches",
        batches,
    ]
    out = subprocess.run(cmd, env=env, capture_output=True, text=True, check=True).stdout
    line = next(x for x in out.splitlines() if x.startswith("RESULT "))
    result: dict[str, Any] = json.loads(line.removeprefix("RESULT "))
    return result


def _agreement(a: list[int], b: list[int]) -> int:
    n = 0
    for x, y in zip(a, b, strict=False):
        if x != y:
            break
        n += 1
    return n


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--before", type=Path, help="repository root of the tree before the change")
    ap.add_argument("--after", type=Path, default=ROOT, help="repository root of the tree after it")
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--layers", type=int, default=32)
    ap.add_argument("--max-len", type=int, default=4096, help="max_model_len (the graphs' KV capacity)")
    ap.add_argument("--ckpt", type=Path, default=Path("/tmp/hyspec-decode-ab"))
    ap.add_argument("--new", type=int, default=128, help="decode steps timed (batch 32: all rows decode)")
    ap.add_argument("--out", type=Path, default=ROOT / "benchmarks/results")
    ap.add_argument("--demo", action="store_true", help="the shipped demo model (no roofline)")
    ap.add_argument("--batches", default="1,32", help="batch sizes, comma-separated (batch 1 comes first)")
    ap.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    a = ap.parse_args()
    batches = [int(b) for b in a.batches.split(",")]
    if batches[0] != 1:
        ap.error("--batches: expected batch 1 first (its kernels and tokens are recorded)")
    if a.worker:
        print("RESULT " + json.dumps(worker(a.ckpt, a.max_len, a.new, batches)), flush=True)
        return
    if a.before is None:
        ap.error("--before: the repository root of the tree to compare with")
    from bench_decode import build_checkpoint, copy_bandwidth, free

    sizes: dict[str, Any] | None = None
    if a.demo:
        a.ckpt = DEMO
    else:
        model, sizes = build_checkpoint(a.ckpt, a.layers)
        free(model)
    bandwidth = copy_bandwidth()  # bytes/s
    runs: list[dict[str, Any]] = []
    for r in range(a.rounds):
        for tag, tree in (("before", a.before), ("after", a.after)):
            res = _run_tree(tree.resolve(), a.ckpt, a.max_len, a.new, a.batches)
            runs.append({"tag": tag, "round": r + 1, **res})
            print(json.dumps(runs[-1]), flush=True)
    ref = runs[0]["b1_tokens"]
    for run in runs:
        run["b1_agreement_with_first_before"] = _agreement(run.pop("b1_tokens"), ref)
        for batch in batches:
            if sizes is None:
                run[f"b{batch}_of_roofline"] = "-"
                continue
            # the bandwidth roofline: every weight and each row's fp32 GDN state (read + written) per step
            step_bytes = sizes["weight_bytes_per_token"] + batch * sizes["gdn_state_bytes_per_token"]
            floor_s = step_bytes / bandwidth
            run[f"b{batch}_of_roofline"] = f"{floor_s * 1e3 / run[f'b{batch}_step_ms']:.1%}"
    device = torch.cuda.get_device_name()
    res = {
        "device": device,
        "layers": a.layers,
        "max_model_len": a.max_len,
        "sizes": sizes,
        "copy_bandwidth_bytes_per_s": bandwidth,
        "runs": runs,
    }
    a.out.mkdir(parents=True, exist_ok=True)
    stem = a.out / f"{device.lower().replace(' ', '-')}-decode-ab{'-demo' if a.demo else ''}"
    stem.with_suffix(".json").write_text(json.dumps(res, indent=1) + "\n")
    cols = ["b1_step_ms", "b1_tok_s", "b1_of_roofline", "b1_kernels_per_step", "b1_kernel_ms_per_step"]
    for batch in batches[1:]:
        cols += [f"b{batch}_step_ms", f"b{batch}_tok_s", f"b{batch}_of_roofline"]
    cols.append("b1_agreement_with_first_before")
    lines = [
        f"# Plain decode, two trees side by side, {device}",
        "",
        (
            "The shipped demo Qwen3.5 (21.6M parameters), bf16"
            if a.demo
            else f"Qwen3.5-9B-shaped random bf16 ({a.layers} layers)"
        )
        + f", prompt {PROMPT}, {a.new} decode steps timed, "
        f"CUDA graphs, max_model_len "
        f"{a.max_len}; produced by `tools/bench_decode_ab.py`. Roofline: weights + fp32 GDN state (read and "
        f"written) per step at the measured copy bandwidth, {bandwidth / 1e12:.2f} TB/s.",
        "",
        "| tree | round | " + " | ".join(cols) + " |",
        "| --- | --- | " + " | ".join("---" for _ in cols) + " |",
    ]
    lines += [
        f"| {run['tag']} | {run['round']} | " + " | ".join(str(run[c]) for c in cols) + " |" for run in runs
    ]
    stem.with_suffix(".md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
