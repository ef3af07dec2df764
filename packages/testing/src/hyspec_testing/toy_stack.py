"""A synthetic hybrid stack for backend tests: one GDN, one short-conv and one attention layer, no model.

Each layer's per-token inputs (and its weights) are fixed random functions of the token id, so two runs over
the same tokens are comparable whatever the batch looks like: a verify block against the same tokens run one
by one, a padded batch against an unpadded one. Shared by hyspec_attn_backends' tests and usable by anyone
testing a `HybridBackend` change without building a model.
"""

from __future__ import annotations

import torch
from hyspec_attn_backends.backend import HybridBackend
from hyspec_attn_backends.batch import ForwardBatch
from hyspec_attn_backends.layers import AttentionLayer, GDNLayer, ShortConvLayer
from torch import Tensor

TOY_GDN = GDNLayer(layer_id=0, num_k_heads=1, num_v_heads=2, head_k_dim=8, head_v_dim=8, conv_width=4)
TOY_CONV = ShortConvLayer(layer_id=1, channels=8, conv_width=3)
TOY_ATTN = AttentionLayer(layer_id=2, num_heads=2, num_kv_heads=1, head_dim=8, scale=8**-0.5)
TOY_LAYERS = [TOY_GDN, TOY_CONV, TOY_ATTN]
TOY_LAYER_TYPES = ["linear_attention", "conv", "full_attention"]
TOY_VOCAB = 50


class ToyStack:
    """Random per-token inputs and weights of the three toy layers (seeded: every instance is the same)."""

    def __init__(self, seed: int = 0) -> None:
        g = torch.Generator().manual_seed(seed)

        def r(*shape: int, scale: float = 1.0) -> Tensor:
            return torch.randn(*shape, generator=g) * scale

        v, gdn = TOY_VOCAB, TOY_GDN
        self.qkv, self.a, self.b = r(v, gdn.conv_dim), r(v, 2), r(v, 2)
        self.x, self.q, self.k, self.v = r(v, 8), r(v, 2, 8), r(v, 1, 8), r(v, 1, 8)
        self.w_gdn, self.w_conv, self.bias = r(gdn.conv_dim, 1, 4, scale=0.5), r(8, 1, 3, scale=0.5), r(8)
        self.A_log, self.dt_bias = r(2, scale=0.3), r(2, scale=0.3)

    def run(self, backend: HybridBackend, batch: ForwardBatch) -> Tensor:
        """One forward through the three layers (a CPU backend: the inputs live on the CPU); returns their
        outputs side by side, [T, 40] fp32."""
        ids = batch.input_ids
        o1 = backend.gdn(
            TOY_GDN,
            self.qkv[ids],
            a=self.a[ids],
            b=self.b[ids],
            conv_weight=self.w_gdn,
            A_log=self.A_log,
            dt_bias=self.dt_bias,
            batch=batch,
        )
        o2 = backend.short_conv(
            TOY_CONV, self.x[ids], conv_weight=self.w_conv, conv_bias=self.bias, batch=batch
        )
        o3 = backend.attention(TOY_ATTN, self.q[ids], self.k[ids], self.v[ids], batch)
        return torch.cat([o1.flatten(1), o2, o3.flatten(1)], dim=-1)  # [T, 40]
