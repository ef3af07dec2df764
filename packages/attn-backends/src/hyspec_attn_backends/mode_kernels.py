"""How a linear (GDN or short-conv) layer calls its kernels in each forward mode: prefill for EXTEND, decode
for DECODE, verify (no state written: the inputs kept for the commit's replay, conv windows to scratch) for
TARGET_VERIFY. `layer_kernels.run_gdn` / `run_short_conv` call these with the batch's state slots and rows."""

from __future__ import annotations

from hyspec_kernels.conv import conv_decode, conv_prefill, conv_verify
from hyspec_kernels.gdn import PendingTokens, apply_pending, gdn_decode, gdn_prefill, gdn_verify
from hyspec_statepool.state_pool import ReplayInputs
from torch import Tensor

from hyspec_attn_backends.batch import ForwardBatch
from hyspec_attn_backends.modes import ForwardMode


def mode_conv(
    x: Tensor,
    weight: Tensor,
    bias: Tensor | None,
    *,
    conv_state: Tensor | None,
    conv_scratch: Tensor | None,
    activation: str | None,
    batch: ForwardBatch,
    check_indices: bool | None,
) -> Tensor:
    """The conv of a linear layer in the batch's mode. x [T, C] -> [T, C]; `check_indices`: the backend's
    kernel-check setting."""
    if conv_state is None:
        raise ValueError("conv_state: the pool has no conv state for this layer")
    assert batch.state_slots is not None and batch.batch_rows is not None
    slots = batch.state_slots.tensor
    w = weight.reshape(weight.shape[0], weight.shape[-1]).to(x.dtype)  # [C, W]
    bias = None if bias is None else bias.to(x.dtype)
    state = conv_state
    if batch.mode is ForwardMode.DECODE:
        return conv_decode(
            x,
            w,
            bias,
            conv_state=state,
            state_slots=slots,
            activation=activation,  # type: ignore[arg-type]
            check_indices=check_indices,
        )
    if batch.mode is ForwardMode.TARGET_VERIFY:
        if conv_scratch is None:
            raise ValueError("conv_scratch: the pool has no verify scratch (plan without a draft_shape)")
        n, d = batch.num_seqs, batch.verify_len
        y = conv_verify(
            x.reshape(n, d, -1),
            w,
            bias,
            conv_state=state,
            state_slots=slots,
            scratch=conv_scratch,
            scratch_rows=batch.batch_rows.tensor,
            parents=batch.tree_parents,
            activation=activation,  # type: ignore[arg-type]
            check_indices=check_indices,
        )
        return y.reshape(n * d, -1)
    return conv_prefill(
        x,
        w,
        bias,
        cu_seqlens=batch.cu_seqlens_q,
        conv_state=state,
        state_slots=slots,
        has_initial_state=batch.has_initial_state,
        activation=activation,  # type: ignore[arg-type]
        save_states=batch.state_saves,
        check_indices=check_indices,
    )


def mode_recurrence(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    g: Tensor,
    beta: Tensor,
    *,
    state: Tensor,
    replay: ReplayInputs | None,
    batch: ForwardBatch,
    check_indices: bool | None,
    pending: PendingTokens | None = None,
    raw_gates: tuple[Tensor, Tensor] | None = None,
) -> Tensor:
    """The gated delta rule of a GDN layer in the batch's mode. q/k [T, HK, K], v [T, HV, V], g/beta [T, HV]
    fp32 -> o [T, HV, V]; `check_indices`: the backend's kernel-check setting. `raw_gates` (A_log, dt_bias),
    decode and verify only: g / beta are the raw a / b, gated by the recurrent kernel itself.

    A verify keeps, per (batch row, step), the step's inputs (`replay`: the commit replays the accepted
    steps, `gdn_replay`), no state. With `pending` (deferred commits) each slot's pending tokens are applied
    first: by the decode and verify kernels themselves (a verify then keeps its inputs at the slots' next
    rows), by a replay before a prefill."""
    assert batch.state_slots is not None and batch.batch_rows is not None
    slots = batch.state_slots.tensor
    if batch.mode is ForwardMode.DECODE:
        # slots come from the pool (checked at prepare time): no per-layer host read of the indices
        return gdn_decode(
            q, k, v, g, beta, state=state, state_slots=slots, pending=pending, raw_gates=raw_gates,
            check_indices=False,
        )  # fmt: skip
    if batch.mode is ForwardMode.TARGET_VERIFY:
        n, d = batch.num_seqs, batch.verify_len
        if replay is None:
            raise ValueError("replay: the pool has no verify scratch (plan without a draft_shape)")
        # no state is kept per step: the kernel stores the block tokens' inputs at their batch rows (with
        # pending tokens: at the slots' next rows), for the commit's replay
        o = gdn_verify(
            q.reshape(n, d, *q.shape[1:]),
            k.reshape(n, d, *k.shape[1:]),
            v.reshape(n, d, *v.shape[1:]),
            g.reshape(n, d, -1),
            beta.reshape(n, d, -1),
            state=state,
            state_slots=slots,
            scratch=None,
            scratch_rows=None,
            parents=batch.tree_parents,  # a tree's branch states are recomputed in the kernel
            keep_inputs=None if pending is not None else (replay.k, replay.v, replay.g, replay.beta),
            input_rows=None if pending is not None else batch.batch_rows.tensor,
            pending=pending,
            raw_gates=raw_gates,
            check_indices=False,
        )
        return o.reshape(n * d, *v.shape[1:])
    if raw_gates is not None:
        # the chunked prefill reads gated g / beta: raw a / b would be taken for them
        raise ValueError(f"raw_gates: decode and verify only, got a {batch.mode.name} batch")
    if pending is not None:
        # a prefill reads the committed state of rows that continue (a decode riding in a prompt step)
        apply_pending(pending, state, slots)
    out = gdn_prefill(
        q,
        k,
        v,
        g,
        beta,
        cu_seqlens=batch.cu_seqlens_q,
        state=state,
        state_slots=slots,
        has_initial_state=batch.has_initial_state,
        save_states=batch.state_saves,
        cu_seqlens_host=batch.host_cu_seqlens,
        check_indices=check_indices,
    )
    return out.o
