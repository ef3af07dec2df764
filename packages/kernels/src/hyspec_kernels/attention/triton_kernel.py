"""Triton kernels: flash-attention style paged attention (the KV store into pages is `triton_store_kv.py`).

Attention grid: (sequence, query tile, counted from the last, KV head). A program takes BLOCK_M query tokens
of one sequence and all GROUP query heads that share one KV head, as BLOCK_M * GROUP_PAD rows of a single
matrix, so the K/V it streams from the pages serve the whole group (GQA) and decode still fills a tensor-core
tile. It walks the sequence's KV positions in blocks of BLOCK_N, looking each position's page up in the page
table (any page size, 1 included), with an online softmax in fp32. Positions at or past a sequence's KV
length are never loaded (masked loads give zeros), so unused pages cannot leak into the output even when they
hold NaN. Positions below it that a row's causal or tree mask hides are loaded with the tile (their weight is
0, but 0 * NaN is NaN): callers keep every position below the KV length finite, as the torch path needs too.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ..jit import jit_varying
from ..launch import pdl_args, wait_for_inputs

_LOG2E = 1.4426950408889634
# the most KV splits the heuristic picks; the merge kernel's split tile is this wide for every split count,
# so one compiled merge serves them all (a tile per power of two compiled one more while serving)
_MAX_SPLITS = 32


@triton.jit  # type: ignore[untyped-decorator]
def _attend_block(  # type: ignore[no-untyped-def]
    q,
    m_i,
    l_i,
    acc,
    start,
    k_cache_ptr,
    v_cache_ptr,
    page_table_ptr,
    tree_ptr,
    seq,
    kv_head,
    kv_len,
    prefix,
    m,
    qpos,
    row_valid,
    d,
    d_valid,
    qk_scale,
    kc_stride_page,
    kc_stride_off,
    kc_stride_h,
    vc_stride_page,
    vc_stride_off,
    vc_stride_h,
    pt_stride_n,
    pt_stride_p,
    tree_stride_n,
    tree_stride_i,
    page_size,
    BLOCK_N: tl.constexpr,
    MASKED: tl.constexpr,
    HAS_TREE: tl.constexpr,
    EVEN_D: tl.constexpr,
    DOT_FP32: tl.constexpr,
):
    """One online-softmax step over KV positions [start, start + BLOCK_N).

    MASKED=False is the fast path for blocks every row of the tile sees in full (the cached prefix, or the
    causal past of the tile's first query): no position, causal or tree masks.
    """
    pos = start + tl.arange(0, BLOCK_N)  # [BLOCK_N] absolute KV positions
    if MASKED:
        pos_valid = pos < kv_len
        page = tl.load(
            page_table_ptr + seq * pt_stride_n + (pos // page_size) * pt_stride_p, mask=pos_valid, other=0
        )
        kv_mask = pos_valid[:, None] & d_valid[None, :]
    else:
        page = tl.load(page_table_ptr + seq * pt_stride_n + (pos // page_size) * pt_stride_p)
        kv_mask = d_valid[None, :]
    page = page.to(tl.int64)
    offset = pos % page_size
    k_ptrs = (
        k_cache_ptr + page[:, None] * kc_stride_page + offset[:, None] * kc_stride_off + kv_head * kc_stride_h
    )
    v_ptrs = (
        v_cache_ptr + page[:, None] * vc_stride_page + offset[:, None] * vc_stride_off + kv_head * vc_stride_h
    )
    if MASKED or not EVEN_D:
        k = tl.load(k_ptrs + d[None, :], mask=kv_mask, other=0.0)  # [BLOCK_N, BLOCK_D]
    else:
        k = tl.load(k_ptrs + d[None, :])
    if DOT_FP32:
        k = k.to(tl.float32)
    scores = tl.dot(q, tl.trans(k), input_precision="ieee" if DOT_FP32 else "tf32") * qk_scale  # [R, BLOCK_N]

    if MASKED:
        allowed = row_valid[:, None] & pos_valid[None, :]
        if HAS_TREE:
            j = pos - prefix  # block index; negative inside the prefix, which every query sees
            bit = tl.load(
                tree_ptr + seq * tree_stride_n + m[:, None] * tree_stride_i + j[None, :],
                mask=allowed & (j >= 0)[None, :],
                other=0,
            )
            allowed = allowed & ((j < 0)[None, :] | (bit != 0))
        else:
            allowed = allowed & (pos[None, :] <= qpos[:, None])
        scores = tl.where(allowed, scores, float("-inf"))

    m_new = tl.maximum(m_i, tl.max(scores, axis=1))
    p = tl.exp2(scores - m_new[:, None])  # [R, BLOCK_N] fp32, 0 where masked
    alpha = tl.exp2(m_i - m_new)
    l_i = l_i * alpha + tl.sum(p, axis=1)
    if MASKED or not EVEN_D:
        v = tl.load(v_ptrs + d[None, :], mask=kv_mask, other=0.0)  # [BLOCK_N, BLOCK_D]
    else:
        v = tl.load(v_ptrs + d[None, :])
    if DOT_FP32:
        acc = acc * alpha[:, None] + tl.dot(p, v.to(tl.float32), input_precision="ieee")
    else:
        # Half-precision tensor-core product; the softmax statistics stay fp32.
        acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v)
    return m_new, l_i, acc


@jit_varying("page_table_ptr", "cu_seqlens_ptr", "kv_lens_ptr", "tree_ptr", "lse_stride_split", "num_splits")
def _paged_attention_kernel(  # type: ignore[no-untyped-def]
    q_ptr,
    k_cache_ptr,
    v_cache_ptr,
    o_ptr,
    lse_ptr,
    page_table_ptr,
    cu_seqlens_ptr,
    kv_lens_ptr,
    tree_ptr,
    qk_scale,  # softmax scale * log2(e): the kernel works in base 2
    q_stride_t,
    q_stride_h,
    o_stride_split,
    o_stride_t,
    o_stride_h,
    lse_stride_split,
    lse_stride_t,
    kc_stride_page,
    kc_stride_off,
    kc_stride_h,
    vc_stride_page,
    vc_stride_off,
    vc_stride_h,
    pt_stride_n,
    pt_stride_p,
    tree_stride_n,
    tree_stride_i,
    page_size,
    head_dim,
    num_splits,
    GROUP: tl.constexpr,
    GROUP_PAD: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_D: tl.constexpr,
    HAS_TREE: tl.constexpr,
    EVEN_D: tl.constexpr,
    DOT_FP32: tl.constexpr,
    WRITE_LSE: tl.constexpr,
    PDL: tl.constexpr,
):
    wait_for_inputs(PDL)
    seq = tl.program_id(0).to(tl.int64)
    # the last query tiles see the most KV (causal): they start first, so the short ones fill the tail (an
    # 8k-token chunk on an H200: 272 -> 301 TFLOP/s without a cached prefix, 304 -> 312 after 24k cached)
    tile = tl.num_programs(1) - 1 - tl.program_id(1)
    kv_head = (tl.program_id(2) // num_splits).to(tl.int64)
    split = tl.program_id(2) % num_splits

    q_start = tl.load(cu_seqlens_ptr + seq).to(tl.int64)
    q_len = tl.load(cu_seqlens_ptr + seq + 1).to(tl.int64) - q_start
    kv_len = tl.load(kv_lens_ptr + seq).to(tl.int64)
    prefix = kv_len - q_len  # positions before this call's new tokens

    # Row r of the tile matrix is query token tile * BLOCK_M + r // GROUP_PAD, query head r % GROUP_PAD.
    rows = tl.arange(0, BLOCK_M * GROUP_PAD)
    m = tile * BLOCK_M + rows // GROUP_PAD  # [R] index inside the sequence
    g = rows % GROUP_PAD
    row_valid = (m < q_len) & (g < GROUP)
    token = q_start + m
    head = kv_head * GROUP + g
    qpos = prefix + m  # absolute position of each row's query
    d = tl.arange(0, BLOCK_D)
    d_valid = d < head_dim

    q = tl.load(
        q_ptr + token[:, None] * q_stride_t + head[:, None] * q_stride_h + d[None, :],
        mask=row_valid[:, None] & d_valid[None, :],
        other=0.0,
    )  # [R, BLOCK_D]
    if DOT_FP32:
        q = q.to(tl.float32)

    # kv_end: one past the last position any row of the tile sees; full_end: positions below it are seen by
    # every row (causal: the first query's past; tree: the cached prefix).
    tile_live = tile * BLOCK_M < q_len
    if HAS_TREE:
        kv_end = tl.where(tile_live, kv_len, 0)
        full_end = prefix
    else:
        kv_end = tl.where(tile_live, prefix + tl.minimum(q_len, (tile + 1) * BLOCK_M), 0)
        full_end = prefix + tile * BLOCK_M + 1
    # Each sequence splits its own KV evenly (whole KV blocks): its splits share the work at every length,
    # under a CUDA graph whose split count was chosen for the longest sequence the graph can hold, too.
    split_len = tl.cdiv(tl.cdiv(tl.maximum(kv_len, 1), num_splits), BLOCK_N) * BLOCK_N
    lo = split * split_len
    hi = tl.minimum(lo + split_len, kv_end)
    mid = tl.maximum(lo, (tl.minimum(hi, full_end) // BLOCK_N) * BLOCK_N)

    # A finite floor instead of -inf keeps exp2(m_old - m_new) defined while a row has seen nothing yet.
    m_i = tl.full([BLOCK_M * GROUP_PAD], -1.0e30, dtype=tl.float32)
    l_i = tl.zeros([BLOCK_M * GROUP_PAD], dtype=tl.float32)
    acc = tl.zeros([BLOCK_M * GROUP_PAD, BLOCK_D], dtype=tl.float32)
    for start in range(lo, mid, BLOCK_N):
        m_i, l_i, acc = _attend_block(
            q, m_i, l_i, acc, start, k_cache_ptr, v_cache_ptr, page_table_ptr, tree_ptr, seq, kv_head, kv_len,
            prefix, m, qpos, row_valid, d, d_valid, qk_scale, kc_stride_page, kc_stride_off, kc_stride_h,
            vc_stride_page, vc_stride_off, vc_stride_h, pt_stride_n, pt_stride_p, tree_stride_n,
            tree_stride_i, page_size,
            BLOCK_N=BLOCK_N, MASKED=False, HAS_TREE=HAS_TREE, EVEN_D=EVEN_D, DOT_FP32=DOT_FP32,
        )  # fmt: skip
    for start in range(mid, hi, BLOCK_N):
        m_i, l_i, acc = _attend_block(
            q, m_i, l_i, acc, start, k_cache_ptr, v_cache_ptr, page_table_ptr, tree_ptr, seq, kv_head, kv_len,
            prefix, m, qpos, row_valid, d, d_valid, qk_scale, kc_stride_page, kc_stride_off, kc_stride_h,
            vc_stride_page, vc_stride_off, vc_stride_h, pt_stride_n, pt_stride_p, tree_stride_n,
            tree_stride_i, page_size,
            BLOCK_N=BLOCK_N, MASKED=True, HAS_TREE=HAS_TREE, EVEN_D=EVEN_D, DOT_FP32=DOT_FP32,
        )  # fmt: skip

    seen = l_i > 0
    out = acc / tl.where(seen, l_i, 1.0)[:, None]
    store_mask = row_valid[:, None] & d_valid[None, :]
    o_ptrs = (
        o_ptr + split * o_stride_split + token[:, None] * o_stride_t + head[:, None] * o_stride_h + d[None, :]
    )
    tl.store(o_ptrs, out.to(o_ptr.dtype.element_ty), mask=store_mask)
    if WRITE_LSE:
        # Base-2 log-sum-exp of this split's scores; -inf for a split that saw nothing (weight 0 when merged).
        lse = tl.where(seen, m_i + tl.log2(tl.where(seen, l_i, 1.0)), float("-inf"))
        tl.store(lse_ptr + split * lse_stride_split + token * lse_stride_t + head, lse, mask=row_valid)


@jit_varying("lse_stride_split", "num_splits")
def _merge_splits_kernel(  # type: ignore[no-untyped-def]
    part_ptr,
    lse_ptr,
    o_ptr,
    part_stride_split,
    part_stride_t,
    part_stride_h,
    lse_stride_split,
    lse_stride_t,
    o_stride_t,
    o_stride_h,
    num_splits,
    head_dim,
    BLOCK_S: tl.constexpr,
    BLOCK_D: tl.constexpr,
    PDL: tl.constexpr,
):
    """o[t, h] = sum_s w_s * part[s, t, h] with w_s = 2^lse_s / sum 2^lse (splits' softmax masses)."""
    wait_for_inputs(PDL)
    t = tl.program_id(0).to(tl.int64)
    h = tl.program_id(1)
    s = tl.arange(0, BLOCK_S)
    d = tl.arange(0, BLOCK_D)
    s_valid = s < num_splits
    lse = tl.load(lse_ptr + s * lse_stride_split + t * lse_stride_t + h, mask=s_valid, other=float("-inf"))
    weight = tl.exp2(lse - tl.max(lse, axis=0))  # [BLOCK_S], 0 for empty splits
    part = tl.load(
        part_ptr + s[:, None] * part_stride_split + t * part_stride_t + h * part_stride_h + d[None, :],
        mask=s_valid[:, None] & (d < head_dim)[None, :],
        other=0.0,
    )  # [BLOCK_S, BLOCK_D] fp32
    out = tl.sum(weight[:, None] * part, axis=0) / tl.sum(weight, axis=0)
    tl.store(o_ptr + t * o_stride_t + h * o_stride_h + d, out.to(o_ptr.dtype.element_ty), mask=d < head_dim)


def _launch_config(
    max_q_len: int, group_pad: int, head_dim: int, interpreted: bool, half: bool = True
) -> tuple[int, int, int]:
    """(BLOCK_M, BLOCK_N, num_warps), tuned on an H100 at HQ=16, HKV=2, Dh 128 and 256 in bf16, and for long
    prefill tiles on an H200 at HQ=16, HKV=4, Dh 256.

    Rows (BLOCK_M * GROUP_PAD) are capped at 128 for a 16-bit prefill with Dh <= 256 (`half`; else 64, as
    for at most 16 query tokens, so that the tiles fit in shared memory), the fp32
    accumulator of 128 rows spread over 8 warps, and kept at 16 or more for tl.dot. Short tiles (decode,
    short verify) stream longer KV blocks. A prefill tile of 128 rows and 64 KV positions ran 1.6x faster
    than 64 rows and 32 positions over 4 warps (8k-token chunks after 0-24k cached tokens: 270-300 against
    170-185 TFLOP/s; 256 rows run out of shared memory). Under the CPU interpreter the tiles are small on
    purpose, so tiny test shapes still cross query tiles and KV blocks.
    """
    # decode and verify blocks (at most 16 tokens) keep the tiles they were tuned with
    wide = half and head_dim <= 256 and max_q_len > 16
    max_rows = 16 if interpreted else 128 if wide else 64
    block_m = max(1, min(triton.next_power_of_2(max_q_len), max_rows // group_pad))
    while block_m * group_pad < 16:
        block_m *= 2
    if interpreted:
        return block_m, 16, 4
    rows = block_m * group_pad
    if rows <= 32:
        return block_m, 128 if head_dim <= 128 else 64, 4
    if rows <= 64:
        return block_m, 64 if head_dim <= 128 else 32, 4
    return block_m, 64, 8


def _short_kv_blocks(block_n: int, rows: int, programs: int, num_sms: int) -> int:
    """KV blocks of at most 32 positions for decode-sized tiles (at most 32 rows) when the programs are so few
    that `_num_splits` splits each sequence the most ways: each split's share of a short context is then
    a block or two, and longer blocks leave more splits empty. On an H200 (HQ=16, HKV=4, bf16, batch 1, the
    split count a CUDA graph of 4k-32k positions picks): Dh 256 17.0 -> 12.1 us at 560 positions and
    20.4 -> 16.8 us at 3000; Dh 128 15.0 -> 9.0 and 15.0 -> 12.0. At batch 8 and more it was mixed or slower
    (48.4 -> 51.4 us at batch 8 and 3000 positions), so those keep their blocks."""
    if rows <= 32 and programs * _MAX_SPLITS <= 2 * num_sms:
        return min(block_n, 32)
    return block_n


def _decode_tiles(
    block_n: int, rows: int, head_dim: int, programs: int, num_sms: int
) -> tuple[int, int | None, int]:
    """(BLOCK_N, num_stages or None for Triton's default, programs per SM for `_num_splits`) of a CUDA launch
    of `programs` (sequence x KV head) programs before splits.

    Decode-sized tiles (at most 32 rows) of wide heads (Dh > 128) stream their KV two stages deep with about
    three programs per SM: Triton's default three stages of 64 positions take 192 KiB of shared memory at
    Dh 256, so one program fits an SM and a batch of 32 runs its 256 programs in two waves. Blocks of 32
    positions while the programs are fewer than the SMs, of 64 from there. On an H200 (HQ 16, HKV 4,
    Dh 256, bf16, one and four query tokens; `nvidia-h200-attention-decode-tiles.md`): batch 8 23.5 -> 15.2
    us at 600 positions and 96.6 -> 82.3 at 8000, batch 32 45.0 -> 35.6 and 317 -> 283, batch 64 (64-position
    blocks) 68.2 -> 60.8 and 629 -> 571, batch 1 11.5 -> 10.3 and 29.9 -> 26.0.
    """
    if rows <= 32 and head_dim > 128:
        return (32 if programs < num_sms else 64), 2, 3
    return block_n, None, 2


def _num_splits(programs: int, max_kv_len: int, block_n: int, device: torch.device, per_sm: int = 2) -> int:
    """Split each sequence's KV so that small batches still occupy every SM (flash-decoding).

    About `per_sm` programs per SM and at least one KV block per split: on an H100 (bf16, Dh 128 and 256,
    batch 1 to 128, KV 512 to 32k) two were within 10% of the best forced split count, often the best.
    """
    if device.type != "cuda":
        return 1
    target = per_sm * torch.cuda.get_device_properties(device).multi_processor_count
    by_length = max(1, max_kv_len // block_n)
    return max(1, min(target // max(programs, 1), by_length, _MAX_SPLITS))


def paged_attention_triton(
    q: torch.Tensor,
    *,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    page_table: torch.Tensor,
    cu_seqlens_q: torch.Tensor,
    kv_lens: torch.Tensor,
    scale: float,
    tree_mask: torch.Tensor | None = None,
    max_q_len: int,
    max_kv_len: int,
    num_kv_splits: int | None = None,
) -> torch.Tensor:
    """Unvalidated launcher: last dims of q and the caches must have stride 1 (the wrapper checks).

    `num_kv_splits` overrides the split-KV heuristic (tests use it to cover the merge on CPU).
    """
    num_tokens, num_q_heads, head_dim = q.shape
    num_kv_heads = k_cache.shape[2]
    num_seqs = kv_lens.shape[0]
    out = torch.empty_like(q)
    if num_tokens == 0 or num_seqs == 0 or max_q_len == 0:
        return out
    group = num_q_heads // num_kv_heads
    group_pad = triton.next_power_of_2(group)
    block_m, block_n, num_warps = _launch_config(
        max_q_len, group_pad, head_dim, q.device.type == "cpu", half=q.element_size() == 2
    )
    block_d = max(16, triton.next_power_of_2(head_dim))
    tiles = triton.cdiv(max_q_len, block_m)
    programs = num_seqs * tiles * num_kv_heads
    stages: dict[str, int] = {}  # num_stages when not Triton's default
    per_sm = 2
    if q.device.type == "cuda" and num_kv_splits is None:  # (a forced split count keeps its blocks)
        sms = torch.cuda.get_device_properties(q.device).multi_processor_count
        block_n = _short_kv_blocks(block_n, block_m * group_pad, programs, sms)
        block_n, num_stages, per_sm = _decode_tiles(block_n, block_m * group_pad, head_dim, programs, sms)
        if num_stages is not None:
            stages["num_stages"] = num_stages
    splits = num_kv_splits or _num_splits(programs, max_kv_len, block_n, q.device, per_sm)
    if splits > 1:
        part = torch.empty(splits, num_tokens, num_q_heads, head_dim, dtype=torch.float32, device=q.device)
        lse = torch.empty(splits, num_tokens, num_q_heads, dtype=torch.float32, device=q.device)
    else:
        part, lse = out[None], out  # lse unused (WRITE_LSE=False)
    # The kernel reads the mask as bytes with unit stride along its last dim; the mask is tiny.
    tree = tree_mask.contiguous().view(torch.uint8) if tree_mask is not None else kv_lens
    grid = (num_seqs, tiles, num_kv_heads * splits)
    _paged_attention_kernel[grid](
        q,
        k_cache,
        v_cache,
        part,
        lse,
        page_table,
        cu_seqlens_q,
        kv_lens,
        tree,
        scale * _LOG2E,
        q.stride(0),
        q.stride(1),
        part.stride(0),
        part.stride(1),
        part.stride(2),
        lse.stride(0) if splits > 1 else 0,
        lse.stride(1) if splits > 1 else 0,
        k_cache.stride(0),
        k_cache.stride(1),
        k_cache.stride(2),
        v_cache.stride(0),
        v_cache.stride(1),
        v_cache.stride(2),
        page_table.stride(0),
        page_table.stride(1),
        tree.stride(0) if tree_mask is not None else 0,
        tree.stride(1) if tree_mask is not None else 0,
        k_cache.shape[1],
        head_dim,
        splits,
        GROUP=group,
        GROUP_PAD=group_pad,
        BLOCK_M=block_m,
        BLOCK_N=block_n,
        BLOCK_D=block_d,
        HAS_TREE=tree_mask is not None,
        EVEN_D=block_d == head_dim,
        # fp32 inputs get exact fp32 products (not tf32). On CPU the interpreter runs the kernel, and its
        # tl.dot gives garbage for bf16 operands (triton 3.9), so it multiplies in fp32 there too.
        DOT_FP32=q.dtype == torch.float32 or q.device.type == "cpu",
        WRITE_LSE=splits > 1,
        num_warps=num_warps,
        **stages,
        **pdl_args(q.device, heavy=True),
    )
    if splits > 1:
        _merge_splits_kernel[(num_tokens, num_q_heads)](
            part,
            lse,
            out,
            part.stride(0),
            part.stride(1),
            part.stride(2),
            lse.stride(0),
            lse.stride(1),
            out.stride(0),
            out.stride(1),
            splits,
            head_dim,
            BLOCK_S=max(_MAX_SPLITS, triton.next_power_of_2(splits)),
            BLOCK_D=block_d,
            **pdl_args(part.device),
        )
    return out
