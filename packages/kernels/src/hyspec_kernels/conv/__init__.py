"""Causal depthwise conv1d (width 2..5, optional bias, SiLU or no activation).

Varlen prefill with state slots, decode by slot, and chain/tree verify that writes the window after every step
to scratch and leaves the state untouched."""

from hyspec_kernels.conv.common import Activation
from hyspec_kernels.conv.op import conv_decode, conv_prefill, conv_verify

__all__ = ["Activation", "conv_decode", "conv_prefill", "conv_verify"]
