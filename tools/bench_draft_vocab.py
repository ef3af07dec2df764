"""What a draft vocabulary costs in acceptance: the demo models' drafters with the K most frequent tokens.

    python tools/bench_draft_vocab.py --out benchmarks/results [--device cpu] [--sizes 4096,2048,1024,512]

The shipped demo Qwen3.5 (vocabulary 6144) with its trained drafters (MTP, EAGLE-3 and DFlash, all three
over the target's lm_head). A draft vocabulary of each size is counted the way `hyspec draft-vocab` counts
(`draft_vocab_cli.count_tokens` / `draft_vocab_ids`) over the demo corpus's training split; greedy, S=3,
`--prompts` validation-split prompts of `--prompt-tokens` tokens (`bench_demo.corpus_prompts`), `--new`
tokens each, all prompts in one batch. Reports per drafter and size the mean tokens per round, the share of
drafts accepted and the share of the plain output's tokens the vocabulary holds; every output must equal
the plain one (lossless). Acceptance does not depend on the device beyond bf16 near-ties (`--device cpu`
runs fp32). Writes `<device>-draft-vocab-acceptance.md` and `.json` into `--out`.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

DEMO = ROOT / "packages/server/src/hyspec_server/demo_models"
DRAFTERS: dict[str, dict[str, Any]] = {
    "mtp": {"method": "mtp"},
    "eagle3": {"method": "eagle3", "model": str(DEMO / "qwen3_5-eagle3")},
    "dflash": {"method": "dflash", "model": str(DEMO / "qwen3_5-dflash")},
}


def main() -> None:
    import torch
    from hyspec_runner.config import EngineArgs
    from hyspec_server import LLM, SamplingParams
    from hyspec_server.builder import build_engine
    from hyspec_server.draft_vocab_cli import count_tokens, draft_vocab_ids
    from hyspec_server.tokenizer import HFTokenizer

    from tools.bench_demo import corpus_prompts
    from tools.demo import corpus

    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", type=Path, default=ROOT / "benchmarks/results")
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--sizes", default="4096,2048,1024,512")
    ap.add_argument("--prompts", type=int, default=16)
    ap.add_argument("--prompt-tokens", type=int, default=128)
    ap.add_argument("--new", type=int, default=128)
    ap.add_argument("--count-files", type=int, default=4000, help="training files counted (evenly spaced)")
    a = ap.parse_args()
    target = DEMO / "qwen3_5"
    tok = HFTokenizer(target)
    vocab_size = int(json.loads((target / "config.json").read_text())["vocab_size"])
    train, _ = corpus.split_sources(corpus.list_sources())
    step = max(1, len(train) // a.count_files)
    t0 = time.perf_counter()
    counts = count_tokens(tok, [f.path for f in train[::step][: a.count_files]])
    count_s = time.perf_counter() - t0
    prompts = corpus_prompts(tok.hf_tokenizer, a.prompts, a.prompt_tokens)
    items = [{"prompt_token_ids": p} for p in prompts]
    params = SamplingParams(max_tokens=a.new, temperature=0, ignore_eos=True)
    max_len = max(len(p) for p in prompts) + a.new + 16

    def run(spec: dict[str, Any] | None) -> tuple[list[list[int]], dict[str, float]]:
        args = EngineArgs(
            model=str(target),
            device=a.device,
            dtype="bfloat16" if a.device == "cuda" else "float32",
            max_model_len=max_len,
            max_num_seqs=len(prompts),
            speculative_config=spec,
        )
        llm = LLM.from_engine(build_engine(args))
        outs = llm.generate(items, params)
        llm.close()
        stats = [o.spec_stats for o in outs if o.spec_stats is not None]
        drafts = sum(s.num_drafts for s in stats)
        draft_tokens = sum(s.num_draft_tokens for s in stats)
        accepted = sum(s.num_accepted_tokens for s in stats)
        return [list(o.outputs[0].token_ids) for o in outs], {
            "tokens_per_round": 1 + accepted / drafts if drafts else 0.0,
            "accepted_share": accepted / draft_tokens if draft_tokens else 0.0,
            "rounds": drafts,
        }

    plain, _ = run(None)
    res: dict[str, Any] = {
        "device": torch.cuda.get_device_name() if a.device == "cuda" else "cpu",
        "vocab_size": vocab_size,
        "prompts": len(prompts),
        "prompt_tokens": a.prompt_tokens,
        "new_tokens": a.new,
        "counted_files": len(train[::step][: a.count_files]),
        "counted_tokens": sum(counts.values()),
        "count_s": count_s,
        "runs": {},
    }
    out_tokens = [t for row in plain for t in row]
    sizes = [None, *(int(x) for x in a.sizes.split(","))]
    for name, base in DRAFTERS.items():
        for k in sizes:
            spec = {**base, "num_speculative_tokens": 3}
            row: dict[str, Any] = {"size": vocab_size if k is None else k}
            if k is not None:
                ids, _ = draft_vocab_ids(tok, counts, k)
                spec["draft_vocab"] = ids
                kept = set(ids)
                row["ids"] = len(ids)
                row["output_coverage"] = sum(t in kept for t in out_tokens) / len(out_tokens)
            got, stats = run(spec)
            row |= stats
            row["lossless"] = got == plain
            res["runs"][f"{name}/{row['size']}"] = row
            print(name, row, flush=True)
    a.out.mkdir(parents=True, exist_ok=True)
    stem = a.out / f"{res['device'].lower().replace(' ', '-')}-draft-vocab-acceptance"
    stem.with_suffix(".json").write_text(json.dumps(res, indent=1))
    lines = [
        f"# Draft vocabularies on the demo models' drafters: acceptance ({res['device']})",
        "",
        f"`tools/bench_draft_vocab.py`: the demo Qwen3.5 (vocabulary {vocab_size}), greedy, S=3, "
        f"{len(prompts)} validation prompts of {a.prompt_tokens} tokens in one batch, {a.new} new tokens "
        f"each. Draft vocabularies: the K most frequent tokens of {res['counted_files']} training-split "
        f"files ({res['counted_tokens']} tokens) plus the special ones. Coverage: share of the plain "
        "output's tokens in the vocabulary.",
        "",
        "| drafter | K | tokens per round | drafts accepted | output coverage | output = plain |",
        "|---|---|---|---|---|---|",
    ]
    for key, r in res["runs"].items():
        cov = f"{r['output_coverage']:.3f}" if "output_coverage" in r else "1 (whole)"
        lines.append(
            f"| {key.split('/')[0]} | {r['size']} | {r['tokens_per_round']:.2f} | {r['accepted_share']:.3f} "
            f"| {cov} | {r['lossless']} |"
        )
    stem.with_suffix(".md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
