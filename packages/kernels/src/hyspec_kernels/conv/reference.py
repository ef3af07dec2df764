"""Causal depthwise conv1d, token by token in fp32: the definition every fast path is tested against.

For width W, token t of a sequence sees the window of its W inputs, oldest first:
    y_t = act(bias + sum_{i=0}^{W-1} weight[:, i] * x_{t-(W-1)+i})
Inputs before the sequence start come from a prior window (the last W - 1 inputs of what came before,
oldest first, as kept in a conv state) or are zero. In a verify tree, token j's predecessors are its parent,
grand-parent, ... inside the block, then the committed window.

The first two functions define the math for one sequence; the `*_reference` functions below apply them to
the op signatures of `hyspec_kernels.conv.op` (same read/write rules, slow and obvious).
"""

from __future__ import annotations

import torch

from hyspec_kernels.conv.common import Activation


def _apply(acc: torch.Tensor, activation: Activation) -> torch.Tensor:
    return acc * torch.sigmoid(acc) if activation == "silu" else acc


def _step(
    window: list[torch.Tensor], weight: torch.Tensor, bias: torch.Tensor | None, activation: Activation
) -> torch.Tensor:
    """One output from a full window of W inputs (each [C] fp32, oldest first)."""
    acc = torch.zeros_like(window[0]) if bias is None else bias.float().clone()  # [C] fp32
    for i, xi in enumerate(window):
        acc = acc + weight[:, i].float() * xi
    return _apply(acc, activation)


def conv_sequence_ref(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    *,
    initial_window: torch.Tensor | None,
    activation: Activation,
) -> tuple[torch.Tensor, torch.Tensor]:
    """One sequence. x [L, C]; initial_window [C, W-1] or None (zeros).

    Returns (y [L, C], final window [C, W-1]) in fp32; the final window is the last W - 1 inputs,
    reaching into the initial window when L < W - 1."""
    num_ch, width = weight.shape
    prev = (
        torch.zeros(num_ch, width - 1, dtype=torch.float32, device=x.device)
        if initial_window is None
        else initial_window.float()
    )
    history = [prev[:, i] for i in range(width - 1)]  # oldest first, each [C] fp32
    ys = []
    for t in range(x.shape[0]):
        xt = x[t].float()
        ys.append(_step([*history[-(width - 1) :], xt], weight, bias, activation))
        history.append(xt)
    y = torch.stack(ys) if ys else torch.zeros(0, num_ch, dtype=torch.float32, device=x.device)
    final = torch.stack(history[-(width - 1) :], dim=1)  # [C, W-1]
    return y, final


def conv_tree_ref(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    *,
    window: torch.Tensor | None,
    parents: list[int],
    activation: Activation,
) -> tuple[torch.Tensor, torch.Tensor]:
    """One verify block. x [D, C]; window [C, W-1] committed (or None: zeros); parents[j] < j or -1.

    Returns (y [D, C], windows [D, C, W-1]) in fp32, where windows[j] holds the W - 1 most recent inputs
    ending at token j along its ancestor path: what a decode along that path would leave."""
    num_ch, width = weight.shape
    committed = (
        torch.zeros(num_ch, width - 1, dtype=torch.float32, device=x.device)
        if window is None
        else window.float()
    )
    ys, wins = [], []
    for j in range(x.shape[0]):
        # Walk up the ancestors: path[0] = x_j, path[1] = parent, ...; past the root, the committed inputs
        # from the most recent backwards.
        path: list[torch.Tensor] = []
        node, depth_into_committed = j, 0
        while len(path) < width:
            if node >= 0:
                path.append(x[node].float())
                node = parents[node]
            else:
                depth_into_committed += 1
                path.append(committed[:, width - 1 - depth_into_committed])
        full = path[::-1]  # oldest first, W entries
        ys.append(_step(full, weight, bias, activation))
        wins.append(torch.stack(full[1:], dim=1))  # [C, W-1]
    return torch.stack(ys), torch.stack(wins)


def conv_prefill_reference(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    *,
    cu_seqlens: torch.Tensor,
    conv_state: torch.Tensor,
    state_slots: torch.Tensor,
    has_initial_state: torch.Tensor,
    activation: Activation,
) -> torch.Tensor:
    y = torch.empty(x.shape, dtype=x.dtype, device=x.device)  # [T, C]
    bounds = cu_seqlens.tolist()
    for n, slot in enumerate(state_slots.tolist()):
        lo, hi = bounds[n], bounds[n + 1]
        init = conv_state[slot] if slot >= 0 and bool(has_initial_state[n]) else None
        yn, final = conv_sequence_ref(x[lo:hi], weight, bias, initial_window=init, activation=activation)
        y[lo:hi] = yn.to(x.dtype)
        if slot >= 0:
            conv_state[slot] = final.to(conv_state.dtype)
    return y


def conv_decode_reference(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    *,
    conv_state: torch.Tensor,
    state_slots: torch.Tensor,
    activation: Activation,
) -> torch.Tensor:
    y = torch.empty(x.shape, dtype=x.dtype, device=x.device)  # [N, C]
    for n, slot in enumerate(state_slots.tolist()):
        init = conv_state[slot] if slot >= 0 else None
        yn, final = conv_sequence_ref(x[n : n + 1], weight, bias, initial_window=init, activation=activation)
        y[n] = yn[0].to(x.dtype)
        if slot >= 0:
            conv_state[slot] = final.to(conv_state.dtype)
    return y


def conv_verify_reference(
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
) -> torch.Tensor:
    num_rows, depth = x.shape[0], x.shape[1]
    y = torch.empty(x.shape, dtype=x.dtype, device=x.device)  # [N, D, C]
    slots, rows = state_slots.tolist(), scratch_rows.tolist()
    for n in range(num_rows):
        par = list(range(-1, depth - 1)) if parents is None else [int(p) for p in parents[n].tolist()]
        init = conv_state[slots[n]] if slots[n] >= 0 else None
        yn, wins = conv_tree_ref(x[n], weight, bias, window=init, parents=par, activation=activation)
        y[n] = yn.to(x.dtype)
        if rows[n] >= 0:
            scratch[rows[n], :depth] = wins.to(scratch.dtype)
    return y
