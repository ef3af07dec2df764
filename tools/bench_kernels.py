"""Time hyspec's GDN and conv kernels next to flash-linear-attention in the same run, on one GPU.

    python tools/bench_kernels.py --out benchmarks/results [--quick]

Shapes are Qwen3.5's linear layers (HK=16, HV=32, K=V=128, fp32 state, bf16 inputs, conv width 4). Decode and
verify figures include the achieved bandwidth of the recurrent-state traffic (bytes read + written), which is
what bounds them, next to the device's measured copy bandwidth. fla is optional: without it only hyspec's
figures are written. The paged-attention prefill (Qwen3.5-9B's attention shape) is timed next to PyTorch's
SDPA flash kernel on the same FLOPs (contiguous K/V: the limit a paged kernel chases). Results go to
`<out>/<device>-kernels.json` and `.md`.
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
from hyspec_kernels.gdn import gdn_decode, gdn_prefill, gdn_replay, gdn_verify
from hyspec_kernels.gdn.triton_chunk import chunk_layout, launch_chunk_prefill
from triton.testing import do_bench

HK, HV, K, V = 16, 32, 128, 128
CONV_W = 4
CONV_DIM = 2 * HK * K + HV * V
DEV = torch.device("cuda")
BF16 = torch.bfloat16


def bench_ms(fn: Callable[[], object], rep: int = 200) -> float:
    return float(do_bench(fn, warmup=25, rep=rep))


def graph_ms(fn: Callable[[], object], rep: int = 200) -> float | None:
    """Replay time of `fn` captured in a CUDA graph: the kernels alone, without Python launch overhead.

    None when `fn` cannot be captured (for example a host sync inside it)."""
    try:
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            for _ in range(3):
                fn()
        torch.cuda.current_stream().wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            fn()
        return bench_ms(graph.replay, rep)
    except Exception as e:  # a failed capture is reported, not fatal
        print(f"graph capture failed: {e!r}"[:200], file=sys.stderr)
        torch.cuda.synchronize()
        return None


def both(fn: Callable[[], object], rep: int = 200) -> tuple[float, float | None]:
    return bench_ms(fn, rep), graph_ms(fn, rep)


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


def _tbps(nbytes: int, ms: float | None) -> float | None:
    return None if ms is None else nbytes / (ms * 1e-3) / 1e12


def _ratio(a: float | None, b: float | None) -> float | None:
    return None if a is None or b is None else a / b


def bench_decode(batches: list[int], fla: Any, bw: float) -> list[dict[str, Any]]:
    rows = []
    for b in batches:
        x = decode_inputs(b)
        # a pool larger than the batch with scrambled slots, as in serving
        pool = torch.randn(2 * b + 1, HV, K, V, device=DEV, dtype=torch.float32)
        slots = (torch.randperm(2 * b, device=DEV)[:b] + 1).to(torch.int32)
        # the engine's hot path: indices were validated when statepool built them
        eager, graph = both(lambda: gdn_decode(**x, state=pool, state_slots=slots, check_indices=False))
        nbytes = 2 * b * HV * K * V * 4
        row: dict[str, Any] = {
            "B": b,
            "hyspec_eager_us": eager * 1e3,
            "hyspec_graph_us": None if graph is None else graph * 1e3,
            "hyspec_graph_TBps": _tbps(nbytes, graph),
            "hyspec_graph_frac_copy_bw": None if graph is None else nbytes / (graph * 1e-3) / bw,
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

            f_eager, f_graph = both(run_fla)
            row |= {
                "fla_eager_us": f_eager * 1e3,
                "fla_graph_us": None if f_graph is None else f_graph * 1e3,
                "fla_graph_TBps": _tbps(nbytes, f_graph),
                "time_vs_fla_eager": eager / f_eager,
                "time_vs_fla_graph": _ratio(graph, f_graph),
            }
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
        v_eager, v_graph = both(
            lambda: gdn_verify(
                **x,
                state=pool,
                state_slots=slots,
                scratch=scratch,
                scratch_rows=rows_idx,
                parents=None,
                check_indices=False,
            )
        )
        d_eager, d_graph = both(lambda: gdn_decode(**xd, state=pool, state_slots=slots, check_indices=False))
        # what the engine runs: a verify that keeps no state, then the commit's replay of the whole block
        # (every draft accepted: the longest replay) from the stored inputs
        _, n_graph = both(
            lambda: gdn_verify(
                **x, state=pool, state_slots=slots, scratch=None, scratch_rows=None, check_indices=False
            )
        )
        # a tree of D nodes (root, its two children, then a chain under the first child), no state writes:
        # its steps' states live in a workspace of the call
        parents = torch.tensor([-1, 0, 0, *range(1, d - 2)][:d], device=DEV, dtype=torch.int32)
        tree = parents.expand(b, d).contiguous()
        _, t_graph = both(
            lambda: gdn_verify(
                **x,
                state=pool,
                state_slots=slots,
                scratch=None,
                scratch_rows=None,
                parents=tree,
                check_indices=False,
            )
        )
        ins = {
            "k": x["k"].float(),
            "v": x["v"].float(),
            "g": x["g"],
            "beta": x["beta"],
        }
        paths = torch.arange(d, device=DEV).expand(b, d).contiguous()
        _, r_graph = both(
            lambda: gdn_replay(
                **ins, state=pool, state_slots=slots, rows=rows_idx, paths=paths, check_indices=False
            )
        )
        row = {
            "B": b,
            "D": d,
            "Dmax": d_max,
            "verify_graph_us": None if v_graph is None else v_graph * 1e3,
            "decode_graph_us": None if d_graph is None else d_graph * 1e3,
            "verify_over_decode_graph": _ratio(v_graph, d_graph),
            "verify_over_decode_eager": v_eager / d_eager,
            "verify_graph_TBps": _tbps((1 + d) * b * HV * K * V * 4, v_graph),
            "verify_no_states_graph_us": None if n_graph is None else n_graph * 1e3,
            "replay_commit_graph_us": None if r_graph is None else r_graph * 1e3,
            "verify_no_states_over_decode_graph": _ratio(n_graph, d_graph),
            "tree_no_states_graph_us": None if t_graph is None else t_graph * 1e3,
            "tree_no_states_over_decode_graph": _ratio(t_graph, d_graph),
        }
        rows.append(row)
        print("verify", row, flush=True)
    return rows


def bench_prefill(lengths: list[int], fla: Any) -> list[dict[str, Any]]:
    """One sequence of each length: eager (what a step's Python launch costs included) and in a CUDA graph
    (the kernels alone), next to fla's `chunk_gated_delta_rule` timed the same two ways."""
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
            lambda: gdn_prefill(
                **x,
                cu_seqlens=cu,
                cu_seqlens_host=[0, t],  # as the engine calls it: no read back of the offsets
                state=pool,
                state_slots=slots,
                has_initial_state=init,
                check_indices=False,
            ),
            rep=100,
        )
        # the op sends the chunk layout from the host each call: captured, the kernels run on one made ahead
        layout = chunk_layout([0, t], DEV)
        ours_graph = graph_ms(
            lambda: launch_chunk_prefill(
                **x,
                cu_seqlens=[0, t],
                state=pool,
                state_slots=slots,
                has_initial_state=init.to(torch.int8),
                return_chunk_states=False,
                layout=layout,
            ),
            rep=100,
        )
        row: dict[str, Any] = {
            "T": t,
            "hyspec_ms": ours,
            "hyspec_graph_ms": ours_graph,
            "hyspec_Mtok_s": t / (ours * 1e-3) / 1e6,
        }
        if fla is not None:
            q, k, v = x["q"][None], x["k"][None], x["v"][None]
            gg, beta = g[None], x["beta"][None].to(BF16)

            def run_fla() -> object:
                return fla.chunk_gated_delta_rule(
                    q, k, v, g=gg, beta=beta, output_final_state=True, use_qk_l2norm_in_kernel=True
                )

            theirs, theirs_graph = both(run_fla, rep=100)
            row |= {
                "fla_ms": theirs,
                "fla_graph_ms": theirs_graph,
                "fla_Mtok_s": t / (theirs * 1e-3) / 1e6,
                "time_vs_fla": ours / theirs,
                "time_vs_fla_graph": _ratio(ours_graph, theirs_graph),
            }
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
        eager, graph = both(
            lambda: conv_decode(x, weight, None, conv_state=pool, state_slots=slots, activation="silu")
        )
        nbytes = b * CONV_DIM * (2 * (CONV_W - 1) + 2) * 2
        row = {
            "B": b,
            "eager_us": eager * 1e3,
            "graph_us": None if graph is None else graph * 1e3,
            "graph_TBps": _tbps(nbytes, graph),
        }
        dec_rows.append(row)
        print("conv_decode", row, flush=True)
    for t in lengths:
        x = torch.randn(t, CONV_DIM, device=DEV, dtype=BF16)
        pool = torch.zeros(2, CONV_DIM, CONV_W - 1, device=DEV, dtype=BF16)
        cu = torch.tensor([0, t], device=DEV, dtype=torch.int32)
        slots = torch.tensor([1], device=DEV, dtype=torch.int32)
        init = torch.tensor([False], device=DEV)
        eager, graph = both(
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
        row = {
            "T": t,
            "eager_ms": eager,
            "graph_ms": graph,
            "graph_TBps": _tbps(2 * t * CONV_DIM * 2, graph),
        }
        pre_rows.append(row)
        print("conv_prefill", row, flush=True)
    return {"decode": dec_rows, "prefill": pre_rows}


# Qwen3.5-9B's full-attention layers: 16 query heads over 4 KV heads of 256, pages of 16 tokens
ATT_HQ, ATT_HKV, ATT_D, ATT_PAGE = 16, 4, 256, 16


def bench_attention_prefill(quick: bool) -> list[dict[str, Any]]:
    """Paged attention over a prefill chunk (bf16, a CUDA graph) after `prefix` cached tokens, in causal
    attention's FLOPs per second, next to PyTorch's SDPA (flash, contiguous K/V without pages, no prefix):
    the physical limit a paged kernel chases."""
    from hyspec_kernels.attention import paged_attention

    shapes = [(2048, 0)] if quick else [(2048, 0), (8192, 0), (8192, 8192), (8192, 24576)]
    rows = []
    for t, prefix in shapes:
        kv = prefix + t
        pages = -(-kv // ATT_PAGE)
        q = torch.randn(t, ATT_HQ, ATT_D, device=DEV, dtype=BF16)
        kc = torch.randn(pages + 1, ATT_PAGE, ATT_HKV, ATT_D, device=DEV, dtype=BF16)
        vc = torch.randn_like(kc)
        table_ = (torch.randperm(pages, device=DEV, dtype=torch.int32) + 1)[None]  # pages in any order
        cu = torch.tensor([0, t], device=DEV, dtype=torch.int32)
        kv_lens = torch.tensor([kv], device=DEV, dtype=torch.int32)
        flops = 4 * ATT_HQ * ATT_D * (t * prefix + t * t / 2)
        ours = graph_ms(
            lambda: paged_attention(
                q, k_cache=kc, v_cache=vc, page_table=table_, cu_seqlens_q=cu, kv_lens=kv_lens,
                scale=ATT_D**-0.5, host_lens=(t, kv), check_indices=False,
            ),
            rep=20,
        )  # fmt: skip
        row: dict[str, Any] = {"T": t, "prefix": prefix, "hyspec_graph_ms": ours}
        row["hyspec_TFLOPs"] = None if ours is None else flops / ours / 1e9
        if prefix == 0:
            group = ATT_HQ // ATT_HKV
            qs = q.transpose(0, 1)[None]  # [1, HQ, T, D]
            ks = kc[1:].reshape(-1, ATT_HKV, ATT_D)[:t].transpose(0, 1)[None].repeat_interleave(group, 1)
            vs = vc[1:].reshape(-1, ATT_HKV, ATT_D)[:t].transpose(0, 1)[None].repeat_interleave(group, 1)
            sdpa = graph_ms(
                lambda: torch.nn.functional.scaled_dot_product_attention(qs, ks, vs, is_causal=True), rep=20
            )
            row["sdpa_graph_ms"] = sdpa
            row["sdpa_TFLOPs"] = None if sdpa is None else flops / sdpa / 1e9
        rows.append(row)
        print("attention prefill", row, flush=True)
    return rows


def _verdict(ok: bool) -> str:
    return "MET" if ok else "NOT MET"


def goals(res: dict[str, Any]) -> list[str]:
    """The issue's goals, each marked met or not with the margin (kernels timed in CUDA graphs)."""
    out = []
    for r in res["gdn_decode"]:
        ratio = r.get("time_vs_fla_graph")
        if ratio is not None:
            out.append(
                f"decode B={r['B']} at least as fast as fla (graph): {_verdict(ratio <= 1.0)} "
                f"(hyspec/fla time {ratio:.2f}; eager {r['time_vs_fla_eager']:.2f})"
            )
        frac = r.get("hyspec_graph_frac_copy_bw")
        if r["B"] >= 32 and frac is not None:
            out.append(
                f"decode B={r['B']} state traffic >= 80% of copy bandwidth: {_verdict(frac >= 0.8)} "
                f"({100 * frac:.0f}%)"
            )
    for r in res["gdn_verify"]:
        ratio = r.get("verify_over_decode_graph")
        if ratio is not None:
            out.append(
                f"verify D={r['D']} B={r['B']} under 1.5x decode: {_verdict(ratio < 1.5)} ({ratio:.2f}x)"
            )
        lean = r.get("verify_no_states_over_decode_graph")
        if lean is not None:
            out.append(
                f"verify D={r['D']} B={r['B']} without state writes (the engine's, commit by replay) under "
                f"1.5x decode: {_verdict(lean < 1.5)} ({lean:.2f}x)"
            )
        tree = r.get("tree_no_states_over_decode_graph")
        if tree is not None:
            out.append(
                f"tree verify of {r['D']} nodes B={r['B']} without state writes under 1.5x decode: "
                f"{_verdict(tree < 1.5)} ({tree:.2f}x)"
            )
    for r in res["gdn_prefill"]:
        ratio = r.get("time_vs_fla_graph")
        if ratio is not None:
            out.append(
                f"prefill T={r['T']} no slower than fla (graph): {_verdict(ratio <= 1.0)} "
                f"(hyspec/fla time {ratio:.2f}; eager {r['time_vs_fla']:.2f})"
            )
    return out


def table(rows: list[dict[str, Any]]) -> str:
    if not rows:
        return ""
    keys = list(rows[0].keys())
    for r in rows[1:]:
        keys += [k for k in r if k not in keys]

    def fmt(v: Any) -> str:
        if v is None:
            return "-"
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
    lengths = [1024] if args.quick else [1024, 4096, 16384, 65536]
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
    res["attention_prefill"] = bench_attention_prefill(args.quick)
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
        "Columns `*_graph_*` are CUDA-graph replays (kernels only); `*_eager_*` include Python launch",
        "overhead. hyspec is called as the engine calls it, index validation off (`check_indices=False`).",
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
        f"## Paged attention over a prefill chunk (HQ={ATT_HQ}, HKV={ATT_HKV}, Dh={ATT_D}, bf16) vs SDPA",
        table(res["attention_prefill"]),
        "",
        "## Goals",
        *[f"- {g}" for g in res["goals"]],
        "",
    ]
    (args.out / f"{stem}-kernels.md").write_text("\n".join(md))
    print("\n".join(md))


if __name__ == "__main__":
    main()
