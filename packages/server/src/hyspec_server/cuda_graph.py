"""The target's DECODE and TARGET_VERIFY forwards under CUDA graphs: which shapes the server captures.

The graphs themselves are attn-backends' `CudaGraphRunner` (the one implementation in the repo: padded rows
use state slot -1 and KV slot -1, every batch tensor lives in the backend's static buffers). This module adds
the server's policy on top:

- what a graph runs: the target forward returning the final hidden states plus the layer outputs a model
  drafter reads (`capture_layers`), so decode stays under graphs with MTP / EAGLE-3 / DFlash drafters on;
- which padded batch sizes are captured (`capture_sizes`), and which verify blocks
  (`SpeculativeConfig.verify_shapes`): a tree
  config verifies D = num_draft_tokens nodes; a chain config D = 1 + s for each draft length s a request may
  use (S, or each adaptive candidate);
- how a verify block of d tokens meets a captured D >= d (`block_len`): the block is padded with chain
  nodes past every row's real ones. They are invisible to the real nodes (causal, parents precede children),
  never reached by verification (absent from first_child / next_sibling), never committed (the commit step
  is <= num_accepted < num_nodes), and their KV lands in the room the scheduler reserved for Dmax tokens,
  past the committed length that later forwards attend to. So tokens, commit and stats are those of the
  unpadded block.

On CPU, or with `--enforce-eager`, nothing is captured: every forward runs eagerly through the same calls.
"""

from __future__ import annotations

import sys
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from hyspec_attn_backends import (
    CudaGraphRunner,
    ForwardBatch,
    ForwardMode,
    HybridBackend,
    MixedBatch,
    StepBatch,
)
from hyspec_statepool.indices import ReqRows
from torch import Tensor


def capture_sizes(max_num_seqs: int) -> list[int]:
    """1, 2, 4, 8, then every multiple of 8 up to `max_num_seqs` (always included)."""
    sizes = {s for s in (1, 2, 4) if s <= max_num_seqs}
    sizes |= set(range(8, max_num_seqs + 1, 8))
    sizes.add(max_num_seqs)
    return sorted(sizes)


@dataclass(slots=True)
class GraphCounts:
    """Forwards of each graph-capturable mode: replayed from a graph, or run eagerly."""

    decode_replays: int = 0
    decode_eager: int = 0
    verify_replays: int = 0
    verify_eager: int = 0
    mixed: int = 0  # MIXED forwards (prompt chunks beside verify blocks): always eager


class TargetGraphs:
    """The target model's forward behind a `CudaGraphRunner`, with the server's capture policy.

    Args:
        model: the target (`model(batch, backend, capture_layers=...)`).
        backend: the target's backend (its static batch buffers are what the graphs read).
        capture_layers: target layers whose outputs every forward also returns (a model drafter's features).
        enabled: False (CPU, `--enforce-eager`) runs everything eagerly.
        max_num_seqs: largest batch to capture.
        verify: (D, tree) verify shapes to capture (`SpeculativeConfig.verify_shapes`); empty without
            speculation.
    """

    def __init__(
        self,
        model: Any,
        backend: HybridBackend,
        *,
        capture_layers: Sequence[int] = (),
        enabled: bool,
        max_num_seqs: int,
        verify: Sequence[tuple[int, bool]] = (),
    ) -> None:
        if max_num_seqs < 1:
            raise ValueError(f"max_num_seqs: expected >= 1, got {max_num_seqs}")
        self.model, self.backend = model, backend
        self.capture_layers = tuple(capture_layers)
        self.sizes = capture_sizes(max_num_seqs)
        self.verify = tuple(sorted(set(verify)))
        plan = backend.pool.plan
        for d, _ in self.verify:
            if not 1 <= d <= backend.max_verify_len:
                raise ValueError(
                    f"verify: expected block sizes in [1, Dmax = {backend.max_verify_len}] (the verify "
                    f"scratch the pool was planned for), got {d}"
                )
        # padded verify rows write their own scratch rows: every captured size needs that many (bug class 21)
        if self.verify and self.sizes[-1] > plan.scratch_rows:
            raise ValueError(
                f"max_num_seqs: verify graphs of {self.sizes[-1]} rows need as many verify-scratch rows, the "
                f"pool has {plan.scratch_rows}"
            )
        self.counts = GraphCounts()
        self.runner = CudaGraphRunner(backend, self._forward, enabled=enabled)

    def _forward(self, batch: StepBatch) -> tuple[Tensor, ...]:
        out = self.model(batch, self.backend, capture_layers=self.capture_layers)
        return (out.hidden_states, *out.aux_hidden_states)  # [T, H] each

    @property
    def active(self) -> bool:
        return self.runner.active

    def capture(self) -> None:
        """Capture every decode and verify shape; on failure log it and run eagerly from then on. A
        progress bar where someone watches (a terminal), as vLLM shows one."""
        from tqdm import tqdm

        total = len(self.sizes) * (1 + len(self.verify))
        shown = self.runner.active and sys.stderr.isatty()
        with tqdm(total=total, desc="capturing CUDA graphs", unit="graph", disable=not shown) as bar:
            self.runner.on_capture = lambda _key: bar.update()
            try:
                self.runner.capture_or_eager(self.sizes, decode=True, verify=self.verify)
            finally:
                self.runner.on_capture = None

    # ---------------------------------------------------------------- per step

    def block_len(self, num_seqs: int, d: int, *, tree: bool) -> int:
        """The verify block size to run d-token blocks of `num_seqs` rows at: the smallest captured D >= d
        with a graph for that many rows, else d (eager)."""
        for dd, tt in self.verify:
            if tt == tree and dd >= d:
                b = self.runner.padded_size(ForwardMode.TARGET_VERIFY, num_seqs, verify_len=dd, tree=tt)
                if b is not None:
                    return dd
        return d

    def prepare_decode(
        self, *, req_rows: ReqRows, input_ids: Tensor, prefix_lens: Sequence[int]
    ) -> ForwardBatch:
        """A DECODE batch padded to the captured size that fits (unpadded when none does)."""
        return self.runner.prepare_decode(req_rows=req_rows, input_ids=input_ids, prefix_lens=prefix_lens)

    def prepare_verify(
        self,
        *,
        req_rows: ReqRows,
        block_tokens: Tensor,
        prefix_lens: Sequence[int],
        tree_parents: Tensor | None,
    ) -> ForwardBatch:
        """A TARGET_VERIFY batch padded to the captured size that fits (unpadded when none does)."""
        return self.runner.prepare_verify(
            req_rows=req_rows, block_tokens=block_tokens, prefix_lens=prefix_lens, tree_parents=tree_parents
        )

    def run(self, batch: StepBatch) -> tuple[Tensor, tuple[Tensor, ...]]:
        """Replay (or run eagerly) -> (hidden [T_live, H], captured layers [T_live, H] each) of the live rows.

        After a replay these are views of the graph's static outputs: use them before the next forward.
        """
        if isinstance(batch, MixedBatch):
            self.counts.mixed += 1
            hidden, *aux = self._forward(batch)
            return hidden, tuple(aux)
        before = self.runner.num_replays
        outs = self.runner.run(batch)
        replayed = self.runner.num_replays > before
        c = self.counts
        if batch.mode is ForwardMode.DECODE:
            if replayed:
                c.decode_replays += 1
            else:
                c.decode_eager += 1
        elif batch.mode is ForwardMode.TARGET_VERIFY:
            if replayed:
                c.verify_replays += 1
            else:
                c.verify_eager += 1
        live = batch.num_live_tokens
        return outs[0][:live], tuple(a[:live] for a in outs[1:])

    def release(self) -> None:
        self.runner.release()
