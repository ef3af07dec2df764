"""`draft_block_after_verify` as one Triton launch: a program per (row, block of feature columns)."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ..jit import jit_varying
from ..launch import pdl_args, wait_for_inputs


@jit_varying("num_d")
def draft_block_kernel(  # type: ignore[no-untyped-def]
    block_tokens_ptr,  # [N, Dv] int64, row stride s_bt
    output_tokens_ptr,  # [N, Do] int64, row stride s_ot
    features_ptr,  # [N * Dv, F], row stride s_f
    paths_ptr,  # [N, P] int64, row stride s_p (unused for a chain)
    num_accepted_ptr,  # [N] int64
    rows_ptr,  # [N] int64
    root_ptr,  # [R, F], row stride s_r
    x_ptr,  # [>= N * W, F], row stride s_x
    root_index_ptr,  # [>= N] int64
    tokens_ptr,  # [N, W] int64 contiguous
    num_d,  # d: path nodes the block takes
    s_bt,
    s_ot,
    s_f,
    s_p,
    s_r,
    s_x,
    F,
    DV: tl.constexpr,
    W: tl.constexpr,
    BW: tl.constexpr,
    BF: tl.constexpr,
    TREE: tl.constexpr,
    PDL: tl.constexpr,
):
    wait_for_inputs(PDL)
    i = tl.program_id(0).to(tl.int64)
    fb = tl.program_id(1)
    fo = fb * BF + tl.arange(0, BF)
    fm = fo < F
    r = tl.load(rows_ptr + i)
    a = tl.load(num_accepted_ptr + i)
    # the old root feature first: this program writes the row's new one below, over the same columns
    old = tl.load(root_ptr + r * s_r + fo, mask=fm, other=0.0)
    tl.store(x_ptr + (i * W) * s_x + fo, old.to(x_ptr.dtype.element_ty), mask=fm)
    for j in tl.static_range(W - 1):
        taken = (fo * 0 + j) < num_d  # [BF] the block takes path node j (else padding)
        node = i * 0 + j
        if TREE:
            node = tl.maximum(tl.load(paths_ptr + i * s_p + j, mask=(i * 0 + j) < num_d, other=0), 0)
        val = tl.load(features_ptr + (i * DV + node) * s_f + fo, mask=fm & taken, other=0.0)
        tl.store(x_ptr + (i * W + 1 + j) * s_x + fo, val.to(x_ptr.dtype.element_ty), mask=fm)
    node_a = a
    if TREE:
        node_a = tl.maximum(tl.load(paths_ptr + i * s_p + a), 0)
    new = tl.load(features_ptr + (i * DV + node_a) * s_f + fo, mask=fm, other=0.0)
    tl.store(root_ptr + r * s_r + fo, new.to(root_ptr.dtype.element_ty), mask=fm)
    if fb == 0:
        o = tl.arange(0, BW)
        root_tok = tl.load(block_tokens_ptr + i * s_bt + o * 0)
        emitted = tl.load(output_tokens_ptr + i * s_ot + (o - 1), mask=(o >= 1) & (o - 1 < num_d), other=0)
        tok = tl.maximum(tl.where(o == 0, root_tok, emitted), 0)
        tl.store(tokens_ptr + i * W + o, tok, mask=o < W)
        tl.store(root_index_ptr + i, a + 1)


def draft_block_after_verify_triton(
    *,
    block_tokens: torch.Tensor,
    output_tokens: torch.Tensor,
    features: torch.Tensor,
    paths: torch.Tensor | None,
    num_accepted: torch.Tensor,
    rows: torch.Tensor,
    root_features: torch.Tensor,
    x: torch.Tensor,
    root_index: torch.Tensor,
    width: int,
) -> torch.Tensor:
    """The reference's result in one launch (arguments as there; feature rows may be strided)."""
    n, dv = block_tokens.shape
    d = min(dv if paths is None else paths.shape[1], width - 1)
    f = int(features.shape[1])
    tokens = torch.empty(n, width, dtype=torch.int64, device=block_tokens.device)
    if n == 0:
        return tokens
    bf = min(triton.next_power_of_2(f), 1024)
    p = block_tokens if paths is None else paths  # a chain's kernel never reads it
    draft_block_kernel[(n, triton.cdiv(f, bf))](
        block_tokens, output_tokens, features, p, num_accepted, rows, root_features, x, root_index, tokens,
        d, block_tokens.stride(0), output_tokens.stride(0), features.stride(0), p.stride(0),
        root_features.stride(0), x.stride(0), f,
        DV=dv, W=width, BW=max(triton.next_power_of_2(width), 2), BF=bf, TREE=paths is not None,
        **pdl_args(block_tokens.device),
    )  # fmt: skip
    return tokens
