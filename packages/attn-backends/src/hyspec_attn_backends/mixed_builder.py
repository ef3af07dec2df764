"""`MixedBuilder`: a MIXED step's batch (`MixedBatch`), an engine step's prompt chunks beside the verify
blocks of other requests in one forward, for `HybridBackend.prepare_mixed`.

The two parts are prepared by two `BatchBuilder`s: the verify blocks in the backend's own buffers (those of
every other batch), the chunks in a second set of their own, so both parts stay valid together until the next
`prepare_*`.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from hyspec_kernels import StateSave
from hyspec_statepool.indices import ReqRows
from torch import Tensor

from hyspec_attn_backends.batch import MixedBatch
from hyspec_attn_backends.batch_builder import BatchBuilder


class MixedBuilder:
    """Prepares MIXED steps from two builders over the same pool.

    Args:
        verify: the builder of the verify part: the backend's, whose buffers every other batch uses.
        extend: the builder of the prompt chunks, with buffers of its own.
    """

    def __init__(self, verify: BatchBuilder, extend: BatchBuilder) -> None:
        self.verify = verify
        self.extend = extend

    def prepare(
        self,
        *,
        req_rows: ReqRows,
        input_ids: Tensor,
        q_lens: Sequence[int],
        prefix_lens: Sequence[int],
        verify_rows: ReqRows,
        block_tokens: Tensor,
        verify_prefix_lens: Sequence[int],
        tree_parents: Tensor | None = None,
        state_saves: Sequence[StateSave] = (),
    ) -> MixedBatch:
        """The chunks' EXTEND part and the unpadded TARGET_VERIFY part as one forward: the arguments as
        `HybridBackend.prepare_mixed` takes them."""
        verify = self.verify.prepare_verify(
            req_rows=verify_rows,
            block_tokens=block_tokens,
            prefix_lens=verify_prefix_lens,
            tree_parents=tree_parents,
        )
        extend = self.extend.prepare_extend(
            req_rows=req_rows,
            input_ids=input_ids,
            q_lens=q_lens,
            prefix_lens=prefix_lens,
            state_saves=state_saves,
        )
        return MixedBatch(
            extend=extend,
            verify=verify,
            input_ids=torch.cat([extend.input_ids, verify.input_ids]),  # [T_e + N_v·D] int64
            positions=torch.cat([extend.positions, verify.positions]),  # [T_e + N_v·D] int64
        )
