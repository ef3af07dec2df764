"""Random alloc / chunked-prefill / grow / truncate / free sequences against a plain-Python model."""

from __future__ import annotations

import pytest
import torch
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule
from hyspec_statepool import (
    AttentionSpec,
    DoubleFreeError,
    DraftShape,
    HybridStatePool,
    MemoryPlan,
    ModelStateSpecs,
    PoolExhaustedError,
    ShortConvSpec,
    StateDtypes,
    StateSlots,
    UseAfterFreeError,
)
from hyspec_statepool import translate as translate_module

SPECS = ModelStateSpecs.from_pairs(
    [(0, ShortConvSpec(3, 3)), (1, AttentionSpec(1, 2)), (2, ShortConvSpec(3, 3))]
)
MAX_RUNNING, SLOTS, PAGES = 4, 6, 10
IDS = st.integers(0, 7)
# most picks name a live request, so growth and truncation really happen; the rest may name a dead one
PICK = st.integers(0, 99)


class PoolMachine(RuleBasedStateMachine):
    """The model: which requests are live, their slot, and how many tokens of KV they asked for."""

    @initialize(page_size=st.sampled_from([1, 2, 3]))
    def build(self, page_size: int) -> None:
        self.page_size = page_size
        plan = MemoryPlan(
            specs=SPECS,
            max_model_len=9,
            max_num_seqs=MAX_RUNNING,
            draft_shape=DraftShape("chain", 2),
            page_size=page_size,
            num_state_slots=SLOTS,
            num_kv_pages=PAGES,
            dtypes=StateDtypes(kv=torch.float32, conv=torch.float32),
        )
        self.pool = HybridStatePool(plan, debug=True)
        self.slot_of: dict[int, int] = {}
        self.tokens: dict[int, int] = {}
        self.detached: list[StateSlots] = []
        self.ever_dirty: set[int] = set()

    def _choose(self, pick: int) -> int:
        live = sorted(self.slot_of)
        return live[pick % len(live)] if live and pick < 85 else pick % 8

    def _pages(self, n: int) -> int:
        return -(-n // self.page_size)

    @rule(ids=st.lists(IDS, min_size=1, max_size=3, unique=True))
    def alloc(self, ids: list[int]) -> None:
        new = [i for i in ids if i not in self.slot_of]
        free_slots = SLOTS - len(self.slot_of) - sum(len(d) for d in self.detached)
        if len(self.slot_of) + len(new) > MAX_RUNNING or len(new) > free_slots:
            with pytest.raises(PoolExhaustedError):
                self.pool.alloc(ids)
            return
        rows = self.pool.alloc(ids)
        slots = self.pool.state_slots(rows).tolist()
        for req_id, slot in zip(ids, slots, strict=True):
            if req_id in self.slot_of:
                assert self.slot_of[req_id] == slot  # chunked prefill keeps its slot
            else:
                assert slot != 0 and slot not in self.slot_of.values()
                for t in self.pool.states.states.values():
                    assert bool((t[:, slot] == 0).all())  # cleared for the new owner
                    t[:, slot] = float(req_id + 1)  # dirty it, as a prefill would
                self.slot_of[req_id] = slot
                self.tokens[req_id] = 0

    @rule(pick=PICK, n=st.integers(0, 11))
    def grow(self, pick: int, n: int) -> None:
        req_id = self._choose(pick)
        if req_id not in self.slot_of:
            with pytest.raises(UseAfterFreeError):
                self.pool.ensure_kv_capacity([req_id], [n])
            return
        if n > self.pool.plan.table_width:
            with pytest.raises(ValueError, match="max_model_len"):
                self.pool.ensure_kv_capacity([req_id], [n])
            return
        used = sum(self._pages(t) for t in self.tokens.values())
        extra = max(0, self._pages(n) - self._pages(self.tokens[req_id]))
        if used + extra > PAGES:
            with pytest.raises(PoolExhaustedError):
                self.pool.ensure_kv_capacity([req_id], [n])
            return
        self.pool.ensure_kv_capacity([req_id], [n])
        self.tokens[req_id] = max(self.tokens[req_id], self._pages(n) * self.page_size)

    @rule(pick=PICK, n=st.integers(0, 11))
    def truncate(self, pick: int, n: int) -> None:
        req_id = self._choose(pick)
        if req_id not in self.slot_of:
            with pytest.raises(UseAfterFreeError):
                self.pool.truncate_kv(req_id, n)
            return
        self.pool.truncate_kv(req_id, n)
        self.tokens[req_id] = min(self.tokens[req_id], self._pages(n) * self.page_size)

    @rule(picks=st.lists(PICK, min_size=1, max_size=2))
    def free(self, picks: list[int]) -> None:
        ids = list(dict.fromkeys(self._choose(p) for p in picks))
        if any(i not in self.slot_of for i in ids):
            with pytest.raises(DoubleFreeError):
                self.pool.free(ids)
            return
        self.pool.free(ids)
        for i in ids:
            del self.slot_of[i], self.tokens[i]

    @precondition(lambda self: len(self.detached) < 2)
    @rule()
    def take_detached(self) -> None:
        if len(self.slot_of) + sum(len(d) for d in self.detached) >= SLOTS:
            with pytest.raises(PoolExhaustedError):
                self.pool.alloc_detached_slots(1)
            return
        self.detached.append(self.pool.alloc_detached_slots(1))

    @precondition(lambda self: bool(self.detached))
    @rule()
    def return_detached(self) -> None:
        self.pool.free_detached_slots(self.detached.pop())

    @invariant()
    def consistent(self) -> None:
        if not hasattr(self, "pool"):
            return
        report = self.pool.leak_check()
        assert report.clean, report
        assert report.live_requests == len(self.slot_of)
        ids = list(self.slot_of)
        if ids:
            rows = self.pool.req_rows(ids)
            assert len(set(rows.tolist())) == len(ids)
            assert self.pool.state_slots(rows).tolist() == [self.slot_of[i] for i in ids]
            for i in ids:
                assert self.pool.kv_capacity(i) == min(self.tokens[i], self.pool.plan.table_width)
        handed = list(self.slot_of.values()) + [s for d in self.detached for s in d.tolist()]
        assert 0 not in handed and len(set(handed)) == len(handed)
        # no KV slot belongs to two rows
        table = self.pool.table  # every row's slot at every position
        grid = torch.arange(table.num_rows).repeat_interleave(table.width)
        kv = table.kv_slots(grid, torch.arange(table.width).repeat(table.num_rows))
        live_kv = kv[kv >= 0]
        assert len(set(live_kv.tolist())) == live_kv.numel()
        for t in self.pool.states.states.values():
            assert bool(t[:, 0].isnan().all())  # the reserved slot was never written

    @invariant()
    def host_translations_match_the_device(self) -> None:
        """The table's host mirrors, and every host translation made from them, equal the device side."""
        if not hasattr(self, "pool"):
            return
        pool = self.pool
        assert pool.table.mirror_mismatches() == []
        ids = list(self.slot_of)
        rows = pool.req_rows(ids)
        n = len(ids)
        assert pool.host_state_slots(rows, pad_to=n + 1).tolist() == [*pool.state_slots(rows).tolist(), -1]
        table = pool.host_page_table(rows, pad_to=n + 1)
        assert torch.equal(table[:n], pool.page_table(rows)) and not table[n:].any()
        # every position each request holds, packed (a request may hold none), both ways of computing it
        held = [pool.kv_capacity(i) for i in ids]
        want = pool.kv_slots(
            req_rows=rows,
            start_positions=torch.zeros(n, dtype=torch.long),
            num_tokens=torch.tensor(held, dtype=torch.long),
        ).tolist()
        for loop_max in (translate_module.LOOP_MAX_TOKENS, 0):
            saved, translate_module.LOOP_MAX_TOKENS = translate_module.LOOP_MAX_TOKENS, loop_max
            try:
                got = pool.host_kv_slots(
                    req_rows=rows, start_positions=[0] * n, num_tokens=held, pad_to=len(want) + 1
                )
            finally:
                translate_module.LOOP_MAX_TOKENS = saved
            assert got.tolist() == [*want, -1]

    def teardown(self) -> None:
        if not hasattr(self, "pool"):
            return
        self.pool.free(list(self.slot_of))
        for d in self.detached:
            self.pool.free_detached_slots(d)
        report = self.pool.leak_check()
        report.raise_if_leaking(allow_detached=False)
        assert self.pool.kv.num_free == PAGES and self.pool.states.num_free == SLOTS


PoolMachine.TestCase.settings = settings(
    max_examples=60, stateful_step_count=25, deadline=None, suppress_health_check=[HealthCheck.too_slow]
)
test_pool_state_machine = PoolMachine.TestCase
