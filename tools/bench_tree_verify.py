"""GDN verify of a tree without state writes against a chain and decode, under CUDA graphs (issue #18).

    PYTHONPATH=<tree>/packages/kernels/src python tools/bench_tree_verify.py

Times the kernels of whichever hyspec_kernels is first on PYTHONPATH (run it once per tree, in one GPU
call, to compare two), at B = 1 .. 256: decode, chain verifies of D = 4 and 7, the tree [-1, 0, 0, 1]
(root, two children, a grandchild under the first: bench_kernels' shape) and a drafter's breadth-first
top-2 tree of depth 2 (7 nodes), no scratch as the engine runs them
(the engine's verify also stores each token's inputs for the commit's replay, `keep_inputs`: not here).
"""

from __future__ import annotations

from collections.abc import Callable

import hyspec_kernels
import torch
from hyspec_kernels.gdn import gdn_decode, gdn_verify

HK, HV, K, V = 16, 32, 128, 128
TREES = ([-1, 0, 0, 1], [-1, 0, 0, 1, 1, 2, 2])


def graph_us(fn: Callable[[], object], reps: int = 50) -> float:
    """Mean microseconds of one CUDA-graph replay of `fn`."""
    side = torch.cuda.Stream()
    with torch.cuda.stream(side):
        fn()
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        fn()
    graph.replay()
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(reps):
        graph.replay()
    end.record()
    torch.cuda.synchronize()
    return float(start.elapsed_time(end)) / reps * 1e3


def main() -> None:
    dev = "cuda"
    print(torch.cuda.get_device_name(), hyspec_kernels.__file__)
    for shape in TREES:
        d = len(shape)
        print(f"tree {shape}")
        for b in (1, 8, 32, 128, 256):
            q = torch.randn(b, d, HK, K, device=dev, dtype=torch.bfloat16)
            k = torch.randn_like(q)
            v = torch.randn(b, d, HV, V, device=dev, dtype=torch.bfloat16)
            g = -torch.rand(b, d, HV, device=dev) * 0.5
            beta = torch.rand(b, d, HV, device=dev)
            pool = torch.randn(b + 1, HV, K, V, device=dev) * 0.1
            slots = torch.arange(b, device=dev)
            parents = torch.tensor(shape, device=dev, dtype=torch.int32).expand(b, d).contiguous()

            def verify(tree: torch.Tensor | None) -> Callable[[], object]:
                return lambda: gdn_verify(
                    q, k, v, g, beta, state=pool, state_slots=slots, scratch=None, scratch_rows=None,
                    parents=tree, check_indices=False,
                )  # fmt: skip

            chain = graph_us(verify(None))
            tree = graph_us(verify(parents))
            dec = graph_us(
                lambda: gdn_decode(
                    q[:, 0], k[:, 0], v[:, 0], g[:, 0], beta[:, 0], state=pool, state_slots=slots,
                    check_indices=False,
                )
            )  # fmt: skip
            print(
                f"B {b:4d}: decode {dec:7.1f} us, chain verify D={d} {chain:7.1f} ({chain / dec:.2f}x), "
                f"tree verify {tree:7.1f} ({tree / dec:.2f}x)",
                flush=True,
            )


if __name__ == "__main__":
    main()
