"""Weightless mixer cores that a model places in each decoder layer.

The model owns the projections and norms; the core only names the layer and its shapes. The backend routes a
call by the core's type (full attention, GDN, short conv), and checks once at start-up that the types agree
with the config's `layer_types`.
"""

from __future__ import annotations

from enum import Enum

from torch import nn


class MixerKind(Enum):
    """The three token-mixer kinds of a hybrid model."""

    ATTENTION = "attention"
    GDN = "gdn"
    SHORT_CONV = "short_conv"


# config `layer_types` values (Qwen3-Next / Qwen3.5 / LFM2 spellings) -> mixer kind
LAYER_TYPE_KINDS: dict[str, MixerKind] = {
    "full_attention": MixerKind.ATTENTION,
    "attention": MixerKind.ATTENTION,
    "linear_attention": MixerKind.GDN,
    "conv": MixerKind.SHORT_CONV,
    "short_conv": MixerKind.SHORT_CONV,
}


def _check_positive(**values: int) -> None:
    for name, value in values.items():
        if not isinstance(value, int) or value < 1:
            raise ValueError(f"{name}: expected an int >= 1, got {value!r}")


class AttentionLayer(nn.Module):
    """Full (softmax) attention over the paged KV cache. No parameters."""

    kind = MixerKind.ATTENTION

    def __init__(
        self, *, layer_id: int, num_heads: int, num_kv_heads: int, head_dim: int, scale: float
    ) -> None:
        super().__init__()
        _check_positive(num_heads=num_heads, num_kv_heads=num_kv_heads, head_dim=head_dim)
        if layer_id < 0:
            raise ValueError(f"layer_id: expected >= 0, got {layer_id}")
        if num_heads % num_kv_heads:
            raise ValueError(
                f"num_heads: expected a multiple of num_kv_heads={num_kv_heads}, got {num_heads}"
            )
        self.layer_id = layer_id
        self.num_heads = num_heads
        self.num_kv_heads = num_kv_heads
        self.head_dim = head_dim
        self.scale = scale

    def extra_repr(self) -> str:
        return (
            f"layer_id={self.layer_id}, heads={self.num_heads}/{self.num_kv_heads}, head_dim={self.head_dim}"
        )


class GDNLayer(nn.Module):
    """Gated DeltaNet core: causal conv (SiLU) over packed q|k|v, gating, and the delta-rule recurrence."""

    kind = MixerKind.GDN

    def __init__(
        self,
        *,
        layer_id: int,
        num_k_heads: int,
        num_v_heads: int,
        head_k_dim: int,
        head_v_dim: int,
        conv_width: int,
    ) -> None:
        super().__init__()
        _check_positive(
            num_k_heads=num_k_heads,
            num_v_heads=num_v_heads,
            head_k_dim=head_k_dim,
            head_v_dim=head_v_dim,
            conv_width=conv_width,
        )
        if layer_id < 0:
            raise ValueError(f"layer_id: expected >= 0, got {layer_id}")
        if num_v_heads % num_k_heads:
            raise ValueError(
                f"num_v_heads: expected a multiple of num_k_heads={num_k_heads}, got {num_v_heads}"
            )
        self.layer_id = layer_id
        self.num_k_heads = num_k_heads
        self.num_v_heads = num_v_heads
        self.head_k_dim = head_k_dim
        self.head_v_dim = head_v_dim
        self.conv_width = conv_width

    @property
    def key_dim(self) -> int:
        return self.num_k_heads * self.head_k_dim

    @property
    def value_dim(self) -> int:
        return self.num_v_heads * self.head_v_dim

    @property
    def conv_dim(self) -> int:
        """Channels of the conv over packed q|k|v."""
        return 2 * self.key_dim + self.value_dim

    def extra_repr(self) -> str:
        return (
            f"layer_id={self.layer_id}, heads={self.num_k_heads}/{self.num_v_heads}, "
            f"dims={self.head_k_dim}/{self.head_v_dim}, conv_width={self.conv_width}"
        )


class ShortConvLayer(nn.Module):
    """LFM2 short conv core: depthwise causal conv with no activation. No parameters."""

    kind = MixerKind.SHORT_CONV

    def __init__(self, *, layer_id: int, channels: int, conv_width: int) -> None:
        super().__init__()
        _check_positive(channels=channels, conv_width=conv_width)
        if layer_id < 0:
            raise ValueError(f"layer_id: expected >= 0, got {layer_id}")
        self.layer_id = layer_id
        self.channels = channels
        self.conv_width = conv_width

    def extra_repr(self) -> str:
        return f"layer_id={self.layer_id}, channels={self.channels}, conv_width={self.conv_width}"


MixerLayer = AttentionLayer | GDNLayer | ShortConvLayer
