"""Types shared by the conv reference, torch path, Triton kernels and wrappers."""

from __future__ import annotations

from typing import Literal, TypeAlias

# None is LFM2's short conv (no activation); "silu" is the GDN / Mamba pre-mixer conv.
Activation: TypeAlias = Literal["silu"] | None
ACTIVATIONS: tuple[Activation, ...] = ("silu", None)
MIN_WIDTH, MAX_WIDTH = 2, 5
