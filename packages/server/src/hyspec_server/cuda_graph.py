"""CUDA graphs for decode steps (one token per request), captured once per batch size.

A decode batch of n requests replays the graph of the smallest captured size >= n. The graph reads the
backend's static batch buffers and the index tensors of the `ForwardBatch` it was captured with; a replay
refills them in place. Padded rows use state slot -1 and KV slot -1 (the kernels skip them) and attend to one
reserved KV page of a pad request, so they never touch a real request's memory.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch
from hyspec_attn_backends import ForwardBatch, HybridBackend
from hyspec_statepool.indices import ReqRows
from hyspec_statepool.pool import HybridStatePool

PAD_REQUEST = "__hyspec_cuda_graph_pad__"


def capture_sizes(max_batch: int) -> list[int]:
    """1, 2, 4, 8, then every multiple of 8 up to `max_batch` (always included)."""
    sizes = {s for s in (1, 2, 4) if s <= max_batch}
    sizes |= set(range(8, max_batch + 1, 8))
    sizes.add(max_batch)
    return sorted(sizes)


@dataclass(slots=True)
class _Graph:
    graph: torch.cuda.CUDAGraph
    batch: ForwardBatch
    hidden: torch.Tensor  # [bs, H], written by the graph


class DecodeGraphs:
    def __init__(self, model: Any, backend: HybridBackend, pool: HybridStatePool, *, max_batch: int) -> None:
        self.model, self.backend, self.pool = model, backend, pool
        self.sizes = capture_sizes(max_batch)
        self.num_replays = 0
        # the pad request owns one zeroed page that padded rows read as their only key
        pool.alloc([PAD_REQUEST])
        pool.ensure_kv_capacity([PAD_REQUEST], [1])
        if pool.kv.k is not None and pool.kv.v is not None:
            page = int(pool.page_table(pool.req_rows([PAD_REQUEST]))[0, 0])
            pool.kv.k[:, page].zero_()
            pool.kv.v[:, page].zero_()
        self._pad_page_row = pool.page_table(pool.req_rows([PAD_REQUEST]))[0].clone()  # [max_pages] int32
        self._graphs: dict[int, _Graph] = {}
        self._mempool = torch.cuda.graph_pool_handle()
        try:
            with torch.inference_mode():
                for bs in reversed(self.sizes):
                    self._graphs[bs] = self._capture(bs)
        except Exception:
            self.release()
            raise

    def release(self) -> None:
        """Drops the graphs and returns the pad request's memory to the pool."""
        self._graphs.clear()
        if self.pool.is_live(PAD_REQUEST):
            self.pool.free([PAD_REQUEST])

    def fits(self, n: int) -> bool:
        return 0 < n <= self.sizes[-1]

    def _pad_batch(self, bs: int) -> ForwardBatch:
        rows = self.pool.req_rows([PAD_REQUEST] * bs)
        batch = self.backend.prepare_decode(
            req_rows=rows, input_ids=torch.zeros(bs, dtype=torch.int64), prefix_lens=[0] * bs
        )
        self._fill_pads(batch, 0, bs)
        return batch

    def _fill_pads(self, batch: ForwardBatch, n: int, bs: int) -> None:
        """Rows [n, bs) become padded rows: token 0 at position 0, no state, no KV write, one pad key."""
        assert batch.state_slots is not None and batch.kv_slots is not None
        batch.input_ids[n:bs].zero_()
        batch.positions[n:bs].zero_()
        batch.page_table[n:bs] = self._pad_page_row
        batch.cu_seqlens_q[n + 1 : bs + 1] = torch.arange(
            n + 1, bs + 1, dtype=batch.cu_seqlens_q.dtype, device=batch.cu_seqlens_q.device
        )
        batch.q_lens[n:bs] = 1
        batch.prefix_lens[n:bs] = 0
        batch.kv_lens[n:bs] = 1
        batch.has_initial_state[n:bs] = False
        batch.state_slots.tensor[n:bs] = -1
        batch.kv_slots.tensor[n:bs] = -1

    def _capture(self, bs: int) -> _Graph:
        batch = self._pad_batch(bs)
        # warm-up off the capture stream: Triton compiles and autotunes here, not inside the graph
        stream = torch.cuda.Stream()  # type: ignore[no-untyped-call]
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):
            for _ in range(2):
                self.model(batch, self.backend)
        torch.cuda.current_stream().wait_stream(stream)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=self._mempool):
            hidden = self.model(batch, self.backend).hidden_states
        return _Graph(graph, batch, hidden)

    def run(self, *, req_rows: ReqRows, input_ids: torch.Tensor, prefix_lens: Sequence[int]) -> torch.Tensor:
        """Decode one token for each of the n requests; returns hidden states [n, H]."""
        n = len(req_rows)
        bs = next(s for s in self.sizes if s >= n)
        g = self._graphs[bs]
        # fills the shared buffers [:n] in place and gives this step's index tensors
        live = self.backend.prepare_decode(req_rows=req_rows, input_ids=input_ids, prefix_lens=prefix_lens)
        assert live.state_slots is not None and live.kv_slots is not None and live.req_rows is not None
        b = g.batch
        assert b.state_slots is not None and b.kv_slots is not None and b.req_rows is not None
        b.state_slots.tensor[:n] = live.state_slots.tensor
        b.kv_slots.tensor[:n] = live.kv_slots.tensor
        b.req_rows.tensor[:n] = live.req_rows.tensor
        self._fill_pads(b, n, bs)
        g.graph.replay()
        self.num_replays += 1
        return g.hidden[:n]
