"""Attention over a paged KV cache: store K/V into pages; extend, decode, chain and tree verify."""

from hyspec_kernels.attention.op import paged_attention, store_kv
from hyspec_kernels.attention.reference import paged_attention_reference, store_kv_reference
from hyspec_kernels.attention.torch_impl import paged_attention_torch, store_kv_torch

__all__ = [
    "paged_attention",
    "paged_attention_reference",
    "paged_attention_torch",
    "store_kv",
    "store_kv_reference",
    "store_kv_torch",
]
