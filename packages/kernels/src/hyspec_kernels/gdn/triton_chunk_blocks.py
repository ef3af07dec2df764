"""Block helpers of the chunked GDN prefill's Triton kernels (`triton_chunk.py`): 16-row blocks of a 64-token
chunk, loaded and stored through a token stride, and the block products and the unit-lower inverse the WY
stage is built from. With `LOWP` the products take bf16 / fp16 operands (tensor cores, fp32 accumulation);
the solve's merges take TF32 operands.
"""

from __future__ import annotations

import triton
import triton.language as tl

SUB = 16  # rows of one block of the WY stage; CHUNK_SIZE == 4 * SUB


@triton.jit  # type: ignore[untyped-decorator]
def _mm(a, b, LOWP: tl.constexpr):  # type: ignore[no-untyped-def]
    if LOWP:
        return tl.dot(a.to(tl.bfloat16), b.to(tl.bfloat16))
    else:
        return tl.dot(a.to(tl.float32), b.to(tl.float32), input_precision="ieee")


@triton.jit
def _load_rows_normed(ptr, rows, m_rows, s_t, o_k, m_k):  # type: ignore[no-untyped-def]
    # [R, BK] rows of q or k, L2-normalised in fp32; masked rows come back as zeros
    x = tl.load(ptr + rows[:, None] * s_t + o_k[None, :], mask=m_rows[:, None] & m_k[None, :], other=0.0)
    x = x.to(tl.float32)
    return x * tl.rsqrt(tl.sum(x * x, 1) + 1e-6)[:, None]


@triton.jit  # type: ignore[untyped-decorator]
def _unit_lower_inv4(a0, a1, a2, a3, BC: tl.constexpr):  # type: ignore[no-untyped-def]
    # (I + a)^-1 of four strictly lower [BC, BC] blocks by forward substitution, the four in one loop (four
    # independent chains the scheduler can interleave). With x = (I + a)^-1 - I, row r of x is
    # -a[r] - sum_m a[r, m] x[m] = n + sum_m n[m] x[m] where n = -a[r] (zero from column r on, so the rows
    # of x not yet done drop out); rows 0 and 1 are -a[0] = 0 and -a[1] already
    o_r = tl.arange(0, BC)
    x0, x1, x2, x3 = -a0, -a1, -a2, -a3
    for r in range(2, BC):
        sel = (o_r == r)[:, None]
        n0 = tl.sum(tl.where(sel, x0, 0.0), 0)  # [BC] = -a0[r]: row r of x0 is still -a0[r]
        n1 = tl.sum(tl.where(sel, x1, 0.0), 0)
        n2 = tl.sum(tl.where(sel, x2, 0.0), 0)
        n3 = tl.sum(tl.where(sel, x3, 0.0), 0)
        x0 = tl.where(sel, (n0 + tl.sum(n0[:, None] * x0, 0))[None, :], x0)
        x1 = tl.where(sel, (n1 + tl.sum(n1[:, None] * x1, 0))[None, :], x1)
        x2 = tl.where(sel, (n2 + tl.sum(n2[:, None] * x2, 0))[None, :], x2)
        x3 = tl.where(sel, (n3 + tl.sum(n3[:, None] * x3, 0))[None, :], x3)
    eye = (o_r[:, None] == o_r[None, :]).to(tl.float32)
    return x0 + eye, x1 + eye, x2 + eye, x3 + eye


@triton.jit
def _load_rows(ptr, rows, m_r, s_t, o_c, m_c):  # type: ignore[no-untyped-def]
    # [R, C] fp32: rows `rows` (token stride s_t) at columns o_c; masked rows and columns come back as zeros
    return tl.load(ptr + rows[:, None] * s_t + o_c[None, :], mask=m_r[:, None] & m_c[None, :], other=0.0).to(
        tl.float32
    )


@triton.jit
def _store_rows(ptr, x, rows, m_r, s_t, o_c, m_c):  # type: ignore[no-untyped-def]
    tl.store(
        ptr + rows[:, None] * s_t + o_c[None, :], x.to(ptr.dtype.element_ty), mask=m_r[:, None] & m_c[None, :]
    )


@triton.jit  # type: ignore[untyped-decorator]
def _k_rows(k_ptr, rows, m_r, s_kt, o_k, m_k, LOWP: tl.constexpr):  # type: ignore[no-untyped-def]
    # [BC, BK] key rows, L2-normalised (bf16 when the products take bf16), and their 1 / |k| [BC] fp32
    kf = _load_rows(k_ptr, rows, m_r, s_kt, o_k, m_k)
    rk = tl.rsqrt(tl.sum(kf * kf, 1) + 1e-6)
    kn = kf * rk[:, None]
    if LOWP:
        kn = kn.to(tl.bfloat16)
    return kn, rk


@triton.jit  # type: ignore[untyped-decorator]
def _a_block(ki, kj, bi, gi, gj, LOWP: tl.constexpr):  # type: ignore[no-untyped-def]
    # an off-diagonal [BC, BC] block of A = beta_i k_i k_j^T e^(gamma_i - gamma_j) (rows i after columns j)
    return _mm(ki, tl.trans(kj), LOWP) * (bi[:, None] * tl.exp(gi[:, None] - gj[None, :]))


@triton.jit  # type: ignore[untyped-decorator]
def _a_diag(ki, bi, gi, BC: tl.constexpr, LOWP: tl.constexpr):  # type: ignore[no-untyped-def]
    # a diagonal [BC, BC] block of A, strictly lower
    o = tl.arange(0, BC)
    strict = o[:, None] > o[None, :]
    decay = tl.exp(tl.where(strict, gi[:, None] - gi[None, :], float("-inf")))
    return tl.where(strict, _mm(ki, tl.trans(ki), LOWP) * (bi[:, None] * decay), 0.0)


@triton.jit  # type: ignore[untyped-decorator]
def _merge(a, b, LOWP: tl.constexpr):  # type: ignore[no-untyped-def]
    # a block product of the solve's merge: TF32 tensor cores with bf16 inputs (X is rounded to bf16 for W
    # and U anyway, and TF32 keeps two more mantissa bits; FMA-based fp32 products made the merge the slowest
    # part of the stage), exact fp32 with fp32 inputs
    if LOWP:
        return tl.dot(a, b, input_precision="tf32")
    else:
        return tl.dot(a, b, input_precision="ieee")


@triton.jit  # type: ignore[untyped-decorator]
def _store_lower_product(  # type: ignore[no-untyped-def]
    ptr, s_t, o_c, m_c, xs, y0, y1, y2, y3, r0, r1, r2, r3, m0, m1, m2, m3, LOWP: tl.constexpr
):
    # the four row blocks of X Y to rows r0..r3: X block lower triangular, its ten blocks in `xs` row by
    # row; Y four [BC, C] row blocks
    x00, x10, x11, x20, x21, x22, x30, x31, x32, x33 = xs
    _store_rows(ptr, _mm(x00, y0, LOWP), r0, m0, s_t, o_c, m_c)
    _store_rows(ptr, _mm(x10, y0, LOWP) + _mm(x11, y1, LOWP), r1, m1, s_t, o_c, m_c)
    z2 = _mm(x20, y0, LOWP) + _mm(x21, y1, LOWP) + _mm(x22, y2, LOWP)
    _store_rows(ptr, z2, r2, m2, s_t, o_c, m_c)
    z3 = _mm(x30, y0, LOWP) + _mm(x31, y1, LOWP) + _mm(x32, y2, LOWP) + _mm(x33, y3, LOWP)
    _store_rows(ptr, z3, r3, m3, s_t, o_c, m_c)
