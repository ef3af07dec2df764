"""Vectorised torch path of the causal conv ops (the CPU engine's path).

Every op gathers, for each output token, its W inputs as W column tensors [.., C] from a buffer that puts the
prior window in front of the new inputs, and sums the taps in fp32 oldest first. Reading a state slot goes
through `torch.where`, never a multiply by a mask, so a NaN-poisoned slot that is not read stays out of the
output.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from hyspec_kernels.conv.common import Activation


def _taps(
    cols: list[torch.Tensor], weight: torch.Tensor, bias: torch.Tensor | None, activation: Activation
) -> torch.Tensor:
    """act(bias + sum_i weight[:, i] * cols[i]) with cols oldest first, each [..., C] fp32."""
    w = weight.float()  # [C, W]
    acc = torch.zeros_like(cols[0]) if bias is None else bias.float().expand_as(cols[0]).clone()
    for i, col in enumerate(cols):
        acc = acc + w[:, i] * col
    return F.silu(acc) if activation == "silu" else acc


def _committed(conv_state: torch.Tensor, slots: torch.Tensor, read: torch.Tensor) -> torch.Tensor:
    """conv_state[slot] where `read`, else zeros: [N, C, W-1] fp32."""
    gathered = conv_state[slots.clamp(min=0)].float()
    return torch.where(read[:, None, None], gathered, torch.zeros((), device=gathered.device))


def conv_prefill_torch(
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
    num_tokens, num_ch = x.shape
    prev = weight.shape[1] - 1
    num_seqs = state_slots.shape[0]
    dev = x.device
    cu = cu_seqlens.long()
    slots = state_slots.long()
    live = slots >= 0
    init = _committed(conv_state, slots, live & has_initial_state)  # [N, C, P]

    # ext holds per sequence [prior window (P rows), tokens]: token t of sequence n is row t + (n + 1) P.
    seq_ids = torch.arange(num_seqs, device=dev)
    seq_of_token = torch.repeat_interleave(seq_ids, cu[1:] - cu[:-1], output_size=num_tokens)  # [T]
    ext = torch.empty(num_tokens + num_seqs * prev, num_ch, dtype=torch.float32, device=dev)
    base = (
        torch.arange(num_tokens, device=dev) + seq_of_token * prev
    )  # [T] ext row of each token's oldest tap
    ext[base + prev] = x.float()
    taps = torch.arange(prev, device=dev)
    init_rows = (cu[:-1] + seq_ids * prev)[:, None] + taps  # [N, P]
    ext[init_rows] = init.transpose(1, 2)

    y = _taps([ext[base + i] for i in range(prev + 1)], weight, bias, activation)  # [T, C] fp32

    # The last P rows of each sequence's span in ext: its new window (reaching into the prior one if short).
    final = ext[(cu[1:] + seq_ids * prev)[:, None] + taps].transpose(1, 2)  # [N, C, P]
    conv_state[slots[live]] = final[live].to(conv_state.dtype)
    return y.to(x.dtype)


def conv_decode_torch(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    *,
    conv_state: torch.Tensor,
    state_slots: torch.Tensor,
    activation: Activation,
) -> torch.Tensor:
    prev = weight.shape[1] - 1
    slots = state_slots.long()
    live = slots >= 0
    window = _committed(conv_state, slots, live)  # [N, C, P]
    cols = [window[:, :, i] for i in range(prev)] + [x.float()]
    y = _taps(cols, weight, bias, activation)  # [N, C] fp32
    new = torch.stack(cols[1:], dim=2)  # [N, C, P]
    conv_state[slots[live]] = new[live].to(conv_state.dtype)
    return y.to(x.dtype)


def conv_verify_torch(
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
    num_rows, depth, num_ch = x.shape
    prev = weight.shape[1] - 1
    dev = x.device
    slots = state_slots.long()
    window = _committed(conv_state, slots, slots >= 0)  # [N, C, P]
    ext = torch.cat([window.transpose(1, 2), x.float()], dim=1)  # [N, P + D, C]; token j at row P + j

    # path[k] = block index of token j's k-th predecessor; negative values count back into the committed
    # window (-1 = its most recent input), which is also ext row P + path[k].
    cur = torch.arange(depth, device=dev).expand(num_rows, depth)  # [N, D]
    par = None if parents is None else parents.long()
    path = [cur]
    for _ in range(prev):
        if par is None:
            cur = cur - 1
        else:
            cur = torch.where(cur >= 0, par.gather(1, cur.clamp(min=0)), cur - 1)
        path.append(cur)
    cols = [ext.gather(1, (p + prev)[..., None].expand(num_rows, depth, num_ch)) for p in reversed(path)]
    y = _taps(cols, weight, bias, activation)  # [N, D, C] fp32

    rows = scratch_rows.long()
    keep = rows >= 0
    windows = torch.stack(cols[1:], dim=3)  # [N, D, C, P]
    scratch[rows[keep], :depth] = windows[keep].to(scratch.dtype)
    return y.to(x.dtype)
