"""Per-call time of the small kernels of a decode step, in a CUDA graph of 200 back-to-back calls (#21).

    python tools/bench_small_kernels.py        # GPU; writes $OUT (or /tmp)/small_kernels.json

The add + RMSNorm row kernel at 1, 8 and 32 rows of 4096 (Qwen3.5-9B's hidden size) by rows per program
and warps, the library's own launches of the other small kernels (gated RMSNorm, SwiGLU's product, GDN
gating) and a one-element torch add (the floor of a launch in a graph). Median of 5 replays.
"""

import json
import os

import torch
import triton
from hyspec_kernels.gating import triton_kernel as gk
from hyspec_kernels.launch import pdl_args


def per_call(fn, calls=200, reps=5):
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        fn()
    torch.cuda.current_stream().wait_stream(s)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        for _ in range(calls):
            fn()
    g.replay()
    torch.cuda.synchronize()
    ts = []
    for _ in range(reps):
        a = torch.cuda.Event(enable_timing=True)
        b = torch.cuda.Event(enable_timing=True)
        a.record()
        g.replay()
        b.record()
        torch.cuda.synchronize()
        ts.append(a.elapsed_time(b) * 1e3 / calls)
    return sorted(ts)[reps // 2]


def main() -> None:
    dev = torch.device("cuda")
    res: dict[str, float | str] = {}
    for rows in (1, 8, 32):
        h = 4096
        x = torch.randn(rows, h, device=dev).bfloat16()
        r = torch.randn(rows, h, device=dev).bfloat16()
        w = torch.randn(h, device=dev).bfloat16()
        out = torch.empty_like(x)
        summed = torch.empty_like(x)
        for block_r_cap in (1, 2, 4):
            for warps in (2, 4, 8, 16):
                block_h = 4096
                block_r = min(block_r_cap, triton.next_power_of_2(rows))

                def fn():
                    gk._rms_norm_kernel[(triton.cdiv(rows, block_r),)](
                        x,
                        r,
                        summed,
                        w,
                        out,
                        rows,
                        h,
                        1e-6,
                        1.0,
                        x.stride(0),
                        x.stride(1),
                        r.stride(0),
                        r.stride(1),
                        w.stride(0),
                        HAS_RESIDUAL=True,
                        ZERO_CENTRED=True,
                        PROD=1,
                        BLOCK_R=block_r,
                        BLOCK_H=block_h,
                        num_warps=warps,
                        **pdl_args(dev),
                    )

                try:
                    res[f"add_rms_norm rows {rows} block_r {block_r} warps {warps}"] = per_call(fn)
                except Exception as e:
                    res[f"add_rms_norm rows {rows} block_r {block_r} warps {warps}"] = str(e)[:80]
        # the library's own launch, for reference
        from hyspec_kernels import add_rms_norm, gated_rmsnorm, gdn_gating, silu_and_mul

        res[f"add_rms_norm (library) rows {rows}"] = per_call(lambda: add_rms_norm(x, r, w, 1e-6, offset=1.0))
        xo = torch.randn(rows, 32, 128, device=dev).bfloat16()
        z = torch.randn(rows, 32, 128, device=dev).bfloat16()
        wv = torch.randn(128, device=dev).bfloat16()
        res[f"gated_rmsnorm (library) rows {rows}"] = per_call(lambda: gated_rmsnorm(xo, z, wv, 1e-6))
        gu = torch.randn(rows, 2 * 12288, device=dev).bfloat16()
        res[f"silu_and_mul (library) rows {rows}"] = per_call(
            lambda: silu_and_mul(gu[:, :12288], gu[:, 12288:])
        )
        a = torch.randn(rows, 32, device=dev).bfloat16()
        bb = torch.randn(rows, 32, device=dev).bfloat16()
        al = torch.randn(32, device=dev)
        dt = torch.randn(32, device=dev)
        res[f"gdn_gating (library) rows {rows}"] = per_call(lambda: gdn_gating(al, a, bb, dt))
        empty = torch.empty(1, device=dev)
        res[f"torch add_ (tiny) rows {rows}"] = per_call(lambda: empty.add_(1))
    for k, v in res.items():
        print(f"{k:55s} {v if isinstance(v, str) else f'{v:7.2f} us'}")
    json.dump(
        {"device": torch.cuda.get_device_name(), "per_call_us": res},
        open(os.environ.get("OUT", "/tmp") + "/small_kernels.json", "w"),
        indent=1,
    )


if __name__ == "__main__":
    main()
