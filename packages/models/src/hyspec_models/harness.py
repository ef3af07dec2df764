"""A small driver around model + pool + backend: prefill (chunked), decode, verify and commit by request id.

Meant for tests and examples (the engine has its own scheduler). It keeps each request's committed length and
hands the backend exactly what the engine would: request rows from the pool, KV capacity ensured first.
"""

from __future__ import annotations

from collections.abc import Hashable, Mapping, Sequence
from typing import Any

import torch
from hyspec_attn_backends import ForwardBatch, HybridBackend, model_state_specs
from hyspec_statepool import DraftShape, HybridStatePool, MemoryPlan, StateDtypes
from torch import Tensor


class Harness:
    """Run a `HybridCausalLM` request by request.

    Args:
        model: the model (target or anything with the same forward contract).
        max_running: request rows (and verify-scratch rows - 1).
        num_state_slots: recurrent-state slots (>= max_running).
        max_context: tokens per request.
        page_size: KV page size.
        draft_shape: verify-block shape the scratch is sized for (None: no verify).
        debug: NaN-poison free slots, slot 0 and scratch.
    """

    def __init__(
        self,
        model: Any,
        *,
        max_running: int = 6,
        num_state_slots: int | None = None,
        max_context: int = 160,
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
            max_context=max_context,
            max_running=max_running,
            draft_shape=draft_shape,
            page_size=page_size,
            num_state_slots=num_state_slots or max_running,
            num_kv_pages=0,
        )
        plan = MemoryPlan(
            specs=specs,
            max_context=max_context,
            max_running=max_running,
            draft_shape=draft_shape,
            page_size=page_size,
            num_state_slots=num_state_slots or max_running,
            num_kv_pages=max_running * probe.max_pages_per_request,
            dtypes=StateDtypes(kv=dtype, conv=dtype, recurrent=torch.float32),
        )
        self.pool = HybridStatePool(plan, device=device, debug=debug)
        self.backend = HybridBackend(self.pool, layers=model.mixer_layers(), layer_types=model.layer_types)
        self.lens: dict[Hashable, int] = {}

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

    def decode(self, tokens: Mapping[Hashable, int]) -> dict[Hashable, Tensor]:
        """One token per request in one DECODE batch; returns logits [V] per request."""
        ids = list(tokens)
        prefix = [self.lens[r] for r in ids]
        self.pool.ensure_kv_capacity(ids, [p + 1 for p in prefix])
        batch = self.backend.prepare_decode(
            req_rows=self.pool.req_rows(ids),
            input_ids=torch.tensor([tokens[r] for r in ids], dtype=torch.long),
            prefix_lens=prefix,
        )
        logits, _ = self._forward(batch)
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
        self, blocks: Mapping[Hashable, Sequence[int]], tree_parents: Tensor | None = None
    ) -> tuple[ForwardBatch, dict[Hashable, Tensor]]:
        """Run one TARGET_VERIFY batch (block token 0 = the current token); returns it and logits [D, V]."""
        ids = list(blocks)
        d = len(blocks[ids[0]])
        prefix = [self.lens[r] for r in ids]
        self.pool.ensure_kv_capacity(ids, [p + d for p in prefix])
        batch = self.backend.prepare_verify(
            req_rows=self.pool.req_rows(ids),
            block_tokens=torch.tensor([list(blocks[r]) for r in ids], dtype=torch.long),
            prefix_lens=prefix,
            tree_parents=tree_parents,
        )
        logits, _ = self._forward(batch)
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


def rel_err(got: Tensor, want: Tensor) -> float:
    """max |got - want| / max |want| (the parity metric of the model tests)."""
    return float((got.float() - want.float()).abs().max() / want.float().abs().max())
