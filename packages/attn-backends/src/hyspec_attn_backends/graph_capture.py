"""Capturing the graphs of one `CudaGraphRunner` (`graphs.py`, which picks the shapes and replays them): the
all-padding batch each shape is captured on, the eager warm-up runs before each capture, the memory pool and
warm-up stream every graph of the runner shares, the commit graph and the tail graph captured after every
verify graph (chain or tree), and where the backend rewrites its batches in place (`BatchRewrite`) the
rewrite of every decode or verify shape (a `RewriteGraph`, registered with the rewrite, which replays it).

A graph is captured on an all-padding batch (no live rows), which writes no state and no KV, so capturing
at start-up never disturbs a request. Warm-up runs go first because Triton compiles and autotunes on a
kernel's first calls, which must not land inside a graph.
"""

from __future__ import annotations

import gc
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any, Protocol, TypeVar

import torch
from torch import Tensor

from hyspec_attn_backends.backend import HybridBackend
from hyspec_attn_backends.batch import ForwardBatch
from hyspec_attn_backends.batch_rewrite import RewriteGraph, write_every_row
from hyspec_attn_backends.graph_keys import GraphKey, batch_pointers
from hyspec_attn_backends.modes import ForwardMode

# what a graph captures: batch -> output tensors (e.g. hidden states, logits); the outputs of a replay are
# the graph's own static tensors, overwritten by the next replay of the same graph
ForwardFn = Callable[[ForwardBatch], tuple[Tensor, ...]]
_R = TypeVar("_R")


class VerifyTail(Protocol):
    """Work captured after each verify forward, in a graph of its own (`CudaGraphRunner.run_tail`):
    a function of the batch, the forward's outputs and static inputs the caller fills before each replay
    (spec-workers' greedy tail: logits, token choice and commit)."""

    def static_inputs(self, batch_size: int, verify_len: int, device: torch.device) -> tuple[Tensor, ...]:
        """Fresh input tensors for a graph of this shape, holding what its padded rows need."""
        ...

    def __call__(
        self, batch: ForwardBatch, outputs: tuple[Tensor, ...], inputs: tuple[Tensor, ...]
    ) -> tuple[Tensor, ...]: ...


@dataclass(slots=True)
class CommitGraph:
    """A verify key's commit, captured over every row of its batch size (`CudaGraphRunner.commit`)."""

    graph: torch.cuda.CUDAGraph
    accepted: Tensor  # [B] int64 static input: accepted drafts per row, -1 on padded rows
    steps: Tensor  # [B] int64 static output: the committed step per row
    paths: Tensor | None = None  # [B, D] int64 static input of a tree key: accepted paths, -1 past them


@dataclass(slots=True)
class TailGraph:
    """A verify key's tail (`VerifyTail`), captured over every row of its batch size."""

    graph: torch.cuda.CUDAGraph
    inputs: tuple[Tensor, ...]  # static, filled before each replay
    outputs: tuple[Tensor, ...]  # static, every row


@dataclass(slots=True)
class Captured:
    """Everything captured for one `GraphKey`: the forward's graph, the buffers it reads, and for a verify
    key the graphs captured after it (a commit; a tail)."""

    graph: torch.cuda.CUDAGraph
    outputs: tuple[Tensor, ...]  # the forward's static outputs, every row
    pointers: tuple[int, ...]  # `batch_pointers` of the batch it was captured on
    commit: CommitGraph | None = None
    tail: TailGraph | None = None


def padding_batch(backend: HybridBackend, key: GraphKey) -> ForwardBatch:
    """A batch of `key.batch_size` padded rows and no live request: it writes no state and no KV."""
    pool, dev = backend.pool, backend.pool.device
    none = pool.req_rows([])
    if key.mode is ForwardMode.DECODE:
        return backend.prepare_decode(
            req_rows=none,
            input_ids=torch.zeros(0, dtype=torch.int64, device=dev),
            prefix_lens=[],
            pad_to=key.batch_size,
        )
    parents = torch.zeros(0, key.verify_len, dtype=torch.int32, device=dev) if key.tree else None
    return backend.prepare_verify(
        req_rows=none,
        block_tokens=torch.zeros(0, key.verify_len, dtype=torch.int64, device=dev),
        prefix_lens=[],
        tree_parents=parents,
        pad_to=key.batch_size,
    )


def _release_default_generators() -> None:
    """Free each device's default CUDA generator from a capture that failed part-way.

    torch registers the default generators with a graph when its capture begins and releases them only when
    the capture ends well; after a failed one every later random op on the device (`torch.randn`,
    `torch.multinomial` without a generator) raises "Offset increment outside graph capture". A fresh copy
    of the generator's state (same seed and offset, not registered with any graph) replaces the stuck one.
    """
    for i in range(torch.cuda.device_count()):
        gen = torch.cuda.default_generators[i]
        gen.graphsafe_set_state(gen.clone_state())


class GraphCapturer:
    """Captures the graphs of one runner, each after `warmup_runs` eager runs, all in one memory pool.

    Args:
        backend: the backend whose buffers the captured batches live in.
        warmup_runs: eager runs before each capture (>= 1, checked by the runner).
    """

    def __init__(self, backend: HybridBackend, *, warmup_runs: int) -> None:
        self.backend = backend
        self.warmup_runs = warmup_runs
        self._mempool: Any = None  # torch.cuda graph pool handle, shared by every graph of this runner
        self._side: Any = None  # the warm-up stream of every capture (created at the first)
        # the rewrite graphs registered with the backend's rewrite (`release` takes them back)
        self._rewrites: list[RewriteGraph] = []
        self._rewrite_pool: Any = None  # the rewrite graphs' memory pool (created at the first)

    def capture(
        self, key: GraphKey, forward: ForwardFn, *, commit: bool, tail: VerifyTail | None
    ) -> Captured:
        """`forward` captured on the all-padding batch of `key`; for a verify key (chain or tree) also its
        commit (if `commit`) and `tail` (if any), each in a graph of its own right after it. Needs CUDA."""
        if self._mempool is None:
            self._mempool = torch.cuda.graph_pool_handle()
        batch = padding_batch(self.backend, key)
        with torch.no_grad():
            if self._side is None:
                # one warm-up stream for every capture: each new stream gets its own cuBLAS workspace
                self._side = torch.cuda.Stream()  # type: ignore[no-untyped-call]
            graph, outputs = self._warm_and_capture(
                lambda: tuple(forward(batch)),
                f"{key} (a host sync or host-to-device copy inside the forward?)",
            )
            commit_graph = tail_graph = None
            if key.mode is ForwardMode.TARGET_VERIFY:
                commit_graph = self._capture_commit(key, batch) if commit else None
                tail_graph = None if tail is None else self._capture_tail(key, batch, outputs, tail)
            rewrite = self.backend.builder.rewrite
            rewrite_graph = None if rewrite is None else self._capture_rewrite(key, batch)
        if rewrite is not None and rewrite_graph is not None:
            rewrite.add_graph(rewrite_graph)
            if rewrite_graph not in self._rewrites:
                self._rewrites.append(rewrite_graph)
        return Captured(graph, outputs, batch_pointers(batch), commit_graph, tail_graph)

    def release(self) -> None:
        """Drop the memory pool handle (the graphs holding it are the runner's to drop) and take the rewrite
        graphs back from the backend's rewrite."""
        self._mempool = self._rewrite_pool = None
        rewrite = self.backend.builder.rewrite
        if rewrite is not None:
            for g in self._rewrites:
                rewrite.drop_graph(g)
        self._rewrites.clear()

    def _capture_rewrite(self, key: GraphKey, batch: ForwardBatch) -> RewriteGraph | None:
        """The rewrite of every row of `key`'s batch from static inputs (`write_every_row`), captured on its
        all-padding batch: every row -1 while warming up and capturing, so it writes that batch again. None
        for a mode the rewrite does not cover."""
        if key.mode not in (ForwardMode.DECODE, ForwardMode.TARGET_VERIFY):
            return None
        n, d, dev = key.batch_size, max(key.verify_len, 1), self.backend.pool.device
        for g in self._rewrites:  # runners sharing this capturer share the backend: one graph per shape
            if g.mode is key.mode and tuple(g.tokens.shape) == (n, d) and (g.parents is not None) == key.tree:
                return g
        prefix = torch.full((n,), -1, dtype=torch.int32, device=dev)
        tokens = torch.zeros(n, d, dtype=torch.int64, device=dev)
        parents = torch.zeros(n, d, dtype=torch.int32, device=dev) if key.tree else None
        page_size = self.backend.pool.plan.page_size
        if self._rewrite_pool is None:
            self._rewrite_pool = torch.cuda.graph_pool_handle()
        # a pool of their own: a rewrite replays between another graph's replay and the reads of its
        # outputs (a decode step prepared ahead), so its temporaries (a tree's) must not alias those
        graph, _ = self._warm_and_capture(
            lambda: write_every_row(batch, prefix, tokens, parents, page_size=page_size),
            f"{key}'s batch rewrite",
            pool=self._rewrite_pool,
        )
        return RewriteGraph(graph, prefix, tokens, parents, batch.positions.data_ptr(), key.mode)

    def _warm_and_capture(
        self, fn: Callable[[], _R], what: str, *, pool: Any = None
    ) -> tuple[torch.cuda.CUDAGraph, _R]:
        """`fn` run `warmup_runs` times on the side stream (Triton compiles and autotunes there), then
        captured into a graph in this runner's pool (or `pool`) -> (graph, what the captured call
        returned)."""
        side = self._side
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            for _ in range(self.warmup_runs):
                fn()
        torch.cuda.current_stream().wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        try:
            with no_cyclic_gc(), torch.cuda.graph(graph, pool=self._mempool if pool is None else pool):
                out = fn()
        except RuntimeError as exc:
            _release_default_generators()
            raise RuntimeError(f"CUDA graph capture of {what} failed: {exc}") from exc
        return graph, out

    def _capture_tail(
        self, key: GraphKey, batch: ForwardBatch, outputs: tuple[Tensor, ...], tail: VerifyTail
    ) -> TailGraph:
        """`tail` after the verify graph of `key`, reading its static outputs and fresh static inputs (whose
        rows are all padded ones: the warm-up runs commit nothing)."""
        inputs = tail.static_inputs(key.batch_size, key.verify_len, self.backend.pool.device)
        graph, outs = self._warm_and_capture(lambda: tuple(tail(batch, outputs, inputs)), f"{key}'s tail")
        return TailGraph(graph, inputs, outs)

    def _capture_commit(self, key: GraphKey, batch: ForwardBatch) -> CommitGraph:
        """The commit after a verify of `key`, over all its rows: the verify batch's own state slots and
        batch rows (-1 slots on the padded ones) and a static accepted count per row, for a tree key also a
        static accepted path per row (every row -1 while warming up and capturing: the kernels load, nothing
        is committed)."""
        dev = self.backend.pool.device
        accepted = torch.full((key.batch_size,), -1, dtype=torch.int64, device=dev)
        paths = (
            torch.full((key.batch_size, key.verify_len), -1, dtype=torch.int64, device=dev)
            if key.tree
            else None
        )
        graph, steps = self._warm_and_capture(
            lambda: self.backend.commit_every_row(batch=batch, num_accepted=accepted, accept_paths=paths),
            f"{key}'s commit",
        )
        return CommitGraph(graph, accepted, steps, paths)


@contextmanager
def no_cyclic_gc() -> Iterator[None]:
    """Python's cyclic garbage collector held off for a capture: a collection inside one may free an
    unreachable earlier `CUDAGraph` (a dropped engine's, a test's), whose destructor is a CUDA call that is
    illegal while a stream captures, and the capture fails (`torch.cuda.graph` no longer collects before
    capturing). Cycles are collected after it."""
    was_enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if was_enabled:
            gc.enable()
