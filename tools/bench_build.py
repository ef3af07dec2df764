"""Host cost of building batch metadata (`HybridBackend.prepare_*`), on CUDA.

    PYTHONPATH=$(ls -d packages/*/src | paste -sd:) python tools/bench_build.py [--iters 100]

For each batch kind (DECODE and chain / tree TARGET_VERIFY padded to a graph size, a chain verify batch moved
on from the last round's instead of built, `move_batches`, a ragged EXTEND) prints:
the host time of one build (builds queued back to back, as in serving; the median over rounds of their mean),
the device operations one build queues (kernel launches, copies and memsets, counted by the profiler's CUDA
runtime events), and whether the build runs under `torch.cuda.set_sync_debug_mode("error")` (it raises on
any device-to-host synchronisation). The pool's layers are tiny: only the metadata matters. Host times on a
shared machine vary by tens of percent between runs: compare versions within one run, alternating.
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Callable

import torch
from hyspec_attn_backends import AttentionLayer, ForwardBatch, GDNLayer, HybridBackend, model_state_specs
from hyspec_statepool import DraftShape, HybridStatePool, MemoryPlan, StateDtypes

LAYERS = [
    GDNLayer(layer_id=0, num_k_heads=1, num_v_heads=1, head_k_dim=16, head_v_dim=16, conv_width=4),
    AttentionLayer(layer_id=1, num_heads=1, num_kv_heads=1, head_dim=16, scale=0.25),
]
TYPES = ["linear_attention", "full_attention"]
# CUDA runtime / driver calls that queue work on the device
DEVICE_OPS = ("cudaLaunchKernel", "cuLaunchKernel", "cudaMemcpyAsync", "cudaMemsetAsync", "cudaMemcpy2DAsync")


def _backend(
    max_num_seqs: int, page_size: int, max_model_len: int, d: int, *, move_batches: bool = False
) -> HybridBackend:
    plan = MemoryPlan(
        specs=model_state_specs(LAYERS),
        max_model_len=max_model_len,
        max_num_seqs=max_num_seqs,
        draft_shape=DraftShape(kind="chain", num_steps=d - 1),
        page_size=page_size,
        num_state_slots=max_num_seqs,
        num_kv_pages=max_num_seqs * (-(-(max_model_len + d) // page_size)),
        dtypes=StateDtypes(kv=torch.bfloat16, conv=torch.bfloat16),
    )
    pool = HybridStatePool(plan, device="cuda")
    return HybridBackend(pool, layers=LAYERS, layer_types=TYPES, move_batches=move_batches)


def _count_ops(build: Callable[[], ForwardBatch]) -> int:
    from torch.profiler import ProfilerActivity, profile

    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        build()
        torch.cuda.synchronize()
    return sum(1 for e in prof.events() if any(e.name.startswith(op) for op in DEVICE_OPS))


def _sync_free(build: Callable[[], ForwardBatch]) -> bool:
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        build()
        return True
    except RuntimeError:
        return False
    finally:
        torch.cuda.set_sync_debug_mode("default")


def _time_us(build: Callable[[], ForwardBatch], iters: int, rounds: int = 7) -> float:
    """Median over rounds of the mean host time of `iters` builds queued back to back (as in serving: the
    device runs while the host builds), the stream synchronised between rounds, outside the timing."""
    per_round = []
    for _ in range(rounds):
        torch.cuda.synchronize()
        t = time.perf_counter()
        for _ in range(iters):
            build()
        per_round.append((time.perf_counter() - t) / iters)
    torch.cuda.synchronize()
    return statistics.median(per_round) * 1e6


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--iters", type=int, default=100)
    ap.add_argument("--page-size", type=int, default=16)
    ap.add_argument("--max-context", type=int, default=8192)
    args = ap.parse_args()
    d = 4
    rows = []
    for n, pad in ((1, 1), (8, 8), (48, 64)):
        be = _backend(64, args.page_size, args.max_model_len, d)
        pool = be.pool
        ids = [f"r{i}" for i in range(n)]
        pool.alloc_detached_slots(1)  # state slots != request rows
        pool.alloc(ids)
        prefix = [700 + 37 * i for i in range(n)]
        pool.ensure_kv_capacity(ids, [p + d for p in prefix])
        req_rows = pool.req_rows(ids)
        host_tokens = torch.arange(n, dtype=torch.int64)
        dev_block = torch.ones(n, d, dtype=torch.int64, device="cuda")
        host_parents = torch.tensor([[-1, 0, 0, 1]] * n, dtype=torch.int32)
        cases: dict[str, Callable[[], ForwardBatch]] = {
            "decode": lambda: be.prepare_decode(
                req_rows=req_rows, input_ids=host_tokens, prefix_lens=prefix, pad_to=pad
            ),
            "verify chain": lambda: be.prepare_verify(
                req_rows=req_rows, block_tokens=dev_block, prefix_lens=prefix, pad_to=pad
            ),
            "verify tree": lambda: be.prepare_verify(
                req_rows=req_rows,
                block_tokens=dev_block,
                prefix_lens=prefix,
                tree_parents=host_parents,
                pad_to=pad,
            ),
        }
        if n == 8:
            q = [512, 0, 33, 1, 7, 300, 2, 1]
            cases["extend"] = lambda: be.prepare_extend(
                req_rows=req_rows,
                input_ids=torch.zeros(sum(q), dtype=torch.int64),
                q_lens=q,
                prefix_lens=[p - 600 for p in prefix],
            )
        # a round's verify batch of the same rows, each one token further than the last (as after a round that
        # accepted nothing): moved on in place after the first build
        moving = _backend(64, args.page_size, args.max_model_len, d, move_batches=True)
        moving.pool.alloc_detached_slots(1)
        moving.pool.alloc(ids)
        calls = 20 + 7 * args.iters + 4  # warm-up, timing rounds, op count and sync check
        moving.pool.ensure_kv_capacity(ids, [p + d + calls for p in prefix])
        moved_rows = moving.pool.req_rows(ids)
        at = [list(prefix)]

        def moved() -> ForwardBatch:
            at[0] = [p + 1 for p in at[0]]
            return moving.prepare_verify(
                req_rows=moved_rows, block_tokens=dev_block, prefix_lens=at[0], pad_to=pad
            )

        cases["verify chain moved on"] = moved
        for name, build in cases.items():
            for _ in range(20):
                build()  # warm-up
            rows.append(
                (
                    f"{name} n={n} pad_to={pad}",
                    _time_us(build, args.iters),
                    _count_ops(build),
                    _sync_free(build),
                )
            )
    print(f"{'batch':34} {'host us':>9} {'device ops':>10} {'sync-free':>9}")
    for name, us, ops, free in rows:
        print(f"{name:34} {us:9.1f} {ops:10d} {free!s:>9}")


if __name__ == "__main__":
    main()
