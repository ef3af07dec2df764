"""Chunked prefill of the gated delta rule in Triton, over packed variable-length sequences.

Same math as torch_impl.torch_prefill (64-token chunks, WY / UT form), in three launches:

1. `gdn_chunk_wy_kernel`, one program per (chunk, value head), all in parallel, on the chunk's four 16-row
   blocks: gamma = cumsum(g) inside the chunk, the ten lower 16x16 blocks of
   A = strict_lower(beta K K^T ⊙ decay) as products of key row blocks, (I + A)^-1 by forward substitution
   on the four diagonal blocks and block back-substitution for the rest, then W = (I + A)^-1 (beta K e^gamma)
   and U = (I + A)^-1 (beta V) as sums of [16, 16] x [16, D] block products.
2. `gdn_chunk_state_kernel`, one program per (sequence, value head, V tile): the only sequential part. It
   walks the sequence's chunks, storing the state at the start of each chunk, v_new = U - W S and the next
   state; the initial state comes from state[slot] and the final one goes back there (and the state at the
   start of a chunk named in `chunk_saves` to its slot: a snapshot inside the sequence).
3. `gdn_chunk_out_kernel`, one program per (chunk, value head, V tile), all in parallel:
   o = (Q e^gamma) S_chunk + ((Q K^T) ⊙ decay) v_new.

With bf16/fp16 inputs the matrix products take bf16 operands with fp32 accumulation (tensor cores), the
solve's block merges TF32 operands; with fp32 inputs they are exact fp32. The recurrent state itself is
always carried in fp32.
"""

from __future__ import annotations

import itertools
import os
from collections.abc import Sequence
from typing import NamedTuple

import torch
import triton
import triton.language as tl

from ..jit import jit_varying
from ..launch import pdl_args, wait_for_inputs
from ..transfer import to_device
from .checks import token_rows
from .reference import CHUNK_SIZE
from .triton_chunk_blocks import (
    SUB,
    _a_block,
    _a_diag,
    _k_rows,
    _load_rows,
    _load_rows_normed,
    _merge,
    _mm,
    _store_lower_product,
    _unit_lower_inv4,
)


@jit_varying("chunk_start_ptr", "chunk_end_ptr")
def gdn_chunk_wy_kernel(  # type: ignore[no-untyped-def]
    k_ptr,  # [T, HK, K]
    v_ptr,  # [T, HV, V]
    g_ptr,  # [T, HV] fp32
    beta_ptr,  # [T, HV] fp32
    chunk_start_ptr,  # [NC]
    chunk_end_ptr,  # [NC]
    w_ptr,  # [T, HV, K] out
    u_ptr,  # [T, HV, V] out
    gamma_ptr,  # [T, HV] fp32 out
    rk_ptr,  # [T, HV] fp32 out: 1 / |k| of each token's key head
    s_kt,  # k's token stride (its [HK, K] rows are contiguous)
    s_vt,  # v's token stride
    HK: tl.constexpr,
    HV: tl.constexpr,
    K: tl.constexpr,
    V: tl.constexpr,
    BK: tl.constexpr,
    BV: tl.constexpr,
    BT: tl.constexpr,
    BC: tl.constexpr,
    LOWP: tl.constexpr,
    PDL: tl.constexpr,
):
    # k and v may be column slices of a wider projection (token strides s_kt, s_vt); the outputs and g, beta
    # are contiguous, with token strides HV * K, HV * V and HV. The chunk is four [BC] row blocks: A's ten
    # lower [BC, BC] blocks are products of key row blocks, (I + A)^-1 = X is solved by blocks and W, U are
    # sums of [BC, BC] x [BC, *] block products, so no [BT, BT] matrix is ever split or put together
    wait_for_inputs(PDL)
    tl.static_assert(BT == 4 * BC)
    i_ch = tl.program_id(0)
    i_c = i_ch // HV
    i_hv = i_ch % HV
    i_hk = i_hv // (HV // HK)
    bos = tl.load(chunk_start_ptr + i_c).to(tl.int64)
    end = tl.load(chunk_end_ptr + i_c).to(tl.int64)
    o_c = tl.arange(0, BC)
    o_k = tl.arange(0, BK)
    m_k = o_k < K
    r0 = bos + o_c
    r1 = r0 + BC
    r2 = r1 + BC
    r3 = r2 + BC
    m0, m1, m2, m3 = r0 < end, r1 < end, r2 < end, r3 < end

    kp = k_ptr + i_hk * K
    k0, rk0 = _k_rows(kp, r0, m0, s_kt, o_k, m_k, LOWP)
    k1, rk1 = _k_rows(kp, r1, m1, s_kt, o_k, m_k, LOWP)
    k2, rk2 = _k_rows(kp, r2, m2, s_kt, o_k, m_k, LOWP)
    k3, rk3 = _k_rows(kp, r3, m3, s_kt, o_k, m_k, LOWP)
    # the sequential stage scales raw k rows by 1 / |k| instead of re-normalising them
    tl.store(rk_ptr + r0 * HV + i_hv, rk0, mask=m0)
    tl.store(rk_ptr + r1 * HV + i_hv, rk1, mask=m1)
    tl.store(rk_ptr + r2 * HV + i_hv, rk2, mask=m2)
    tl.store(rk_ptr + r3 * HV + i_hv, rk3, mask=m3)
    b0 = tl.load(beta_ptr + r0 * HV + i_hv, mask=m0, other=0.0).to(tl.float32)
    b1 = tl.load(beta_ptr + r1 * HV + i_hv, mask=m1, other=0.0).to(tl.float32)
    b2 = tl.load(beta_ptr + r2 * HV + i_hv, mask=m2, other=0.0).to(tl.float32)
    b3 = tl.load(beta_ptr + r3 * HV + i_hv, mask=m3, other=0.0).to(tl.float32)
    g0 = tl.load(g_ptr + r0 * HV + i_hv, mask=m0, other=0.0).to(tl.float32)
    g1 = tl.load(g_ptr + r1 * HV + i_hv, mask=m1, other=0.0).to(tl.float32)
    g2 = tl.load(g_ptr + r2 * HV + i_hv, mask=m2, other=0.0).to(tl.float32)
    g3 = tl.load(g_ptr + r3 * HV + i_hv, mask=m3, other=0.0).to(tl.float32)
    # gamma = cumsum(g) over the chunk, block by block
    c0 = tl.cumsum(g0, 0)
    c1 = tl.cumsum(g1, 0) + tl.sum(g0, 0)
    c2 = tl.cumsum(g2, 0) + (tl.sum(g0, 0) + tl.sum(g1, 0))
    c3 = tl.cumsum(g3, 0) + (tl.sum(g0, 0) + tl.sum(g1, 0) + tl.sum(g2, 0))
    tl.store(gamma_ptr + r0 * HV + i_hv, c0, mask=m0)
    tl.store(gamma_ptr + r1 * HV + i_hv, c1, mask=m1)
    tl.store(gamma_ptr + r2 * HV + i_hv, c2, mask=m2)
    tl.store(gamma_ptr + r3 * HV + i_hv, c3, mask=m3)

    # A = strict_lower(beta K K^T (.) e^(gamma_i - gamma_j)) by [BC, BC] blocks
    a00 = _a_diag(k0, b0, c0, BC, LOWP)
    a11 = _a_diag(k1, b1, c1, BC, LOWP)
    a22 = _a_diag(k2, b2, c2, BC, LOWP)
    a33 = _a_diag(k3, b3, c3, BC, LOWP)
    a10 = _a_block(k1, k0, b1, c1, c0, LOWP)
    a20 = _a_block(k2, k0, b2, c2, c0, LOWP)
    a21 = _a_block(k2, k1, b2, c2, c1, LOWP)
    a30 = _a_block(k3, k0, b3, c3, c0, LOWP)
    a31 = _a_block(k3, k1, b3, c3, c1, LOWP)
    a32 = _a_block(k3, k2, b3, c3, c2, LOWP)

    # X = (I + A)^-1 by blocks: the diagonal ones by forward substitution, then
    # X_ij = -X_ii sum_{m=j}^{i-1} A_im X_mj
    x00, x11, x22, x33 = _unit_lower_inv4(a00, a11, a22, a33, BC)
    x10 = -_merge(x11, _merge(a10, x00, LOWP), LOWP)
    x21 = -_merge(x22, _merge(a21, x11, LOWP), LOWP)
    x32 = -_merge(x33, _merge(a32, x22, LOWP), LOWP)
    x20 = -_merge(x22, _merge(a20, x00, LOWP) + _merge(a21, x10, LOWP), LOWP)
    x31 = -_merge(x33, _merge(a31, x11, LOWP) + _merge(a32, x21, LOWP), LOWP)
    x30 = -_merge(x33, _merge(a30, x00, LOWP) + _merge(a31, x10, LOWP) + _merge(a32, x20, LOWP), LOWP)

    # W = X (beta k e^gamma), U = X (beta v), row block by row block
    s0 = k0.to(tl.float32) * (b0 * tl.exp(c0))[:, None]
    s1 = k1.to(tl.float32) * (b1 * tl.exp(c1))[:, None]
    s2 = k2.to(tl.float32) * (b2 * tl.exp(c2))[:, None]
    s3 = k3.to(tl.float32) * (b3 * tl.exp(c3))[:, None]
    xs = (x00, x10, x11, x20, x21, x22, x30, x31, x32, x33)
    _store_lower_product(
        w_ptr + i_hv * K, HV * K, o_k, m_k, xs, s0, s1, s2, s3, r0, r1, r2, r3, m0, m1, m2, m3, LOWP
    )

    o_v = tl.arange(0, BV)
    m_v = o_v < V
    vp = v_ptr + i_hv * V
    v0 = _load_rows(vp, r0, m0, s_vt, o_v, m_v) * b0[:, None]
    v1 = _load_rows(vp, r1, m1, s_vt, o_v, m_v) * b1[:, None]
    v2 = _load_rows(vp, r2, m2, s_vt, o_v, m_v) * b2[:, None]
    v3 = _load_rows(vp, r3, m3, s_vt, o_v, m_v) * b3[:, None]
    _store_lower_product(
        u_ptr + i_hv * V, HV * V, o_v, m_v, xs, v0, v1, v2, v3, r0, r1, r2, r3, m0, m1, m2, m3, LOWP
    )


@jit_varying("cu_seqlens_ptr", "chunk_off_ptr", "slots_ptr", "has_init_ptr", "save_ptr")
def gdn_chunk_state_kernel(  # type: ignore[no-untyped-def]
    k_ptr,  # [T, HK, K]
    w_ptr,  # [T, HV, K]
    u_ptr,  # [T, HV, V]
    gamma_ptr,  # [T, HV] fp32
    rk_ptr,  # [T, HV] fp32
    v_new_ptr,  # [T, HV, V] out
    h_ptr,  # [NC, HV, K, V] out: state at the start of each chunk
    state_ptr,  # [S, HV, K, V]
    cu_seqlens_ptr,  # [N + 1]
    chunk_off_ptr,  # [N + 1]
    slots_ptr,  # [N]
    has_init_ptr,  # [N] bool
    save_ptr,  # [NC] int32: a slot to write the state at the start of each chunk to, or -1 (HAS_SAVE only)
    s_sn,
    s_sh,
    s_sk,
    s_sv,
    s_kt,  # k's token stride
    HK: tl.constexpr,
    HV: tl.constexpr,
    K: tl.constexpr,
    V: tl.constexpr,
    BK: tl.constexpr,
    BV: tl.constexpr,
    BT: tl.constexpr,
    LOWP: tl.constexpr,
    HAS_SAVE: tl.constexpr,
    PDL: tl.constexpr,
):
    wait_for_inputs(PDL)
    i_nh = tl.program_id(0)
    i_v = tl.program_id(1)
    i_n = i_nh // HV
    i_hv = i_nh % HV
    i_hk = i_hv // (HV // HK)
    bos = tl.load(cu_seqlens_ptr + i_n).to(tl.int64)
    eos = tl.load(cu_seqlens_ptr + i_n + 1).to(tl.int64)
    c0 = tl.load(chunk_off_ptr + i_n).to(tl.int64)
    num_chunks = tl.cdiv(eos - bos, BT)

    o_k = tl.arange(0, BK)
    o_v = i_v * BV + tl.arange(0, BV)
    o_t = tl.arange(0, BT)
    m_k = o_k < K
    m_v = o_v < V
    m_kv = m_k[:, None] & m_v[None, :]

    slot = tl.load(slots_ptr + i_n).to(tl.int64)
    has_init = tl.load(has_init_ptr + i_n).to(tl.int32)
    o_kv = i_hv * s_sh + o_k[:, None] * s_sk + o_v[None, :] * s_sv  # [BK, BV] this head's tile in a slot
    p_state = state_ptr + tl.maximum(slot, 0) * s_sn + o_kv
    # validity as a [BK] block: the interpreter rejects a mask built from a scalar bool
    ok_slot = (tl.zeros_like(o_k) + slot) >= 0
    ok_read = ok_slot & ((tl.zeros_like(o_k) + has_init) != 0)
    b_s = tl.load(p_state, mask=m_kv & ok_read[:, None], other=0.0).to(tl.float32)  # [BK, BV]

    # h is [NC, HV, K, V] contiguous
    p_h = h_ptr + (c0 * HV + i_hv) * K * V + o_k[:, None] * V + o_v[None, :]
    for c in range(num_chunks):
        rows = bos + c * BT + o_t
        m_t = rows < eos
        tl.store(p_h + c * HV * K * V, b_s.to(h_ptr.dtype.element_ty), mask=m_kv)
        if HAS_SAVE:
            # a prefix-cache snapshot inside the sequence: the fp32 state after its first c chunks
            sv = tl.load(save_ptr + c0 + c).to(tl.int64)
            ok_sv = (tl.zeros_like(o_k) + sv) >= 0
            p_sv = state_ptr + tl.maximum(sv, 0) * s_sn + o_kv
            tl.store(p_sv, b_s.to(state_ptr.dtype.element_ty), mask=m_kv & ok_sv[:, None])
        b_w = tl.load(
            w_ptr + rows[:, None] * (HV * K) + i_hv * K + o_k[None, :],
            mask=m_t[:, None] & m_k[None, :],
            other=0.0,
        )
        b_u = tl.load(
            u_ptr + rows[:, None] * (HV * V) + i_hv * V + o_v[None, :],
            mask=m_t[:, None] & m_v[None, :],
            other=0.0,
        ).to(tl.float32)
        b_vn = b_u - _mm(b_w, b_s, LOWP)  # [BT, BV]
        tl.store(
            v_new_ptr + rows[:, None] * (HV * V) + i_hv * V + o_v[None, :],
            b_vn.to(v_new_ptr.dtype.element_ty),
            mask=m_t[:, None] & m_v[None, :],
        )
        b_gamma = tl.load(gamma_ptr + rows * HV + i_hv, mask=m_t, other=0.0)  # [BT]
        last = tl.minimum(bos + c * BT + BT, eos) - 1
        b_glast = tl.load(gamma_ptr + last * HV + i_hv)
        m_tk = m_t[:, None] & m_k[None, :]
        b_k = tl.load(k_ptr + rows[:, None] * s_kt + i_hk * K + o_k[None, :], mask=m_tk, other=0.0)  # raw
        b_rk = tl.load(rk_ptr + rows * HV + i_hv, mask=m_t, other=0.0)
        # k normalisation and the decay to the chunk end, applied to the [BT, BV] side
        b_vs = b_vn * (b_rk * tl.where(m_t, tl.exp(b_glast - b_gamma), 0.0))[:, None]
        b_s = b_s * tl.exp(b_glast) + _mm(tl.trans(b_k), b_vs, LOWP)

    tl.store(p_state, b_s.to(state_ptr.dtype.element_ty), mask=m_kv & ok_slot[:, None])


@jit_varying("chunk_start_ptr", "chunk_end_ptr")
def gdn_chunk_out_kernel(  # type: ignore[no-untyped-def]
    q_ptr,  # [T, HK, K]
    k_ptr,  # [T, HK, K]
    v_new_ptr,  # [T, HV, V]
    gamma_ptr,  # [T, HV] fp32
    h_ptr,  # [NC, HV, K, V]
    chunk_start_ptr,  # [NC]
    chunk_end_ptr,  # [NC]
    o_ptr,  # [T, HV, V] out
    scale,
    s_qt,  # q's token stride
    s_kt,  # k's token stride
    HK: tl.constexpr,
    HV: tl.constexpr,
    K: tl.constexpr,
    V: tl.constexpr,
    BK: tl.constexpr,
    BV: tl.constexpr,
    BT: tl.constexpr,
    LOWP: tl.constexpr,
    PDL: tl.constexpr,
):
    wait_for_inputs(PDL)
    i_ch = tl.program_id(0)
    i_v = tl.program_id(1)
    i_c = (i_ch // HV).to(tl.int64)
    i_hv = i_ch % HV
    i_hk = i_hv // (HV // HK)
    bos = tl.load(chunk_start_ptr + i_c).to(tl.int64)
    end = tl.load(chunk_end_ptr + i_c).to(tl.int64)

    o_k = tl.arange(0, BK)
    o_v = i_v * BV + tl.arange(0, BV)
    o_t = tl.arange(0, BT)
    m_k = o_k < K
    m_v = o_v < V
    rows = bos + o_t
    m_t = rows < end

    b_q = _load_rows_normed(q_ptr + i_hk * K, rows, m_t, s_qt, o_k, m_k) * scale  # [BT, BK]
    b_k = _load_rows_normed(k_ptr + i_hk * K, rows, m_t, s_kt, o_k, m_k)  # [BT, BK]
    b_gamma = tl.load(gamma_ptr + rows * HV + i_hv, mask=m_t, other=0.0)  # [BT]
    b_h = tl.load(
        h_ptr + (i_c * HV + i_hv) * K * V + o_k[:, None] * V + o_v[None, :],
        mask=m_k[:, None] & m_v[None, :],
        other=0.0,
    )  # [BK, BV]
    b_vn = tl.load(
        v_new_ptr + rows[:, None] * (HV * V) + i_hv * V + o_v[None, :],
        mask=m_t[:, None] & m_v[None, :],
        other=0.0,
    )  # [BT, BV]
    causal = o_t[:, None] >= o_t[None, :]
    decay = tl.exp(tl.where(causal, b_gamma[:, None] - b_gamma[None, :], float("-inf")))
    b_a = tl.where(causal, _mm(b_q, tl.trans(b_k), LOWP) * decay, 0.0)  # [BT, BT]
    b_o = _mm(b_q * tl.exp(b_gamma)[:, None], b_h, LOWP) + _mm(b_a, b_vn, LOWP)
    tl.store(
        o_ptr + rows[:, None] * (HV * V) + i_hv * V + o_v[None, :],
        b_o.to(o_ptr.dtype.element_ty),
        mask=m_t[:, None] & m_v[None, :],
    )


class ChunkLayout(NamedTuple):
    """Where each 64-token chunk of the packed sequences lies, on the device (one copy from the host)."""

    starts: torch.Tensor  # [NC] int32 first packed token of each chunk
    ends: torch.Tensor  # [NC] int32 one past its last
    chunk_off: torch.Tensor  # [N + 1] int32 first chunk of each sequence
    cu_seqlens: torch.Tensor  # [N + 1] int32
    num_chunks: int


def chunk_layout(cu_seqlens: list[int], device: torch.device) -> ChunkLayout:
    """The chunk layout of packed sequences with host offsets `cu_seqlens` ([N + 1]), sent in one copy that
    does not wait for the device."""
    bt = CHUNK_SIZE
    chunk_start: list[int] = []
    chunk_end: list[int] = []
    chunk_off = [0]
    for bos, eos in itertools.pairwise(cu_seqlens):
        starts = list(range(bos, eos, bt))
        chunk_start += starts
        chunk_end += [min(c + bt, eos) for c in starts]
        chunk_off.append(chunk_off[-1] + len(starts))
    nc, n = chunk_off[-1], len(cu_seqlens) - 1
    meta = to_device(chunk_start + chunk_end + chunk_off + cu_seqlens, dtype=torch.int32, device=device)
    return ChunkLayout(
        meta[:nc], meta[nc : 2 * nc], meta[2 * nc : 2 * nc + n + 1], meta[2 * nc + n + 1 :], nc
    )


def launch_chunk_prefill(
    q: torch.Tensor,  # [T, HK, K], each token's [HK, K] contiguous (`token_rows`)
    k: torch.Tensor,  # [T, HK, K], likewise
    v: torch.Tensor,  # [T, HV, V], likewise
    g: torch.Tensor,  # [T, HV] fp32 contiguous
    beta: torch.Tensor,  # [T, HV] fp32 contiguous
    *,
    cu_seqlens: list[int],  # [N + 1] on the host: the launch grids need the chunk layout anyway
    state: torch.Tensor,  # [S, HV, K, V]
    state_slots: torch.Tensor,  # [N]
    has_initial_state: torch.Tensor,  # [N] int8
    return_chunk_states: bool,
    tiles: tuple[int, int, int, int, int] | None = None,  # launch-shape override, for tuning
    layout: ChunkLayout | None = None,  # `chunk_layout(cu_seqlens)` made ahead (a CUDA-graph capture)
    chunk_saves: Sequence[tuple[int, int]] = (),  # (chunk, slot): the state at the chunk's start to slot
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Runs the three stages.

    Returns (o [T, HV, V] in q's dtype, chunk_states [NC, HV, K, V] fp32 or None).
    """
    q, k, v, g, beta = token_rows(q), token_rows(k), token_rows(v), g.contiguous(), beta.contiguous()
    num_tokens, num_k_heads, head_k = q.shape
    num_v_heads, head_v = v.shape[1], v.shape[2]
    dev = q.device
    num_seqs = len(cu_seqlens) - 1
    bt = CHUNK_SIZE
    lay = layout or chunk_layout(cu_seqlens, dev)
    starts_d, ends_d, chunk_off_d, cu_d, total_chunks = lay

    lowp = q.dtype != torch.float32
    # the interpreter multiplies bf16 blocks as raw bits, so on CPU the products stay fp32
    dot_lowp = lowp and os.environ.get("TRITON_INTERPRET") != "1"
    work_dtype = torch.bfloat16 if lowp else torch.float32
    o = torch.empty(num_tokens, num_v_heads, head_v, dtype=q.dtype, device=dev)
    h_dtype = torch.float32 if return_chunk_states or not lowp else work_dtype
    h = torch.empty(total_chunks, num_v_heads, head_k, head_v, dtype=h_dtype, device=dev)
    w = torch.empty(num_tokens, num_v_heads, head_k, dtype=work_dtype, device=dev)
    u = torch.empty(num_tokens, num_v_heads, head_v, dtype=work_dtype, device=dev)
    v_new = torch.empty_like(u)
    gamma = torch.empty(num_tokens, num_v_heads, dtype=torch.float32, device=dev)
    rk = torch.empty_like(gamma)

    bk = max(triton.next_power_of_2(head_k), 16)
    bv_full = max(triton.next_power_of_2(head_v), 16)
    common = {"HK": num_k_heads, "HV": num_v_heads, "K": head_k, "V": head_v, "BK": bk, "LOWP": dot_lowp}
    # launch shapes: (wy warps, state V tile, state warps, output V tile, output warps); the sequential stage
    # has only N * HV * NV programs, so narrower V tiles when there are few sequences
    # (tuned on an H100 at 1k-16k tokens, tools/bench_kernels.py: two warps for the chunk products, the
    # whole V width per output program)
    few = num_seqs * num_v_heads < 256
    cfg = tiles or (2, 32 if few else 64, 4, 128, 4)
    if total_chunks > 0:
        gdn_chunk_wy_kernel[(total_chunks * num_v_heads,)](
            k, v, g, beta, starts_d, ends_d, w, u, gamma, rk, k.stride(0), v.stride(0),
            BV=bv_full, BT=bt, BC=SUB, num_warps=cfg[0], **common, **pdl_args(k.device, heavy=True),
        )  # fmt: skip
    bv_state = min(bv_full, cfg[1])
    saves = None
    if chunk_saves:
        per_chunk = [-1] * total_chunks
        for chunk, slot in chunk_saves:
            per_chunk[chunk] = slot
        saves = to_device(per_chunk, dtype=torch.int32, device=dev)
    if num_seqs > 0:
        gdn_chunk_state_kernel[(num_seqs * num_v_heads, triton.cdiv(head_v, bv_state))](
            k, w, u, gamma, rk, v_new, h, state, cu_d, chunk_off_d, state_slots, has_initial_state,
            has_initial_state if saves is None else saves,
            state.stride(0), state.stride(1), state.stride(2), state.stride(3), k.stride(0),
            BV=bv_state, BT=bt, num_warps=cfg[2], HAS_SAVE=saves is not None, **common,
            **pdl_args(k.device, heavy=True),
        )  # fmt: skip
    bv_out = min(bv_full, cfg[3])
    if total_chunks > 0:
        gdn_chunk_out_kernel[(total_chunks * num_v_heads, triton.cdiv(head_v, bv_out))](
            q, k, v_new, gamma, h, starts_d, ends_d, o, head_k**-0.5, q.stride(0), k.stride(0),
            BV=bv_out, BT=bt, num_warps=cfg[4], **common, **pdl_args(q.device, heavy=True),
        )  # fmt: skip
    return o, (h if return_chunk_states else None)
