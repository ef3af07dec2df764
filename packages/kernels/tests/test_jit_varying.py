"""Kernels compile once for every batch: batch-dependent arguments stay out of Triton's specialization key.

On the GPU, batches that differ in what used to pick new variants (sequence and token counts equal to 1 or
divisible by 16, metadata views at offsets that are not 16-byte aligned, split counts) reuse the first
batch's compiled kernels; on the CPU, `jit_varying` refuses names that are not runtime parameters.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
import triton.language as tl
from hyspec_kernels.attention.triton_kernel import (
    _merge_splits_kernel,
    _paged_attention_kernel,
    paged_attention_triton,
)
from hyspec_kernels.conv import conv_prefill
from hyspec_kernels.conv.triton_kernel import _conv_prefill_kernel
from hyspec_kernels.gdn import gdn_prefill
from hyspec_kernels.gdn.triton_chunk import gdn_chunk_out_kernel, gdn_chunk_state_kernel, gdn_chunk_wy_kernel
from hyspec_kernels.jit import jit_varying

gpu = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")


def _kernel(x_ptr, n, BLOCK: tl.constexpr):  # type: ignore[no-untyped-def]
    pass


def test_jit_varying_refuses_unknown_and_constexpr_names() -> None:
    with pytest.raises(ValueError, match=r"names: _kernel has no parameters \['num_rows'\]"):
        jit_varying("n", "num_rows")(_kernel)
    with pytest.raises(ValueError, match=r"names: \['BLOCK'\] of _kernel are constexprs"):
        jit_varying("BLOCK")(_kernel)
    assert jit_varying("x_ptr", "n")(_kernel) is not None


def _variants(kernel: Any) -> int:
    """Compiled variants of a Triton kernel on every device (the in-memory JIT cache)."""
    caches = getattr(kernel, "device_caches", None)
    if caches is not None:
        return sum(len(entry[0]) for entry in caches.values())
    return sum(len(c) for c in kernel.cache.values())


def _at_offset(values: list[int], offset: int, dtype: torch.dtype) -> torch.Tensor:
    """`values` on the GPU as a view `offset` elements into a larger tensor (a pointer not 16-byte aligned
    when offset * itemsize is not a multiple of 16), like the slices of one packed metadata copy."""
    buf = torch.zeros(len(values) + offset, dtype=dtype, device="cuda")
    buf[offset:] = torch.tensor(values, dtype=dtype)
    return buf[offset:]


def _cu(lens: list[int]) -> list[int]:
    out = [0]
    for n in lens:
        out.append(out[-1] + n)
    return out


# sequence lengths of successive batches: counts of 1, divisible by 16 and neither, for tokens and sequences
BATCHES = [[37, 5, 300], [1], [16] * 16, [5] * 17, [64, 1, 2, 13], [128]]


@gpu
@pytest.mark.gpu
def test_conv_prefill_compiles_once_for_every_batch() -> None:
    channels, width = 256, 4
    weight = torch.randn(channels, width, device="cuda").bfloat16()
    pool = torch.zeros(40, channels, width - 1, device="cuda")
    counts = []
    for i, lens in enumerate(BATCHES):
        n = len(lens)
        x = torch.randn(sum(lens), channels, device="cuda").bfloat16()
        conv_prefill(
            x, weight, None, cu_seqlens=_at_offset(_cu(lens), i % 3, torch.int32), conv_state=pool,
            state_slots=_at_offset(list(range(n)), (i + 1) % 3, torch.int32),
            has_initial_state=_at_offset([1] * n, i % 5, torch.bool),
            activation="silu", backend="triton",
        )  # fmt: skip
        counts.append(_variants(_conv_prefill_kernel))
    assert counts == [counts[0]] * len(BATCHES), counts


@gpu
@pytest.mark.gpu
def test_gdn_prefill_compiles_once_for_every_batch() -> None:
    hk, hv, dk, dv = 2, 4, 64, 64  # few (sequence, head) programs in every batch: one tile choice
    pool = torch.zeros(40, hv, dk, dv, device="cuda")
    kernels = (gdn_chunk_wy_kernel, gdn_chunk_state_kernel, gdn_chunk_out_kernel)
    counts = []
    for i, lens in enumerate(BATCHES):
        n, t = len(lens), sum(lens)
        q = torch.randn(t, hk, dk, device="cuda").bfloat16()
        k = torch.randn(t, hk, dk, device="cuda").bfloat16()
        v = torch.randn(t, hv, dv, device="cuda").bfloat16()
        g = -torch.rand(t, hv, device="cuda")
        beta = torch.rand(t, hv, device="cuda")
        gdn_prefill(
            q, k, v, g, beta, cu_seqlens=_at_offset(_cu(lens), i % 3, torch.int32), state=pool,
            state_slots=_at_offset(list(range(n)), (i + 1) % 3, torch.int32),
            has_initial_state=_at_offset([i % 2] * n, i % 5, torch.bool), cu_seqlens_host=_cu(lens),
            backend="triton",
        )  # fmt: skip
        counts.append(tuple(_variants(kern) for kern in kernels))
    assert counts == [counts[0]] * len(BATCHES), counts


@gpu
@pytest.mark.gpu
def test_split_kv_attention_compiles_once_for_every_batch() -> None:
    hq, hkv, dh, page = 4, 2, 64, 16
    k_cache = torch.randn(256, page, hkv, dh, device="cuda").bfloat16()
    v_cache = torch.randn_like(k_cache)
    counts = []
    # every query length >= 64: one query tile shape; split counts 3, 16 and 32 (divisible by 16) and 5
    for i, (lens, splits) in enumerate(
        zip([[64, 70], [65], [64] * 16, [67] * 3], [3, 16, 5, 32], strict=True)
    ):
        n, kv = len(lens), [q + 100 for q in lens]
        q = torch.randn(sum(lens), hq, dh, device="cuda").bfloat16()
        table = torch.arange(n * 16, device="cuda", dtype=torch.int32).reshape(n, 16)
        paged_attention_triton(
            q, k_cache=k_cache, v_cache=v_cache, page_table=table,
            cu_seqlens_q=_at_offset(_cu(lens), i % 3, torch.int32),
            kv_lens=_at_offset(kv, (i + 1) % 3, torch.int32),
            scale=dh**-0.5, max_q_len=max(lens), max_kv_len=max(kv), num_kv_splits=splits,
        )  # fmt: skip
        counts.append((_variants(_paged_attention_kernel), _variants(_merge_splits_kernel)))
    assert counts == [counts[0]] * len(counts), counts
