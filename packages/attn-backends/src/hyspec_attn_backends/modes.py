"""Forward modes: what a batch does, which decides the kernels each layer calls."""

from __future__ import annotations

from enum import Enum


class ForwardMode(Enum):
    """The kind of forward a batch runs.

    - EXTEND: new tokens after a (possibly empty) cached prefix: prefill, chunked prefill, extend after a
      prefix-cache hit. Recurrent layers continue from the slot's state when `prefix_len > 0`.
    - DECODE: exactly one new token per request.
    - TARGET_VERIFY: a verify block of D tokens per request (chain or tree). Recurrent layers read the
      committed state and write only verify scratch; `commit_after_verify` commits afterwards.
    - DRAFT_EXTEND: a draft model extends over accepted tokens (same kernels as EXTEND).
    - IDLE: an empty batch (no requests); every layer returns an empty tensor of the right shape.
    - MIXED: an engine step's EXTEND rows and TARGET_VERIFY blocks in one forward (`MixedBatch`): the dense
      layers run once over every token, each mixer layer runs each part with its own kernels.
    """

    EXTEND = "extend"
    DECODE = "decode"
    TARGET_VERIFY = "target_verify"
    DRAFT_EXTEND = "draft_extend"
    IDLE = "idle"
    MIXED = "mixed"

    @property
    def is_extend_like(self) -> bool:
        """True for modes that run the varlen prefill kernels."""
        return self in (ForwardMode.EXTEND, ForwardMode.DRAFT_EXTEND)

    @property
    def is_graph_capturable(self) -> bool:
        """True for modes with a fixed token count per request (DECODE, TARGET_VERIFY): what a CUDA graph
        captures, and what must run without host syncs."""
        return self in (ForwardMode.DECODE, ForwardMode.TARGET_VERIFY)
