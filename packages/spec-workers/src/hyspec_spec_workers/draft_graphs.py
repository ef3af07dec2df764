"""CUDA graphs for a model drafter's proposal forwards.

Every proposal forward (MTP / EAGLE-3 draft step j, the DFlash block) is a TARGET_VERIFY forward on the
draft's own backend with a block size fixed by the config: step j of a hidden-state drafter runs 1 + j·topk
nodes, DFlash runs its whole block. So each is captured once per padded batch size with attn-backends'
`CudaGraphRunner`, exactly like the target's verify. What a drafter adds on top:

- every per-step input that is not in the `ForwardBatch` lives in a persistent buffer of the drafter, read at
  offset 0 (`HiddenStateDrafter.features_in`: a chained step's input hidden state is copied there before the
  replay, so the graph reads the chained value and never a stale one);
- the outputs of a replay are the graph's static tensors, consumed before the next replay.

Draft extends (`commit`, variable accepted lengths) stay eager. On CPU, before `capture`, or when capture
fails, `run` calls the forward eagerly through the same code.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol, runtime_checkable

from hyspec_attn_backends import CudaGraphRunner, ForwardBatch, HybridBackend
from hyspec_attn_backends.graphs import ForwardFn
from hyspec_statepool.indices import ReqRows
from torch import Tensor


@dataclass(slots=True)
class DraftGraphCounts:
    """Proposal forwards replayed from a graph, and run eagerly."""

    replays: int = 0
    eager: int = 0


@runtime_checkable
class GraphedDrafter(Protocol):
    """A drafter whose proposal forwards can run under CUDA graphs (the model drafters of this package)."""

    def capture_graphs(self, batch_sizes: Sequence[int]) -> None:
        """Capture every proposal forward shape for these padded batch sizes (no-op on CPU)."""
        ...

    @property
    def graph_counts(self) -> DraftGraphCounts: ...


class DraftGraphs:
    """A draft backend's proposal forward behind a `CudaGraphRunner`, for a fixed set of block shapes.

    Args:
        backend: the draft's own backend (its static batch buffers are what the graphs read).
        forward: batch -> output tensors; it must read nothing per batch but the batch and persistent buffers.
        shapes: (D, tree) of every block the drafter runs.
    """

    def __init__(self, backend: HybridBackend, forward: ForwardFn, *, shapes: Sequence[tuple[int, bool]]):
        for d, _ in shapes:
            if not 1 <= d <= backend.max_verify_len:
                raise ValueError(f"shapes: expected block sizes in [1, {backend.max_verify_len}], got {d}")
        self.backend, self.forward = backend, forward
        self.shapes = tuple(sorted(set(shapes)))
        self.counts = DraftGraphCounts()
        # active on CUDA, but eager until `capture` (a batch without a captured graph runs eagerly)
        self.runner = CudaGraphRunner(backend, forward, enabled=True)

    @property
    def active(self) -> bool:
        return self.runner.active

    def capture(self, batch_sizes: Sequence[int]) -> None:
        """Capture every shape at these padded batch sizes; on failure log it and stay eager."""
        self.runner.capture_or_eager(batch_sizes, decode=False, verify=self.shapes)

    def prepare_verify(
        self,
        *,
        req_rows: ReqRows,
        block_tokens: Tensor,
        prefix_lens: Sequence[int] | Tensor,
        tree_parents: Tensor | None,
    ) -> ForwardBatch:
        """A proposal batch padded to the captured size that fits (unpadded when none does)."""
        return self.runner.prepare_verify(
            req_rows=req_rows, block_tokens=block_tokens, prefix_lens=prefix_lens, tree_parents=tree_parents
        )

    def run(self, batch: ForwardBatch) -> tuple[Tensor, ...]:
        """Replay (or run eagerly) -> outputs of the live rows' tokens; views of static graph outputs after a
        replay, so use them before the next forward."""
        before = self.runner.num_replays
        outs = self.runner.run(batch)
        if self.runner.num_replays > before:
            self.counts.replays += 1
        else:
            self.counts.eager += 1
        return tuple(o[: batch.num_live_tokens] for o in outs)

    def release(self) -> None:
        self.runner.release()
