"""Gated delta rule (GDN): chunked prefill, recurrent decode, chain/tree verify and the replay commit.

Each op has a token-by-token fp32 reference (`reference`), a vectorised torch path for CPU (`torch_impl`) and
Triton kernels (`triton_recurrent`, `triton_chunk`), behind the validated wrappers re-exported here (`op`,
and `replay_op` for the commit's replay).
"""

from .op import GDNPrefillOutput, gdn_decode, gdn_prefill, gdn_verify
from .pending import PendingTokens, apply_pending, next_rows
from .reference import CHUNK_SIZE, gdn_reference_sequence, gdn_reference_tree
from .replay_op import gdn_replay

__all__ = [
    "CHUNK_SIZE",
    "GDNPrefillOutput",
    "PendingTokens",
    "apply_pending",
    "gdn_decode",
    "gdn_prefill",
    "gdn_reference_sequence",
    "gdn_reference_tree",
    "gdn_replay",
    "gdn_verify",
    "next_rows",
]
