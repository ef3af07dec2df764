"""Pool sizing: a `MemoryPlan` fixes every count the pool allocates; `plan_memory` solves one from a budget.

The plan's byte counts are sums over the same tensor table (`layout.py`) the pool allocates from, so a plan's
`total_bytes` is exactly what `HybridStatePool(plan)` allocates.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from hyspec_statepool.draft_shape import DraftShape, max_draft_tokens
from hyspec_statepool.layout import (
    TensorSpec,
    group_linear_layers,
    kv_tensors,
    scratch_tensors,
    state_tensors,
    table_tensors,
)
from hyspec_statepool.specs import ModelStateSpecs, StateDtypes


@dataclass(frozen=True, slots=True)
class MemoryPlan:
    """Every count the pool allocates.

    Attributes:
        specs: the model's layers.
        max_model_len: most tokens one request may hold (prompt plus output).
        max_num_seqs: most live requests; also the number of request-table rows.
        draft_shape: the speculative shape, None without speculation (then no verify scratch).
        page_size: tokens per KV page (1 allowed).
        num_state_slots: state slots handed out (>= max_num_seqs; extra ones serve detached uses such as
            prefix-cache tracking). Slot 0 is reserved on top of these.
        num_kv_pages: pages in the KV pool.
        dtypes: storage dtypes.
        budget_bytes: the budget the plan was solved for, None when given by hand.
    """

    specs: ModelStateSpecs
    max_model_len: int
    max_num_seqs: int
    draft_shape: DraftShape | None
    page_size: int
    num_state_slots: int
    num_kv_pages: int
    dtypes: StateDtypes = field(default_factory=StateDtypes)
    budget_bytes: int | None = None

    def __post_init__(self) -> None:
        for name in ("max_model_len", "max_num_seqs", "page_size"):
            if not isinstance(getattr(self, name), int) or getattr(self, name) < 1:
                raise ValueError(f"{name}: expected an int >= 1, got {getattr(self, name)!r}")
        if not isinstance(self.num_state_slots, int) or self.num_state_slots < self.max_num_seqs:
            raise ValueError(
                f"num_state_slots: expected an int >= max_num_seqs={self.max_num_seqs} (one slot per live "
                f"request), got {self.num_state_slots!r}"
            )
        if not isinstance(self.num_kv_pages, int) or self.num_kv_pages < 0:
            raise ValueError(f"num_kv_pages: expected an int >= 0, got {self.num_kv_pages!r}")
        # raises on attention layers with different KV shapes, before anything is allocated
        group_linear_layers(self.specs)
        kv_tensors(self.specs, num_pages=0, page_size=self.page_size, dtypes=self.dtypes)

    @property
    def max_draft_tokens(self) -> int:
        """`Dmax`: the verify block size every draft-length-dependent buffer is sized for."""
        return max_draft_tokens(self.draft_shape)

    @property
    def table_width(self) -> int:
        """Request-table columns: max context plus a whole verify block, so a block never overflows a row."""
        return self.max_model_len + self.max_draft_tokens

    @property
    def max_pages_per_request(self) -> int:
        return -(-self.table_width // self.page_size)

    @property
    def scratch_rows(self) -> int:
        """Verify-scratch rows: one per running request plus a spare; 0 without speculation."""
        return self.max_num_seqs + 1 if self.draft_shape is not None else 0

    @property
    def kv_tensors(self) -> list[TensorSpec]:
        return kv_tensors(
            self.specs, num_pages=self.num_kv_pages, page_size=self.page_size, dtypes=self.dtypes
        )

    @property
    def state_tensors(self) -> list[TensorSpec]:
        groups = group_linear_layers(self.specs)
        return state_tensors(groups, num_slots=self.num_state_slots, dtypes=self.dtypes)

    @property
    def scratch_tensors(self) -> list[TensorSpec]:
        groups = group_linear_layers(self.specs)
        return scratch_tensors(
            groups,
            rows=self.scratch_rows,
            max_draft_tokens=self.max_draft_tokens,
            dtypes=self.dtypes,
        )

    @property
    def table_tensors(self) -> list[TensorSpec]:
        return table_tensors(rows=self.max_num_seqs, width=self.table_width, page_size=self.page_size)

    @property
    def kv_bytes(self) -> int:
        return sum(t.nbytes for t in self.kv_tensors)

    @property
    def state_bytes(self) -> int:
        return sum(t.nbytes for t in self.state_tensors)

    @property
    def scratch_bytes(self) -> int:
        return sum(t.nbytes for t in self.scratch_tensors)

    @property
    def table_bytes(self) -> int:
        return sum(t.nbytes for t in self.table_tensors)

    @property
    def total_bytes(self) -> int:
        return self.kv_bytes + self.state_bytes + self.scratch_bytes + self.table_bytes

    @property
    def kv_bytes_per_page(self) -> int:
        per_token = sum(spec.bytes_per_token(self.dtypes) for _, spec in self.specs.attention_layers)
        return per_token * self.page_size

    def summary(self) -> str:
        """One line per part, for logs."""
        mib = 1 << 20
        return (
            f"state slots {self.num_state_slots} (+1 reserved): {self.state_bytes / mib:.1f} MiB; "
            f"verify scratch {self.scratch_rows} rows x {self.max_draft_tokens} steps: "
            f"{self.scratch_bytes / mib:.1f} MiB; KV {self.num_kv_pages} pages x {self.page_size} tokens: "
            f"{self.kv_bytes / mib:.1f} MiB; tables {self.table_bytes / mib:.1f} MiB; "
            f"total {self.total_bytes / mib:.1f} MiB"
        )


def plan_memory(
    budget_bytes: int,
    specs: ModelStateSpecs,
    *,
    max_model_len: int,
    max_num_seqs: int,
    draft_shape: DraftShape | None,
    page_size: int,
    dtypes: StateDtypes | None = None,
    num_state_slots: int | None = None,
) -> MemoryPlan:
    """Fit state slots, verify scratch, tables and KV pages into `budget_bytes`.

    State slots (`num_state_slots`, default `max_num_seqs`), verify scratch (`max_num_seqs + 1` rows of
    `Dmax` steps) and the request table are fixed by the request limits; every remaining byte goes to KV
    pages, up to what `max_num_seqs` requests at full width can use. Raises ValueError naming the knobs when
    the fixed part does not fit or the rest cannot hold one request at `max_model_len` plus a verify block.
    """
    base = MemoryPlan(
        specs=specs,
        max_model_len=max_model_len,
        max_num_seqs=max_num_seqs,
        draft_shape=draft_shape,
        page_size=page_size,
        num_state_slots=max_num_seqs if num_state_slots is None else num_state_slots,
        num_kv_pages=0,
        dtypes=StateDtypes() if dtypes is None else dtypes,
        budget_bytes=budget_bytes,
    )
    dmax = base.max_draft_tokens
    knobs = (
        f"budget_bytes={budget_bytes}, max_model_len={max_model_len}, max_num_seqs={max_num_seqs}, "
        f"draft length Dmax={dmax}, num_state_slots={base.num_state_slots}"
    )
    fixed = base.total_bytes
    if fixed > budget_bytes:
        raise ValueError(
            f"budget_bytes: the recurrent state ({base.state_bytes} B), verify scratch "
            f"({base.scratch_bytes} B) "
            f"and request table ({base.table_bytes} B) alone need {fixed} B ({knobs}); raise budget_bytes or "
            f"lower max_num_seqs, num_state_slots or the draft length"
        )
    page_bytes = base.kv_bytes_per_page
    if page_bytes == 0:
        return base
    need = base.max_pages_per_request
    pages = min((budget_bytes - fixed) // page_bytes, max_num_seqs * need)
    if pages < need:
        raise ValueError(
            f"budget_bytes: after {fixed} B of state, scratch and tables, {budget_bytes - fixed} B leave "
            f"{pages} KV pages of {page_size} tokens, but one request at max_model_len plus a verify block "
            f"needs {need} pages ({knobs}); raise budget_bytes or lower max_model_len, max_num_seqs or the "
            f"draft length"
        )
    return MemoryPlan(
        specs=specs,
        max_model_len=max_model_len,
        max_num_seqs=max_num_seqs,
        draft_shape=draft_shape,
        page_size=page_size,
        num_state_slots=base.num_state_slots,
        num_kv_pages=pages,
        dtypes=base.dtypes,
        budget_bytes=budget_bytes,
    )
