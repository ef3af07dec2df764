"""How many requests fit, and with how much KV: the state pool sized from the memory the device has left.

On CUDA the budget is `gpu_memory_utilization` of the GPU's memory, less what is already in use once the
weights are loaded (the weights, other processes) and an estimate of the activations of the largest step; on
the CPU it is a fixed `CPU_KV_CACHE_BYTES` (vLLM's `VLLM_CPU_KVCACHE_SPACE` default), never more than the
requests can use. `kv_cache_bytes` overrides both. `hyspec_statepool.plan_memory` splits the budget into
request state slots, prefix-cache snapshot slots, verify scratch, tables and KV pages; when `max_num_seqs` is
left at its default, it is lowered to what fits with room for one request at `max_model_len`.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
from hyspec_statepool.draft_shape import DraftShape
from hyspec_statepool.sizing import MemoryPlan, plan_memory
from hyspec_statepool.specs import ModelStateSpecs, StateDtypes

from hyspec_runner.config import DEFAULT_MAX_NUM_SEQS, EngineArgs, device_kind

CPU_KV_CACHE_BYTES = 4 << 30
# CUDA-graph pools, the allocator's fragmentation and kernel workspaces, on top of the activation estimate
_CUDA_OVERHEAD_BYTES = 512 << 20
_GIB = float(1 << 30)


def default_max_num_seqs(device: torch.device) -> int:
    # vLLM's: 256 running requests where a GPU batches them; the CPU gains little past a few
    return DEFAULT_MAX_NUM_SEQS[device_kind(str(device))]


def activation_bytes(
    *, num_tokens: int, num_logit_rows: int, hidden_size: int, vocab_size: int, dtype: torch.dtype
) -> int:
    """A generous estimate of one step's transient memory: ~32 hidden-sized activations per token (MLP
    intermediates, attention and recurrent-mixer temporaries) and four fp32 vocabulary rows per sampled
    position (logits, probabilities, log-probabilities, penalties)."""
    elt = torch.empty((), dtype=dtype).element_size()
    return num_tokens * hidden_size * elt * 32 + num_logit_rows * vocab_size * 4 * 4


@dataclass(frozen=True, slots=True)
class Budget:
    """Bytes for the state pool (and a model drafter's own KV) and, for messages, where they come from."""

    bytes: int
    source: str
    fixed: bool  # True: kv_cache_bytes or the CPU budget; False: measured from the GPU's free memory


def memory_budget(args: EngineArgs, device: torch.device, *, activations: int) -> Budget:
    """Call once the weights are on the device: on CUDA the budget is what they leave."""
    if args.kv_cache_bytes is not None:
        return Budget(args.kv_cache_bytes, f"kv_cache_bytes={args.kv_cache_bytes}", True)
    if device.type != "cuda":
        return Budget(
            CPU_KV_CACHE_BYTES,
            f"the CPU budget of {CPU_KV_CACHE_BYTES / _GIB:.0f} GiB (kv_cache_bytes sets another)",
            True,
        )
    free, total = torch.cuda.mem_get_info(device)
    used = total - free
    reserve = activations + _CUDA_OVERHEAD_BYTES
    util = args.gpu_memory_utilization
    left = int(total * util) - used - reserve
    source = (
        f"gpu_memory_utilization={util} of {total / _GIB:.1f} GiB, less {used / _GIB:.2f} GiB in use (the "
        f"weights and any other process) and {reserve / _GIB:.2f} GiB kept for activations"
    )
    if left <= 0:
        raise ValueError(
            f"gpu_memory_utilization: {source} leaves nothing for the KV cache and recurrent state; raise "
            f"gpu_memory_utilization, lower max_num_batched_tokens, or free the GPU"
        )
    return Budget(left, source, False)


@dataclass(frozen=True, slots=True)
class PoolShape:
    """Everything `plan_memory` needs besides the budget and the request count."""

    specs: ModelStateSpecs
    max_model_len: int
    draft_shape: DraftShape | None
    page_size: int
    dtypes: StateDtypes
    snapshot_slots: Callable[[int], int]  # max_num_seqs -> prefix-cache snapshot slots

    def plan(self, budget: int, max_num_seqs: int) -> MemoryPlan:
        return plan_memory(
            budget,
            self.specs,
            max_model_len=self.max_model_len,
            max_num_seqs=max_num_seqs,
            draft_shape=self.draft_shape,
            page_size=self.page_size,
            dtypes=self.dtypes,
            num_state_slots=max_num_seqs + self.snapshot_slots(max_num_seqs),
        )

    def bytes_for_one(self) -> int:
        """What one request at `max_model_len` needs: its state slot(s), scratch, table row and KV pages."""
        base = MemoryPlan(
            specs=self.specs,
            max_model_len=self.max_model_len,
            max_num_seqs=1,
            draft_shape=self.draft_shape,
            page_size=self.page_size,
            num_state_slots=1 + self.snapshot_slots(1),
            num_kv_pages=0,
            dtypes=self.dtypes,
        )
        pages = base.max_pages_per_request if self.specs.attention_layers else 0
        return base.total_bytes + pages * base.kv_bytes_per_page


def fit_pool(shape: PoolShape, budget: Budget, *, max_num_seqs: int | None, default: int) -> MemoryPlan:
    """The plan for `max_num_seqs` requests, or (None) for the most requests up to `default` that fit with
    one of them at full context. Raises ValueError saying what is needed and what to lower."""
    if max_num_seqs is not None:
        try:
            return shape.plan(budget.bytes, max_num_seqs)
        except ValueError as e:
            raise ValueError(_no_fit(shape, budget, f"max_num_seqs={max_num_seqs}: ") + f" ({e})") from None
    lo, hi = 0, default  # lo: most known to fit (0: none yet)
    best: MemoryPlan | None = None
    n = default
    while lo < hi:
        try:
            plan = shape.plan(budget.bytes, n)
        except ValueError:
            hi = n - 1
        else:
            lo, best = n, plan
        n = (lo + hi + 1) // 2
    if best is None:
        raise ValueError(_no_fit(shape, budget, ""))
    return best


def _no_fit(shape: PoolShape, budget: Budget, prefix: str) -> str:
    need = shape.bytes_for_one()
    lower = "max_model_len, max_num_seqs or the draft length"
    more = "kv_cache_bytes" if budget.fixed else "gpu_memory_utilization (or use kv_cache_bytes)"
    return (
        f"{prefix}one request at max_model_len={shape.max_model_len} needs {need / _GIB:.3f} GiB of KV cache "
        f"and recurrent state, and {budget.source} leaves {budget.bytes / _GIB:.3f} GiB; lower {lower}, "
        f"or raise {more}"
    )


def max_concurrency(plan: MemoryPlan) -> float:
    """Requests that fit at once at full context: KV pages over pages per request (state slots without
    attention layers)."""
    if not plan.specs.attention_layers:
        return float(plan.max_num_seqs)
    return min(plan.max_num_seqs, plan.num_kv_pages / plan.max_pages_per_request)
