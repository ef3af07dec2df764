"""What each mixer layer runs over one `ForwardBatch`: the kernel sequence of full attention, Gated DeltaNet
and short conv, on the pool's tensors for that layer.

`HybridBackend.attention` / `gdn` / `short_conv` call these once they have checked the layer's route and
split a MIXED step into its parts; which GDN and conv kernel runs in which mode is `mode_kernels.py`'s.
`kernel_checks` is the backend's kernel value-check setting (`hyspec_kernels.value_checks`).
"""

from __future__ import annotations

import torch
from hyspec_kernels.attention import paged_attention, store_kv
from hyspec_kernels.gating import gdn_gating
from hyspec_statepool.pool import HybridStatePool
from torch import Tensor

from hyspec_attn_backends.batch import ForwardBatch
from hyspec_attn_backends.batch_builder import static_max_q_len
from hyspec_attn_backends.layers import AttentionLayer, GDNLayer, ShortConvLayer
from hyspec_attn_backends.mode_kernels import mode_conv, mode_recurrence
from hyspec_attn_backends.modes import ForwardMode


def run_attention(
    pool: HybridStatePool,
    layer: AttentionLayer,
    q: Tensor,
    k: Tensor,
    v: Tensor,
    batch: ForwardBatch,
    *,
    kernel_checks: bool | None,
) -> Tensor:
    """Store the new tokens' K/V, then attend over the paged cache.

    q [T, HQ, Dh], k/v [T, HKV, Dh] -> [T, HQ, Dh].
    """
    if batch.num_tokens == 0:
        return q.new_empty((0, layer.num_heads, layer.head_dim))
    k_cache, v_cache = pool.kv_cache(layer.layer_id)
    assert batch.kv_slots is not None
    store_kv(
        k.to(k_cache.dtype),
        v.to(v_cache.dtype),
        k_cache=k_cache,
        v_cache=v_cache,
        kv_slots=batch.kv_slots.tensor,
        check_indices=kernel_checks,
    )
    o = paged_attention(
        q.to(k_cache.dtype),
        k_cache=k_cache,
        v_cache=v_cache,
        page_table=batch.page_table,
        cu_seqlens_q=batch.cu_seqlens_q,
        kv_lens=batch.kv_lens,
        scale=layer.scale,
        tree_mask=batch.tree_mask,
        # a static bound on q_len: the same launch grid eagerly as under CUDA-graph capture
        max_q_len=static_max_q_len(batch),
        host_lens=batch.host_max_lens,
        check_indices=kernel_checks,
    )
    return o.to(q.dtype)


def run_gdn(
    pool: HybridStatePool,
    layer: GDNLayer,
    mixed_qkv: Tensor,
    *,
    a: Tensor,
    b: Tensor,
    conv_weight: Tensor,
    A_log: Tensor,
    dt_bias: Tensor,
    batch: ForwardBatch,
    kernel_checks: bool | None,
    defer: bool = False,
) -> Tensor:
    """Gated DeltaNet core. mixed_qkv [T, 2·HK·K + HV·V] (pre-conv), a/b [T, HV] -> o [T, HV, V]; `defer`:
    the pool's pending tokens are applied first (`HybridBackend`'s `defer_commit`)."""
    hk, hv, dk, dv = layer.num_k_heads, layer.num_v_heads, layer.head_k_dim, layer.head_v_dim
    t = batch.num_tokens
    if t == 0:
        return mixed_qkv.new_empty((0, hv, dv))
    st = pool.layer_state(layer.layer_id)
    x = mode_conv(
        mixed_qkv,
        conv_weight,
        None,
        conv_state=st.conv,
        conv_scratch=st.conv_scratch,
        activation="silu",
        batch=batch,
        check_indices=kernel_checks,
    )
    q, k, v = torch.split(x, [hk * dk, hk * dk, hv * dv], dim=-1)
    q, k, v = q.reshape(t, hk, dk), k.reshape(t, hk, dk), v.reshape(t, hv, dv)
    if st.recurrent is None:
        raise ValueError(f"layer {layer.layer_id}: the pool has no recurrent state")
    raw_gates: tuple[Tensor, Tensor] | None = None
    if batch.mode in (ForwardMode.DECODE, ForwardMode.TARGET_VERIFY):
        # the recurrent kernel gates its tokens itself: a launch fewer per GDN layer and step
        g, beta, raw_gates = a, b, (A_log, dt_bias)
    else:
        g, beta = gdn_gating(A_log, a, b, dt_bias)  # [T, HV] fp32 each
    return mode_recurrence(
        q,
        k,
        v,
        g,
        beta,
        raw_gates=raw_gates,
        state=st.recurrent,
        replay=st.replay,
        pending=st.pending if defer else None,
        batch=batch,
        check_indices=kernel_checks,
    )


def run_short_conv(
    pool: HybridStatePool,
    layer: ShortConvLayer,
    x: Tensor,
    *,
    conv_weight: Tensor,
    conv_bias: Tensor | None,
    batch: ForwardBatch,
    kernel_checks: bool | None,
) -> Tensor:
    """LFM2 short conv (no activation). x [T, C] = B·x -> conv output [T, C]."""
    if batch.num_tokens == 0:
        return x.new_empty((0, layer.channels))
    st = pool.layer_state(layer.layer_id)
    return mode_conv(
        x,
        conv_weight,
        conv_bias,
        conv_state=st.conv,
        conv_scratch=st.conv_scratch,
        activation=None,
        batch=batch,
        check_indices=kernel_checks,
    )
