"""CUDA graphs for DECODE and TARGET_VERIFY forwards, captured once per padded batch size: the one graph
runner of the repo (the model runner's target forward and every drafter's proposal forwards each have one;
single launches between them replay from `launch_graphs.py`).

A CUDA graph replays the kernel launches of one forward with the addresses they were captured with. Every
tensor of a `ForwardBatch` is a view at offset 0 of the backend's `BatchBuffers`, which `prepare_*` refill in
place, so a batch of n live requests prepared with `pad_to=b` (b a captured size) is exactly what the graph
captured for b reads. The graph is captured on an all-padding batch (no live rows), which writes no state
and no KV, so capturing at start-up never disturbs a request (how a graph is captured: `graph_capture.py`).

What a replay needs from the forward: no host reads of device values (`.item()`, `bool(t)`, data-dependent
shapes), no host-to-device copies, every per-batch tensor taken from the batch. The kernel wrappers skip their
value checks while a graph is being captured; `prepare_*` validates instead, outside the graph.

On CPU, or with `enabled=False` (the server's `--enforce-eager`), nothing is captured and `run` calls the
forward eagerly; callers use the same code either way.

A runner is configured with what it captures (DECODE or not, and the (D, tree) verify shapes), captures them
at the batch sizes `capture` gets (`capture_sizes(max_num_seqs)` for an engine), picks the captured shape a
batch runs at (`prepare_*` pad the rows, `block_len` the verify block) and counts replays and eager runs
per mode.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence

import torch
from hyspec_statepool.indices import ReqRows
from hyspec_statepool.transfer import write_into
from torch import Tensor

from hyspec_attn_backends.backend import HybridBackend
from hyspec_attn_backends.batch import ForwardBatch
from hyspec_attn_backends.graph_capture import Captured, ForwardFn, GraphCapturer, VerifyTail, padding_batch
from hyspec_attn_backends.graph_keys import GraphCounts, GraphKey, batch_pointers
from hyspec_attn_backends.modes import ForwardMode

log = logging.getLogger(__name__)


class CudaGraphRunner:
    """Capture `forward(batch)` for a set of padded batch sizes and replay it after a refill.

    Args:
        backend: the backend whose buffers the batches live in (and whose pool the forward uses).
        forward: batch -> output tensors; called eagerly for warm-up and fallback, and once under capture.
        enabled: False turns graphs off (eager everywhere). Graphs are also off on a non-CUDA pool.
        warmup_runs: eager runs before each capture (Triton compiles and autotunes there, not in the graph).
        decode: `capture` captures DECODE graphs.
        verify: the (D, tree) TARGET_VERIFY shapes `capture` captures (D within the backend's Dmax).
        commit: with each verify graph (chain or tree) also capture its commit (`backend.commit_every_row`:
            every row of the batch size), which `commit` replays: a target's verify, not a drafter's.
        tail: with each verify graph also capture this tail, which `run_tail` replays.
        share_pool_with: capture into that runner's memory pool (and with its warm-up runs) instead of a
            pool of its own: for runners of one backend whose graphs never run at the same time and whose
            outputs are read before another of them replays (e.g. a drafter's proposal per draft length).

    Usage (an engine step): `runner.capture(capture_sizes(max_num_seqs))` at start-up; per step `batch =
    runner.prepare_decode(...)` (padded to the captured size that fits), `outs = runner.run(batch)`: the
    live rows' outputs, used before the next replay.
    """

    def __init__(
        self,
        backend: HybridBackend,
        forward: ForwardFn,
        *,
        enabled: bool = True,
        warmup_runs: int = 2,
        decode: bool = True,
        verify: Sequence[tuple[int, bool]] = (),
        commit: bool = False,
        tail: VerifyTail | None = None,
        share_pool_with: CudaGraphRunner | None = None,
    ) -> None:
        if warmup_runs < 1:
            raise ValueError(f"warmup_runs: expected >= 1, got {warmup_runs}")
        for d, _ in verify:
            if not 1 <= d <= backend.max_verify_len:
                raise ValueError(
                    f"verify: expected block sizes in [1, Dmax = {backend.max_verify_len}] (the verify "
                    f"scratch the pool was planned for), got {d}"
                )
        self.backend = backend
        self.forward = forward
        # how each graph is captured: warm-up runs, the shared memory pool, the commit and tail graphs
        if share_pool_with is not None and share_pool_with.backend is not backend:
            raise ValueError("share_pool_with: expected a runner of the same backend")
        self.capturer: GraphCapturer = (
            GraphCapturer(backend, warmup_runs=warmup_runs)
            if share_pool_with is None
            else share_pool_with.capturer
        )
        self.decode = decode
        self.verify = tuple(sorted(set(verify)))
        self.commit_graphs = commit
        self.tail = tail
        self.sizes: list[int] = []  # the batch sizes `capture` was given
        self.active = bool(enabled) and backend.pool.device.type == "cuda" and torch.cuda.is_available()
        self.counts = GraphCounts()
        self.num_replays = 0
        self.num_eager = 0
        self._graphs: dict[GraphKey, Captured] = {}
        # captured sizes per (mode, D, tree), sorted: asked for before every batch (forgotten on a capture)
        self._sizes: dict[tuple[ForwardMode, int, bool], list[int]] = {}
        # called after each graph is captured (the model runner's progress bar)
        self.on_capture: Callable[[GraphKey], None] | None = None

    # ------------------------------------------------------------------ capture

    def capture(self, batch_sizes: Sequence[int]) -> None:
        """Capture the configured shapes (DECODE if `decode`, every `verify` shape) at these padded batch
        sizes; a failed capture leaves the runner eager (`capture_or_eager`)."""
        rows = self.backend.pool.plan.scratch_rows
        if self.verify and max(batch_sizes, default=0) > rows:
            # padded verify rows write their own scratch rows: no graph may be larger (bug class 21)
            raise ValueError(
                f"batch_sizes: verify graphs of {max(batch_sizes)} rows need as many verify-scratch rows, "
                f"the pool has {rows}"
            )
        self.sizes = sorted(set(batch_sizes))
        self.capture_or_eager(self.sizes, decode=self.decode, verify=self.verify)

    def capture_decode(self, batch_sizes: Sequence[int]) -> None:
        """Capture DECODE graphs for these padded batch sizes (no-op when inactive)."""
        self._capture_all([GraphKey(ForwardMode.DECODE, b) for b in batch_sizes])

    def capture_verify(self, batch_sizes: Sequence[int], *, verify_len: int, tree: bool = False) -> None:
        """Capture TARGET_VERIFY graphs for a fixed block size D, chain or tree (no-op when inactive)."""
        self._capture_all(
            [GraphKey(ForwardMode.TARGET_VERIFY, b, verify_len=verify_len, tree=tree) for b in batch_sizes]
        )

    def capture_or_eager(
        self, batch_sizes: Sequence[int], *, decode: bool, verify: Sequence[tuple[int, bool]] = ()
    ) -> None:
        """Capture DECODE (if `decode`) and every (D, tree) verify shape at these sizes; a failed capture
        (e.g. a layer that reads device values on the host) is logged, drops every graph, and leaves the
        runner eager from then on, since a half-captured runner is not usable."""
        try:
            if decode:
                self.capture_decode(batch_sizes)
            for d, tree in verify:
                self.capture_verify(batch_sizes, verify_len=d, tree=tree)
        except RuntimeError as e:
            if not self.active:
                raise
            log.warning("CUDA graph capture failed, running eagerly: %s", e)
            torch.cuda.synchronize()
            self.release()
            self.active = False

    def _capture_all(self, keys: list[GraphKey]) -> None:
        limit = self.backend.buffers.max_num_seqs
        for key in keys:
            if key.batch_size > limit:
                raise ValueError(
                    f"batch_sizes: expected sizes <= the backend's max_num_seqs {limit}, got {key}"
                )
        if not self.active:
            return
        # largest first: smaller graphs then reuse the pool memory the largest one reserved
        for key in sorted(keys, key=lambda k: -k.batch_size):
            if key not in self._graphs:
                # this runner's forward, and what it captures after chain verifies
                self._graphs[key] = self.capturer.capture(
                    key, self.forward, commit=self.commit_graphs, tail=self.tail
                )
                self._sizes.clear()
                if self.on_capture is not None:
                    self.on_capture(key)

    def _padding_batch(self, key: GraphKey) -> ForwardBatch:
        """The all-padding batch a graph of `key` is captured on (the server's tests run its tail there)."""
        return padding_batch(self.backend, key)

    # ------------------------------------------------------------------ replay

    def captured_sizes(self, mode: ForwardMode, *, verify_len: int = 0, tree: bool = False) -> list[int]:
        """Captured padded batch sizes for this mode (and D, tree), ascending."""
        return list(self._sorted_sizes(mode, verify_len, tree))

    def _sorted_sizes(self, mode: ForwardMode, verify_len: int, tree: bool) -> list[int]:
        """`captured_sizes`, kept until the next capture (the caller must not change it)."""
        at = (mode, verify_len, tree)
        sizes = self._sizes.get(at)
        if sizes is None:
            sizes = self._sizes[at] = sorted(
                k.batch_size
                for k in self._graphs
                if k.mode is mode and k.verify_len == verify_len and k.tree == tree
            )
        return sizes

    def padded_size(
        self, mode: ForwardMode, n: int, *, verify_len: int = 0, tree: bool = False
    ) -> int | None:
        """The smallest captured size >= n, or None (run unpadded and eager)."""
        for b in self._sorted_sizes(mode, verify_len, tree):
            if b >= n:
                return b
        return None

    def prepare_decode(
        self, *, req_rows: ReqRows, input_ids: Tensor, prefix_lens: Sequence[int] | Tensor
    ) -> ForwardBatch:
        """`backend.prepare_decode`, padded to the captured size that fits (unpadded if none does)."""
        pad_to = self.padded_size(ForwardMode.DECODE, len(req_rows))
        return self.backend.prepare_decode(
            req_rows=req_rows, input_ids=input_ids, prefix_lens=prefix_lens, pad_to=pad_to
        )

    def prepare_verify(
        self,
        *,
        req_rows: ReqRows,
        block_tokens: Tensor,
        prefix_lens: Sequence[int] | Tensor,
        tree_parents: Tensor | None = None,
    ) -> ForwardBatch:
        """`backend.prepare_verify`, padded to the captured size that fits (unpadded if none does)."""
        d = int(block_tokens.shape[-1]) if block_tokens.dim() == 2 else 0
        pad_to = self.padded_size(
            ForwardMode.TARGET_VERIFY, len(req_rows), verify_len=d, tree=tree_parents is not None
        )
        return self.backend.prepare_verify(
            req_rows=req_rows,
            block_tokens=block_tokens,
            prefix_lens=prefix_lens,
            tree_parents=tree_parents,
            pad_to=pad_to,
        )

    def block_len(self, num_seqs: int, d: int, *, tree: bool) -> int:
        """The verify block size to run d-token blocks of `num_seqs` rows at: the smallest configured D >= d
        with a graph for that many rows, else d (eager). A block run at a larger D is padded by the caller
        with nodes no real node sees (spec-workers' `pad_block`)."""
        for dd, tt in self.verify:
            if tt == tree and dd >= d:
                if self.padded_size(ForwardMode.TARGET_VERIFY, num_seqs, verify_len=dd, tree=tt) is not None:
                    return dd
        return d

    def _replayable(self, batch: ForwardBatch) -> Captured | None:
        """The graphs captured for this batch's key, if they read the very buffers this batch lives in."""
        key = GraphKey.of(batch)
        captured = None if key is None else self._graphs.get(key)
        return captured if captured is not None and captured.pointers == batch_pointers(batch) else None

    def can_replay(self, batch: ForwardBatch) -> bool:
        """A graph was captured for this batch's key, reading the very buffers this batch lives in."""
        return self._replayable(batch) is not None

    def run(self, batch: ForwardBatch) -> tuple[Tensor, ...]:
        """Replay the graph captured for this batch, or run the forward eagerly when there is none -> the
        outputs of the live rows' tokens (`[:batch.num_live_tokens]` of each).

        After a replay these are views of the graph's static outputs: read (or copy) them before the next.
        """
        captured = self._replayable(batch)
        replay = captured is not None
        if captured is not None:
            captured.graph.replay()
            self.num_replays += 1
            outs = captured.outputs
        else:
            self.num_eager += 1
            with torch.no_grad():
                outs = tuple(self.forward(batch))
        c = self.counts
        if batch.mode is ForwardMode.DECODE:
            c.decode_replays += int(replay)
            c.decode_eager += int(not replay)
        elif batch.mode is ForwardMode.TARGET_VERIFY:
            c.verify_replays += int(replay)
            c.verify_eager += int(not replay)
        live = batch.num_live_tokens
        return tuple(o[:live] for o in outs)

    def commit(self, batch: ForwardBatch, *, num_accepted: Tensor, accept_paths: Tensor | None) -> Tensor:
        """`backend.commit_after_verify` after `run(batch)` (a TARGET_VERIFY batch): replayed from the graph
        captured with the batch's verify graph when there is one, else run eagerly -> [N] int64 committed
        step per live row.

        `num_accepted`: [N] int accepted drafts per live row (-1 skips one), on the device; `accept_paths`:
        [N, D] for a tree batch (its commit graph reads them), None for a chain.
        """
        n = batch.num_live
        captured = self._replayable(batch)
        c = None if captured is None else captured.commit
        if c is None or (accept_paths is None) != (c.paths is None):
            steps = self.backend.commit_after_verify(
                batch=batch, num_accepted=num_accepted, accept_paths=accept_paths
            )
            self.counts.commit_eager += 1
            return steps
        if tuple(num_accepted.shape) != (n,):
            raise ValueError(f"num_accepted: expected shape [{n}], got {list(num_accepted.shape)}")
        if accept_paths is not None and c.paths is not None:
            if tuple(accept_paths.shape) != (n, c.paths.shape[1]):
                raise ValueError(
                    f"accept_paths: expected shape [{n}, {c.paths.shape[1]}], got {list(accept_paths.shape)}"
                )
            c.paths[:n].copy_(accept_paths, non_blocking=True)
            c.paths[n:].fill_(-1)
        c.accepted[:n].copy_(num_accepted, non_blocking=True)
        if n < c.accepted.shape[0]:
            c.accepted[n:].fill_(-1)  # padded rows commit nothing
        c.graph.replay()
        self.counts.commit_replays += 1
        return c.steps[:n]

    def run_tail(
        self, batch: ForwardBatch, hidden: Tensor, inputs: Sequence[Tensor]
    ) -> tuple[Tensor, ...] | None:
        """Replay the tail captured with `batch`'s verify graph on these inputs (host tensors shaped as its
        static ones: every row, padded ones included) -> its outputs, every row (graph outputs: read them
        before the next replay); None when there is no such tail, or when `hidden` (the verify forward's
        first output) is not that graph's own output: a forward that ran eagerly (a MIXED step's verify part
        lives in the same buffers, so its batch can look replayable) left the tail nothing to read."""
        captured = self._replayable(batch)
        if captured is None or captured.tail is None or hidden.data_ptr() != captured.outputs[0].data_ptr():
            return None
        t = captured.tail
        if len(inputs) != len(t.inputs) or any(
            a.shape != b.shape for a, b in zip(inputs, t.inputs, strict=True)
        ):
            got = [list(a.shape) for a in inputs]
            raise ValueError(f"inputs: expected shapes {[list(b.shape) for b in t.inputs]}, got {got}")
        for buffer, values in zip(t.inputs, inputs, strict=True):
            write_into(buffer, values)  # non-blocking
        t.graph.replay()
        self.counts.tail_replays += 1
        return t.outputs

    def release(self) -> None:
        """Drop every graph (and with the last reference, the memory they hold)."""
        self._graphs.clear()
        self._sizes.clear()
        self.capturer.release()
