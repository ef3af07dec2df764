"""Speculative rounds on the 9B shape at batch 1, 8 and 32: what a round costs and what the oracle gains.

    python tools/bench_round_9b.py --ckpt /tmp/ck9b --out result.json [--batches 1,8,32] [--sizes 32768]
        [--repeat 3] [--no-oracle] [--tree] [--runs mtp_s3,oracle_s3] [--profile 32]

Builds (or reuses) the 9B-shaped random checkpoint of `bench_decode.build_checkpoint` (vocabulary 248320,
hidden 4096: its lm_head is 2 GB of bf16, read by every MTP draft step), by default with decisive values
(greedy choices far from ties: its docstring; `--flat` for plain random values, whose rows part from the
oracle's references at bf16 near-ties at batch > 1), then times in one process, one engine per
configuration serving every batch size in turn:

- plain decoding;
- MTP S=3 (fixed length, no adaptive) with the whole vocabulary and with a draft vocabulary of each size in
  `--sizes` (`speculative_config.draft_vocab`; a seeded random subset: the cost does not depend on which).
  The random MTP head accepts nothing, so every step of these engines is a whole round (3 drafts, the verify
  of 4 tokens per row, commit) producing one token per row: its steady step time (every row decoding) is the
  round's cost, against the plain engine's steady step;
- with `--tree`, an MTP tree of the same depth (topk 2, 6 verify nodes), each step one tree round;
- the oracle (`bench_decode.oracle_registry`: every draft right, re-anchored on its own greedy output,
  `bench_decode.reanchored`), whose speed-up is its first-to-last-token decode rate against plain's.

With `--profile B`, every engine then runs 20 steady steps at batch B under torch.profiler: wall and kernel
time per step and the kernels with the most device time (`profile_steps`). Every figure is the median of
`--repeat` runs. Greedy agreement with the plain run of the same batch is
reported beside each (bf16 verify blocks and decode steps can part at near-ties on a random model; a plain
batch's first rows are also compared with the same prompts decoded alone, which shows how often the batch
shape alone flips a token); a draft vocabulary's run is also compared with the whole vocabulary's (the
random head accepts nothing with either: both verify the same blocks, so their outputs should be identical).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import statistics
import sys
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))

from bench_decode import (
    agreement,
    build_checkpoint,
    copy_bandwidth,
    free,
    hyspec_decode,
    make_llm,
    oracle_registry,
    reanchored,
)

PROMPT, NEW, S = 512, 128, 3


def share(a: Sequence[list[int]], b: Sequence[list[int]]) -> float:
    """Common-prefix tokens of paired outputs over all tokens of `b`."""
    return sum(agreement(x, y) for x, y in zip(a, b, strict=False)) / sum(len(y) for y in b[: len(a)])


def profile_steps(llm: Any, rows: Sequence[list[int]], steps: int = 20, host: bool = False) -> dict[str, Any]:
    """torch.profiler over `steps` engine steps once every row decodes: the wall and device (kernel) time per
    step, and the kernels with the most device time (per step). Wall well above device time: host-bound."""
    import time

    from hyspec_server import SamplingParams
    from torch.profiler import ProfilerActivity, profile

    engine = llm.engine
    params = SamplingParams(max_tokens=NEW, temperature=0, ignore_eos=True)
    for p in rows:
        engine.add_request(p, params)
    for _ in range(2 + -(-len(rows) * len(rows[0]) // 2048)):  # past the prefill (chunks of 2048 tokens)
        engine.step()
    torch.cuda.synchronize()
    host_top: list[str] = []
    if host:
        # where the host's time goes: cProfile's cumulative top (slows the host; device times not taken)
        import cProfile
        import io
        import pstats

        pr = cProfile.Profile()
        pr.enable()
        for _ in range(steps):
            engine.step()
        torch.cuda.synchronize()
        pr.disable()
        buf = io.StringIO()
        stats = pstats.Stats(pr, stream=buf)
        stats.sort_stats("cumulative").print_stats(45)
        stats.sort_stats("tottime").print_stats(45)  # self time: where the host's own work is
        stats.print_callees(r"graphs.py:\d+\(run\)")
        host_top = buf.getvalue().splitlines()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:  # CUDA only: least overhead on the host
        t0 = time.perf_counter()
        for _ in range(steps):
            engine.step()
        torch.cuda.synchronize()
        wall = time.perf_counter() - t0
    while engine.has_unfinished():
        engine.step()
    kernels = sorted(
        (
            (e.key, e.self_device_time_total, e.count)
            for e in prof.key_averages()
            if e.self_device_time_total > 0
        ),
        key=lambda k: -k[1],
    )
    return {
        "wall_ms_per_step": wall / steps * 1e3,
        "device_ms_per_step": sum(k[1] for k in kernels) / steps / 1e3,
        "top_kernels": [
            {"name": n[:120], "ms_per_step": t / steps / 1e3, "calls_per_step": c / steps}
            for n, t, c in kernels[:25]
        ],
        "host_profile": host_top,
    }


@contextlib.contextmanager
def commit_at_once(on: bool) -> Iterator[None]:
    """With `on`, engines built inside commit GDN states right after each verify (`gdn_replay`) instead of
    deferring to the next forward (`HybridBackend(defer_commit=True)`, what the runner builds): the other side
    of the comparison, in the same run."""
    import hyspec_runner.model_runner as mr

    built = mr.HybridBackend
    if on:
        mr.HybridBackend = lambda *args, **kw: built(*args, **{**kw, "defer_commit": False})  # type: ignore[misc]
    try:
        yield
    finally:
        mr.HybridBackend = built  # type: ignore[misc]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--ckpt", type=Path, required=True, help="checkpoint folder (built if it has none)")
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--batches", default="1,8,32")
    ap.add_argument("--sizes", default="32768", help="draft vocabulary sizes, comma-separated")
    ap.add_argument("--repeat", type=int, default=3, help="runs per engine and batch size (their median)")
    ap.add_argument("--no-oracle", action="store_true")
    ap.add_argument("--tree", action="store_true", help="also an MTP tree (topk 2, 6 nodes) of depth S")
    ap.add_argument("--runs", help="only these runs (comma-separated names), plain always included")
    ap.add_argument("--host-profile", action="store_true", help="with --profile: cProfile 20 steps too")
    ap.add_argument(
        "--at-once", action="store_true", help="also every speculative run committing at once (no deferral)"
    )
    ap.add_argument("--at-once-first", action="store_true", help="with --at-once: those runs first")
    ap.add_argument("--flat", action="store_true", help="a plain random checkpoint (default: decisive)")
    ap.add_argument(
        "--profile", type=int, help="also profile 20 steady steps of every run at this batch size"
    )
    ap.add_argument(
        "--max-num-batched-tokens",
        type=int,
        default=2048,
        help="every engine's step budget; at batch x prompt length every prompt prefills in one step, so the "
        "first-to-last-token window is decode only",
    )
    a = ap.parse_args()
    batches = [int(x) for x in a.batches.split(",")]
    if not (a.ckpt / "config.json").exists():
        hf, _ = build_checkpoint(a.ckpt, 32, decisive=not a.flat)
        free(hf)
    vocab = int(json.loads((a.ckpt / "config.json").read_text())["vocab_size"])
    g = torch.Generator().manual_seed(0)
    prompts = [torch.randint(0, vocab, (PROMPT,), generator=g).tolist() for _ in range(max(batches))]
    res: dict[str, Any] = {
        "device": torch.cuda.get_device_name(),
        "copy_bw_TBps": copy_bandwidth() / 1e12,
        "vocab_size": vocab,
        "checkpoint": "flat random" if a.flat else "decisive random (bench_decode.build_checkpoint)",
        "prompt_len": PROMPT,
        "new_tokens": NEW,
        "max_num_batched_tokens": a.max_num_batched_tokens,
        "runs": {},
    }
    refs: list[list[int]] = []  # the oracle's references, set per batch size (the registry reads this list)
    configs: list[tuple[str, dict[str, Any] | None, Callable[[], Any] | None]] = [
        ("plain", None, None),
        ("mtp_s3", {"method": "mtp"}, None),
    ]
    for k in (int(x) for x in a.sizes.split(",") if x):
        ids = torch.randperm(vocab, generator=torch.Generator().manual_seed(k))[:k].tolist()
        configs.append((f"mtp_s3_vocab{k}", {"method": "mtp", "draft_vocab": ids}, None))
    if a.tree:
        # a tree of depth S (topk 2, 6 verify nodes) against the chain: the random head accepts nothing here
        # either, so each step is one tree round
        tree = {"method": "mtp", "topk": 2, "num_draft_tokens": 6}
        configs.append(("mtp_tree_k2_d6", tree, None))
        for name, spec, _ in configs[2:]:
            if name.startswith("mtp_s3_vocab") and spec is not None:
                configs.append(
                    (f"mtp_tree_k2_d6_{name[7:]}", {**tree, "draft_vocab": spec["draft_vocab"]}, None)
                )
    if not a.no_oracle:
        configs.append(("oracle_s3", {"method": "ngram"}, lambda: oracle_registry(refs, S)))
    if a.at_once:
        at_once = [(f"{n}_at_once", spec, reg) for n, spec, reg in configs if spec is not None]
        # which side runs first is a choice (a GPU's speed drifts over a run): --at-once-first swaps them
        configs = [configs[0], *at_once, *configs[1:]] if a.at_once_first else [*configs, *at_once]
    if a.runs:
        keep = {"plain", *a.runs.split(",")}
        configs = [c for c in configs if c[0] in keep]
    outputs: dict[str, dict[int, list[list[int]]]] = {}
    for name, spec, registry in configs:
        if spec is not None:
            spec = {**spec, "num_speculative_tokens": S}
        with commit_at_once(name.endswith("_at_once")):
            llm = make_llm(
                a.ckpt,
                spec=spec,
                drafters=None if registry is None else registry(),
                max_num_seqs=max(batches),
                max_len=PROMPT + NEW + 16,
                max_num_batched_tokens=a.max_num_batched_tokens,
            )
        outputs[name] = {}
        for b in batches:
            rows = prompts[:b]
            reps: list[dict[str, Any]] = []
            if registry is not None:
                refs[:] = [p + t for p, t in zip(rows, outputs["plain"][b], strict=True)]
                reps.append(reanchored(llm, rows, NEW, refs, hyspec_decode(llm, rows, NEW)))
            reps += [hyspec_decode(llm, rows, NEW) for _ in range(a.repeat - len(reps))]
            # every row decodes one token per step in the steady window (a random MTP round accepts 0)
            steps = sorted(b / (x["steady_decode_tok_s"] or x["decode_tok_s"]) * 1e3 for x in reps)
            r = reps[-1]
            outputs[name][b] = r.pop("tokens")
            r["step_ms"], r["step_ms_each"] = statistics.median(steps), steps
            r["decode_tok_s_each"] = [x["decode_tok_s"] for x in reps]
            r["decode_tok_s"] = statistics.median(r["decode_tok_s_each"])
            if name == "plain":
                if b > 1:  # the numerics alone: the first rows decoded one by one against the batch's rows
                    alone = [hyspec_decode(llm, [p], NEW)["tokens"][0] for p in rows[:8]]
                    r["greedy_agreement_with_rows_alone"] = share(alone, outputs[name][b])
            else:
                r["greedy_agreement"] = share(outputs[name][b], outputs["plain"][b])
                if registry is not None:  # rows whose output is their reference's continuation
                    own = [p + t for p, t in zip(rows, outputs[name][b], strict=True)]
                    r["oracle_followed"] = sum(x == y for x, y in zip(own, refs, strict=True)) / b
                if name.startswith("mtp_s3_vocab") and "mtp_s3" in outputs:
                    r["greedy_agreement_with_mtp_s3"] = share(outputs[name][b], outputs["mtp_s3"][b])
            res["runs"][f"{name}/b{b}"] = r
            print(name, b, f"{r['step_ms']:.3f} ms", f"{r['decode_tok_s']:.1f} tok/s", flush=True)
        if a.profile:
            res.setdefault("profile", {})[name] = prof = profile_steps(
                llm, prompts[: a.profile], host=a.host_profile
            )
            print(name, "profile", json.dumps(prof, indent=1), flush=True)
        llm.close()
        free(llm)
    for b in batches:
        plain = res["runs"][f"plain/b{b}"]
        for name, _, _ in configs[1:]:
            r = res["runs"][f"{name}/b{b}"]
            r["step_vs_plain"] = r["step_ms"] / plain["step_ms"]
            r["speed_up"] = r["decode_tok_s"] / plain["decode_tok_s"]
    a.out.parent.mkdir(parents=True, exist_ok=True)
    a.out.write_text(json.dumps(res, indent=1))
    for key, r in res["runs"].items():
        print(
            key,
            f"step {r['step_ms']:.2f} ms ({r.get('step_vs_plain', 1.0):.3f}x plain)",
            f"speed-up {r.get('speed_up', 1.0):.3f}x",
            f"accept {r.get('mean_accept_length')}",
            f"agree {r.get('greedy_agreement')}",
            f"agree-alone {r.get('greedy_agreement_with_rows_alone')}",
            f"agree-mtp {r.get('greedy_agreement_with_mtp_s3')}",
            f"followed {r.get('oracle_followed')}",
        )


if __name__ == "__main__":
    main()
