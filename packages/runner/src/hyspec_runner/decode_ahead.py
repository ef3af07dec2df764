"""The next decode step's batch, prepared while the device still runs this one.

A decode step's host work between reading its sampled tokens and launching the next forward is idle time for
the device. The largest part is the next batch's metadata (`prepare_decode`: positions, KV slots, state slots,
page-table rows; 0.9 ms of host time per step on an H100 machine against a 7.4 ms forward of a 9B model at
batch 1 when it was built on the device, about 0.35 ms when it is built on the host; a batch of the same rows
as the last one is that one moved on by one launch instead, `attn-backends` `BatchRewrite`). When every chunk
of a step decodes one token, the runner therefore builds the batch of the same requests one position on right
after queueing the sampler and before reading its tokens: the build's copies queue behind the running forward,
so its host time overlaps the device's work, and the next step's input tokens are copied from the sampler's
output on the device.

The next step takes the prepared batch only if nothing it was built from has changed since:

- the same requests in the same order, each at the predicted position, each fed the token that was sampled;
- their rows of the pool's request table unchanged (`HybridStatePool.row_layout`: no state slot or KV page
  of theirs mapped or unmapped since: the batch holds copies of those indices); other rows may have changed;
- nothing else written into the backend's batch buffers since (`HybridBackend.num_builds`: every batch,
  graphed or not, lives in the same buffers).

The batch leaves out the requests that the step ends by their token budget (`max_tokens`: known before the
tokens are read), so a step after some requests finished by length, the common case under load, still takes
it. Anything else (a request stopped at EOS or a stop string, joined or was preempted, a verify or prefill
forward ran) drops it, and the step prepares its batch as before. A prepared batch is used once. A request
whose next position starts a new KV page gets that page when its batch is prepared, one step before the
scheduler would add it.

With async scheduling the step also queues the prepared batch's forward before reading its tokens
(`take_built`, `PlainForwards.run_ahead`): the checks on tokens and requests then move to the next step,
which takes that forward's hidden states instead of running one.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch
from hyspec_attn_backends import CudaGraphRunner, ForwardBatch, HybridBackend
from hyspec_statepool.errors import PoolExhaustedError
from hyspec_statepool.indices import ReqRows
from hyspec_statepool.pool import HybridStatePool


@dataclass(slots=True)
class _Prepared:
    req_ids: tuple[str, ...]
    prefix_lens: tuple[int, ...]
    batch: ForwardBatch
    layout: tuple[tuple[int, int], ...]  # `HybridStatePool.row_layout` of its requests
    num_builds: int
    keep: tuple[int, ...]  # the building step's rows (indices) that it holds, in order
    tokens: tuple[int, ...] | None = None  # the sampled tokens it was built for, once the host read them


class DecodeAhead:
    """Builds at most one decode batch ahead and hands it to the next step if it still matches.

    Args:
        graphs: prepares decode batches (padded to a captured graph size when one fits).
        backend, pool: whose buffer writes and table changes invalidate a prepared batch.
        enabled: off, `build` does nothing and `take` finds nothing (the runner enables it on CUDA).
        lookahead: KV positions the scheduler reserves past a decoding request's next token (speculative
            decoding's drafts, also in rounds without drafts); reserved here too, or each page boundary of
            the lookahead would change the table under the prepared batch.
    """

    def __init__(
        self,
        graphs: CudaGraphRunner,
        backend: HybridBackend,
        pool: HybridStatePool,
        *,
        enabled: bool,
        lookahead: int = 0,
    ) -> None:
        self.graphs = graphs
        self.backend = backend
        self.pool = pool
        self.enabled = enabled
        self.lookahead = lookahead
        self.num_used = 0  # steps that took a prepared batch
        self.num_dropped = 0  # prepared batches no step could take
        self._prepared: _Prepared | None = None

    def build(
        self,
        *,
        req_ids: Sequence[str],
        req_rows: ReqRows,
        prefix_lens: Sequence[int],
        next_tokens: torch.Tensor,
        keep: Sequence[int],
    ) -> None:
        """Queue the batch that decodes `next_tokens` ([N] on the device, not yet read) at `prefix_lens`
        (this step's positions + 1) for these requests, which are rows `keep` of the building step (the
        others end with it); skipped when the pool has no page left for a next position."""
        self._drop()
        if not self.enabled or not req_ids:
            return
        width = self.pool.plan.table_width
        if max(prefix_lens, default=0) + 1 > width:
            return  # past the longest request: that step never comes
        try:
            # a request at a page boundary gets its next page one step early, with its lookahead (the
            # scheduler would add them before the next step anyway; finishing or preemption frees them)
            self.pool.ensure_kv_capacity(req_ids, [min(p + 1 + self.lookahead, width) for p in prefix_lens])
        except PoolExhaustedError:
            return  # the scheduler decides who gets the last pages (and whom to preempt)
        # the tokens are copied on the device, queued after the sampler that writes them (a decode batch of
        # the same rows as the last one is that batch moved on: `BatchRewrite`)
        batch = self.graphs.prepare_decode(
            req_rows=req_rows, input_ids=next_tokens, prefix_lens=list(prefix_lens)
        )
        self._prepared = _Prepared(
            tuple(req_ids),
            tuple(prefix_lens),
            batch,
            self.pool.row_layout(req_ids),
            self.backend.num_builds,
            tuple(keep),
        )

    def sampled(self, tokens: Sequence[int]) -> None:
        """The host has read the building step's tokens (one per row), which the prepared batch feeds."""
        p = self._prepared
        if p is not None:
            p.tokens = tuple(tokens[i] for i in p.keep)

    def take(
        self, *, req_ids: Sequence[str], prefix_lens: Sequence[int], tokens: Sequence[int]
    ) -> ForwardBatch | None:
        """The prepared batch if it is exactly this decode step's (see the module docstring), else None."""
        p, self._prepared = self._prepared, None
        if p is None:
            return None
        ok = (
            p.req_ids == tuple(req_ids)
            and p.prefix_lens == tuple(prefix_lens)
            and p.tokens == tuple(tokens)
            and p.layout == self.pool.row_layout(req_ids)
            and p.num_builds == self.backend.num_builds
        )
        if not ok:
            self.num_dropped += 1
            return None
        self.num_used += 1
        return p.batch

    def take_built(self) -> _Prepared | None:
        """The batch `build` queued in this step, for a forward queued before the step's tokens are read
        (the engine's async scheduling): only if no build and no change of its requests' rows came since."""
        p, self._prepared = self._prepared, None
        if p is None:
            return None
        if p.layout != self.pool.row_layout(p.req_ids) or p.num_builds != self.backend.num_builds:
            self.num_dropped += 1
            return None
        self.num_used += 1
        return p

    def _drop(self) -> None:
        if self._prepared is not None:
            self.num_dropped += 1
            self._prepared = None
