"""`store_kv` and `paged_attention`: validated entry points over a paged KV cache.

Cache layout `[P, page_size, HKV, Dh]` for both K and V; a KV slot is `page * page_size + offset`. The caller
stores the new tokens' K/V first, then attends: query i of sequence n sits at absolute position
`kv_lens[n] - q_len_n + i`. The same op serves extend after a cached prefix, decode (q_len 1), chain verify
(causal) and tree verify (`tree_mask`), and sequences with q_len 0 (padding rows).
"""

from __future__ import annotations

import math
from functools import partial

import torch

from hyspec_kernels._checks import (
    FLOAT_DTYPES,
    INDEX_DTYPES,
    Backend,
    capturing,
    check_cu_seqlens,
    check_index,
    check_tensor,
    check_unit_stride,
    dim,
    implementation,
    value_checks,
)
from hyspec_kernels.attention.reference import paged_attention_reference, store_kv_reference
from hyspec_kernels.attention.torch_impl import paged_attention_torch, store_kv_torch
from hyspec_kernels.attention.triton_kernel import paged_attention_triton
from hyspec_kernels.attention.triton_store_kv import store_kv_triton


def _check_caches(
    k_cache: object,
    v_cache: object,
    device: torch.device | None,
    dtypes: tuple[torch.dtype, ...] = FLOAT_DTYPES,
    head_dim: int | str = "Dh",
) -> tuple[torch.Tensor, torch.Tensor]:
    shape = ("P", "page_size", "HKV", head_dim)
    k_cache = check_tensor("k_cache", k_cache, shape, dtypes=dtypes, device=device)
    v_cache = check_tensor("v_cache", v_cache, tuple(k_cache.shape), dtypes=(k_cache.dtype,), device=device)
    if k_cache.shape[0] == 0 or k_cache.shape[1] == 0:
        raise ValueError(
            f"k_cache: expected at least one page of at least one slot, got {list(k_cache.shape)}"
        )
    return k_cache, v_cache


def _store_kv_triton(
    k: torch.Tensor, v: torch.Tensor, *, k_cache: torch.Tensor, v_cache: torch.Tensor, kv_slots: torch.Tensor
) -> None:
    check_unit_stride({"k": k, "v": v, "k_cache": k_cache, "v_cache": v_cache}, "the head dim")
    # the kernel steps through the slots by 1: a strided view (a column of packed metadata) is copied
    store_kv_triton(k, v, k_cache=k_cache, v_cache=v_cache, kv_slots=kv_slots.contiguous())


def _paged_attention_triton(
    q: torch.Tensor,
    *,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    page_table: torch.Tensor,
    cu_seqlens_q: torch.Tensor,
    kv_lens: torch.Tensor,
    scale: float,
    tree_mask: torch.Tensor | None,
    max_q_len: int,
    max_kv_len: int,
) -> torch.Tensor:
    """The Triton path with the launch bounds the wrapper read (the other paths derive them)."""
    check_unit_stride({"q": q, "k_cache": k_cache, "v_cache": v_cache}, "the head dim")
    return paged_attention_triton(
        q,
        k_cache=k_cache,
        v_cache=v_cache,
        page_table=page_table,
        # the kernel steps through these by 1 (the page table goes by its strides): strided views are copied
        cu_seqlens_q=cu_seqlens_q.contiguous(),
        kv_lens=kv_lens.contiguous(),
        scale=scale,
        tree_mask=tree_mask,
        max_q_len=max_q_len,
        max_kv_len=max_kv_len,
    )


def _max_lens(q_lens: torch.Tensor, kv_lens: torch.Tensor) -> tuple[int, int]:
    """(max q_len, max kv_len) read back in one host transfer; (0, 0) without sequences."""
    if q_lens.numel() == 0:
        return 0, 0
    both = torch.stack([q_lens.max().long(), kv_lens.max().long()]).tolist()  # [2]
    return int(both[0]), int(both[1])


def _launch_lens(
    q_lens: torch.Tensor, kv_lens: torch.Tensor, host_lens: tuple[int, int] | None, *, checks: bool
) -> tuple[int, int]:
    """(longest q_len, longest kv_len): `host_lens` as given, read from the device to check them where value
    checks run, or read when there are none."""
    if host_lens is not None:
        ok = (
            isinstance(host_lens, tuple)
            and len(host_lens) == 2
            and all(isinstance(v, int) and not isinstance(v, bool) and v >= 0 for v in host_lens)
        )
        if not ok:
            raise ValueError(
                f"host_lens: expected None or (max q_len, max kv_len) ints >= 0, got {host_lens!r}"
            )
        if not checks:
            return host_lens
    real = _max_lens(q_lens, kv_lens)
    if host_lens is not None and real != host_lens:
        raise ValueError(f"host_lens: expected the longest (q_len, kv_len) = {real}, got {host_lens}")
    return real


def store_kv(
    k: torch.Tensor,
    v: torch.Tensor,
    *,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    kv_slots: torch.Tensor,
    backend: Backend = "auto",
    check_indices: bool | None = None,
) -> None:
    """Write token t's K/V ([T, HKV, Dh] each) to flat KV slot `kv_slots[t]` of the caches; -1 is skipped.

    Two live tokens with the same slot race (undefined which one lands); the caller hands out unique slots.
    `check_indices`: the slot range check's rule (`value_checks`: None checks on the CPU only, as on CUDA it
    is a sync; True on any device; False never).
    """
    k_cache, v_cache = _check_caches(
        k_cache, v_cache, k_cache.device if isinstance(k_cache, torch.Tensor) else None
    )
    num_pages, page_size, num_kv_heads, head_dim = k_cache.shape
    k = check_tensor("k", k, ("T", num_kv_heads, head_dim), dtypes=(k_cache.dtype,), device=k_cache.device)
    v = check_tensor("v", v, tuple(k.shape), dtypes=(k_cache.dtype,), device=k_cache.device)
    kv_slots = check_index(
        "kv_slots",
        kv_slots,
        (k.shape[0],),
        low=0,
        high=num_pages * page_size,
        device=k_cache.device,
        check_values=check_indices,
    )
    run = implementation(
        backend,
        k_cache.device,
        reference=store_kv_reference,
        torch_path=store_kv_torch,
        triton=lambda: _store_kv_triton,
    )
    run(k, v, k_cache=k_cache, v_cache=v_cache, kv_slots=kv_slots)


def paged_attention(
    q: torch.Tensor,
    *,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    page_table: torch.Tensor,
    cu_seqlens_q: torch.Tensor,
    kv_lens: torch.Tensor,
    scale: float,
    tree_mask: torch.Tensor | None = None,
    max_q_len: int | None = None,
    host_lens: tuple[int, int] | None = None,
    backend: Backend = "auto",
    check_indices: bool | None = None,
) -> torch.Tensor:
    """Attention of packed queries over paged K/V. Returns o [T, HQ, Dh] in q's dtype (softmax in fp32).

    Args:
        q: [T, HQ, Dh], HQ a multiple of HKV (query head h reads KV head h // (HQ // HKV)).
        k_cache, v_cache: [P, page_size, HKV, Dh], q's dtype; the new tokens' K/V already stored.
        page_table: [N, max_pages] int; position p of sequence n is at page `page_table[n, p // page_size]`.
            Only the first ceil(kv_lens[n] / page_size) entries of a row are read (and range-checked).
        cu_seqlens_q: [N + 1] int offsets of each sequence's queries in q; q_len 0 is allowed.
        kv_lens: [N] int, tokens in the cache for each sequence including the new ones; >= q_len.
        scale: softmax scale, usually Dh ** -0.5.
        tree_mask: [N, D, D] bool or None. With it, each sequence's q_len <= D new tokens form a verify block:
            query i sees the prefix and block token j iff `tree_mask[n, i, j]` (diagonal must be true).
            Without it attention is causal.
        max_q_len: optional static bound on every q_len (1 for decode, D for verify). Only the launch grid
            uses it: under CUDA graph capture, where q_lens cannot be read, it keeps the grid tight instead of
            assuming one sequence may hold all T tokens. Checked against the real q_lens otherwise.
        host_lens: (longest q_len, longest kv_len), when the caller has them on the host (a batch built
            from host lengths): the eager launch then reads nothing from the device. Checked against the
            device values where value checks run.
        backend: "auto" (Triton on CUDA, torch elsewhere), "triton", "torch" or "reference".
        check_indices: the rule of the value checks (cu_seqlens_q, kv_lens, page_table, tree_mask diagonal),
            which read the device (`value_checks`): None checks on the CPU only, True on any device, False
            never. The real longest q_len and kv_len are read outside graph capture whatever it says, unless
            `host_lens` gives them: the launch needs them.
    """
    q = check_tensor("q", q, ("T", "HQ", "Dh"), dtypes=FLOAT_DTYPES)
    device = q.device
    num_tokens, num_q_heads, head_dim = q.shape
    k_cache, v_cache = _check_caches(k_cache, v_cache, device, (q.dtype,), head_dim)
    num_pages, page_size, num_kv_heads, _ = k_cache.shape
    if num_kv_heads == 0 or num_q_heads % num_kv_heads != 0:
        raise ValueError(f"q: expected HQ a multiple of HKV = {num_kv_heads}, got shape {list(q.shape)}")
    page_table = check_tensor(
        "page_table", page_table, ("N", "max_pages"), dtypes=INDEX_DTYPES, device=device
    )
    num_seqs, max_pages = page_table.shape
    cu_seqlens_q = check_cu_seqlens(
        "cu_seqlens_q", cu_seqlens_q, num_tokens, device=device, check_values=check_indices
    )
    dim("cu_seqlens_q", cu_seqlens_q, 0, num_seqs + 1, "N + 1, N = page_table rows")
    kv_lens = check_tensor("kv_lens", kv_lens, (num_seqs,), dtypes=INDEX_DTYPES, device=device)
    # under CUDA graph capture nothing may read device values: skip the value checks and launch for the
    # static upper bounds (T queries, a full page-table row of keys); the kernel masks by the real lengths
    graph = capturing(q)
    # value checks read the device: by default on the CPU only (on CUDA each is a sync)
    checks = value_checks(device, check_indices)
    # only the checks and an eager launch's bounds read the query lengths: a graph (no checks) would replay
    # their subtraction as one more kernel in every attention layer of every step
    q_lens = cu_seqlens_q[1:] - cu_seqlens_q[:-1] if checks or not graph else cu_seqlens_q[:0]  # [N]
    if num_seqs and checks and bool(((kv_lens < q_lens) | (kv_lens > max_pages * page_size)).any()):
        raise ValueError(
            f"kv_lens: expected q_len <= kv_len <= max_pages * page_size = {max_pages * page_size}, "
            f"got kv_lens {kv_lens.tolist()} for q_lens {q_lens.tolist()}"
        )
    if checks:
        used = torch.arange(max_pages, device=device)[None, :] * page_size < kv_lens[:, None]  # [N, pages]
        check_index(
            "page_table", page_table[used], (None,), low=0, high=num_pages, allow_pad=False, check_values=True
        )
    if isinstance(scale, bool) or not isinstance(scale, int | float) or not math.isfinite(scale):
        raise ValueError(f"scale: expected a finite float, got {scale!r}")
    if max_q_len is not None and (
        isinstance(max_q_len, bool) or not isinstance(max_q_len, int) or max_q_len < 0
    ):
        raise ValueError(f"max_q_len: expected None or an int >= 0, got {max_q_len!r}")
    depth = num_tokens  # bound on q_len: a tree verify block holds at most D queries
    if tree_mask is not None:
        tree_mask = check_tensor(
            "tree_mask", tree_mask, (num_seqs, "D", "D"), dtypes=(torch.bool,), device=device
        )
        depth = dim("tree_mask", tree_mask, 1)
        dim("tree_mask", tree_mask, 2, depth, "D, a square mask")
    if graph:
        bound = min(num_tokens, depth, num_tokens if max_q_len is None else max_q_len)
        max_q_len, max_kv_len = (bound, max_pages * page_size) if num_seqs else (0, 0)
    else:
        # the launch grid needs the real longest q_len and kv_len (they set the tiles and the KV splits):
        # the caller's host values, or one host read for both
        real_max_q, max_kv_len = _launch_lens(q_lens, kv_lens, host_lens, checks=checks)
        if max_q_len is not None and real_max_q > max_q_len:
            raise ValueError(
                f"max_q_len: expected >= every q_len, got {max_q_len} for a q_len of {real_max_q}"
            )
        if tree_mask is not None and real_max_q > depth:
            raise ValueError(
                f"tree_mask: expected D >= every q_len = {real_max_q}, got {list(tree_mask.shape)}"
            )
        if tree_mask is not None and checks:
            diag = tree_mask.diagonal(dim1=1, dim2=2)  # [N, D]
            live = torch.arange(depth, device=device)[None, :] < q_lens[:, None]
            if not bool(diag[live].all()):
                raise ValueError("tree_mask: expected tree_mask[n, i, i] true for every query i < q_len")
        max_q_len = real_max_q

    run = implementation(
        backend,
        device,
        reference=paged_attention_reference,
        torch_path=paged_attention_torch,
        triton=lambda: partial(_paged_attention_triton, max_q_len=max_q_len, max_kv_len=max_kv_len),
    )
    out: torch.Tensor = run(
        q,
        k_cache=k_cache,
        v_cache=v_cache,
        page_table=page_table,
        cu_seqlens_q=cu_seqlens_q,
        kv_lens=kv_lens,
        scale=float(scale),
        tree_mask=tree_mask,
    )
    return out
