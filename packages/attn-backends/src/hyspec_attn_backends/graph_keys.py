"""The vocabulary of the graph runner (`graphs.py`): which batch sizes are captured, what a graph is
specialised to (`GraphKey`), which buffers a replay must find (`batch_pointers`), and the replay counts."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from torch import Tensor

from hyspec_attn_backends.batch import ForwardBatch
from hyspec_attn_backends.modes import ForwardMode


def capture_sizes(max_num_seqs: int) -> list[int]:
    """The padded batch sizes an engine captures: 1, 2, 4, 8, then every multiple of 8 up to `max_num_seqs`
    (always included)."""
    if max_num_seqs < 1:
        raise ValueError(f"max_num_seqs: expected >= 1, got {max_num_seqs}")
    sizes = {s for s in (1, 2, 4) if s <= max_num_seqs}
    sizes |= set(range(8, max_num_seqs + 1, 8))
    sizes.add(max_num_seqs)
    return sorted(sizes)


@dataclass(slots=True)
class GraphCounts:
    """Forwards of each graph-capturable mode: replayed from a graph, or run eagerly."""

    decode_replays: int = 0
    decode_eager: int = 0
    verify_replays: int = 0
    verify_eager: int = 0
    commit_replays: int = 0  # commits after a verify (`CudaGraphRunner.commit`): not forwards
    commit_eager: int = 0
    tail_replays: int = 0  # verify tails (`CudaGraphRunner.run_tail`): not forwards either

    @property
    def replays(self) -> int:
        return self.decode_replays + self.verify_replays

    @property
    def eager(self) -> int:
        return self.decode_eager + self.verify_eager

    @staticmethod
    def total(counts: Sequence[GraphCounts]) -> GraphCounts:
        """The counts of several runners (a drafter's) added up."""
        return GraphCounts(
            sum(c.decode_replays for c in counts),
            sum(c.decode_eager for c in counts),
            sum(c.verify_replays for c in counts),
            sum(c.verify_eager for c in counts),
            sum(c.commit_replays for c in counts),
            sum(c.commit_eager for c in counts),
            sum(c.tail_replays for c in counts),
        )


@dataclass(frozen=True, slots=True)
class GraphKey:
    """What a captured graph is specialised to: mode, padded batch size, verify block size, tree or chain."""

    mode: ForwardMode
    batch_size: int
    verify_len: int = 0
    tree: bool = False

    def __post_init__(self) -> None:
        if not self.mode.is_graph_capturable:
            raise ValueError(f"mode: expected DECODE or TARGET_VERIFY, got {self.mode}")
        if self.batch_size < 1:
            raise ValueError(f"batch_size: expected >= 1, got {self.batch_size}")
        if self.mode is ForwardMode.DECODE and (self.verify_len or self.tree):
            raise ValueError("verify_len, tree: only for TARGET_VERIFY graphs")
        if self.mode is ForwardMode.TARGET_VERIFY and self.verify_len < 1:
            raise ValueError(f"verify_len: expected D >= 1 for a TARGET_VERIFY graph, got {self.verify_len}")

    @classmethod
    def of(cls, batch: ForwardBatch) -> GraphKey | None:
        """The key a batch would replay under, or None for a mode that is never captured."""
        if not batch.mode.is_graph_capturable or batch.num_seqs == 0:
            return None
        return cls(batch.mode, batch.num_seqs, batch.verify_len, batch.is_tree)


def batch_pointers(batch: ForwardBatch) -> tuple[int, ...]:
    """Addresses of every tensor a forward reads from the batch (a replay needs the captured ones)."""
    tensors: list[Tensor | None] = [
        batch.input_ids,
        batch.positions,
        batch.page_table,
        batch.cu_seqlens_q,
        batch.q_lens,
        batch.prefix_lens,
        batch.kv_lens,
        batch.has_initial_state,
        None if batch.state_slots is None else batch.state_slots.tensor,
        None if batch.batch_rows is None else batch.batch_rows.tensor,
        None if batch.kv_slots is None else batch.kv_slots.tensor,
        batch.tree_parents,
        batch.tree_mask,
    ]
    return tuple(0 if t is None else t.data_ptr() for t in tensors)
