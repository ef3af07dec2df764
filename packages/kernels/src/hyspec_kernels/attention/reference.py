"""Paged attention, the readable way: one query token at a time, gathering its visible keys page by page.

Cache layout: `k_cache[page, offset, kv_head, :]`; the token at absolute position p of sequence n lives at
page `page_table[n, p // page_size]`, offset `p % page_size`. Query i of a sequence with q_len new tokens sits
at position `kv_len - q_len + i` (the new tokens' K/V are already stored). Without a tree mask it sees every
position up to its own; with one, it sees the whole prefix `[0, kv_len - q_len)` and block token j iff
`tree_mask[n, i, j]`.
"""

from __future__ import annotations

import torch


def store_kv_reference(
    k: torch.Tensor, v: torch.Tensor, *, k_cache: torch.Tensor, v_cache: torch.Tensor, kv_slots: torch.Tensor
) -> None:
    """Unvalidated reference for `store_kv`: token t goes to flat slot kv_slots[t] (-1 skipped)."""
    page_size = k_cache.shape[1]
    for t, slot in enumerate(kv_slots.tolist()):
        if slot < 0:
            continue
        k_cache[slot // page_size, slot % page_size] = k[t]  # [HKV, Dh]
        v_cache[slot // page_size, slot % page_size] = v[t]


def visible_positions(kv_len: int, q_len: int, i: int, tree_row: list[bool] | None) -> list[int]:
    """Absolute KV positions query i of a sequence attends to."""
    prefix = kv_len - q_len
    if tree_row is None:
        return list(range(prefix + i + 1))
    return list(range(prefix)) + [prefix + j for j in range(q_len) if tree_row[j]]


def paged_attention_reference(
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
    """Unvalidated reference for `paged_attention`; fp32 math, output in q's dtype."""
    num_q_heads = q.shape[1]
    group = num_q_heads // k_cache.shape[2]  # query heads per KV head
    page_size = k_cache.shape[1]
    out = torch.zeros(q.shape, dtype=torch.float32, device=q.device)  # [T, HQ, Dh]
    cu = cu_seqlens_q.tolist()
    for n, kv_len in enumerate(kv_lens.tolist()):
        q_len = cu[n + 1] - cu[n]
        for i in range(q_len):
            t = cu[n] + i
            tree_row = None if tree_mask is None else tree_mask[n, i, :q_len].tolist()
            positions = visible_positions(kv_len, q_len, i, tree_row)
            pages = page_table[n, [p // page_size for p in positions]].long()
            offsets = torch.tensor([p % page_size for p in positions], device=q.device)
            keys = k_cache[pages, offsets].float().repeat_interleave(group, dim=1)  # [P_vis, HQ, Dh]
            values = v_cache[pages, offsets].float().repeat_interleave(group, dim=1)  # [P_vis, HQ, Dh]
            scores = torch.einsum("hd,phd->hp", q[t].float(), keys) * scale  # [HQ, P_vis]
            weights = torch.softmax(scores, dim=-1)
            out[t] = torch.einsum("hp,phd->hd", weights, values)
    return out.to(q.dtype)
