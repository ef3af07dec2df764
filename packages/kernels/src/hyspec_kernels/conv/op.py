"""Validated public wrappers of the causal depthwise conv1d ops.

Layouts: tokens packed token-major (x [T, C] or [N, D, C]); weight [C, W] with W in 2..5; conv state pool
[S, C, W-1] holding each sequence's last W - 1 inputs, oldest first. All math is fp32; outputs take x's dtype;
state and scratch take their own dtype (fp32 or bf16 in practice). A state slot of -1 marks a padded row:
its state is neither read (zeros instead) nor written. Slots must be distinct apart from -1, because two rows
writing one slot would race.

Value checks (index ranges, offsets, distinct slots) read the tensors on the host: `check_indices` follows the
rule of every op (`value_checks`): None (default) checks on the CPU only, True on any device, False never.
"""

from __future__ import annotations

from collections.abc import Sequence
from types import ModuleType

import torch

from hyspec_kernels._checks import (
    FLOAT_DTYPES,
    Backend,
    check_cu_seqlens,
    check_index,
    check_tensor,
    dim,
    implementation,
    value_checks,
)
from hyspec_kernels.conv import reference, torch_impl
from hyspec_kernels.conv.common import ACTIVATIONS, MAX_WIDTH, MIN_WIDTH, Activation
from hyspec_kernels.saves import StateSave, check_saves, slots_tensor
from hyspec_kernels.transfer import to_device


def _check_weights(
    weight: object, bias: object, num_ch: int, device: torch.device
) -> tuple[torch.Tensor, torch.Tensor | None, int]:
    weight = check_tensor("weight", weight, ("C", "W"), dtypes=FLOAT_DTYPES, device=device)
    dim("weight", weight, 0, num_ch, "C, channels of x")
    width = dim("weight", weight, 1)
    if not MIN_WIDTH <= width <= MAX_WIDTH:
        raise ValueError(
            f"weight: expected shape [C, W] with W in {MIN_WIDTH}..{MAX_WIDTH}, got {list(weight.shape)}"
        )
    if bias is not None:
        bias = check_tensor("bias", bias, (num_ch,), dtypes=FLOAT_DTYPES, device=device)
    return weight, bias, width


def _check_activation(activation: object) -> Activation:
    if activation not in ACTIVATIONS:
        raise ValueError(f"activation: expected one of {ACTIVATIONS}, got {activation!r}")
    return activation


def _check_state(name: str, t: object, num_ch: int, width: int, device: torch.device) -> torch.Tensor:
    return check_tensor(name, t, ("S", num_ch, width - 1), dtypes=FLOAT_DTYPES, device=device)


def _check_distinct(name: str, t: torch.Tensor, check_values: bool | None) -> None:
    """Non-padding values must be distinct: each names memory that exactly one row writes."""
    if not value_checks(t.device, check_values):
        return
    used = t[t >= 0]
    if used.numel() != torch.unique(used).numel():
        raise ValueError(f"{name}: expected distinct values apart from -1, got {t.tolist()}")


def _triton() -> ModuleType:
    # Imported on first use: under TRITON_INTERPRET the variable must be set before any @triton.jit runs,
    # and importing the package alone should not decide that.
    from hyspec_kernels.conv import triton_kernel

    return triton_kernel


def _check_slots(
    state_slots: torch.Tensor, num_rows: int, conv_state: torch.Tensor, check_indices: bool | None
) -> torch.Tensor:
    """[num_rows] slots into `conv_state`, distinct; values read back only when `value_checks` says so."""
    slots = check_index(
        "state_slots",
        state_slots,
        (num_rows,),
        low=0,
        high=conv_state.shape[0],
        device=conv_state.device,
        check_values=check_indices,
    )
    _check_distinct("state_slots", slots, check_indices)
    return slots


def conv_prefill(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    *,
    cu_seqlens: torch.Tensor,
    conv_state: torch.Tensor,
    state_slots: torch.Tensor,
    has_initial_state: torch.Tensor,
    activation: Activation,
    save_states: Sequence[StateSave] = (),
    backend: Backend = "auto",
    check_indices: bool | None = None,
) -> torch.Tensor:
    """Causal conv over packed variable-length sequences; returns y [T, C] in x's dtype.

    x [T, C]; cu_seqlens [N + 1]; conv_state [S, C, W-1]; state_slots [N]; has_initial_state [N] bool.
    Sequence n starts from `conv_state[state_slots[n]]` when that slot is >= 0 and `has_initial_state[n]`,
    else from zeros; its last W - 1 inputs (reaching into the prior window when it is shorter) are written
    back to the slot when the slot is >= 0. `save_states` also writes windows part-way through sequences to
    other slots (`StateSave`: the W - 1 inputs before packed index `token`, at least W - 1 tokens into its
    sequence; each to a distinct slot no sequence of the call uses): what a prefill ending there would leave.
    """
    x = check_tensor("x", x, ("T", "C"), dtypes=FLOAT_DTYPES)
    num_tokens, num_ch = x.shape
    device = x.device
    weight, bias, width = _check_weights(weight, bias, num_ch, device)
    cu_seqlens = check_cu_seqlens(
        "cu_seqlens", cu_seqlens, num_tokens, device=device, check_values=check_indices
    )
    num_seqs = cu_seqlens.shape[0] - 1
    conv_state = _check_state("conv_state", conv_state, num_ch, width, device)
    state_slots = _check_slots(state_slots, num_seqs, conv_state, check_indices)
    has_initial_state = check_tensor(
        "has_initial_state", has_initial_state, (num_seqs,), dtypes=(torch.bool,), device=device
    )
    activation = _check_activation(activation)

    fn = implementation(
        backend,
        device,
        reference=reference.conv_prefill_reference,
        torch_path=torch_impl.conv_prefill_torch,
        triton=lambda: _triton().conv_prefill_triton,
    )
    if save_states and value_checks(device, check_indices):
        bounds = [int(b) for b in cu_seqlens.tolist()]
        check_saves(save_states, bounds, conv_state.shape[0], state_slots.tolist())
        short = [s for s in save_states if s.token - bounds[s.seq] < width - 1]
        if short:
            raise ValueError(
                f"save_states: {short[0]} is fewer than W - 1 = {width - 1} tokens into its sequence"
            )
    y = fn(
        x,
        weight,
        bias,
        cu_seqlens=cu_seqlens,
        conv_state=conv_state,
        state_slots=state_slots,
        has_initial_state=has_initial_state,
        activation=activation,
    )
    if save_states:
        windows = _save_windows(x, save_states, width)  # [S, C, W-1]
        conv_state.index_copy_(0, slots_tensor(save_states, device), windows.to(conv_state.dtype))
    return y


def _save_windows(x: torch.Tensor, saves: Sequence[StateSave], width: int) -> torch.Tensor:
    """The W - 1 inputs before each save's token, oldest first: [len(saves), C, W-1] in x's dtype."""
    rows = [[s.token - (width - 1) + j for j in range(width - 1)] for s in saves]
    idx = to_device(rows, dtype=torch.int64, device=x.device)  # [S, W-1]
    return x[idx].transpose(1, 2)


def conv_decode(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    *,
    conv_state: torch.Tensor,
    state_slots: torch.Tensor,
    activation: Activation,
    backend: Backend = "auto",
    check_indices: bool | None = None,
) -> torch.Tensor:
    """One token per sequence; returns y [N, C] in x's dtype and shifts x into `conv_state[slot]` in place.

    x [N, C]; conv_state [S, C, W-1]; state_slots [N] (-1: padded row, zero window, nothing written).
    """
    x = check_tensor("x", x, ("N", "C"), dtypes=FLOAT_DTYPES)
    num_rows, num_ch = x.shape
    device = x.device
    weight, bias, width = _check_weights(weight, bias, num_ch, device)
    conv_state = _check_state("conv_state", conv_state, num_ch, width, device)
    state_slots = _check_slots(state_slots, num_rows, conv_state, check_indices)
    activation = _check_activation(activation)

    fn = implementation(
        backend,
        device,
        reference=reference.conv_decode_reference,
        torch_path=torch_impl.conv_decode_torch,
        triton=lambda: _triton().conv_decode_triton,
    )
    return fn(x, weight, bias, conv_state=conv_state, state_slots=state_slots, activation=activation)


def conv_verify(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    *,
    conv_state: torch.Tensor,
    state_slots: torch.Tensor,
    scratch: torch.Tensor,
    scratch_rows: torch.Tensor,
    parents: torch.Tensor | None,
    activation: Activation,
    backend: Backend = "auto",
    check_indices: bool | None = None,
) -> torch.Tensor:
    """D block tokens per sequence; returns y [N, D, C] in x's dtype and never writes `conv_state`.

    x [N, D, C]; conv_state [S, C, W-1]; state_slots [N]; scratch [R, Dmax, C, W-1] (Dmax >= D, same dtype as
    conv_state, as commit copies it there); scratch_rows [N] (-1: no scratch write); parents [N, D] or None
    (a chain). `parents[n, j]` is the block index of token j's parent, -1 for a root (which continues from the
    committed window); parents precede children. The window after step j, along j's ancestor path, goes to
    `scratch[scratch_rows[n], j]`.
    """
    x = check_tensor("x", x, ("N", "D", "C"), dtypes=FLOAT_DTYPES)
    num_rows, depth, num_ch = x.shape
    device = x.device
    weight, bias, width = _check_weights(weight, bias, num_ch, device)
    conv_state = _check_state("conv_state", conv_state, num_ch, width, device)
    state_slots = _check_slots(state_slots, num_rows, conv_state, check_indices)
    scratch = check_tensor(
        "scratch", scratch, ("R", "Dmax", num_ch, width - 1), dtypes=(conv_state.dtype,), device=device
    )
    if scratch.shape[1] < depth:
        raise ValueError(
            f"scratch: expected shape [R, Dmax, {num_ch}, {width - 1}] with Dmax >= D = {depth}, "
            f"got {list(scratch.shape)}"
        )
    scratch_rows = check_index(
        "scratch_rows",
        scratch_rows,
        (num_rows,),
        low=0,
        high=scratch.shape[0],
        device=device,
        check_values=check_indices,
    )
    _check_distinct("scratch_rows", scratch_rows, check_indices)
    if parents is not None:
        parents = check_tensor("parents", parents, (num_rows, depth), device=device)
        if parents.dtype not in (torch.int32, torch.int64):
            raise ValueError(f"parents: expected dtype int32 or int64, got {parents.dtype}")
        steps = torch.arange(depth, device=device)
        # a host read: runs under the rule of every value check (`value_checks`)
        if value_checks(device, check_indices) and bool(((parents < -1) | (parents >= steps)).any()):
            raise ValueError(
                "parents: expected -1 <= parents[n, j] < j (parents precede children), "
                f"got {parents.tolist()}"
            )
    activation = _check_activation(activation)

    fn = implementation(
        backend,
        device,
        reference=reference.conv_verify_reference,
        torch_path=torch_impl.conv_verify_torch,
        triton=lambda: _triton().conv_verify_triton,
    )
    return fn(
        x,
        weight,
        bias,
        conv_state=conv_state,
        state_slots=state_slots,
        scratch=scratch,
        scratch_rows=scratch_rows,
        parents=parents,
        activation=activation,
    )
