"""A small driver around model + pool + backend: prefill (chunked), decode, verify and commit by request id.

Meant for tests and examples (the engine has its own scheduler). It keeps each request's committed length and
hands the backend exactly what the engine would: request rows from the pool, KV capacity ensured first.
Decode and verify can run padded (`pad_to`) and, on CUDA, under CUDA graphs (`enable_cuda_graphs`).
"""

from __future__ import annotations

from collections.abc import Hashable, Mapping, Sequence
from typing import Any

import torch
from hyspec_attn_backends import CudaGraphRunner, ForwardBatch, ForwardFn, HybridBackend, model_state_specs
from hyspec_statepool import DraftShape, HybridStatePool, MemoryPlan, StateDtypes
from torch import Tensor


class Harness:
    """Run a `HybridCausalLM` request by request.

    Args:
        model: the model (target or anything with the same forward contract).
        max_num_seqs: request rows (and verify-scratch rows - 1).
        num_state_slots: recurrent-state slots (>= max_num_seqs).
        max_model_len: tokens per request.
        page_size: KV page size.
        draft_shape: verify-block shape the scratch is sized for (None: no verify).
        debug: NaN-poison free slots, slot 0 and scratch.
    """

    def __init__(
        self,
        model: Any,
        *,
        max_num_seqs: int = 6,
        num_state_slots: int | None = None,
        max_model_len: int = 160,
        page_size: int = 4,
        draft_shape: DraftShape | None = None,
        debug: bool = True,
    ) -> None:
        self.model = model
        dtype = next(model.parameters()).dtype
        device = next(model.parameters()).device
        specs = model_state_specs(model.mixer_layers())
        probe = MemoryPlan(
            specs=specs,
            max_model_len=max_model_len,
            max_num_seqs=max_num_seqs,
            draft_shape=draft_shape,
            page_size=page_size,
            num_state_slots=num_state_slots or max_num_seqs,
            num_kv_pages=0,
        )
        plan = MemoryPlan(
            specs=specs,
            max_model_len=max_model_len,
            max_num_seqs=max_num_seqs,
            draft_shape=draft_shape,
            page_size=page_size,
            num_state_slots=num_state_slots or max_num_seqs,
            num_kv_pages=max_num_seqs * probe.max_pages_per_request,
            dtypes=StateDtypes(kv=dtype, conv=dtype, recurrent=torch.float32),
        )
        self.pool = HybridStatePool(plan, device=device, debug=debug)
        self.backend = HybridBackend(self.pool, layers=model.mixer_layers(), layer_types=model.layer_types)
        self.lens: dict[Hashable, int] = {}
        self.graphs: CudaGraphRunner | None = None

    def enable_cuda_graphs(
        self, *, decode_sizes: Sequence[int] = (1, 2, 4, 8), verify: Sequence[tuple[int, bool]] = ()
    ) -> CudaGraphRunner:
        """Capture decode graphs for `decode_sizes` and verify graphs for each (D, tree) in `verify`.

        Later `decode` / `verify` calls pad to the smallest captured size and replay; sizes not captured run
        eagerly. On CPU nothing is captured (everything stays eager).
        """
        runner = CudaGraphRunner(self.backend, model_step_fn(self.model, self.backend))
        runner.capture_decode(decode_sizes)
        for d, tree in verify:
            runner.capture_verify(decode_sizes, verify_len=d, tree=tree)
        self.graphs = runner
        return runner

    def _step(self, batch: ForwardBatch) -> Tensor:
        """A DECODE / TARGET_VERIFY batch through the graph runner (or eagerly) -> live tokens' logits."""
        if self.graphs is not None:
            outs = self.graphs.run(batch)
        else:
            with torch.no_grad():
                outs = model_step_fn(self.model, self.backend)(batch)
        live_tokens = batch.num_live * max(batch.verify_len, 1)
        # a copy: graph outputs are overwritten by the next replay
        return outs[1][:live_tokens].to(torch.float32, copy=True)

    def _forward(
        self, batch: ForwardBatch, capture_layers: Sequence[int] = ()
    ) -> tuple[Tensor, tuple[Tensor, ...]]:
        with torch.no_grad():
            out = self.model(batch, self.backend, capture_layers=capture_layers)
            return self.model.compute_logits(out.hidden_states).float(), out.aux_hidden_states

    def alloc(self, req_ids: Sequence[Hashable]) -> None:
        self.pool.alloc(list(req_ids))
        for r in req_ids:
            self.lens.setdefault(r, 0)

    def free(self, req_ids: Sequence[Hashable]) -> None:
        self.pool.free(list(req_ids))
        for r in req_ids:
            del self.lens[r]

    def extend(
        self, chunks: Mapping[Hashable, Sequence[int]], capture_layers: Sequence[int] = ()
    ) -> dict[Hashable, Tensor]:
        """Append each request's tokens (prefill or a prefill chunk) in one batch; new requests are allocated.

        Returns per request the logits [q_len, V] of its new tokens (fp32).
        """
        ids = list(chunks)
        self.alloc([r for r in ids if r not in self.lens])
        q_lens = [len(chunks[r]) for r in ids]
        prefix = [self.lens[r] for r in ids]
        self.pool.ensure_kv_capacity(ids, [p + q for p, q in zip(prefix, q_lens, strict=True)])
        tokens = torch.tensor([t for r in ids for t in chunks[r]], dtype=torch.long)
        batch = self.backend.prepare_extend(
            req_rows=self.pool.req_rows(ids), input_ids=tokens, q_lens=q_lens, prefix_lens=prefix
        )
        logits, aux = self._forward(batch, capture_layers)
        self.last_aux = aux
        for r, q in zip(ids, q_lens, strict=True):
            self.lens[r] += q
        return dict(zip(ids, torch.split(logits, q_lens), strict=True))

    def decode(self, tokens: Mapping[Hashable, int], *, pad_to: int | None = None) -> dict[Hashable, Tensor]:
        """One token per request in one DECODE batch; returns logits [V] per request.

        `pad_to` pads the batch to that many rows; with CUDA graphs on, the batch is padded to the captured
        size that fits instead.
        """
        ids = list(tokens)
        prefix = [self.lens[r] for r in ids]
        self.pool.ensure_kv_capacity(ids, [p + 1 for p in prefix])
        req_rows = self.pool.req_rows(ids)
        input_ids = torch.tensor([tokens[r] for r in ids], dtype=torch.long)
        if self.graphs is not None and pad_to is None:
            batch = self.graphs.prepare_decode(req_rows=req_rows, input_ids=input_ids, prefix_lens=prefix)
        else:
            batch = self.backend.prepare_decode(
                req_rows=req_rows, input_ids=input_ids, prefix_lens=prefix, pad_to=pad_to
            )
        self.last_batch = batch
        logits = self._step(batch)
        for r in ids:
            self.lens[r] += 1
        return dict(zip(ids, logits, strict=True))

    def generate(self, req_id: Hashable, prompt: Sequence[int], max_new_tokens: int) -> list[int]:
        """Greedy generation (prefill then decode steps), ties to the lowest id like torch.argmax."""
        last = self.extend({req_id: prompt})[req_id][-1]
        out = [int(torch.argmax(last))]
        while len(out) < max_new_tokens:
            out.append(int(torch.argmax(self.decode({req_id: out[-1]})[req_id])))
        return out

    def verify(
        self,
        blocks: Mapping[Hashable, Sequence[int]],
        tree_parents: Tensor | None = None,
        *,
        pad_to: int | None = None,
    ) -> tuple[ForwardBatch, dict[Hashable, Tensor]]:
        """Run one TARGET_VERIFY batch (block token 0 = the current token); returns it and logits [D, V].

        `pad_to` as in `decode`.
        """
        ids = list(blocks)
        d = len(blocks[ids[0]])
        prefix = [self.lens[r] for r in ids]
        self.pool.ensure_kv_capacity(ids, [p + d for p in prefix])
        req_rows = self.pool.req_rows(ids)
        block_tokens = torch.tensor([list(blocks[r]) for r in ids], dtype=torch.long)
        if self.graphs is not None and pad_to is None:
            batch = self.graphs.prepare_verify(
                req_rows=req_rows, block_tokens=block_tokens, prefix_lens=prefix, tree_parents=tree_parents
            )
        else:
            batch = self.backend.prepare_verify(
                req_rows=req_rows,
                block_tokens=block_tokens,
                prefix_lens=prefix,
                tree_parents=tree_parents,
                pad_to=pad_to,
            )
        self.last_batch = batch
        logits = self._step(batch)
        return batch, dict(zip(ids, logits.view(len(ids), d, -1), strict=True))

    def commit(
        self,
        batch: ForwardBatch,
        req_ids: Sequence[Hashable],
        num_accepted: Sequence[int],
        accept_paths: Tensor | None = None,
    ) -> None:
        """Commit a verify (state and tree KV via the backend), advance lengths, drop surplus pages."""
        self.backend.commit_after_verify(
            batch=batch,
            num_accepted=torch.tensor(list(num_accepted), dtype=torch.long),
            accept_paths=accept_paths,
        )
        for r, k in zip(req_ids, num_accepted, strict=True):
            self.lens[r] += k + 1
            self.pool.truncate_kv(r, self.lens[r])


def model_step_fn(model: Any, backend: HybridBackend, capture_layers: Sequence[int] = ()) -> ForwardFn:
    """`batch -> (hidden_states [T, H], logits [T, V], *captured layers)`: what a step's CUDA graph runs."""

    def step(batch: ForwardBatch) -> tuple[Tensor, ...]:
        out = model(batch, backend, capture_layers=capture_layers)
        return (out.hidden_states, model.compute_logits(out.hidden_states), *out.aux_hidden_states)

    return step


def rel_err(got: Tensor, want: Tensor) -> float:
    """max |got - want| / max |want| (the parity metric of the model tests)."""
    return float((got.float() - want.float()).abs().max() / want.float().abs().max())


def snapshot_pool(pool: HybridStatePool) -> dict[str, Tensor]:
    """A copy of every tensor the pool allocated (KV, states, scratch, tables), by name."""
    return {name: t.clone() for name, t in pool.tensors().items()}


def restore_pool(pool: HybridStatePool, snapshot: Mapping[str, Tensor]) -> None:
    """Write a `snapshot_pool` copy back into the pool's tensors in place."""
    for name, t in pool.tensors().items():
        t.copy_(snapshot[name])


def _bits(t: Tensor) -> Tensor:
    # raw bytes: NaN-poisoned entries compare equal to themselves. Flattened first: an empty view keeps any
    # strides through `.contiguous()` (the pool's transposed conv scratch), which a dtype view refuses
    return t.detach().reshape(-1).view(torch.uint8)


def changes_outside(
    pool: HybridStatePool,
    before: Mapping[str, Tensor],
    *,
    slots: Sequence[int],
    kv_slots: Sequence[int],
    scratch_rows: int | None = None,
    tables: bool = True,
) -> list[str]:
    """Pool tensors that changed (bit for bit) anywhere but the given places; empty when none did.

    Allowed to change: state slots `slots` of every state pool, flat KV slots `kv_slots` of every attention
    layer, and verify scratch rows `>= scratch_rows` (None: no scratch row; 0: every row, as after a verify).
    The request tables must not change at all (unless `tables=False`: a commit truncates pages). The check
    behind "padded rows touch nothing" (bug class 3).
    """
    problems = []
    for name, now in pool.tensors().items():
        old = before[name]
        if name.startswith("table.") and not tables:
            continue
        if name.startswith("kv."):
            keep = torch.ones(now.shape[1] * now.shape[2], dtype=torch.bool, device=now.device)
            keep[list(kv_slots)] = False
            now, old = now.flatten(1, 2)[:, keep], old.flatten(1, 2)[:, keep]  # [L, kept slots, HKV, Dh]
        elif name.startswith("state."):
            keep = torch.ones(now.shape[1], dtype=torch.bool, device=now.device)
            keep[list(slots)] = False
            now, old = now[:, keep], old[:, keep]
        elif name.startswith("scratch.") and scratch_rows is not None:
            now, old = now[:, :scratch_rows], old[:, :scratch_rows]
        if not torch.equal(_bits(now), _bits(old)):
            problems.append(name)
    return problems
