"""Host-side profile (cProfile) of hyspec decode with and without MTP speculation on a GPU.

    python tools/profile_spec.py [--layers 4] [--new 64]

Builds the same random Qwen3.5-9B-wide checkpoint as bench_decode.py (fewer layers) and prints, per mode,
tokens/s and the functions with the most cumulative and own time, to find host overhead per round.
"""

from __future__ import annotations

import argparse
import cProfile
import pstats
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).parent))
from bench_decode import build_checkpoint, free, make_llm


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--new", type=int, default=64)
    ap.add_argument("--top", type=int, default=30)
    a = ap.parse_args()
    from hyspec_server import SamplingParams

    ckpt = Path(tempfile.mkdtemp()) / "ckpt"
    model, _ = build_checkpoint(ckpt, a.layers)
    free(model)
    prompt = {"prompt_token_ids": list(range(100, 164))}
    for name, spec in [("plain", None), ("mtp", {"method": "mtp", "num_speculative_tokens": 3})]:
        llm = make_llm(ckpt, spec=spec, max_seqs=8, max_len=512)
        sp = SamplingParams(max_tokens=a.new, temperature=0, ignore_eos=True)
        llm.generate([prompt], sp)
        torch.cuda.synchronize()
        pr = cProfile.Profile()
        t = time.perf_counter()
        pr.enable()
        llm.generate([prompt], sp)
        torch.cuda.synchronize()
        pr.disable()
        print(f"== {name}: {a.new / (time.perf_counter() - t):.1f} tok/s (prefill included)")
        st = pstats.Stats(pr)
        st.sort_stats("cumulative").print_stats(a.top)
        st.sort_stats("tottime").print_stats(a.top)
        free(llm)


if __name__ == "__main__":
    main()
