"""Cost of structured outputs on the GPU: decode with and without a JSON-schema constraint on the shipped demo
Qwen3.5 at batch 1 and 32 (CUDA graphs on), and speculative acceptance (its MTP head) with and without it;
then the same steps on a random Qwen3.5-9B-shaped body with the demo's tokenizer and vocabulary (a real
model's step, the same masks; `--no-9b` skips it).

    python tools/bench_structured.py --out benchmarks/results

The constrained and free runs decode the same prompts for the same number of steps (`ignore_eos`; the schema
is an array of strings that never has to end, so no request stops early), alternating three times each in one
process (medians compared); per-step time is wall time over steps, so the difference is the masking (matcher
update + mask fill on the host, the mask's upload and application on the device).
Results: <device>-structured-outputs.{json,md}.
"""

from __future__ import annotations

import argparse
import gc
import json
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

SCHEMA = {"type": "array", "items": {"type": "string"}}
NEW = 128
REPEATS = 3


def run(llm: Any, prompts: list[list[int]], schema: bool, spec: bool) -> dict[str, Any]:
    from hyspec_server import SamplingParams, StructuredOutputsParams

    so = StructuredOutputsParams(json=SCHEMA) if schema else None
    params = SamplingParams(max_tokens=NEW, temperature=0, ignore_eos=True, structured_outputs=so)
    batch = [{"prompt_token_ids": p} for p in prompts]
    llm.generate(batch, params)  # warm at this batch size: the grammar compiled, every kernel loaded
    torch.cuda.synchronize()
    steps0 = llm.engine.stats.num_steps
    t0 = time.perf_counter()
    outs = llm.generate(batch, params)
    torch.cuda.synchronize()
    wall = time.perf_counter() - t0
    steps = llm.engine.stats.num_steps - steps0
    tokens = sum(len(o.outputs[0].token_ids) for o in outs)
    res: dict[str, Any] = {"tok_s": tokens / wall, "ms_per_step": wall / steps * 1e3, "steps": steps}
    if spec:
        st = [o.spec_stats for o in outs if o.spec_stats is not None]
        drafts = sum(s.num_draft_tokens for s in st)
        res["acceptance"] = sum(s.num_accepted_tokens for s in st) / drafts if drafts else 0.0
        res["mean_accept_length"] = sum(s.mean_accept_length for s in st) / len(st) if st else 0.0
    if schema:
        ok = sum(_parses_prefix(o.outputs[0].text) for o in outs)
        res["valid_prefixes"] = f"{ok}/{len(outs)}"
    return res


def _parses_prefix(text: str) -> bool:
    """The text starts a JSON array (it is cut by the token budget, so it need not close)."""
    return text.lstrip().startswith("[")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", type=Path, default=ROOT / "benchmarks/results")
    ap.add_argument("--no-9b", dest="nine_b", action="store_false")
    a = ap.parse_args()
    from hyspec_server import LLM
    from transformers import AutoTokenizer

    path = ROOT / "packages/server/src/hyspec_server/demo_models/qwen3_5"
    tok = AutoTokenizer.from_pretrained(str(path))
    base = tok.encode("def parse_config(path):\n    ")
    prompts = [base + tok.encode(f"# {i}\n") for i in range(32)]
    device = torch.cuda.get_device_name()
    res: dict[str, Any] = {"device": device, "new_tokens": NEW, "schema": SCHEMA}
    models = [("demo", path)]
    tmp = tempfile.TemporaryDirectory(prefix="hyspec-structured-")
    if a.nine_b:
        from tools.bench_decode import build_checkpoint

        body = Path(tmp.name) / "qwen3_5-9b-shaped-demo-vocab"
        build_checkpoint(body, 32, vocab_size=json.loads((path / "config.json").read_text())["vocab_size"])
        for f in path.glob("tokenizer*"):
            shutil.copy(f, body / f.name)
        torch.cuda.empty_cache()
        models.append(("9b", body))
    for model, where in models:
        for name, spec in (("plain", None), ("mtp", {"method": "mtp", "num_speculative_tokens": 3})):
            llm = LLM(
                model=str(where), device="cuda", max_num_seqs=32, speculative_config=spec, max_model_len=512
            )
            for batch in (1, 32):
                # free and constrained alternate, REPEATS times each: the median step of each is compared
                # (a ~1 ms host-bound step drifts by tens of percent within a minute on a shared host)
                runs: dict[bool, list[dict[str, Any]]] = {False: [], True: []}
                for _ in range(REPEATS):
                    for schema in (False, True):
                        runs[schema].append(run(llm, prompts[:batch], schema, spec is not None))
                for schema, each in runs.items():
                    key = f"{model}/{name}/b{batch}/{'schema' if schema else 'free'}"
                    res[key] = {
                        **each[0],
                        "ms_per_step": statistics.median(r["ms_per_step"] for r in each),
                        "ms_per_step_each": [r["ms_per_step"] for r in each],
                    }
                    print(key, res[key], flush=True)
            del llm
            gc.collect()
            torch.cuda.empty_cache()
    tmp.cleanup()
    a.out.mkdir(parents=True, exist_ok=True)
    stem = device.lower().replace(" ", "-") + "-structured-outputs"
    (a.out / f"{stem}.json").write_text(json.dumps(res, indent=1))
    lines = [
        f"# Structured outputs, {device}, CUDA graphs, one run (median step of {REPEATS} alternating runs)",
        "",
        f"Greedy, {NEW} new tokens per request, JSON schema {json.dumps(SCHEMA)} (xgrammar masks). demo: "
        "the shipped demo Qwen3.5 (its trained MTP head for acceptance); 9b: a random Qwen3.5-9B-shaped body "
        "with the demo's tokenizer and 6144-token vocabulary (random drafts: acceptance is not meaningful "
        "there).",
        "",
        "| model | engine | batch | free ms/step | schema ms/step | overhead | free acceptance "
        "(tokens/round) | schema acceptance (tokens/round) |",
        "| --- | --- | --- | --- | --- | --- | --- | --- |",
    ]
    for model, _ in models:
        for name in ("plain", "mtp"):
            for batch in (1, 32):
                f, s = res[f"{model}/{name}/b{batch}/free"], res[f"{model}/{name}/b{batch}/schema"]
                acc = ("-", "-")
                if "acceptance" in f and model == "demo":
                    acc = (
                        f"{f['acceptance']:.2f} ({f['mean_accept_length']:.2f})",
                        f"{s['acceptance']:.2f} ({s['mean_accept_length']:.2f})",
                    )
                over = s["ms_per_step"] / f["ms_per_step"] - 1
                lines.append(
                    f"| {model} | {name} | {batch} | {f['ms_per_step']:.2f} | {s['ms_per_step']:.2f} | "
                    f"{over:+.1%} | {acc[0]} | {acc[1]} |"
                )
    (a.out / f"{stem}.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
