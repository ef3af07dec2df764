"""Paged attention's decode tiles (`_decode_tiles`) against the tiles before them and a few alternatives.

    python tools/bench_attention_tiles.py      # GPU; writes $OUT (or /tmp)/attention_tiles.json

Qwen3.5-9B's attention (HQ 16, HKV 4, Dh 256, page 16, bf16) at batch 1-64, 600 / 2000 / 8000 KV positions,
one and four query tokens (decode, a 4-token verify block), through the launcher with its split heuristic.
Each variant is (KV block, pipeline stages, programs per SM); "old" is the launcher before `_decode_tiles`
(its own blocks, Triton's default stages, two programs per SM). Microseconds a call in a CUDA graph of 50
calls, median of 5 replays (`bench_small_kernels.per_call`).
"""

import json
import os
import sys
from pathlib import Path

import torch
from hyspec_kernels.attention import triton_kernel as ak

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_small_kernels import per_call

HQ, HKV, DH, PAGE = 16, 4, 256, 16
VARIANTS = {
    "old": None,
    "32/2/3": (32, 2, 3),
    "32/2/2": (32, 2, 2),
    "32/1/3": (32, 1, 3),
    "32/1/2": (32, 1, 2),
}
VARIANTS["64/2/2"] = (64, 2, 2)


def main() -> None:
    kept = ak._decode_tiles
    res: dict[str, object] = {"device": torch.cuda.get_device_name()}
    for rows in (1, 4, 8, 16, 32, 64):
        for kv in (600, 2000, 8000):
            for q_len in (1, 4):
                pages = (kv + PAGE - 1) // PAGE
                n_pages = rows * pages + 1
                kc = torch.randn(n_pages, PAGE, HKV, DH, device="cuda").bfloat16()
                vc = torch.randn(n_pages, PAGE, HKV, DH, device="cuda").bfloat16()
                table = torch.randperm(n_pages - 1, device="cuda")[: rows * pages].view(rows, pages).int()
                q = torch.randn(rows * q_len, HQ, DH, device="cuda").bfloat16()
                cu = torch.arange(0, rows * q_len + 1, q_len, device="cuda", dtype=torch.int32)
                lens = torch.full((rows,), kv, device="cuda", dtype=torch.int32)

                def run() -> torch.Tensor:
                    return ak.paged_attention_triton(
                        q, k_cache=kc, v_cache=vc, page_table=table, cu_seqlens_q=cu, kv_lens=lens,
                        scale=DH**-0.5, max_q_len=q_len, max_kv_len=max(kv + 1000, 4096),
                    )  # fmt: skip

                line = {"kept": per_call(run, calls=50)}
                for name, v in VARIANTS.items():
                    if v is None:
                        ak._decode_tiles = lambda bn, r, hd, p, s: (bn, None, 2)
                    else:
                        ak._decode_tiles = lambda bn, r, hd, p, s, v=v: (
                            (v[0], v[1], v[2]) if r <= 32 and hd > 128 else kept(bn, r, hd, p, s)
                        )
                    line[name] = per_call(run, calls=50)
                ak._decode_tiles = kept
                res[f"b{rows}/kv{kv}/q{q_len}"] = line
                print(
                    f"b{rows} kv{kv} q{q_len}: " + "  ".join(f"{k} {t:.1f}" for k, t in line.items()),
                    flush=True,
                )
    out = Path(os.environ.get("OUT", "/tmp")) / "attention_tiles.json"
    out.write_text(json.dumps(res, indent=1))


if __name__ == "__main__":
    main()
