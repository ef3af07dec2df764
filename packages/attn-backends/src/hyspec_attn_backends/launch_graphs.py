"""Single launches outside the forward graphs, replayed from a CUDA graph once the same call repeats.

A speculative round queues a few launches of its own between graph replays (a drafter's first block after a
verify, spec-workers' `draft_after.py`). Each eager Triton launch costs 40-65 us of host time on a lent
H200's host (its argument checks, Triton's dispatch), a graph replay about 3 us; a round at batch 1 takes
0.65 ms in all. Those launches read and write the static buffers of the graphs around them, so their
arguments repeat from round to round: `LaunchGraphs` captures a launch the second time in a row it sees the
same key and replays it from then on.

The key is the caller's: it must name every argument the launch depends on, each tensor by `tensor_key`
(address, shape, strides, dtype) and every other value as it is. A replay then touches exactly the memory
the launch would, with the same arguments: it equals the launch. What the launch allocates (its output) is
the graph's static tensor, the same one at every replay of that key: consume it (a device op queued after
it, a copy) before the next call. The first call of a key runs eagerly (Triton compiles there, never inside a
capture); on the CPU, and while a graph is being captured, every call runs eagerly.

Part of the repo's one graph owner (this package: `graphs.py` for the forwards, `graph_capture.py` for how
they are captured).
"""

from __future__ import annotations

import logging
from collections import OrderedDict
from collections.abc import Callable, Hashable
from typing import Any

import torch
from torch import Tensor

from hyspec_attn_backends.graph_capture import no_cyclic_gc

TensorKey = tuple[int, tuple[int, ...], tuple[int, ...], torch.dtype]
log = logging.getLogger(__name__)


def tensor_key(t: Tensor | None) -> TensorKey | None:
    """What a captured launch depends on of one tensor argument: its address, shape, strides and dtype."""
    if t is None:
        return None
    return (t.data_ptr(), tuple(t.shape), t.stride(), t.dtype)


class LaunchGraphs:
    """Launches replayed from CUDA graphs by key (module docstring).

    Args:
        device: where the launches run (on a CPU every call runs eagerly).
        capacity: graphs kept, least recently replayed dropped first (keys change with the batch's rows:
            a caller sizes it for the keys it may meet, or a batch whose size keeps changing captures again
            and again).
    """

    def __init__(self, device: torch.device, *, capacity: int = 8) -> None:
        if capacity < 1:
            raise ValueError(f"capacity: expected >= 1, got {capacity}")
        self.device, self.capacity = device, capacity
        self._graphs: OrderedDict[Hashable, tuple[torch.cuda.CUDAGraph, Tensor]] = OrderedDict()
        self._last: Hashable | None = None  # the key of the last eager call
        self._pool: Any = None  # one memory pool for every graph here (torch's opaque handle)
        self.num_eager = self.num_captures = self.num_replays = 0
        self.enabled = True  # False after a capture failed: every call runs eagerly from then on

    def __call__(self, key: Hashable, launch: Callable[[], Tensor]) -> Tensor:
        """`launch()`'s result: replayed when `key` was captured, captured when the last call had the same
        key, else run as is. A replay's result is the graph's static tensor (consume it before the next)."""
        if not self.enabled or self.device.type != "cuda" or torch.cuda.is_current_stream_capturing():
            self.num_eager += 1
            return launch()
        got = self._graphs.get(key)
        if got is None and key != self._last:
            self._last = key
            self.num_eager += 1
            return launch()
        if got is None:
            try:
                got = self._graphs[key] = self._capture(launch)
            except RuntimeError:
                # a graph is only a faster way to run the launch: without one it runs as it is
                log.warning("a launch could not be captured in a CUDA graph; it runs eagerly", exc_info=True)
                self.enabled = False
                self.num_eager += 1
                return launch()
            self.num_captures += 1
            if len(self._graphs) > self.capacity:
                self._graphs.popitem(last=False)
        else:
            self._graphs.move_to_end(key)
        graph, out = got
        graph.replay()
        self.num_replays += 1
        return out

    def _capture(self, launch: Callable[[], Tensor]) -> tuple[torch.cuda.CUDAGraph, Tensor]:
        """The launch captured on a side stream that waits for the current one (not `torch.cuda.graph`,
        which synchronises the device and empties the allocator's cache at every capture)."""
        if self._pool is None:
            self._pool = torch.cuda.graph_pool_handle()
        graph = torch.cuda.CUDAGraph()
        current = torch.cuda.current_stream(self.device)
        side = torch.cuda.Stream(self.device)  # type: ignore[no-untyped-call]
        side.wait_stream(current)
        # (no cyclic collection inside a capture: `graph_capture.no_cyclic_gc`)
        with no_cyclic_gc(), torch.cuda.stream(side):
            graph.capture_begin(pool=self._pool, capture_error_mode="thread_local")
            try:
                out = launch()
            finally:
                graph.capture_end()
        current.wait_stream(side)
        return graph, out
