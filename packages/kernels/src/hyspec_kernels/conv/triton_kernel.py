"""Triton kernels of the causal conv ops.

Prefill is two launches. The first tiles (tokens x channels) over the packed tokens: each token finds its
sequence by a binary search in `cu_seqlens` and gathers its W inputs from x, or from its sequence's prior
window in the state pool when a tap reaches before the sequence start. The second writes each sequence's new
window back to its slot; it runs after the first because the first still reads the old windows.

Decode and verify share one kernel over (sequence, channel block) programs that walk the D block tokens in
order. Token j's k-th predecessor is j - k in a chain, or found by following `parents` in a tree; a negative
predecessor index -m stands for the committed window's m-th most recent input. The window after step j goes to
verify scratch (verify) or back to the slot (decode, D = 1). The W - 1 previous inputs live in the
variables h1 (most recent) .. h4, of which a width-W conv uses h1 .. h(W-1): a chain's verify loads the
committed window once and shifts each step's input in, a tree's loads each step's along its path. The pool
allocates verify scratch channels-innermost (`[R, Dmax, W-1, C]` in memory, a `[R, Dmax, C, W-1]` view), so
each tap's store is one coalesced row. A verify of 32 x 4 tokens at C = 8192 on an H200: 9.1 us with W-1
interleaved strided stores, 5.7 coalesced, 4.3 with the window in registers (a decode 3.0).

Offsets that multiply a slot, row or token index by a stride are 64-bit: a state pool or a long prompt easily
passes 2**31 elements.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from hyspec_kernels.conv.common import Activation

from ..jit import jit_varying
from ..launch import pdl_args, wait_for_inputs

# Channel tile of decode / verify: 32 programs per row at C = 8192. Prefill tile 16 tokens x 128 channels: the
# fastest of six tiles on an H200 (169 us at T = 8192, C = 8192, bf16, one sequence; 16 x 256 took 192 us,
# 64 x 256 233 us; scratch sweep of 2026-11-27 after the prior-window reads moved off the common path).
_MAX_BLOCK_C = 256
_MAX_BLOCK_C_PREFILL = 128
_MAX_BLOCK_T = 16


@triton.jit
def _vmask(mask, flag):  # type: ignore[no-untyped-def]
    """mask & flag for a scalar flag, via int32: the interpreter mis-types a splatted scalar bool."""
    return mask & ((tl.zeros_like(mask).to(tl.int32) + flag.to(tl.int32)) != 0)


@triton.jit  # type: ignore[untyped-decorator]
def _act(acc, SILU: tl.constexpr):  # type: ignore[no-untyped-def]
    if SILU:
        acc = acc * tl.sigmoid(acc)
    return acc


# the binary search's length is a runtime bound, not a constexpr: one compiled kernel for every batch (a
# constexpr per bit length of the batch size compiled a new kernel, ~1.5 s on an H200, at the first prefill
# of each new batch-size bucket, inside a served step)
@jit_varying("cu_ptr", "slots_ptr", "init_ptr", "num_tokens", "num_seqs", "search_steps")
def _conv_prefill_kernel(  # type: ignore[no-untyped-def]
    x_ptr,
    w_ptr,
    b_ptr,
    y_ptr,
    state_ptr,
    cu_ptr,
    slots_ptr,
    init_ptr,
    num_tokens,
    num_ch,
    num_seqs,
    stride_xt,
    stride_xc,
    stride_wc,
    stride_wk,
    stride_b,
    stride_yt,
    stride_yc,
    stride_ss,
    stride_sc,
    stride_sk,
    search_steps,
    WIDTH: tl.constexpr,
    HAS_BIAS: tl.constexpr,
    SILU: tl.constexpr,
    BLOCK_T: tl.constexpr,
    BLOCK_C: tl.constexpr,
    PDL: tl.constexpr,
):
    wait_for_inputs(PDL)
    offs_t = tl.program_id(0) * BLOCK_T + tl.arange(0, BLOCK_T)  # [BT]
    offs_c = tl.program_id(1) * BLOCK_C + tl.arange(0, BLOCK_C)  # [BC]
    t_mask = offs_t < num_tokens
    c_mask = offs_c < num_ch

    # Sequence of each token: the largest n in [0, N) with cu[n] <= t (skips empty sequences).
    lo = tl.zeros([BLOCK_T], dtype=tl.int32)
    hi = tl.zeros([BLOCK_T], dtype=tl.int32) + (num_seqs - 1)
    for _ in range(search_steps):
        mid = (lo + hi + 1) // 2
        up = tl.load(cu_ptr + mid).to(tl.int32) <= offs_t
        lo = tl.where(up, mid, lo)
        hi = tl.where(up, hi, mid - 1)
    pos = offs_t - tl.load(cu_ptr + lo).to(tl.int32)  # [BT] position inside the sequence
    tc_mask = t_mask[:, None] & c_mask[None, :]
    x_rows = x_ptr + offs_t.to(tl.int64)[:, None] * stride_xt + offs_c[None, :] * stride_xc  # [BT, BC]
    # Only a block holding some sequence's first W - 1 tokens reads prior windows: the others skip the
    # per-element state offsets and masks, which made the kernel instruction-bound (0.75 TB/s on an H200)
    near_start = tl.min(tl.where(t_mask, pos, WIDTH), axis=0) < WIDTH - 1

    if HAS_BIAS:
        acc = tl.load(b_ptr + offs_c * stride_b, mask=c_mask, other=0.0).to(tl.float32)[None, :]
        acc = acc + tl.zeros([BLOCK_T, BLOCK_C], dtype=tl.float32)
    else:
        acc = tl.zeros([BLOCK_T, BLOCK_C], dtype=tl.float32)
    for i in tl.static_range(WIDTH):
        back = WIDTH - 1 - i  # the tap reads the input `back` tokens before this one
        w = tl.load(w_ptr + offs_c * stride_wc + i * stride_wk, mask=c_mask, other=0.0).to(tl.float32)
        if near_start:
            in_seq = pos >= back  # else the tap reaches into the sequence's prior window
            slot = tl.load(slots_ptr + lo).to(tl.int64)
            read = (slot >= 0) & (tl.load(init_ptr + lo) != 0)
            s_rows = state_ptr + tl.maximum(slot, 0)[:, None] * stride_ss + offs_c[None, :] * stride_sc
            xv = tl.load(x_rows - back * stride_xt, mask=tc_mask & in_seq[:, None], other=0.0).to(tl.float32)
            s_col = (WIDTH - 1 - back + pos)[:, None] * stride_sk
            sv = tl.load(s_rows + s_col, mask=tc_mask & (read & ~in_seq)[:, None], other=0.0).to(tl.float32)
            xv = xv + sv
        else:
            xv = tl.load(x_rows - back * stride_xt, mask=tc_mask, other=0.0).to(tl.float32)
        acc += w[None, :] * xv
    acc = _act(acc, SILU)
    y_rows = y_ptr + offs_t.to(tl.int64)[:, None] * stride_yt + offs_c[None, :] * stride_yc
    tl.store(y_rows, acc.to(y_ptr.dtype.element_ty), mask=tc_mask)


@triton.jit  # type: ignore[untyped-decorator]
def _window_col(  # type: ignore[no-untyped-def]
    x_seq, state_row, length, read, c_mask, stride_xt, stride_sk, k, WIDTH: tl.constexpr
):
    """Column k of a sequence's new window: its input at position length - (W-1) + k, else the prior one's."""
    src = length - (WIDTH - 1) + k
    xv = tl.load(x_seq + src * stride_xt, mask=_vmask(c_mask, src >= 0), other=0.0).to(tl.float32)
    sv = tl.load(state_row + (WIDTH - 1 + src) * stride_sk, mask=_vmask(c_mask, read & (src < 0)), other=0.0)
    return xv + sv.to(tl.float32)


@jit_varying("cu_ptr", "slots_ptr", "init_ptr")
def _conv_prefill_state_kernel(  # type: ignore[no-untyped-def]
    x_ptr,
    state_ptr,
    cu_ptr,
    slots_ptr,
    init_ptr,
    num_ch,
    stride_xt,
    stride_xc,
    stride_ss,
    stride_sc,
    stride_sk,
    WIDTH: tl.constexpr,
    BLOCK_C: tl.constexpr,
    PDL: tl.constexpr,
):
    wait_for_inputs(PDL)
    n = tl.program_id(0)
    offs_c = tl.program_id(1) * BLOCK_C + tl.arange(0, BLOCK_C)
    slot = tl.load(slots_ptr + n).to(tl.int64)
    live = slot >= 0
    c_mask = _vmask(offs_c < num_ch, live)
    read = live & (tl.load(init_ptr + n) != 0)
    start = tl.load(cu_ptr + n).to(tl.int64)
    length = tl.load(cu_ptr + n + 1).to(tl.int64) - start
    # A short sequence's new window mixes the old window and new inputs: read every column, then write.
    x_seq = x_ptr + start * stride_xt + offs_c * stride_xc  # [BC] pointers to the sequence's token 0
    base = state_ptr + tl.maximum(slot, 0) * stride_ss + offs_c * stride_sc  # [BC] pointers to column 0
    v0 = _window_col(x_seq, base, length, read, c_mask, stride_xt, stride_sk, 0, WIDTH)
    v1 = v0
    v2 = v0
    v3 = v0
    if WIDTH > 2:
        v1 = _window_col(x_seq, base, length, read, c_mask, stride_xt, stride_sk, 1, WIDTH)
    if WIDTH > 3:
        v2 = _window_col(x_seq, base, length, read, c_mask, stride_xt, stride_sk, 2, WIDTH)
    if WIDTH > 4:
        v3 = _window_col(x_seq, base, length, read, c_mask, stride_xt, stride_sk, 3, WIDTH)
    tl.debug_barrier()
    out_ty = state_ptr.dtype.element_ty
    tl.store(base, v0.to(out_ty), mask=c_mask)
    if WIDTH > 2:
        tl.store(base + stride_sk, v1.to(out_ty), mask=c_mask)
    if WIDTH > 3:
        tl.store(base + 2 * stride_sk, v2.to(out_ty), mask=c_mask)
    if WIDTH > 4:
        tl.store(base + 3 * stride_sk, v3.to(out_ty), mask=c_mask)


@triton.jit  # type: ignore[untyped-decorator]
def _pred(cur, par_row_ptr, stride_pd, TREE: tl.constexpr):  # type: ignore[no-untyped-def]
    """Block index of the predecessor of block index `cur` (negative: into the committed window)."""
    if TREE:
        parent = tl.load(par_row_ptr + tl.maximum(cur, 0).to(tl.int64) * stride_pd, mask=cur >= 0, other=0)
        nxt = tl.where(cur >= 0, parent.to(tl.int32), cur - 1)
    else:
        nxt = cur - 1
    return nxt


@triton.jit  # type: ignore[untyped-decorator]
def _path_input(  # type: ignore[no-untyped-def]
    cur, x_row_ptr, state_row_ptr, live, offs_c, c_mask, stride_xd, stride_sk, WIDTH: tl.constexpr
):
    """Input of block token `cur`; for cur = -m the committed window's m-th latest input (0 if padded)."""
    xv = tl.load(
        x_row_ptr + tl.maximum(cur, 0).to(tl.int64) * stride_xd, mask=_vmask(c_mask, cur >= 0), other=0.0
    )
    col = tl.maximum(WIDTH - 1 + cur, 0)
    sv = tl.load(state_row_ptr + col * stride_sk, mask=_vmask(c_mask, (cur < 0) & live), other=0.0)
    return xv.to(tl.float32) + sv.to(tl.float32)


@triton.jit  # type: ignore[untyped-decorator]
def _committed_input(state_row_ptr, live, c_mask, stride_sk, m, WIDTH: tl.constexpr):  # type: ignore[no-untyped-def]
    """The committed window's m-th latest input (0 for a padded row), fp32."""
    sv = tl.load(state_row_ptr + (WIDTH - 1 - m) * stride_sk, mask=_vmask(c_mask, live), other=0.0)
    return sv.to(tl.float32)


@jit_varying("slots_ptr", "rows_ptr", "par_ptr")
def _conv_steps_kernel(  # type: ignore[no-untyped-def]
    x_ptr,
    w_ptr,
    b_ptr,
    y_ptr,
    state_ptr,
    slots_ptr,
    scratch_ptr,
    rows_ptr,
    par_ptr,
    depth,
    num_ch,
    stride_xn,
    stride_xd,
    stride_xc,
    stride_wc,
    stride_wk,
    stride_b,
    stride_yn,
    stride_yd,
    stride_yc,
    stride_ss,
    stride_sc,
    stride_sk,
    stride_rr,
    stride_rd,
    stride_rc,
    stride_rk,
    stride_pn,
    stride_pd,
    WIDTH: tl.constexpr,
    HAS_BIAS: tl.constexpr,
    SILU: tl.constexpr,
    TREE: tl.constexpr,
    WRITE_STATE: tl.constexpr,
    WRITE_SCRATCH: tl.constexpr,
    ROLL: tl.constexpr,  # a chain's verify: the window moves along in registers
    BLOCK_C: tl.constexpr,
    PDL: tl.constexpr,
):
    wait_for_inputs(PDL)
    n = tl.program_id(0).to(tl.int64)
    offs_c = tl.program_id(1) * BLOCK_C + tl.arange(0, BLOCK_C)
    c_mask = offs_c < num_ch
    slot = tl.load(slots_ptr + n).to(tl.int64)
    live = slot >= 0
    x_row = x_ptr + n * stride_xn + offs_c * stride_xc  # [BC] pointers to token 0
    state_row = state_ptr + tl.maximum(slot, 0) * stride_ss + offs_c * stride_sc  # [BC] pointers to column 0
    par_row = par_ptr + n * stride_pn
    if WRITE_SCRATCH:
        row = tl.load(rows_ptr + n).to(tl.int64)
        s_mask = _vmask(c_mask, row >= 0)
        scratch_row = scratch_ptr + tl.maximum(row, 0) * stride_rr + offs_c * stride_rc

    w_last = tl.load(w_ptr + offs_c * stride_wc + (WIDTH - 1) * stride_wk, mask=c_mask, other=0.0).to(
        tl.float32
    )
    w1 = tl.load(w_ptr + offs_c * stride_wc + (WIDTH - 2) * stride_wk, mask=c_mask, other=0.0).to(tl.float32)
    if HAS_BIAS:
        bias = tl.load(b_ptr + offs_c * stride_b, mask=c_mask, other=0.0).to(tl.float32)
    else:
        bias = tl.zeros([BLOCK_C], dtype=tl.float32)

    # h1 (latest) .. h(W-1). A chain's verify loads the committed window once and moves it along in registers
    # (step j's predecessors are steps j-1, j-2, ...); a tree's loads each step's along its path, and so does
    # decode (D = 1: its window loaded before the loop measured 1.17x slower, 3.0 -> 3.5 us at 32 rows)
    if ROLL:
        h1 = _committed_input(state_row, live, c_mask, stride_sk, 1, WIDTH)
        h2 = h1
        h3 = h1
        h4 = h1
        if WIDTH > 2:
            h2 = _committed_input(state_row, live, c_mask, stride_sk, 2, WIDTH)
        if WIDTH > 3:
            h3 = _committed_input(state_row, live, c_mask, stride_sk, 3, WIDTH)
        if WIDTH > 4:
            h4 = _committed_input(state_row, live, c_mask, stride_sk, 4, WIDTH)
    else:
        h1 = tl.zeros([BLOCK_C], dtype=tl.float32)
        h2 = h1
        h3 = h1
        h4 = h1
    for j in range(depth):
        xj = tl.load(x_row + j * stride_xd, mask=c_mask, other=0.0).to(tl.float32)
        if not ROLL:
            # A tensor even where the interpreter hands out the loop index as a Python int.
            cur = _pred(j + tl.zeros([], dtype=tl.int32), par_row, stride_pd, TREE)
            h1 = _path_input(cur, x_row, state_row, live, offs_c, c_mask, stride_xd, stride_sk, WIDTH)
            if WIDTH > 2:
                cur = _pred(cur, par_row, stride_pd, TREE)
                h2 = _path_input(cur, x_row, state_row, live, offs_c, c_mask, stride_xd, stride_sk, WIDTH)
            if WIDTH > 3:
                cur = _pred(cur, par_row, stride_pd, TREE)
                h3 = _path_input(cur, x_row, state_row, live, offs_c, c_mask, stride_xd, stride_sk, WIDTH)
            if WIDTH > 4:
                cur = _pred(cur, par_row, stride_pd, TREE)
                h4 = _path_input(cur, x_row, state_row, live, offs_c, c_mask, stride_xd, stride_sk, WIDTH)

        # Oldest tap first, like the reference.
        acc = bias
        if WIDTH > 4:
            w4 = tl.load(w_ptr + offs_c * stride_wc + (WIDTH - 5) * stride_wk, mask=c_mask, other=0.0)
            acc = acc + w4.to(tl.float32) * h4
        if WIDTH > 3:
            w3 = tl.load(w_ptr + offs_c * stride_wc + (WIDTH - 4) * stride_wk, mask=c_mask, other=0.0)
            acc = acc + w3.to(tl.float32) * h3
        if WIDTH > 2:
            w2 = tl.load(w_ptr + offs_c * stride_wc + (WIDTH - 3) * stride_wk, mask=c_mask, other=0.0)
            acc = acc + w2.to(tl.float32) * h2
        acc = acc + w1 * h1
        acc = acc + w_last * xj
        acc = _act(acc, SILU)
        y_off = n * stride_yn + j * stride_yd + offs_c * stride_yc
        tl.store(y_ptr + y_off, acc.to(y_ptr.dtype.element_ty), mask=c_mask)

        # Window after step j, oldest first: (h(W-2), ..., h1, x_j).
        if WRITE_SCRATCH:
            out_ty = scratch_ptr.dtype.element_ty
            step = scratch_row + j * stride_rd
            tl.store(step + (WIDTH - 2) * stride_rk, xj.to(out_ty), mask=s_mask)
            if WIDTH > 2:
                tl.store(step + (WIDTH - 3) * stride_rk, h1.to(out_ty), mask=s_mask)
            if WIDTH > 3:
                tl.store(step + (WIDTH - 4) * stride_rk, h2.to(out_ty), mask=s_mask)
            if WIDTH > 4:
                tl.store(step + (WIDTH - 5) * stride_rk, h3.to(out_ty), mask=s_mask)
        if WRITE_STATE:
            # Decode (depth 1): every read of the old window above happens before these writes.
            tl.debug_barrier()
            out_ty = state_ptr.dtype.element_ty
            st_mask = _vmask(c_mask, live)
            tl.store(state_row + (WIDTH - 2) * stride_sk, xj.to(out_ty), mask=st_mask)
            if WIDTH > 2:
                tl.store(state_row + (WIDTH - 3) * stride_sk, h1.to(out_ty), mask=st_mask)
            if WIDTH > 3:
                tl.store(state_row + (WIDTH - 4) * stride_sk, h2.to(out_ty), mask=st_mask)
            if WIDTH > 4:
                tl.store(state_row + (WIDTH - 5) * stride_sk, h3.to(out_ty), mask=st_mask)
        if ROLL:
            h4 = h3
            h3 = h2
            h2 = h1
            h1 = xj


def _block_c(num_ch: int, cap: int) -> int:
    return max(16, min(cap, int(triton.next_power_of_2(num_ch))))


def conv_prefill_triton(
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
    width = weight.shape[1]
    num_seqs = state_slots.shape[0]
    y = torch.empty_like(x, memory_format=torch.contiguous_format)  # [T, C]
    # the kernels step through the per-sequence vectors by 1: strided views are copied
    cu_seqlens, state_slots = cu_seqlens.contiguous(), state_slots.contiguous()  # [N + 1], [N]
    init = has_initial_state.contiguous().view(torch.uint8)  # bool pointers are awkward in Triton; same bytes
    b = weight if bias is None else bias  # any valid pointer; unused without HAS_BIAS
    if num_tokens > 0:
        block_t = max(16, min(_MAX_BLOCK_T, int(triton.next_power_of_2(num_tokens))))
        block_c = _block_c(num_ch, _MAX_BLOCK_C_PREFILL)
        grid = (triton.cdiv(num_tokens, block_t), triton.cdiv(num_ch, block_c))
        _conv_prefill_kernel[grid](
            x, weight, b, y, conv_state, cu_seqlens, state_slots, init,
            num_tokens, num_ch, num_seqs,
            x.stride(0), x.stride(1), weight.stride(0), weight.stride(1), b.stride(0),
            y.stride(0), y.stride(1), conv_state.stride(0), conv_state.stride(1), conv_state.stride(2),
            max(num_seqs - 1, 0).bit_length(),
            WIDTH=width, HAS_BIAS=bias is not None, SILU=activation == "silu",
            BLOCK_T=block_t, BLOCK_C=block_c, **pdl_args(x.device),
        )  # fmt: skip
    if num_seqs > 0:
        block_c = _block_c(num_ch, _MAX_BLOCK_C)
        _conv_prefill_state_kernel[(num_seqs, triton.cdiv(num_ch, block_c))](
            x, conv_state, cu_seqlens, state_slots, init, num_ch,
            x.stride(0), x.stride(1), conv_state.stride(0), conv_state.stride(1), conv_state.stride(2),
            WIDTH=width, BLOCK_C=block_c, **pdl_args(x.device),
        )  # fmt: skip
    return y


def _launch_steps(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    conv_state: torch.Tensor,
    state_slots: torch.Tensor,
    scratch: torch.Tensor | None,
    scratch_rows: torch.Tensor | None,
    parents: torch.Tensor | None,
    activation: Activation,
) -> torch.Tensor:
    num_rows, depth, num_ch = x.shape
    y = torch.empty_like(x, memory_format=torch.contiguous_format)  # [N, D, C]
    if num_rows == 0 or depth == 0:
        return y
    b = weight if bias is None else bias
    # the kernel steps through the slots and rows by 1: strided views are copied
    state_slots = state_slots.contiguous()  # [N]
    scratch_rows = None if scratch_rows is None else scratch_rows.contiguous()  # [N]
    # Unused pointers still need a tensor; their strides are never read without the matching flag.
    scr = conv_state if scratch is None else scratch
    scr_strides = (0, 0, 0, 0) if scratch is None else scratch.stride()
    rows = state_slots if scratch_rows is None else scratch_rows
    par = state_slots.view(1, -1) if parents is None else parents
    block_c = _block_c(num_ch, _MAX_BLOCK_C)
    _conv_steps_kernel[(num_rows, triton.cdiv(num_ch, block_c))](
        x, weight, b, y, conv_state, state_slots, scr, rows, par,
        depth, num_ch,
        x.stride(0), x.stride(1), x.stride(2), weight.stride(0), weight.stride(1), b.stride(0),
        y.stride(0), y.stride(1), y.stride(2),
        conv_state.stride(0), conv_state.stride(1), conv_state.stride(2),
        *scr_strides, par.stride(0), par.stride(1),
        WIDTH=weight.shape[1], HAS_BIAS=bias is not None, SILU=activation == "silu", TREE=parents is not None,
        WRITE_STATE=scratch is None, WRITE_SCRATCH=scratch is not None,
        ROLL=parents is None and scratch is not None, BLOCK_C=block_c, **pdl_args(x.device),
    )  # fmt: skip
    return y


def conv_decode_triton(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    *,
    conv_state: torch.Tensor,
    state_slots: torch.Tensor,
    activation: Activation,
) -> torch.Tensor:
    y = _launch_steps(x[:, None, :], weight, bias, conv_state, state_slots, None, None, None, activation)
    return y[:, 0, :]


def conv_verify_triton(
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
    return _launch_steps(x, weight, bias, conv_state, state_slots, scratch, scratch_rows, parents, activation)
