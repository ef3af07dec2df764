"""Public, validated entry points of the gated delta rule: prefill, decode and verify.

Layouts: recurrent state [HV, K, V] per slot (pool [S, HV, K, V]); tokens packed token-major. q and k are
L2-normalised inside every op and q is scaled by K^-1/2; value head h reads key head h // (HV // HK).

Every wrapper checks dtype, shape, device and index ranges, and raises a ValueError naming the argument.
Index range checks read the index tensors on the host; on CUDA that is a sync, so `check_indices` follows the
rule of every op (`value_checks`): None (default) checks on the CPU only, True on any device (debug mode),
False never (hot paths whose indices are known to be valid); never while a CUDA graph is being captured.
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence
from functools import partial
from typing import NamedTuple

import torch

from .._checks import (
    FLOAT_DTYPES,
    INDEX_DTYPES,
    Backend,
    check_index,
    check_tensor,
    implementation,
    resolve_backend,
)
from ..saves import StateSave, check_saves, slots_tensor
from ..transfer import to_device
from . import reference, torch_impl
from .checks import (
    MAX_RECOMPUTE_NODES,
    STATE_DTYPES,
    check_blocks_contiguous,
    check_distinct,
    check_indices_now,
    check_keep_inputs,
    check_parents,
    check_qkv,
    check_state,
    check_triton_dims,
)
from .pending import PendingTokens, apply_pending, check_pending, next_rows
from .reference import CHUNK_SIZE

# (A_log [HV], dt_bias [HV]): the gate parameters of decode / verify calls given the raw a and b
RawGates = tuple[torch.Tensor, torch.Tensor]


def _gates(
    g: torch.Tensor, beta: torch.Tensor, raw_gates: RawGates | None, hv: int, backend: Backend
) -> tuple[torch.Tensor, torch.Tensor, RawGates | None]:
    """(g, beta, raw_gates) for the chosen path: the Triton kernel gates raw inputs itself; the reference
    and torch paths get them gated first, by `gdn_gating` (the same formula)."""
    if raw_gates is None:
        return g, beta, None
    if not isinstance(raw_gates, tuple | list) or len(raw_gates) != 2:
        raise ValueError(f"raw_gates: expected (A_log [HV], dt_bias [HV]), got {type(raw_gates).__name__}")
    dev = g.device
    A_log = check_tensor("raw_gates[0] (A_log)", raw_gates[0], (hv,), dtypes=FLOAT_DTYPES, device=dev)
    dt_bias = check_tensor("raw_gates[1] (dt_bias)", raw_gates[1], (hv,), dtypes=FLOAT_DTYPES, device=dev)
    chosen = resolve_backend(backend, dev)
    if chosen == "triton":
        return g, beta, (A_log, dt_bias)
    from ..gating import gdn_gating

    # [T, HV] by merging the leading dims (not reshape(-1, hv): ambiguous for zero value heads)
    a, b = g.flatten(0, -2), beta.flatten(0, -2)
    flat_g, flat_beta = gdn_gating(A_log, a, b, dt_bias, backend=chosen)
    return flat_g.reshape(g.shape), flat_beta.reshape(beta.shape), None


class GDNPrefillOutput(NamedTuple):
    o: torch.Tensor  # [T, HV, V], q's dtype
    chunk_states: (
        torch.Tensor | None
    )  # [total_chunks, HV, K, V] fp32: state at the start of each 64-token chunk


def _prefill_triton(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    *,
    cu_seqlens: torch.Tensor,
    cu_host: list[int],
    state: torch.Tensor,
    state_slots: torch.Tensor,
    has_initial_state: torch.Tensor,
    return_chunk_states: bool,
    chunk_saves: Sequence[tuple[int, int]] = (),
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """The chunked Triton prefill, launched over the offsets the wrapper already read to the host; its
    sequential stage writes the `chunk_saves` ((chunk, slot) pairs) itself."""
    from .triton_chunk import launch_chunk_prefill

    check_triton_dims(q.shape[-1], v.shape[-1])
    return launch_chunk_prefill(
        q,
        k,
        v,
        g,
        beta,
        cu_seqlens=cu_host,
        state=state,
        state_slots=state_slots.contiguous(),  # the kernel steps through it by 1: a strided view is copied
        has_initial_state=has_initial_state.to(torch.int8).contiguous(),
        return_chunk_states=return_chunk_states,
        chunk_saves=chunk_saves,
    )


def _decode_triton(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    *,
    state: torch.Tensor,
    state_slots: torch.Tensor,
    pending: PendingTokens | None = None,
    raw_gates: RawGates | None = None,
) -> torch.Tensor:
    """Decode as a one-token verify block without scratch (the same recurrent kernel)."""
    one = (t.unsqueeze(1) for t in (q, k, v, g, beta))
    o = _verify_triton(
        *one,
        state=state,
        state_slots=state_slots,
        scratch=None,
        scratch_rows=None,
        parents=None,
        write_state=True,
        pending=pending,
        raw_gates=raw_gates,
    )
    return o.squeeze(1)


def _verify_triton(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    *,
    state: torch.Tensor,
    state_slots: torch.Tensor,
    scratch: torch.Tensor | None,
    scratch_rows: torch.Tensor | None,
    parents: torch.Tensor | None,
    write_state: bool = False,
    keep_inputs: reference.Inputs | None = None,
    input_rows: torch.Tensor | None = None,
    workspace: bool = False,
    pending: PendingTokens | None = None,
    raw_gates: RawGates | None = None,
) -> torch.Tensor:
    """The recurrent kernel over [N, D] blocks: verify (the steps' states to scratch, or nothing without
    scratch), or with `write_state` decode (the final state written back). `workspace`: the scratch is a
    tree's workspace for this call, so only the states a later token restarts from are written."""
    from .triton_recurrent import launch_recurrent

    check_triton_dims(q.shape[-1], v.shape[-1])
    check_blocks_contiguous("state", state, 3)
    if scratch is not None:
        check_blocks_contiguous("scratch", scratch, 3)
    # the kernel steps through the index vectors (and each row of pending.paths) by 1: strided views (a
    # column of packed metadata) are copied
    return launch_recurrent(
        q,
        k,
        v,
        g,
        beta,
        state=state,
        state_slots=state_slots.contiguous(),
        scratch=scratch,
        scratch_rows=None if scratch_rows is None else scratch_rows.contiguous(),
        parents=None if parents is None else parents.contiguous(),
        out_dtype=q.dtype,
        verify=not write_state,
        keep_inputs=keep_inputs if pending is None else pending.inputs,
        input_rows=None if input_rows is None else input_rows.contiguous(),
        branch_states_only=workspace,
        pending=None if pending is None else (pending.rows.contiguous(), pending.paths.contiguous()),
        raw_gates=raw_gates,
    )


def gdn_prefill(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    *,
    cu_seqlens: torch.Tensor,
    state: torch.Tensor,
    state_slots: torch.Tensor,
    has_initial_state: torch.Tensor,
    return_chunk_states: bool = False,
    save_states: Sequence[StateSave] = (),
    cu_seqlens_host: Sequence[int] | None = None,
    backend: Backend = "auto",
    check_indices: bool | None = None,
) -> GDNPrefillOutput:
    """Chunked prefill over packed variable-length sequences.

    Args:
        q, k: [T, HK, K] fp32/bf16/fp16. v: [T, HV, V], same dtype. g (log-decay), beta: [T, HV] fp32.
        cu_seqlens: [N + 1] int32/int64 offsets of the N sequences in the packed tokens.
        state: [S, HV, K, V] fp32/bf16 pool. The initial state of sequence n is state[state_slots[n]] when
            state_slots[n] >= 0 and has_initial_state[n], else zero; its final state is written to
            state[state_slots[n]] when state_slots[n] >= 0 (slot -1 is a padded row: no read, no write).
        state_slots: [N] int32/int64 in [0, S) or -1, distinct. has_initial_state: [N] bool.
        return_chunk_states: also return the fp32 state at the start of every 64-token chunk, chunks numbered
            sequence by sequence.
        save_states: states part-way through a sequence to write to other slots of `state` (`StateSave`: the
            state after sequence `seq`'s tokens before packed index `token`): at a chunk boundary of the
            sequence (`token - its start` a multiple of CHUNK_SIZE), each to a distinct slot no sequence of
            the call uses. They hold the state a prefill ending there would have left (a prefix cache's
            snapshots without splitting the forward).
        cu_seqlens_host: the same offsets as host ints, when the caller has them (a forward's batch does):
            the launch then reads nothing back from the device (no sync per layer); compared with
            `cu_seqlens` where index values are checked (`check_indices`).

    Returns:
        GDNPrefillOutput(o [T, HV, V] in q's dtype, chunk_states [total_chunks, HV, K, V] fp32 or None).
    """
    q, k, v, g, beta, _hk, head_k, hv, head_v = check_qkv(q, k, v, g, beta, ("T",))
    dev, num_tokens = q.device, q.shape[0]
    state = check_state(state, hv, head_k, head_v, dev)
    cu_seqlens = check_tensor("cu_seqlens", cu_seqlens, (None,), dtypes=INDEX_DTYPES, device=dev)
    check = check_indices_now(check_indices, dev)
    # one host read serves both the checks and the Triton launch grids, unless the caller has the offsets
    cu_host = [int(x) for x in (cu_seqlens.tolist() if cu_seqlens_host is None else cu_seqlens_host)]
    if cu_seqlens_host is not None and (
        len(cu_host) != cu_seqlens.shape[0] or (check and cu_host != cu_seqlens.tolist())
    ):
        raise ValueError(f"cu_seqlens_host: expected the offsets of cu_seqlens, got {cu_host}")
    if not cu_host or cu_host[0] != 0 or cu_host[-1] != num_tokens:
        raise ValueError(f"cu_seqlens: expected [N + 1] offsets from 0 to {num_tokens}, got {cu_host}")
    if any(b < a for a, b in itertools.pairwise(cu_host)):
        raise ValueError(f"cu_seqlens: expected non-decreasing offsets, got {cu_host}")
    num_seqs = len(cu_host) - 1
    if check:
        state_slots = check_index(
            "state_slots", state_slots, (num_seqs,), low=0, high=state.shape[0], device=dev
        )
        check_distinct("state_slots", state_slots)
    else:
        state_slots = check_tensor("state_slots", state_slots, (num_seqs,), dtypes=INDEX_DTYPES, device=dev)
    has_initial_state = check_tensor(
        "has_initial_state", has_initial_state, (num_seqs,), dtypes=(torch.bool,), device=dev
    )
    chunk_ids = _save_chunks(save_states, cu_host, state.shape[0], state_slots, check)
    # the Triton kernel writes the saves as it passes them; the other paths copy them from the chunk states
    in_kernel = resolve_backend(backend, dev) == "triton"
    chunk_saves = [(c, s.slot) for c, s in zip(chunk_ids, save_states, strict=True)]
    fn = implementation(
        backend,
        dev,
        reference=reference.reference_prefill,
        torch_path=torch_impl.torch_prefill,
        triton=lambda: partial(_prefill_triton, cu_host=cu_host, chunk_saves=chunk_saves),
    )
    o, cs = fn(
        q,
        k,
        v,
        g,
        beta,
        cu_seqlens=cu_seqlens,
        state=state,
        state_slots=state_slots,
        has_initial_state=has_initial_state,
        return_chunk_states=return_chunk_states or (bool(chunk_ids) and not in_kernel),
    )
    if chunk_ids and not in_kernel:
        assert cs is not None
        ids = to_device(chunk_ids, dtype=torch.int64, device=dev)
        state.index_copy_(0, slots_tensor(save_states, dev), cs.index_select(0, ids).to(state.dtype))
    return GDNPrefillOutput(o.to(q.dtype), cs if return_chunk_states else None)


def _save_chunks(
    saves: Sequence[StateSave],
    bounds: list[int],
    num_slots: int,
    state_slots: torch.Tensor,
    check: bool,
) -> list[int]:
    """The chunk (numbered sequence by sequence, as chunk_states) whose starting state each save writes."""
    if not saves:
        return []
    # host values: always checked; against the call's own slots only where indices are read back
    check_saves(saves, bounds, num_slots, state_slots.tolist() if check else None)
    chunks = (-(-(b - a) // CHUNK_SIZE) for a, b in itertools.pairwise(bounds))
    firsts = list(itertools.accumulate(chunks, initial=0))
    out = []
    for s in saves:
        into = s.token - bounds[s.seq]
        if into % CHUNK_SIZE:
            raise ValueError(
                f"save_states: {s} is {into} tokens into its sequence, not a multiple of "
                f"CHUNK_SIZE={CHUNK_SIZE}"
            )
        out.append(firsts[s.seq] + into // CHUNK_SIZE)
    return out


def gdn_decode(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    *,
    state: torch.Tensor,
    state_slots: torch.Tensor,
    pending: PendingTokens | None = None,
    raw_gates: RawGates | None = None,
    backend: Backend = "auto",
    check_indices: bool | None = None,
) -> torch.Tensor:
    """One token per sequence; the state is read from and written back to its slot in place.

    Args:
        q, k: [N, HK, K] fp32/bf16/fp16. v: [N, HV, V], same dtype. g, beta: [N, HV] fp32.
        state: [S, HV, K, V] fp32/bf16 pool. state_slots: [N] in [0, S) or -1 (padded row: computed from a
            zero state, nothing read or written), distinct.
        pending: deferred commits (`pending.py`): each slot's pending tokens are applied before its token
            (the caller then clears `pending.paths` of these slots).
        raw_gates: (A_log [HV], dt_bias [HV]): g and beta are the raw gate inputs a and b ([N, HV], any
            float dtype, any token stride), gated as `gdn_gating` gates them (the Triton kernel does it
            itself: no launch of its own).

    Returns:
        o: [N, HV, V] in q's dtype.
    """
    q, k, v, g, beta, _hk, head_k, hv, head_v = check_qkv(q, k, v, g, beta, ("N",), raw=raw_gates is not None)
    g, beta, raw_gates = _gates(g, beta, raw_gates, hv, backend)
    dev, num_seqs = q.device, q.shape[0]
    state = check_state(state, hv, head_k, head_v, dev)
    if check_indices_now(check_indices, dev):
        state_slots = check_index(
            "state_slots", state_slots, (num_seqs,), low=0, high=state.shape[0], device=dev
        )
        check_distinct("state_slots", state_slots)
    else:
        state_slots = check_tensor("state_slots", state_slots, (num_seqs,), dtypes=INDEX_DTYPES, device=dev)
    if pending is not None:
        pending = check_pending(pending, state)
        check_keep_inputs(
            pending.inputs, pending.rows[:0], k[:0, None], v[:0, None], False, name="pending.inputs"
        )
        if resolve_backend(backend, dev) != "triton":
            # the reference and torch paths apply the pending tokens first, as their own step
            apply_pending(pending, state, state_slots, backend=backend)
    fn = implementation(
        backend,
        dev,
        reference=reference.reference_decode,
        torch_path=torch_impl.torch_decode,
        triton=lambda: partial(_decode_triton, pending=pending, raw_gates=raw_gates),
    )
    o: torch.Tensor = fn(q, k, v, g, beta, state=state, state_slots=state_slots)
    return o.to(q.dtype)


def gdn_verify(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    *,
    state: torch.Tensor,
    state_slots: torch.Tensor,
    scratch: torch.Tensor | None,
    scratch_rows: torch.Tensor | None,
    parents: torch.Tensor | None = None,
    keep_inputs: reference.Inputs | None = None,
    input_rows: torch.Tensor | None = None,
    pending: PendingTokens | None = None,
    raw_gates: RawGates | None = None,
    backend: Backend = "auto",
    check_indices: bool | None = None,
) -> torch.Tensor:
    """Verify blocks of D tokens per sequence (chain or tree). Never writes `state` (but with `pending`).

    Args:
        q, k: [N, D, HK, K] fp32/bf16/fp16. v: [N, D, HV, V], same dtype. g, beta: [N, D, HV] fp32.
        state: [S, HV, K, V] committed states, read only. state_slots: [N] in [0, S) or -1 (padded row:
            starts from a zero state).
        scratch: [R, Dmax, HV, K, V] fp32/bf16 with Dmax >= D; the state after step j of sequence n is written
            to scratch[scratch_rows[n], j] (row strides from the allocated Dmax). scratch_rows: [N] in
            [0, R) or -1 (no scratch write), distinct. Both None: nothing is kept, the accepted steps are
            committed by replaying them (`gdn_replay`); a tree token then starts from its parent's state
            recomputed along the parent's path (Triton), or kept in a workspace of this call (the reference
            and torch paths, and trees over MAX_RECOMPUTE_NODES nodes).
        keep_inputs: (k [R, Dmax, HK, K], v [R, Dmax, HV, V], g [R, Dmax, HV], beta [R, Dmax, HV]) fp32
            buffers: token j's raw inputs go to row `input_rows[n]` ([N], -1: none), step j, for the replay.
        parents: [N, D] in [-1, j) for token j: the block index of token j's parent, -1 for a root, which
            continues from the committed state. None means a chain. In tree mode with scratch a token's start
            state is re-read from it, so every row with a state slot needs a scratch row; rows with neither
            get unspecified output.
        pending: deferred commits (`pending.py`), instead of `keep_inputs` and `input_rows`: each slot's
            pending tokens are applied first and the state reached is written back to the slot; the block's
            inputs go to the slot's next rows (`next_rows`) of `pending.inputs` (the caller then makes them
            the slot's pending tokens, or clears them).
        raw_gates: (A_log [HV], dt_bias [HV]): g and beta are the raw gate inputs a and b, as in `gdn_decode`
            (the inputs kept for the replay are the gated values either way).

    Returns:
        o: [N, D, HV, V] in q's dtype.
    """
    q, k, v, g, beta, _hk, head_k, hv, head_v = check_qkv(
        q, k, v, g, beta, ("N", "D"), raw=raw_gates is not None
    )
    g, beta, raw_gates = _gates(g, beta, raw_gates, hv, backend)
    dev, num_seqs, block = q.device, q.shape[0], q.shape[1]
    state = check_state(state, hv, head_k, head_v, dev)
    if (scratch is None) != (scratch_rows is None):
        raise ValueError("scratch, scratch_rows: expected both or neither")
    if (keep_inputs is None) != (input_rows is None):
        raise ValueError("keep_inputs, input_rows: expected both or neither")
    triton = resolve_backend(backend, dev) == "triton"
    check = check_indices_now(check_indices, dev)
    if check:
        state_slots = check_index(
            "state_slots", state_slots, (num_seqs,), low=0, high=state.shape[0], device=dev
        )
        if pending is not None:
            check_distinct("state_slots", state_slots)  # each slot's state is written back
    else:
        state_slots = check_tensor("state_slots", state_slots, (num_seqs,), dtypes=INDEX_DTYPES, device=dev)
    if pending is not None:
        if keep_inputs is not None:
            raise ValueError("keep_inputs, pending: expected one (pending keeps the inputs itself)")
        pending = check_pending(pending, state)
        if triton:
            # the kernel finds each slot's next rows itself (no per-layer index ops in a graph): the buffers'
            # shapes are checked here, with the slots standing in for the rows
            keep_inputs, _ = check_keep_inputs(
                pending.inputs, state_slots, k, v, False, name="pending.inputs", rows_name="state_slots"
            )
        else:
            rows_at = pending.rows[state_slots.long().clamp(min=0)]
            half = pending.inputs[0].shape[0] // 2
            input_rows = torch.where(state_slots >= 0, next_rows(rows_at, half), -1)
            keep_inputs, input_rows = check_keep_inputs(
                pending.inputs,
                input_rows,
                k,
                v,
                check_indices,
                name="pending.inputs",
                rows_name="pending.rows",
            )
    elif keep_inputs is not None and input_rows is not None:
        keep_inputs, input_rows = check_keep_inputs(keep_inputs, input_rows, k, v, check_indices)
    workspace = scratch is None and parents is not None
    # the Triton kernel recomputes a tree token's start state from the committed state along its parent's
    # path (`triton_recurrent`: no state stored); the others keep the states tokens restart from in a
    # workspace of this call
    recompute = workspace and block <= MAX_RECOMPUTE_NODES and triton
    if workspace and not recompute:
        scratch = torch.empty(num_seqs, block, hv, head_k, head_v, dtype=torch.float32, device=dev)
        scratch_rows = torch.arange(num_seqs, dtype=torch.int64, device=dev)
    if scratch is not None and scratch_rows is not None:  # else a chain keeping no state
        scratch = check_tensor(
            "scratch", scratch, (None, None, hv, head_k, head_v), dtypes=STATE_DTYPES, device=dev
        )
        if scratch.shape[1] < block:
            raise ValueError(
                f"scratch: expected shape [R, Dmax, {hv}, {head_k}, {head_v}] with Dmax >= D = {block}, "
                f"got {list(scratch.shape)}"
            )
        if check:
            scratch_rows = check_index(
                "scratch_rows", scratch_rows, (num_seqs,), low=0, high=scratch.shape[0], device=dev
            )
            check_distinct("scratch_rows", scratch_rows)
        else:
            scratch_rows = check_tensor(
                "scratch_rows", scratch_rows, (num_seqs,), dtypes=INDEX_DTYPES, device=dev
            )
    if parents is not None:
        parents = check_parents(parents, num_seqs, block, dev, check)
        if check and scratch_rows is not None and bool(((state_slots >= 0) & (scratch_rows < 0)).any()):
            raise ValueError(
                f"scratch_rows: tree verify needs a scratch row (>= 0) for every row with a state slot, "
                f"got scratch_rows={scratch_rows.tolist()} for state_slots={state_slots.tolist()}"
            )
    if pending is not None and not triton:
        # every argument checked: the reference and torch paths apply the pending tokens first, as their own
        # step (it writes the states: a rejected call must leave them as they were)
        apply_pending(pending, state, state_slots, backend=backend)
    fn = implementation(
        backend,
        dev,
        reference=reference.reference_verify,
        torch_path=torch_impl.torch_verify,
        # with a workspace, the Triton kernel writes to it only the states a later token restarts from
        triton=lambda: partial(
            _verify_triton, workspace=workspace and not recompute, pending=pending, raw_gates=raw_gates
        ),
    )
    o = fn(
        q,
        k,
        v,
        g,
        beta,
        state=state,
        state_slots=state_slots,
        scratch=scratch,
        scratch_rows=scratch_rows,
        parents=parents,
        keep_inputs=keep_inputs,
        input_rows=input_rows,
    )
    return o.to(q.dtype)
