"""Long-prompt prefill of hyspec next to HF transformers, in one run on one GPU: time to first token and the
fraction of the GPU's dense bf16 peak it reaches.

    python tools/bench_prefill.py --out benchmarks/results [--layers 32] [--lengths 1024,4096,16384,32768]

The model is the Qwen3.5-9B-shaped random bf16 checkpoint of `bench_decode.py`. Each length is timed as one
request with `max_tokens=1` through `LLM.generate` (wall time, the median of `--reps` fresh random prompts,
so no prefix-cache hit), with prefix caching on (the default: prefill chunks end at every snapshot interval)
and off, both with the default `max_num_batched_tokens`; HF transformers runs one forward over the prompt
(`logits_to_keep=1`, fla kernels when importable). Model FLOPs per prompt are the projection weights' 2 *
params * T (embedding and LM head excluded: the head runs on the last token only) plus causal attention's
2 * T^2 * heads * head_dim per attention layer; GDN's chunk products are not counted. One prefill of the
longest prompt is profiled (torch.profiler) and its kernel time grouped by kernel name.
Results go to `<out>/<device>-prefill.json` and `.md`.
"""

from __future__ import annotations

import argparse
import json
import re
import statistics
import sys
import tempfile
import time
from collections import defaultdict
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_decode import build_checkpoint, free

# dense bf16 tensor-core peak (no sparsity), by device name
PEAK_BF16 = {"H100": 989.4e12, "H200": 989.4e12, "A100": 312e12}


def peak_flops(device: str) -> float | None:
    return next((v for k, v in PEAK_BF16.items() if k in device), None)


def model_flops(model: Any, t: int) -> float:
    cfg = model.config
    linear = sum(
        p.numel() for n, p in model.model.layers.named_parameters() if p.dim() == 2 and "conv" not in n
    )
    attn_layers = cfg.layer_types.count("full_attention")
    return 2.0 * linear * t + 2.0 * t * t * cfg.num_attention_heads * cfg.head_dim * attn_layers


def prompts(n: int, t: int, vocab: int, seed: int) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(100, vocab - 100, (t,), generator=g).tolist() for _ in range(n)]


def time_hyspec(llm: Any, ps: list[list[int]]) -> list[float]:
    from hyspec_server import SamplingParams

    sp = SamplingParams(max_tokens=1, temperature=0, ignore_eos=True)
    out = []
    for p in ps:
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        llm.generate([{"prompt_token_ids": p}], sp, use_tqdm=False)
        torch.cuda.synchronize()
        out.append(time.perf_counter() - t0)
    return out


def time_hf(model: Any, ps: list[list[int]]) -> list[float]:
    out = []
    with torch.inference_mode():
        for p in ps:
            ids = torch.tensor([p], device="cuda")
            torch.cuda.synchronize()
            t0 = time.perf_counter()
            model(input_ids=ids, logits_to_keep=1, use_cache=False)
            torch.cuda.synchronize()
            out.append(time.perf_counter() - t0)
            del ids
    return out


def profile_kernels(llm: Any, p: list[int], top: int = 14) -> list[dict[str, Any]]:
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        time_hyspec(llm, [p])
    per: dict[str, float] = defaultdict(float)
    count: dict[str, int] = defaultdict(int)
    for e in prof.events():
        if e.device_type.name == "CUDA":
            name = re.sub(r"\s+", " ", e.name)[:90]
            per[name] += e.device_time_total if hasattr(e, "device_time_total") else e.cuda_time_total
            count[name] += 1
    total = sum(per.values())
    rows = sorted(per.items(), key=lambda kv: -kv[1])[:top]
    return [{"kernel": k, "ms": v / 1e3, "share": v / total, "launches": count[k]} for k, v in rows] + [
        {"kernel": "(all kernels)", "ms": total / 1e3, "share": 1.0, "launches": sum(count.values())}
    ]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", type=Path, default=Path("benchmarks/results"))
    ap.add_argument("--layers", type=int, default=32)
    ap.add_argument("--lengths", default="1024,4096,16384,32000")
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--skip-hf", action="store_true")
    a = ap.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("bench_prefill needs a CUDA device")
    lengths = [int(x) for x in a.lengths.split(",")]
    device = torch.cuda.get_device_name(0)
    peak = peak_flops(device)
    res: dict[str, Any] = {"device": device, "torch": torch.__version__, "peak_bf16_flops": peak, "rows": []}
    with tempfile.TemporaryDirectory() as tmp:
        ckpt = Path(tmp) / "ckpt"
        model, _sizes = build_checkpoint(ckpt, a.layers)
        vocab = model.config.vocab_size
        flops = {t: model_flops(model, t) for t in lengths}
        timings: dict[str, dict[int, list[float]]] = {}
        if not a.skip_hf:
            time_hf(model, prompts(1, lengths[0], vocab, 0))  # warm-up
            timings["hf"] = {t: time_hf(model, prompts(a.reps, t, vocab, t)) for t in lengths}
        free(model)
        del model
        from hyspec_server import LLM

        for name, caching in (("hyspec", True), ("hyspec_no_prefix_cache", False)):
            llm = LLM(
                str(ckpt),
                dtype="bfloat16",
                max_model_len=max(lengths) + 1,
                max_num_seqs=8,
                enable_prefix_caching=caching,
            )
            res.setdefault("max_num_batched_tokens", llm.engine.scheduler.config.max_num_batched_tokens)
            time_hyspec(llm, prompts(1, lengths[0], vocab, 1))  # warm-up
            timings[name] = {t: time_hyspec(llm, prompts(a.reps, t, vocab, 7 * t + 1)) for t in lengths}
            if caching:
                res["profile"] = profile_kernels(llm, prompts(1, max(lengths), vocab, 3)[0])
            llm.close()
            free(llm)
    for t in lengths:
        row: dict[str, Any] = {"T": t, "model_TFLOP": flops[t] / 1e12}
        for name, by_len in timings.items():
            s = statistics.median(by_len[t])
            row[f"{name}_s"] = s
            row[f"{name}_of_peak"] = flops[t] / s / peak if peak else None
        res["rows"].append(row)
        print("prefill", row, flush=True)
    write(a.out, res)


def write(out: Path, res: dict[str, Any]) -> None:
    out.mkdir(parents=True, exist_ok=True)
    stem = re.sub(r"[^A-Za-z0-9]+", "-", res["device"]).strip("-").lower()
    (out / f"{stem}-prefill.json").write_text(json.dumps(res, indent=1))
    names = [k[:-2] for k in res["rows"][0] if k.endswith("_s")]
    peak = res["peak_bf16_flops"]
    md = [
        f"# Long-prompt prefill on {res['device']}",
        "",
        f"torch {res['torch']}; Qwen3.5-9B-shaped random bf16 model; one request, `max_tokens=1`, median "
        f"wall time; max_num_batched_tokens {res['max_num_batched_tokens']}; dense bf16 peak "
        f"{peak / 1e12 if peak else 'unknown'} TFLOP/s. Produced by `tools/bench_prefill.py`.",
        "",
        "| prompt tokens | model TFLOP | " + " | ".join(f"{n} s | {n} of peak" for n in names) + " |",
        "|" + "---|" * (2 + 2 * len(names)),
    ]
    for r in res["rows"]:
        cells = [str(r["T"]), f"{r['model_TFLOP']:.1f}"]
        for n in names:
            frac = r[f"{n}_of_peak"]
            cells += [f"{r[f'{n}_s']:.3f}", f"{frac:.1%}" if frac is not None else ""]
        md.append("| " + " | ".join(cells) + " |")
    md += ["", "Kernel time of one prefill of the longest prompt (prefix caching on):", ""]
    md += ["| kernel | ms | share | launches |", "|---|---|---|---|"]
    md += [
        f"| `{p['kernel']}` | {p['ms']:.1f} | {p['share']:.1%} | {p['launches']} |" for p in res["profile"]
    ]
    (out / f"{stem}-prefill.md").write_text("\n".join(md) + "\n")


if __name__ == "__main__":
    main()
