"""Paged attention for the CPU engine: gather every sequence's KV into a padded batch, one masked SDPA call.

Padding is cheap at the CPU engine's sizes and keeps the whole op to a handful of vectorised torch calls.
Positions past a sequence's kv_len are filled with zeros, never read from the cache, so unused pages (which
may hold garbage or NaN) cannot reach the softmax or the value sum.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F


def store_kv_torch(
    k: torch.Tensor, v: torch.Tensor, *, k_cache: torch.Tensor, v_cache: torch.Tensor, kv_slots: torch.Tensor
) -> None:
    """Unvalidated torch path for `store_kv`."""
    live = kv_slots >= 0  # [T] bool
    slots = kv_slots[live].long()
    page_size = k_cache.shape[1]
    pages, offsets = slots // page_size, slots % page_size
    k_cache[pages, offsets] = k[live]  # [T_live, HKV, Dh]
    v_cache[pages, offsets] = v[live]


def visibility_mask(
    cu_seqlens_q: torch.Tensor,
    kv_lens: torch.Tensor,
    max_q: int,
    max_kv: int,
    tree_mask: torch.Tensor | None,
) -> torch.Tensor:
    """[N, max_q, max_kv] bool: may padded query i of sequence n see KV position p."""
    device = kv_lens.device
    q_lens = (cu_seqlens_q[1:] - cu_seqlens_q[:-1]).long()  # [N]
    kv_lens = kv_lens.long()
    prefix = (kv_lens - q_lens)[:, None, None]  # [N, 1, 1]
    i = torch.arange(max_q, device=device)[None, :, None]  # [1, max_q, 1]
    pos = torch.arange(max_kv, device=device)[None, None, :]  # [1, 1, max_kv]
    live = (i < q_lens[:, None, None]) & (pos < kv_lens[:, None, None])
    if tree_mask is None:
        return live & (pos <= prefix + i)
    depth = tree_mask.shape[1]
    j = pos - prefix  # block index of position p, negative inside the prefix
    n = torch.arange(kv_lens.shape[0], device=device)[:, None, None]
    bit = tree_mask[n, i.clamp(max=depth - 1), j.clamp(0, depth - 1)]  # [N, max_q, max_kv]
    return live & ((j < 0) | ((j < q_lens[:, None, None]) & bit))


def paged_attention_torch(
    q: torch.Tensor,
    *,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    page_table: torch.Tensor,
    cu_seqlens_q: torch.Tensor,
    kv_lens: torch.Tensor,
    scale: float,
    tree_mask: torch.Tensor | None = None,
) -> torch.Tensor:
    """Unvalidated torch path for `paged_attention`; fp32 softmax, output in q's dtype."""
    num_tokens, num_q_heads, head_dim = q.shape
    num_seqs = kv_lens.shape[0]
    if num_tokens == 0 or num_seqs == 0:
        return torch.zeros_like(q)
    device = q.device
    page_size = k_cache.shape[1]
    q_lens = (cu_seqlens_q[1:] - cu_seqlens_q[:-1]).long()  # [N]
    max_q, max_kv = int(q_lens.max()), max(int(kv_lens.max()), 1)

    # Gather KV into [N, max_kv, HKV, Dh]; padded positions read page 0 and are then zeroed.
    pos = torch.arange(max_kv, device=device)
    in_range = pos[None, :] < kv_lens[:, None].long()  # [N, max_kv]
    pages = page_table[:, (pos // page_size).clamp(max=page_table.shape[1] - 1)].long()  # [N, max_kv]
    pages = torch.where(in_range, pages, 0)
    keep = in_range[:, :, None, None]
    keys = torch.where(keep, k_cache[pages, pos % page_size].float(), 0.0)  # [N, max_kv, HKV, Dh] fp32
    values = torch.where(keep, v_cache[pages, pos % page_size].float(), 0.0)

    # Scatter the packed queries into [N, max_q, HQ, Dh].
    seq = torch.repeat_interleave(torch.arange(num_seqs, device=device), q_lens, output_size=num_tokens)
    idx = torch.arange(num_tokens, device=device) - cu_seqlens_q[:-1].long()[seq]  # index inside its sequence
    queries = torch.zeros(num_seqs, max_q, num_q_heads, head_dim, dtype=torch.float32, device=device)
    queries[seq, idx] = q.float()

    mask = visibility_mask(cu_seqlens_q, kv_lens, max_q, max_kv, tree_mask)  # [N, max_q, max_kv]
    out = F.scaled_dot_product_attention(
        queries.transpose(1, 2),  # [N, HQ, max_q, Dh]
        keys.transpose(1, 2),  # [N, HKV, max_kv, Dh]
        values.transpose(1, 2),
        attn_mask=mask[:, None],
        scale=scale,
        enable_gqa=True,
    )  # [N, HQ, max_q, Dh]; padded query rows (all masked) are dropped below
    return out.transpose(1, 2)[seq, idx].to(q.dtype)
