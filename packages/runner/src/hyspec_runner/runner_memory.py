"""The model runner's memory at start-up: the budget (what the weights leave, `sizing.py`), the state pool's
plan for it, the drafter (built before the pool: on CUDA what it takes comes off the pool's budget), the pool
and its prefix cache, and the start-up lines that say how it was split."""

from __future__ import annotations

import logging
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from hyspec_attn_backends import MixerLayer, model_state_specs
from hyspec_kernels.gdn import CHUNK_SIZE
from hyspec_spec_workers.round import SpeculativeRound
from hyspec_statepool.pool import ENGINE_SPARE_PAGES, HybridStatePool
from hyspec_statepool.prefix_cache import PrefixCache
from hyspec_statepool.sizing import MemoryPlan
from hyspec_statepool.specs import StateDtypes

from hyspec_runner.config import EngineArgs, num_snapshot_slots, step_capacity
from hyspec_runner.pool_memory import MemoryFollower, StatePoolMemory
from hyspec_runner.sizing import (
    Budget,
    PoolShape,
    activation_bytes,
    default_max_num_seqs,
    fit_pool,
    max_concurrency,
    memory_budget,
)
from hyspec_runner.speculative import DrafterContext, DrafterRegistry

log = logging.getLogger("hyspec.runner")


@dataclass(frozen=True, slots=True)
class RunnerMemory:
    """What `build_memory` made: the pool (`max_num_seqs` requests, resolved), the engine's memory seam over
    it and the speculative round (None without speculation), which follows the pool's lifecycle."""

    pool: HybridStatePool
    memory: StatePoolMemory
    spec: SpeculativeRound | None
    max_num_seqs: int


def build_memory(
    args: EngineArgs,
    *,
    model: Any,
    layers: list[MixerLayer],
    model_dir: Path,
    device: torch.device,
    dtype: torch.dtype,
    max_model_len: int,
    vocab_size: int,
    hidden_size: int,
    drafters: DrafterRegistry | None,
) -> RunnerMemory:
    """Size and allocate the state pool for the loaded `model`, building the configured drafter first."""
    spec_config = args.speculative_config
    draft_shape = None if spec_config is None else spec_config.draft_shape()
    specs = model_state_specs(layers)
    dtypes = StateDtypes(kv=dtype, conv=dtype)
    has_kv = bool(specs.attention_layers)
    if args.enable_prefix_caching and not has_kv:
        log.warning("prefix caching is off: the model has no attention layer to key pages by")
    # the pool is sized from what the weights leave (sizing.py); padded graph rows use slot -1 and KV
    # slot -1, so they need no request of their own
    default_seqs = default_max_num_seqs(device)
    rows = (args.max_num_seqs or default_seqs) * (1 if spec_config is None else spec_config.max_draft_tokens)
    budget = memory_budget(
        args,
        device,
        activations=activation_bytes(
            num_tokens=max(step_capacity(args, args.max_num_seqs or default_seqs, max_model_len), rows),
            num_logit_rows=rows,
            hidden_size=hidden_size,
            vocab_size=vocab_size,
            dtype=dtype,
        ),
    )
    shape = PoolShape(
        specs=specs,
        max_model_len=max_model_len,
        draft_shape=draft_shape,
        page_size=args.page_size,
        dtypes=dtypes,
        snapshot_slots=lambda n: num_snapshot_slots(args, n) if has_kv else 0,
    )
    plan = fit_pool(shape, budget, max_num_seqs=args.max_num_seqs, default=default_seqs)
    max_num_seqs = plan.max_num_seqs
    spec: SpeculativeRound | None = None
    followers: list[MemoryFollower] = []
    if spec_config is not None:
        # the drafter (and a DFlash draft's own KV) is built before the pool: on CUDA what it takes
        # comes off the pool's budget
        before = _allocated_bytes(device)
        ctx = DrafterContext(
            config=spec_config,
            target=model,
            target_path=model_dir,
            max_num_seqs=max_num_seqs,
            max_model_len=max_model_len,
            page_size=args.page_size,
            kv_dtype=dtype,
            device=device,
            num_snapshots=num_snapshot_slots(args, max_num_seqs) if has_kv else 0,
        )
        try:
            drafter = (drafters or DrafterRegistry()).build(ctx)
        except torch.OutOfMemoryError as e:
            raise ValueError(
                f"speculative_config: the {spec_config.method!r} drafter for max_num_seqs={max_num_seqs} "
                f"at max_model_len={max_model_len} does not fit in GPU memory; lower max_num_seqs "
                f"or max_model_len"
            ) from e
        taken = _allocated_bytes(device) - before
        if taken > 0 and not budget.fixed:
            budget = Budget(
                budget.bytes - taken,
                f"{budget.source}, less {taken / 2**30:.2f} GiB for the drafter",
                False,
            )
            plan = fit_pool(shape, budget, max_num_seqs=max_num_seqs, default=max_num_seqs)
        spec = SpeculativeRound.from_config(spec_config, drafter)
        vocab = spec_config.draft_vocab
        log.info(
            "speculative decoding: %s%s",
            spec_config,
            ""
            if vocab is None
            else f" with draft vocabulary {vocab if isinstance(vocab, str) else len(vocab)}",
        )
        followers.append(spec)
    pool = HybridStatePool(plan, device=device, spare_pages=ENGINE_SPARE_PAGES)
    num_snapshots = plan.num_state_slots - max_num_seqs
    cache = PrefixCache(pool, num_snapshots=num_snapshots) if num_snapshots else None
    every = args.prefix_cache_snapshot_interval
    assert every is not None  # EngineArgs resolves its default
    memory = StatePoolMemory(
        pool,
        followers=followers,
        prefix_cache=cache,
        snapshot_interval=every,
        # the prefill kernels write states inside a forward at their chunk boundaries (StateSave)
        inner_snapshots=every % CHUNK_SIZE == 0,
    )
    log_pool_split(plan, num_snapshots, every, budget)
    return RunnerMemory(pool=pool, memory=memory, spec=spec, max_num_seqs=max_num_seqs)


def _allocated_bytes(device: torch.device) -> int:
    return int(torch.cuda.memory_allocated(device)) if device.type == "cuda" else 0


def log_pool_split(plan: MemoryPlan, num_snapshots: int, interval: int, budget: Budget) -> None:
    """Start-up lines: what the state pool holds, how many requests fit at full context, and how much of it
    the prefix cache gets."""
    per_slot = plan.state_bytes // max(1, plan.num_state_slots + 1)
    cache = (
        f"prefix cache: {num_snapshots} snapshot slots ({num_snapshots * per_slot / 2**20:.1f} MiB), "
        f"a snapshot every {interval} prefill tokens"
        if num_snapshots
        else "prefix caching off"
    )
    log.info(
        "memory for the KV cache and recurrent state: %.2f GiB (%s), of which the pool takes %.2f GiB",
        budget.bytes / 2**30,
        budget.source,
        plan.total_bytes / 2**30,
    )
    log.info(
        "state pool: %d request slots of %.1f MiB state, %d KV pages of %d tokens (%.1f MiB); %s",
        plan.max_num_seqs,
        per_slot / 2**20,
        plan.num_kv_pages,
        plan.page_size,
        plan.kv_bytes / 2**20,
        cache,
    )
    log.info(
        "maximum concurrency at max_model_len=%d: %.2fx (max_num_seqs=%d)",
        plan.max_model_len,
        max_concurrency(plan),
        plan.max_num_seqs,
    )
