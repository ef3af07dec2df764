"""Acceptance of seeded (keyed-draw verification) against unseeded (rejection sampling) speculation.

The embedded demo model with its MTP drafter, code prompts, sampled at a few temperatures: the same requests
once with a seed each (verified by the target's keyed draw at every node: output identical to plain
decoding) and once without (exact rejection sampling). Deterministic drafts should be accepted equally often
both ways (a draft d is kept with probability p(d)); the table shows whether they are.

Results: benchmarks/results/<device>-seeded-acceptance.md
"""

from __future__ import annotations

import argparse
from pathlib import Path

import torch
from hyspec_server import LLM, SamplingParams

PROMPTS = [
    "def fibonacci(n):",
    "import os\n\n\ndef list_files(path):",
    "class Stack:\n    def __init__(self):",
    "def parse_args():\n    parser = argparse.ArgumentParser(",
    "def read_json(path):\n    with open(path) as f:",
    "def merge_sort(items):",
    "for i in range(10):",
    "def main():\n    args = parse_args()",
]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--device", default="auto")
    p.add_argument("--max-tokens", type=int, default=96)
    p.add_argument("--repeats", type=int, default=4, help="seeds (and unseeded runs) per prompt")
    p.add_argument("--out", type=Path, default=Path("benchmarks/results"))
    a = p.parse_args()
    llm = LLM(device=a.device, max_num_seqs=len(PROMPTS) * a.repeats)
    device = llm.engine.runner.device  # type: ignore[attr-defined]
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"
    rows = []
    for temp in (0.3, 0.7, 1.0):
        line = [f"| {temp} |"]
        for seeded in (True, False):
            params = [
                SamplingParams(
                    max_tokens=a.max_tokens,
                    temperature=temp,
                    ignore_eos=True,
                    seed=(1000 * r + i) if seeded else None,
                )
                for r in range(a.repeats)
                for i in range(len(PROMPTS))
            ]
            outs = llm.generate(PROMPTS * a.repeats, params, use_tqdm=False)
            drafted = sum(o.spec_stats.num_draft_tokens for o in outs if o.spec_stats)
            accepted = sum(o.spec_stats.num_accepted_tokens for o in outs if o.spec_stats)
            rounds = sum(o.spec_stats.num_drafts for o in outs if o.spec_stats)
            line.append(f" {accepted / max(1, drafted):.3f} | {(accepted + rounds) / max(1, rounds):.2f} |")
        rows.append("".join(line))
    text = "\n".join(
        [
            f"# Seeded (keyed draws) vs unseeded (rejection sampling) speculation ({name})",
            "",
            f"Demo qwen3_5 + MTP (3 drafts), {len(PROMPTS)} code prompts x {a.repeats}, {a.max_tokens} "
            "tokens each (ignore_eos). Acceptance = accepted / drafted; tokens per round = "
            "(accepted + rounds) / rounds.",
            "",
            "| temperature | seeded acceptance | seeded tokens/round | unseeded acceptance | "
            "unseeded tokens/round |",
            "|---|---|---|---|---|",
            *rows,
        ]
    )
    a.out.mkdir(parents=True, exist_ok=True)
    slug = name.lower().replace(" ", "-")
    (a.out / f"{slug}-seeded-acceptance.md").write_text(text + "\n")
    print(text)


if __name__ == "__main__":
    main()
