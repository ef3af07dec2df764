"""Every numeric op of hyspec: a PyTorch reference (token by token, fp32), a fast torch path for CPU and a
Triton kernel for GPU, behind wrappers that validate their inputs.

Ops: gated delta rule (`gdn_prefill`, `gdn_decode`, `gdn_verify`), causal depthwise conv1d (`conv_prefill`,
`conv_decode`, `conv_verify`), state commit after verify (`commit_states`), attention over a paged KV cache
(`store_kv`, `paged_attention`), GDN gating (`gdn_gating`), norms (`gated_rmsnorm`, `rms_norm`,
`add_rms_norm`), SwiGLU's product (`silu_and_mul`), projections over few rows (`linear`), rotary embedding
(`apply_rotary`; after a per-head norm, `norm_rotary`) and a verify block's greedy walk with its stop / budget
cut (`accept_walk`); a chain verify batch's metadata written for its rows' next prefixes (`advance_verify`)
and a one-token batch one position on (`advance_one_token`); a drafter's next first block from a verify's
outputs (`draft_block_after_verify`); verify trees' ancestor masks, depths and child / sibling links from
their parents (`tree_grids`); each row's argmax, the greedy token (`argmax_rows`). The prefills also write
states part-way through a sequence to spare slots (`StateSave`).
`python -m hyspec_kernels.selfcheck` runs each against its reference.
"""

from hyspec_kernels._checks import value_checks
from hyspec_kernels.accept import AcceptResult, accept_walk
from hyspec_kernels.advance import advance_one_token, advance_verify
from hyspec_kernels.argmax import argmax_rows
from hyspec_kernels.attention import paged_attention, store_kv
from hyspec_kernels.commit import StatePair, commit_states
from hyspec_kernels.conv import conv_decode, conv_prefill, conv_verify
from hyspec_kernels.draft_block import draft_block_after_verify
from hyspec_kernels.gating import add_rms_norm, gated_rmsnorm, gdn_gating, rms_norm, silu_and_mul
from hyspec_kernels.gdn import GDNPrefillOutput, gdn_decode, gdn_prefill, gdn_verify
from hyspec_kernels.linear import MAX_SKINNY_ROWS, linear
from hyspec_kernels.rope import apply_rotary, norm_rotary
from hyspec_kernels.saves import StateSave
from hyspec_kernels.tree import TreeGrids, tree_grids

__version__ = "0.1.0"

__all__ = [
    "MAX_SKINNY_ROWS",
    "AcceptResult",
    "GDNPrefillOutput",
    "StatePair",
    "StateSave",
    "TreeGrids",
    "accept_walk",
    "add_rms_norm",
    "advance_one_token",
    "advance_verify",
    "apply_rotary",
    "argmax_rows",
    "commit_states",
    "conv_decode",
    "conv_prefill",
    "conv_verify",
    "draft_block_after_verify",
    "gated_rmsnorm",
    "gdn_decode",
    "gdn_gating",
    "gdn_prefill",
    "gdn_verify",
    "linear",
    "norm_rotary",
    "paged_attention",
    "rms_norm",
    "silu_and_mul",
    "store_kv",
    "tree_grids",
    "value_checks",
]
