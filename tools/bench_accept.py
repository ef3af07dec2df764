"""Host cost of choosing a verify round's outcome: the torch composition against the one-launch walk.

    python tools/bench_accept.py --out benchmarks/results

A speculative round on a small or fast model is bound by host time (launches and Python), not by the GPU.
This times, in one process on one GPU, the round's outcome for greedy rows both ways: `verify_greedy` then
`truncate_at_stop` (some fifty small torch ops) and `hyspec_kernels.accept_walk` (one Triton launch), with
the stop ids and budgets coming from the host as the round passes them. Per call: the wall time of 2000
back-to-back calls / 2000 (the device keeps up, so this is the host's cost). Writes
`<out>/<device>-accept-walk-micro.md` and `.json`.
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path
from typing import Any

import torch
from hyspec_kernels.accept import accept_walk
from hyspec_spec_workers import VerifyTree, truncate_at_stop, verify_greedy
from hyspec_statepool.transfer import to_device

CALLS = 2000


def per_call_ms(fn: Any) -> float:
    for _ in range(50):
        fn()
    torch.cuda.synchronize()
    t = time.perf_counter()
    for _ in range(CALLS):
        fn()
    torch.cuda.synchronize()
    return (time.perf_counter() - t) / CALLS * 1e3


def case(n: int, d: int, tree: bool) -> dict[str, Any]:
    g = torch.Generator().manual_seed(n * 100 + d)
    dev = torch.device("cuda")
    if tree:
        parents = torch.full((n, d), -1)
        for j in range(1, d):
            parents[:, j] = torch.randint(0, j, (n,), generator=g)
        blocks = VerifyTree.from_parents(
            torch.randint(0, 8, (n, d), generator=g), parents, torch.full((n,), d)
        )
    else:
        blocks = VerifyTree.chain(
            torch.randint(0, 8, (n,), generator=g), torch.randint(0, 8, (n, d - 1), generator=g)
        )
    blocks = blocks.to(dev)
    pred = torch.randint(0, 8, (n, d), generator=g).to(dev)
    stops = torch.tensor([[2, -1]] * n, dtype=torch.int64)  # host, as the round builds them
    budget = torch.full((n,), 100, dtype=torch.int64)

    def old() -> Any:
        return truncate_at_stop(verify_greedy(blocks, pred), stop_token_ids=stops, max_new_tokens=budget)

    def new() -> Any:
        return accept_walk(
            choice=pred,
            tokens=blocks.tokens,
            first_child=blocks.first_child,
            next_sibling=blocks.next_sibling,
            stop_ids=to_device(stops, dtype=torch.int64, device=dev),
            budget=to_device(budget, dtype=torch.int64, device=dev),
        )

    a, b = old(), new()
    same = all(
        torch.equal(getattr(a, f), getattr(b, f))
        for f in ("num_accepted", "accept_index", "output_tokens", "bonus", "commit_steps", "finished")
    )
    t_old, t_new = per_call_ms(old), per_call_ms(new)
    return {"n": n, "d": d, "tree": tree, "torch_ms": t_old, "accept_walk_ms": t_new, "same": same}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", type=Path, default=Path("benchmarks/results"))
    a = ap.parse_args()
    rows = [case(n, d, tree) for tree, d in ((False, 4), (True, 8)) for n in (1, 8, 32, 128)]
    dev = torch.cuda.get_device_name()
    lines = [
        f"# Choosing a round's outcome on the host: torch ops vs one launch ({dev})",
        "",
        f"torch {torch.__version__}; `tools/bench_accept.py`; ms per call = wall time of {CALLS} "
        "back-to-back calls / calls (host-bound: the device keeps up). 'torch' = `verify_greedy` + "
        "`truncate_at_stop`; "
        "'accept_walk' = the one-launch kernel the round uses now, stop ids and budgets copied from the host "
        "in both. 'same' = every output field equal.",
        "",
        "| block | N | D | torch ms | accept_walk ms | speed-up | same |",
        "| --- | --- | --- | --- | --- | --- | --- |",
    ]
    for r in rows:
        kind = "tree" if r["tree"] else "chain"
        lines.append(
            f"| {kind} | {r['n']} | {r['d']} | {r['torch_ms']:.3f} | {r['accept_walk_ms']:.3f} | "
            f"{r['torch_ms'] / r['accept_walk_ms']:.1f}x | {r['same']} |"
        )
    a.out.mkdir(parents=True, exist_ok=True)
    name = dev.lower().replace(" ", "-")
    (a.out / f"{name}-accept-walk-micro.md").write_text("\n".join(lines) + "\n")
    (a.out / f"{name}-accept-walk-micro.json").write_text(json.dumps({"device": dev, "rows": rows}, indent=1))
    print("\n".join(lines))


if __name__ == "__main__":
    main()
