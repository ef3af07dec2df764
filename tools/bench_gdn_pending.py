"""GDN verify with deferred commits (pending tokens) against decode, per layer, under CUDA graphs (issue #18).

    PYTHONPATH=<tree>/packages/kernels/src python tools/bench_gdn_pending.py [--sweep] [--batches 1,8,32,128]

#18 asks for a GDN verify of D = 4 at most 1.5x the decode kernel at every batch size, trees included. The
engine defers each verify's commit to the slot's next forward (`hyspec_kernels/gdn/pending.py`), so its
verify kernel first applies the last round's accepted tokens (1 with a useless drafter, 4 with an oracle)
and writes the state it reaches: this times that kernel as the engine runs it (a chain and the tree
[-1, 0, 0, 1], 1 and 4 pending tokens) against a plain decode step, at the 9B shape's GDN heads. Each layer
has its own state pool (24 layers in one graph, as in a forward), so states come from HBM, not from L2.
`--sweep` also times every (BV, num_warps) tile for decode and verify (the two must share a tile: it sets
the order of the K reductions, so a committed state is bit for bit what plain decoding computes).
Which hyspec_kernels runs is whatever PYTHONPATH holds: run it once per tree to compare two.
"""

from __future__ import annotations

import argparse
from collections.abc import Callable

import hyspec_kernels
import torch
from bench_tree_verify import graph_us  # (tools/ is this script's directory)
from hyspec_kernels.gdn import PendingTokens, gdn_decode, gdn_verify
from hyspec_kernels.gdn.triton_recurrent import launch_recurrent

HK, HV, K, V = 16, 32, 128, 128
LAYERS = 24
DMAX = 8
TILES = ((16, 1), (32, 1), (32, 2), (64, 1), (64, 2), (64, 4), (128, 2), (128, 4), (128, 8))


def layers_us(fns: list[Callable[[], object]]) -> float:
    """Mean microseconds per layer of one CUDA-graph replay of every fn (a layer each) in turn."""
    return graph_us(lambda: [f() for f in fns], reps=20) / len(fns)


class Layer:
    """One GDN layer's state pool, a block's inputs and its pending tokens, for `b` sequences."""

    def __init__(self, b: int, d: int, num_pending: int) -> None:
        dev = "cuda"
        self.q = torch.randn(b, d, HK, K, device=dev, dtype=torch.bfloat16)
        self.k = torch.randn_like(self.q)
        self.v = torch.randn(b, d, HV, V, device=dev, dtype=torch.bfloat16)
        self.g = -torch.rand(b, d, HV, device=dev) * 0.5
        self.beta = torch.rand(b, d, HV, device=dev)
        self.state = torch.randn(b + 1, HV, K, V, device=dev) * 0.1
        self.slots = torch.arange(b, device=dev, dtype=torch.int32)
        inputs = (
            torch.randn(2 * b, DMAX, HK, K, device=dev),
            torch.randn(2 * b, DMAX, HV, V, device=dev),
            -torch.rand(2 * b, DMAX, HV, device=dev) * 0.5,
            torch.rand(2 * b, DMAX, HV, device=dev),
        )
        rows = torch.full((b + 1,), -1, dtype=torch.int32, device=dev)
        rows[:b] = torch.arange(b, dtype=torch.int32, device=dev)
        paths = torch.full((b + 1, DMAX), -1, dtype=torch.int32, device=dev)
        paths[:b, :num_pending] = torch.arange(num_pending, dtype=torch.int32, device=dev)
        self.pending = PendingTokens(inputs, rows, paths)

    def verify(self, parents: torch.Tensor | None) -> Callable[[], object]:
        return lambda: gdn_verify(
            self.q, self.k, self.v, self.g, self.beta, state=self.state, state_slots=self.slots,
            scratch=None, scratch_rows=None, parents=parents, pending=self.pending, check_indices=False,
        )  # fmt: skip

    def decode(self) -> Callable[[], object]:
        return lambda: gdn_decode(
            self.q[:, 0], self.k[:, 0], self.v[:, 0], self.g[:, 0], self.beta[:, 0], state=self.state,
            state_slots=self.slots, check_indices=False,
        )  # fmt: skip

    def tiled(self, tiles: tuple[int, int], *, verify: bool) -> Callable[[], object]:
        """The kernel at a tile override: a verify with pending tokens, or a decode."""
        d = self.q.shape[1] if verify else 1
        p = self.pending
        return lambda: launch_recurrent(
            self.q[:, :d], self.k[:, :d], self.v[:, :d], self.g[:, :d].contiguous(),
            self.beta[:, :d].contiguous(), state=self.state, state_slots=self.slots, scratch=None,
            scratch_rows=None, parents=None, out_dtype=torch.bfloat16, tiles=tiles, verify=verify,
            keep_inputs=p.inputs if verify else None, pending=(p.rows, p.paths) if verify else None,
        )  # fmt: skip


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--batches", default="1,8,32,128")
    ap.add_argument("--sweep", action="store_true")
    ap.add_argument("--tiles", help="the sweep's tiles as BVxWARPS, comma-separated (default: all)")
    a = ap.parse_args()
    pairs = [t.split("x") for t in a.tiles.split(",")] if a.tiles else None
    tiles = [(int(bv), int(w)) for bv, w in pairs] if pairs else TILES
    print(torch.cuda.get_device_name(), hyspec_kernels.__file__, flush=True)
    tree = [-1, 0, 0, 1]
    for b in (int(x) for x in a.batches.split(",")):
        line = [f"B {b:4d}:"]
        dec = None
        for p in (1, 4):
            layers = [Layer(b, 4, p) for _ in range(LAYERS)]
            if dec is None:
                dec = layers_us([x.decode() for x in layers])
                line.append(f"decode {dec:6.1f} us")
            chain = layers_us([x.verify(None) for x in layers])
            parents = torch.tensor(tree, device="cuda", dtype=torch.int32).expand(b, 4).contiguous()
            tr = layers_us([x.verify(parents) for x in layers])
            line.append(f"P={p}: chain {chain:6.1f} ({chain / dec:.2f}x) tree {tr:6.1f} ({tr / dec:.2f}x)")
            if a.sweep and p == 4:
                for t in tiles:
                    td = layers_us([x.tiled(t, verify=False) for x in layers])
                    tv = layers_us([x.tiled(t, verify=True) for x in layers])
                    print(f"  B {b:4d} tile {t}: decode {td:6.1f} us, verify P=4 {tv:6.1f} ({tv / td:.2f}x)")
            del layers
            torch.cuda.empty_cache()
        print(" ".join(line), flush=True)


if __name__ == "__main__":
    main()
