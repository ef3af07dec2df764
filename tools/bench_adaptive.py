"""Adaptive speculation with a useless drafter against plain decoding, at batch 1, 8 and 32 (9B shape).

    python tools/bench_adaptive.py --ckpt /tmp/ck9b --out result.json [--batches 1,8,32] [--label after]

Builds (or reuses) the 9B-shaped random checkpoint of `bench_decode.build_checkpoint` (its MTP head is
random: it accepts nothing, the useless drafter the adaptive length must fall back to plain decoding
for), times a plain engine at each batch size (`bench_decode.hyspec_decode`: decode tok/s from the first
token to the last; with a batch, the other rows' prefill is in that window too), then per batch size a
fresh adaptive MTP S=3 engine: its first request (`first`, which starts knowing nothing) and two more
(`again`, `third`: they start from what the earlier ones measured), each with the drafting rounds its rows
ran and the engine's measured costs. `--label` other than `after` skips the plain runs (a second tree
measured in the same session, e.g. with `PYTHONPATH` on another checkout).
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))

from bench_decode import build_checkpoint, free, hyspec_decode, make_llm

PROMPT, NEW = 512, 128


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--ckpt", type=Path, required=True, help="checkpoint folder (built if it has none)")
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--batches", default="1,8,32")
    ap.add_argument("--label", default="after")
    a = ap.parse_args()
    batches = [int(x) for x in a.batches.split(",")]
    if not (a.ckpt / "config.json").exists():
        hf, _ = build_checkpoint(a.ckpt, 32)
        free(hf)
    g = torch.Generator().manual_seed(0)
    prompts = [torch.randint(0, 248320, (PROMPT,), generator=g).tolist() for _ in range(max(batches))]
    res: dict[str, Any] = {"device": torch.cuda.get_device_name(), "label": a.label, "runs": {}}
    max_len = PROMPT + NEW + 16

    def slim(r: dict[str, Any]) -> dict[str, Any]:
        return {k: v for k, v in r.items() if k != "tokens"}

    if a.label == "after":
        llm = make_llm(a.ckpt, spec=None, max_num_seqs=max(batches), max_len=max_len)
        for b in batches:
            res["runs"][f"plain/b{b}"] = r = slim(hyspec_decode(llm, prompts[:b], NEW))
            print("plain", b, r["decode_tok_s"], flush=True)
        llm.close()
    spec = {"method": "mtp", "num_speculative_tokens": 3, "adaptive": True}
    for b in batches:
        t = time.perf_counter()
        llm = make_llm(a.ckpt, spec=spec, max_num_seqs=max(batches), max_len=max_len)
        print("built", round(time.perf_counter() - t, 1), flush=True)
        for rep in ("first", "again", "third"):
            res["runs"][f"adaptive-{rep}/b{b}"] = r = slim(hyspec_decode(llm, prompts[:b], NEW))
            print(a.label, rep, b, r["decode_tok_s"], r.get("verify_rounds"), r.get("measured_ms"))
        llm.close()
    a.out.write_text(json.dumps(res, indent=1))


if __name__ == "__main__":
    main()
