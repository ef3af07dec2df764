"""Time hyspec's GDN and conv kernels next to flash-linear-attention in the same run, on one GPU.

    python tools/bench_kernels.py --out benchmarks/results [--quick]

Shapes are Qwen3.5's linear layers (HK=16, HV=32, K=V=128, fp32 state, bf16 inputs, conv width 4). Decode and
verify figures include the achieved bandwidth of the recurrent-state traffic (bytes read + written), which is
what bounds them, next to the device's measured copy bandwidth. fla is optional: without it only hyspec's
figures are written. Results go to `<out>/<device>-kernels.json` and `.md`.
"""

from __future__ import annotations

import argparse
import json
import math
import re
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from hyspec_kernels.conv import conv_decode, conv_prefill
from hyspec_kernels.gdn import gdn_decode, gdn_prefill, gdn_verify
from triton.testing import do_bench

HK, HV, K, V = 16, 32, 128, 128
CONV_W = 4
CONV_DIM = 2 * HK * K + HV * V
DEV = torch.device("cuda")
BF16 = torch.bfloat16


def bench_ms(fn: Callable[[], object], rep: int = 200) -> float:
    return float(do_bench(fn, warmup=25, rep=rep))


def copy_bandwidth() -> float:
    """Device-to-device copy, bytes read + written per second."""
    n = 1 << 30  # 1 GiB per buffer
    src = torch.empty(n, dtype=torch.uint8, device=DEV)
    dst = torch.empty_like(src)
    ms = bench_ms(lambda: dst.copy_(src), rep=50)
    return 2 * n / (ms * 1e-3)


def decode_inputs(b: int, t: int = 1) -> dict[str, torch.Tensor]:
    shape = (b, t) if t > 1 else (b,)
    return {
        "q": torch.randn(*shape, HK, K, device=DEV, dtype=BF16),
        "k": torch.randn(*shape, HK, K, device=DEV, dtype=BF16),
        "v": torch.randn(*shape, HV, V, device=DEV, dtype=BF16),
        "g": -torch.rand(*shape, HV, device=DEV, dtype=torch.float32),
        "beta": torch.rand(*shape, HV, device=DEV, dtype=torch.float32),
    }


def try_fla() -> Any:
    try:
        import fla.ops.gated_delta_rule as fla_gdn
    except Exception as e:  # fla is optional: record why it is missing
        print(f"flash-linear-attention unavailable: {e!r}", file=sys.stderr)
        return None
    return fla_gdn


def bench_decode(batches: list[int], fla: Any, bw: float) -> list[dict[str, Any]]:
    rows = []
    for b in batches:
        x = decode_inputs(b)
        # a pool larger than the batch with scrambled slots, as in serving
        pool = torch.randn(2 * b + 1, HV, K, V, device=DEV, dtype=torch.float32)
        slots = (torch.randperm(2 * b, device=DEV)[:b] + 1).to(torch.int32)
        ours = bench_ms(lambda: gdn_decode(**x, state=pool, state_slots=slots))
        state_bytes = 2 * b * HV * K * V * 4
        row: dict[str, Any] = {
            "B": b,
            "hyspec_us": ours * 1e3,
            "hyspec_state_TBps": state_bytes / (ours * 1e-3) / 1e12,
            "hyspec_frac_copy_bw": state_bytes / (ours * 1e-3) / bw,
        }
        if fla is not None:
            h0 = torch.randn(b, HV, K, V, device=DEV, dtype=torch.float32)
            q, k, v = x["q"][:, None], x["k"][:, None], x["v"][:, None]
            g, beta = x["g"][:, None], x["beta"][:, None].to(BF16)

            def run_fla() -> object:
                return fla.fused_recurrent_gated_delta_rule(
                    q,
                    k,
                    v,
                    g=g,
                    beta=beta,
                    initial_state=h0,
                    output_final_state=True,
                    use_qk_l2norm_in_kernel=True,
                )

            theirs = bench_ms(run_fla)
            row["fla_us"] = theirs * 1e3
            row["fla_state_TBps"] = state_bytes / (theirs * 1e-3) / 1e12
            row["speedup_vs_fla"] = theirs / ours
        rows.append(row)
        print("decode", row, flush=True)
    return rows


def bench_verify(batches: list[int], d: int, d_max: int) -> list[dict[str, Any]]:
    rows = []
    for b in batches:
        x = decode_inputs(b, d)
        xd = decode_inputs(b)
        pool = torch.randn(2 * b + 1, HV, K, V, device=DEV, dtype=torch.float32)
        slots = (torch.randperm(2 * b, device=DEV)[:b] + 1).to(torch.int32)
        scratch = torch.empty(b + 1, d_max, HV, K, V, device=DEV, dtype=torch.float32)
        rows_idx = torch.arange(b, device=DEV, dtype=torch.int32)
        ver = bench_ms(
            lambda: gdn_verify(
                **x, state=pool, state_slots=slots, scratch=scratch, scratch_rows=rows_idx, parents=None
            )
        )
        dec = bench_ms(lambda: gdn_decode(**xd, state=pool, state_slots=slots))
        traffic = (1 + d) * b * HV * K * V * 4
        row = {
            "B": b,
            "D": d,
            "Dmax": d_max,
            "verify_us": ver * 1e3,
            "decode_us": dec * 1e3,
            "verify_over_decode": ver / dec,
            "verify_state_TBps": traffic / (ver * 1e-3) / 1e12,
        }
        rows.append(row)
        print("verify", row, flush=True)
    return rows


def bench_prefill(lengths: list[int], fla: Any) -> list[dict[str, Any]]:
    rows = []
    for t in lengths:
        x = decode_inputs(t)
        g = -torch.rand(t, HV, device=DEV, dtype=torch.float32) * 0.1
        x["g"] = g
        pool = torch.zeros(2, HV, K, V, device=DEV, dtype=torch.float32)
        cu = torch.tensor([0, t], device=DEV, dtype=torch.int32)
        slots = torch.tensor([1], device=DEV, dtype=torch.int32)
        init = torch.tensor([False], device=DEV)
        ours = bench_ms(
            lambda: gdn_prefill(**x, cu_seqlens=cu, state=pool, state_slots=slots, has_initial_state=init),
            rep=100,
        )
        row: dict[str, Any] = {"T": t, "hyspec_ms": ours, "hyspec_Mtok_s": t / (ours * 1e-3) / 1e6}
        if fla is not None:
            q, k, v = x["q"][None], x["k"][None], x["v"][None]
            gg, beta = g[None], x["beta"][None].to(BF16)

            def run_fla() -> object:
                return fla.chunk_gated_delta_rule(
                    q, k, v, g=gg, beta=beta, output_final_state=True, use_qk_l2norm_in_kernel=True
                )

            theirs = bench_ms(run_fla, rep=100)
            row["fla_ms"] = theirs
            row["fla_Mtok_s"] = t / (theirs * 1e-3) / 1e6
            row["ratio_vs_fla"] = ours / theirs
        rows.append(row)
        print("prefill", row, flush=True)
    return rows


def bench_conv(batches: list[int], lengths: list[int], bw: float) -> dict[str, list[dict[str, Any]]]:
    weight = torch.randn(CONV_DIM, CONV_W, device=DEV, dtype=BF16)
    dec_rows, pre_rows = [], []
    for b in batches:
        x = torch.randn(b, CONV_DIM, device=DEV, dtype=BF16)
        pool = torch.randn(2 * b + 1, CONV_DIM, CONV_W - 1, device=DEV, dtype=BF16)
        slots = (torch.randperm(2 * b, device=DEV)[:b] + 1).to(torch.int32)
        ms = bench_ms(
            lambda: conv_decode(x, weight, None, conv_state=pool, state_slots=slots, activation="silu")
        )
        traffic = b * CONV_DIM * (2 * (CONV_W - 1) + 2) * 2
        row = {
            "B": b,
            "us": ms * 1e3,
            "TBps": traffic / (ms * 1e-3) / 1e12,
            "frac_copy_bw": traffic / (ms * 1e-3) / bw,
        }
        dec_rows.append(row)
        print("conv_decode", row, flush=True)
    for t in lengths:
        x = torch.randn(t, CONV_DIM, device=DEV, dtype=BF16)
        pool = torch.zeros(2, CONV_DIM, CONV_W - 1, device=DEV, dtype=BF16)
        cu = torch.tensor([0, t], device=DEV, dtype=torch.int32)
        slots = torch.tensor([1], device=DEV, dtype=torch.int32)
        init = torch.tensor([False], device=DEV)
        ms = bench_ms(
            lambda: conv_prefill(
                x,
                weight,
                None,
                cu_seqlens=cu,
                conv_state=pool,
                state_slots=slots,
                has_initial_state=init,
                activation="silu",
            ),
            rep=100,
        )
        traffic = 2 * t * CONV_DIM * 2
        row = {"T": t, "ms": ms, "TBps": traffic / (ms * 1e-3) / 1e12}
        pre_rows.append(row)
        print("conv_prefill", row, flush=True)
    return {"decode": dec_rows, "prefill": pre_rows}


def goals(res: dict[str, Any]) -> list[str]:
    """The issue's goals, each marked met or not with the margin."""
    out = []
    for r in res["gdn_decode"]:
        if "fla_us" in r:
            ok = r["hyspec_us"] <= r["fla_us"]
            out.append(
                f"decode B={r['B']}: {'MET' if ok else 'NOT MET'} (hyspec/fla time = "
                f"{r['hyspec_us'] / r['fla_us']:.2f})"
            )
        if r["B"] >= 32:
            ok = r["hyspec_frac_copy_bw"] >= 0.8
            out.append(
                f"decode B={r['B']} state bandwidth >= 80% of copy: {'MET' if ok else 'NOT MET'} "
                f"({100 * r['hyspec_frac_copy_bw']:.0f}%)"
            )
    for r in res["gdn_verify"]:
        ok = r["verify_over_decode"] < 1.5
        out.append(
            f"verify D={r['D']} B={r['B']} < 1.5x decode: {'MET' if ok else 'NOT MET'} "
            f"({r['verify_over_decode']:.2f}x)"
        )
    for r in res["gdn_prefill"]:
        if "fla_ms" in r:
            ok = r["ratio_vs_fla"] <= 1.25
            out.append(
                f"prefill T={r['T']} within 1.25x of fla: {'MET' if ok else 'NOT MET'} "
                f"({r['ratio_vs_fla']:.2f}x)"
            )
    return out


def table(rows: list[dict[str, Any]]) -> str:
    if not rows:
        return ""
    keys = list(rows[0].keys())
    for r in rows[1:]:
        keys += [k for k in r if k not in keys]

    def fmt(v: Any) -> str:
        if isinstance(v, float):
            return f"{v:.3g}" if not math.isnan(v) else "nan"
        return str(v)

    lines = ["| " + " | ".join(keys) + " |", "|" + "---|" * len(keys)]
    lines += ["| " + " | ".join(fmt(r.get(k, "")) for k in keys) + " |" for r in rows]
    return "\n".join(lines)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", type=Path, default=Path("benchmarks/results"))
    ap.add_argument("--quick", action="store_true", help="fewer shapes, for a smoke run")
    args = ap.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("bench_kernels needs a CUDA device")
    batches = [1, 8, 32] if args.quick else [1, 8, 32, 128, 256]
    lengths = [1024] if args.quick else [1024, 4096, 16384]
    fla = try_fla()
    bw = copy_bandwidth()
    device = torch.cuda.get_device_name(0)
    print(f"device {device}, copy bandwidth {bw / 1e12:.2f} TB/s", flush=True)
    res: dict[str, Any] = {
        "device": device,
        "torch": torch.__version__,
        "copy_bandwidth_TBps": bw / 1e12,
        "shapes": {"HK": HK, "HV": HV, "K": K, "V": V, "conv_dim": CONV_DIM, "conv_width": CONV_W},
        "fla": getattr(sys.modules.get("fla"), "__version__", None),
    }
    res["gdn_decode"] = bench_decode(batches, fla, bw)
    res["gdn_verify"] = bench_verify(batches, d=4, d_max=8)
    res["gdn_prefill"] = bench_prefill(lengths, fla)
    res["conv"] = bench_conv(batches, lengths, bw)
    res["goals"] = goals(res)
    args.out.mkdir(parents=True, exist_ok=True)
    stem = re.sub(r"[^A-Za-z0-9]+", "-", device).strip("-").lower()
    (args.out / f"{stem}-kernels.json").write_text(json.dumps(res, indent=1))
    md = [
        f"# Kernel benchmark on {device}",
        "",
        f"torch {torch.__version__}, flash-linear-attention {res['fla']}, measured copy bandwidth "
        f"{bw / 1e12:.2f} TB/s (read + write). Shapes: HK={HK}, HV={HV}, K=V={K}, fp32 state, bf16 inputs.",
        "",
        "## GDN decode (one token per sequence)",
        table(res["gdn_decode"]),
        "",
        "## GDN verify (D=4, scratch allocated for 8 steps) vs decode of the same batch",
        table(res["gdn_verify"]),
        "",
        "## GDN chunked prefill (one sequence)",
        table(res["gdn_prefill"]),
        "",
        "## Causal conv1d (width 4, SiLU, bf16 state)",
        table(res["conv"]["decode"]),
        "",
        table(res["conv"]["prefill"]),
        "",
        "## Goals",
        *[f"- {g}" for g in res["goals"]],
        "",
    ]
    (args.out / f"{stem}-kernels.md").write_text("\n".join(md))
    print("\n".join(md))


if __name__ == "__main__":
    main()
