"""Host-side profile of hyspec decode with and without MTP speculation on a GPU.

    python tools/profile_spec.py [--layers 8] [--new 64] [--mode torch|cprofile]

Builds the same random Qwen3.5-9B-wide checkpoint as bench_decode.py (fewer layers) and prints, per run,
tokens/s and where the time goes: with `--mode torch` (default) torch.profiler's CPU-side operators and CUDA
API calls (how many host-device syncs and copies a step makes, and the GPU's busy time against the wall);
with `--mode cprofile` the Python functions with the most cumulative and own time; with `--mode syncs` every
host-device synchronisation (torch's sync debug mode), counted by the hyspec source line that caused it; with
`--mode phases` the wall time of each phase of a step (GPU work included: every phase ends with a sync), with
`--mode walls` the same without the syncs (what the host spends in each phase, its waits included); with
`--mode steps` the wall time of every engine step (no added syncs), split into steps that drafted, that ran
a draft extend, and plain ones, plus the host time between steps. Several modes: `--mode steps,torch`.
"""

from __future__ import annotations

import argparse
import cProfile
import pstats
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).parent))
from bench_decode import build_checkpoint, free, make_llm, oracle_registry

RUNS: list[tuple[str, dict[str, Any] | None]] = [
    ("plain", None),
    ("mtp", {"method": "mtp", "num_speculative_tokens": 3}),
    ("mtp_adaptive", {"method": "mtp", "num_speculative_tokens": 3, "adaptive": True}),
    ("mtp_tree", {"method": "mtp", "num_speculative_tokens": 3, "topk": 2, "num_draft_tokens": 6}),
    # every draft right: the plain run's own continuation (bench_decode.oracle_registry)
    ("oracle", {"method": "ngram", "num_speculative_tokens": 3}),
]
DEMO = Path(__file__).resolve().parent.parent / "packages/server/src/hyspec_server/demo_models/qwen3_5"


def torch_profile(run: Any, top: int) -> None:
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        t = time.perf_counter()
        run()
        wall = time.perf_counter() - t
    events = prof.key_averages()
    gpu_us = sum(e.self_device_time_total for e in events if e.device_type.name == "CUDA")
    print(f"   wall {wall * 1e3:.1f} ms, GPU kernels busy {gpu_us / 1e3:.1f} ms")
    api = [e for e in events if e.key.startswith("cuda")]
    for e in sorted(api, key=lambda e: -e.self_cpu_time_total)[:8]:
        print(f"   {e.key:40s} calls {e.count:6d}  host {e.self_cpu_time_total / 1e3:8.1f} ms")
    kernels = [e for e in events if e.device_type.name == "CUDA"]
    print(f"   {'top GPU kernels by device time':40s}")
    for e in sorted(kernels, key=lambda e: -e.self_device_time_total)[:top]:
        name = e.key if len(e.key) <= 60 else e.key[:57] + "..."
        print(f"   {name:60s} calls {e.count:6d}  {e.self_device_time_total / 1e3:8.1f} ms")
    ops = [e for e in events if e.device_type.name == "CPU" and not e.key.startswith("cuda")]
    print(f"   {'top CPU ops by self time':40s}")
    for e in sorted(ops, key=lambda e: -e.self_cpu_time_total)[:top]:
        print(f"   {e.key:40s} calls {e.count:6d}  self {e.self_cpu_time_total / 1e3:8.1f} ms")


def sync_sites(run: Any, top: int) -> None:
    """Count synchronising CUDA calls by the innermost hyspec frame that made them."""
    import collections
    import traceback
    import warnings

    sites: collections.Counter[str] = collections.Counter()

    def record(*args: Any, **kwargs: Any) -> None:
        frames = [f for f in traceback.extract_stack()[:-1] if "/packages/" in f.filename]
        site = "?" if not frames else f"{frames[-1].filename.split('/src/')[-1]}:{frames[-1].lineno}"
        sites[site] += 1

    with warnings.catch_warnings():
        warnings.simplefilter("always")
        warnings.showwarning = record
        torch.cuda.set_sync_debug_mode("warn")
        try:
            run()
        finally:
            torch.cuda.set_sync_debug_mode("default")
    print(f"   {sum(sites.values())} synchronising calls")
    for site, n in sites.most_common(top):
        print(f"   {n:6d}  {site}")


def phases(llm: Any, run: Any, *, sync: bool) -> None:
    """Per-phase wall times (ms per call); with `sync` each phase is closed by a device sync so its GPU work
    counts, without it the times are what the host spends in each phase (waits for the device included)."""
    import collections

    totals: dict[str, float] = collections.defaultdict(float)
    calls: collections.Counter[str] = collections.Counter()
    each: collections.defaultdict[str, list[float]] = collections.defaultdict(list)
    engine = llm.engine
    runner = engine.runner
    targets: list[tuple[str, Any, str]] = [
        ("engine.step", engine, "step"),
        ("  schedule", engine.scheduler, "schedule"),
        ("    memory.grow", engine.scheduler.memory, "grow"),
        ("  execute", runner, "execute"),
        ("  finish", engine.scheduler, "finish"),
        ("plain.run", runner.plain, "run"),
        ("  prepare_decode", runner.graphs, "prepare_decode"),
        ("  graphs.run", runner.graphs, "run"),
        ("  compute_logits", runner.model, "compute_logits"),
        ("  ahead.build", runner.ahead, "build"),
        ("  ahead.take", runner.ahead, "take"),
        ("engine._append", engine, "_append"),
        ("engine._append_verified", engine, "_append_verified"),
    ]
    spec = getattr(runner, "spec", None)
    if spec is not None:
        targets += [
            ("spec.run", spec, "run"),
            ("  draft_lengths", spec, "draft_lengths"),
            ("  feed_forward", spec, "feed_forward"),
            ("propose", spec.drafter, "propose"),
        ]
        if spec.feed is not None:
            targets.append(("draft extend (flush)", spec.feed, "flush"))
        import hyspec_spec_workers.round as round_mod
        import hyspec_spec_workers.round_verify as verify_mod
        import hyspec_spec_workers.tree as tree_mod

        targets += [
            ("verify+commit", round_mod, "verify_round"),
            ("  forward_verify", runner, "forward_verify"),
            ("    graphs.prepare_verify", runner.graphs, "prepare_verify"),
            ("  verify logits", runner, "compute_logits"),
            ("  greedy_tail_result", verify_mod, "greedy_tail_result"),
            ("  choose_tokens", verify_mod, "choose_tokens"),
            ("  commit_after_verify", runner, "commit_after_verify"),
            ("  accepted_path", verify_mod, "accepted_path"),
            ("  to_verified", verify_mod, "to_verified"),
            ("  _propose_after", verify_mod, "_propose_after"),
            ("  trim_draft", round_mod, "trim_draft"),
            ("  decode (no drafts)", runner, "decode"),
        ]
        drafter = spec.drafter
        tree = getattr(drafter, "tree", None)
        if tree is not None and getattr(drafter, "topk", 1) > 1:
            # a tree proposal: the general path's steps, or over one layer one forward (`draft_tree_one.py`)
            targets += [
                ("  tree.draft (steps)", tree, "draft"),
                ("    tree prepare_verify", tree.graphs, "prepare_verify"),
                ("    tree graphs.run", tree.graphs, "run"),
                ("  VerifyTree.from_parents", tree_mod.VerifyTree, "from_parents"),
            ]
        # the one-forward proposal of a one-layer chain (`draft_chain.py`) or tree (`draft_tree_one.py`): one
        # batch build and one graph run per round, the next one queued right after a greedy verify
        one = getattr(drafter, "chain", None) or getattr(drafter, "one_tree", None)
        if one is not None:
            name = "chain" if one is getattr(drafter, "chain", None) else "one_tree"
            fresh = "draft" if name == "chain" else "draft_tree"
            targets += [
                (f"  {name}.{fresh}", one, fresh),
                ("  feed.chain_after_verify", spec.feed, "chain_after_verify"),
                (f"  {name}.draft_after_verify", one, "draft_after_verify"),
                ("  after.settle", one.after, "settle"),
                ("  after.take", one.after, "take"),
                ("    ensure_kv_capacity", drafter.kv.pool, "ensure_kv_capacity"),
                ("  draft commit (feed)", drafter, "commit"),
            ]
            for s, r in one.runners.items():
                targets += [
                    (f"    prepare_verify (s={s})", r, "prepare_verify"),
                    (f"    run (s={s})", r, "run"),
                ]

    def timed(name: str, fn: Any) -> Any:
        def wrapper(*args: Any, **kwargs: Any) -> Any:
            if sync:
                torch.cuda.synchronize()
            t = time.perf_counter()
            out = fn(*args, **kwargs)
            if sync:
                torch.cuda.synchronize()
            took = time.perf_counter() - t
            totals[name] += took
            calls[name] += 1
            each[name].append(took)
            return out

        return wrapper

    saved = [(obj, attr, getattr(obj, attr)) for _, obj, attr in targets]
    for name, obj, attr in targets:
        setattr(obj, attr, timed(name, getattr(obj, attr)))
    # the round's one device read: queued (PendingRound.__init__: of the outcome the greedy tail packed, or
    # of what HostRound.start packs), then waited for (PendingRound.wait, its wait for the verify's GPU work
    # included)
    from hyspec_spec_workers.choose import PendingRound

    init, wait = PendingRound.__init__, PendingRound.wait
    PendingRound.__init__ = timed("  PendingRound.__init__", PendingRound.__init__)  # type: ignore[method-assign]
    PendingRound.wait = timed("  PendingRound.wait", PendingRound.wait)  # type: ignore[method-assign]
    try:
        run()
    finally:
        PendingRound.__init__, PendingRound.wait = init, wait  # type: ignore[method-assign]
        for obj, attr, fn in reversed(saved):
            setattr(obj, attr, fn)
    for name in [t[0] for t in targets] + ["  PendingRound.__init__", "  PendingRound.wait"]:
        if calls[name]:
            med = sorted(each[name])[len(each[name]) // 2]
            print(
                f"   {name:24s} calls {calls[name]:5d}  {1e3 * totals[name] / calls[name]:8.3f} ms/call"
                f"  median {1e3 * med:8.3f} ms"
            )


def step_times(llm: Any, run: Any) -> None:
    """Wall time of every engine step as the user sees it (no syncs added), by what the step did."""
    import statistics

    engine = llm.engine
    spec = getattr(engine.runner, "spec", None)
    rows: list[tuple[str, float]] = []
    gaps: list[float] = []
    last_end = [0.0]
    step = engine.step
    feed = None if spec is None else spec.feed
    flush = None if feed is None else feed.flush
    flushed = [0]

    def counted_flush(req_ids: Any) -> int:
        assert flush is not None
        out: int = flush(req_ids)
        flushed[0] += 1
        return out

    def timed_step() -> Any:
        drafts0, flushes0 = engine.stats.spec_num_drafts, flushed[0]
        t = time.perf_counter()
        if last_end[0]:
            gaps.append(t - last_end[0])
        out = step()
        last_end[0] = time.perf_counter()
        kind = "drafted" if engine.stats.spec_num_drafts > drafts0 else "plain"
        if flushed[0] > flushes0:
            kind += "+extend"
        rows.append((kind, last_end[0] - t))
        return out

    engine.step = timed_step
    if feed is not None:
        feed.flush = counted_flush
    try:
        run()
    finally:
        del engine.step
        if feed is not None:
            del feed.flush
    total = sum(t for _, t in rows) + sum(gaps)
    print(f"   {len(rows)} steps, {1e3 * total:.1f} ms in steps and between them")
    for kind in sorted({k for k, _ in rows}):
        ts = sorted(t for k, t in rows if k == kind)
        med, mean, p90 = statistics.median(ts), statistics.mean(ts), ts[int(0.9 * (len(ts) - 1))]
        print(
            f"   {kind:16s} n {len(ts):4d}  sum {1e3 * sum(ts):8.1f} ms"
            f"  median {1e3 * med:7.3f}  mean {1e3 * mean:7.3f}  p90 {1e3 * p90:7.3f} ms"
        )
    if gaps:
        print(
            f"   between steps    n {len(gaps):4d}  sum {1e3 * sum(gaps):8.1f} ms  median "
            f"{1e3 * statistics.median(gaps):7.3f} ms"
        )


MODES = ("torch", "cprofile", "syncs", "phases", "walls", "steps")


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--new", type=int, default=64)
    ap.add_argument("--top", type=int, default=25)
    ap.add_argument("--batch", type=int, default=1, help="prompts decoded together")
    ap.add_argument("--prompt", type=int, default=64, help="prompt tokens (random ids, one prompt per row)")
    ap.add_argument("--mode", default="torch", help=f"one or more of {', '.join(MODES)}, comma-separated")
    ap.add_argument(
        "--no-ahead", action="store_true", help="prepare each decode batch in its own step (decode_ahead.py)"
    )
    ap.add_argument(
        "--probe-every",
        type=int,
        default=0,
        help="speculative runs: draft 1 token every K-th round and none in the others (probe rounds)",
    )
    ap.add_argument("--demo", action="store_true", help="the shipped demo Qwen3.5 instead of a 9B-wide model")
    ap.add_argument("--only", default=None, help="runs to make in this order, comma-separated (default: all)")
    ap.add_argument(
        "--dump", type=Path, default=None, help="cprofile mode: also write <dump>/<run>-b<batch>.prof"
    )
    a = ap.parse_args()
    a.modes = a.mode.split(",")
    if not set(a.modes) <= set(MODES):
        ap.error(f"--mode: expected some of {MODES}, got {a.mode!r}")
    if a.demo:
        profile(DEMO, a)
        return
    with tempfile.TemporaryDirectory(prefix="hyspec-profile-") as tmp:  # a 9B-wide checkpoint: tens of GB
        profile(Path(tmp) / "ckpt", a)


def _every(k: int) -> Any:
    """Draft lengths that draft one token in every k-th round and none in the others."""
    rounds = [0]

    def lengths(rows: Any) -> list[int]:
        rounds[0] += 1
        return [1 if rounds[0] % k == 0 else 0 for _ in rows]

    return lengths


def profile(ckpt: Path, a: argparse.Namespace) -> None:
    from hyspec_server import SamplingParams

    if a.demo:
        import json

        vocab = int(json.loads((ckpt / "config.json").read_text()).get("vocab_size", 0) or 0)
        vocab = vocab or int(json.loads((ckpt / "config.json").read_text())["text_config"]["vocab_size"])
    else:
        model, _ = build_checkpoint(ckpt, a.layers)
        vocab = int(model.config.vocab_size)
        free(model)
    g = torch.Generator().manual_seed(0)
    prompts = [
        {"prompt_token_ids": torch.randint(0, vocab, (a.prompt,), generator=g).tolist()}
        for _ in range(a.batch)
    ]
    known = dict(RUNS)
    names = [name for name, _ in RUNS] if a.only is None else a.only.split(",")
    for name in names:
        if name not in known:
            raise SystemExit(f"--only: expected names from {sorted(known)}, got {name!r}")
        spec = known[name]
        sp = SamplingParams(max_tokens=a.new, temperature=0, ignore_eos=True)
        max_len = a.prompt + a.new + 16
        drafters = None
        if name == "oracle":
            plain = make_llm(ckpt, spec=None, max_num_seqs=max(8, a.batch), max_len=max_len)
            outs = plain.generate(prompts, sp)
            pairs = zip(prompts, outs, strict=True)
            refs = [p["prompt_token_ids"] + o.outputs[0].token_ids for p, o in pairs]
            free(plain)
            drafters = oracle_registry(refs, 3)
        llm = make_llm(ckpt, spec=spec, drafters=drafters, max_num_seqs=max(8, a.batch), max_len=max_len)
        llm.engine.runner.ahead.enabled = not a.no_ahead
        spec_decoder = getattr(llm.engine.runner, "spec", None)
        if a.probe_every and spec_decoder is not None:
            spec_decoder.draft_lengths = _every(a.probe_every)

        def run() -> None:
            llm.generate(prompts, sp)  # noqa: B023 (called within the iteration)
            torch.cuda.synchronize()

        run()
        t = time.perf_counter()
        run()
        print(f"== {name}: {a.batch * a.new / (time.perf_counter() - t):.1f} tok/s (prefill included)")
        for mode in a.modes:
            print(f"-- {name}, {mode}")
            if mode == "torch":
                torch_profile(run, a.top)
            elif mode in ("phases", "walls"):
                phases(llm, run, sync=mode == "phases")
            elif mode == "syncs":
                sync_sites(run, a.top)
            elif mode == "steps":
                step_times(llm, run)
            else:
                pr = cProfile.Profile()
                pr.enable()
                run()
                pr.disable()
                st = pstats.Stats(pr)
                if a.dump is not None:
                    a.dump.mkdir(parents=True, exist_ok=True)
                    st.dump_stats(str(a.dump / f"{name}-b{a.batch}.prof"))
                st.sort_stats("cumulative").print_stats(a.top)
                st.sort_stats("tottime").print_stats(a.top)
        free(llm)


if __name__ == "__main__":
    main()
