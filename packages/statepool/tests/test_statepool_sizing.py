"""Sizing: plan bytes equal hand-computed bytes and the bytes the pool allocates (on the meta device)."""

from __future__ import annotations

from dataclasses import dataclass

import pytest
import torch
from hyspec_statepool import (
    AttentionSpec,
    DraftShape,
    GDNSpec,
    HybridStatePool,
    MemoryPlan,
    ModelStateSpecs,
    ShortConvSpec,
    StateDtypes,
    TensorSpec,
    plan_memory,
)

# Qwen3.5-9B text model (transformers Qwen3_5TextConfig defaults): 32 layers, every 4th full attention.
QWEN35_9B = ModelStateSpecs.from_pairs(
    (
        i,
        AttentionSpec(num_kv_heads=4, head_dim=256)
        if i % 4 == 3
        else GDNSpec(16, 32, 128, 128, conv_kernel=4),
    )
    for i in range(32)
)
# LFM2-1.2B: 16 layers, attention at 2, 5, 8, 10, 12, 14; short conv over hidden 2048 with L_cache 3.
LFM2_ATTN = (2, 5, 8, 10, 12, 14)
LFM2_1B2 = ModelStateSpecs.from_pairs(
    (i, AttentionSpec(num_kv_heads=8, head_dim=64) if i in LFM2_ATTN else ShortConvSpec(2048, conv_kernel=3))
    for i in range(16)
)

CHAIN = DraftShape("chain", num_steps=3)
TREE = DraftShape("tree", num_steps=4, num_draft_tokens=16)
ADAPTIVE = DraftShape("chain", num_steps=3, adaptive_candidate_steps=(1, 3, 7))


@dataclass(frozen=True)
class Expected:
    """Bytes written out from the model shapes, independently of the library's layout table."""

    state: int
    scratch: int
    kv_per_page: int
    table: int


def _hand_bytes(
    model: str, *, slots: int, running: int, dmax: int, spec_on: bool, ps: int, ctx: int
) -> Expected:
    width = ctx + dmax
    table = running * (-(-width // ps) + 1) * 4  # page table and state slot per row (int32)
    scratch_rows = running + 1 if spec_on else 0
    if model == "qwen":
        conv_dim = 2 * 16 * 128 + 32 * 128
        conv = conv_dim * 3 * 2  # bf16 conv window
        per_slot = conv + 32 * 128 * 128 * 4  # and the fp32 recurrent state
        # a verify step keeps its conv window and, instead of the recurrent state, the inputs the commit's
        # replay reads: fp32 k, v, g and beta, in two halves of rows (the second for deferred commits)
        inputs = (16 * 128 + 32 * 128 + 32 + 32) * 4
        return Expected(
            state=24 * (slots + 1) * per_slot,
            scratch=24 * scratch_rows * dmax * (conv + 2 * inputs),
            kv_per_page=2 * 8 * ps * 4 * 256 * 2,
            table=table,
        )
    per_slot = 2048 * 2 * 2
    return Expected(
        state=10 * (slots + 1) * per_slot,
        scratch=10 * scratch_rows * dmax * per_slot,
        kv_per_page=2 * 6 * ps * 8 * 64 * 2,
        table=table,
    )


CASES = [
    ("qwen", None, 1),
    ("qwen", CHAIN, 4),
    ("qwen", TREE, 16),
    ("qwen", ADAPTIVE, 8),
    ("lfm2", None, 1),
    ("lfm2", CHAIN, 4),
    ("lfm2", ADAPTIVE, 8),
]


@pytest.mark.parametrize(("model", "draft", "dmax"), CASES)
def test_plan_matches_hand_bytes_and_allocation(model: str, draft: DraftShape | None, dmax: int) -> None:
    specs = QWEN35_9B if model == "qwen" else LFM2_1B2
    running, ctx, ps, slots = 8, 8192, 16, 10
    hand = _hand_bytes(
        model,
        slots=slots,
        running=running,
        dmax=dmax,
        spec_on=draft is not None,
        ps=ps,
        ctx=ctx,
    )
    fixed = hand.state + hand.scratch + hand.table
    want_pages = 1000  # below the cap of 8 requests x 513 pages, so the budget decides
    budget = fixed + want_pages * hand.kv_per_page + hand.kv_per_page - 1
    plan = plan_memory(
        budget,
        specs,
        max_model_len=ctx,
        max_num_seqs=running,
        draft_shape=draft,
        page_size=ps,
        num_state_slots=slots,
    )
    assert plan.max_draft_tokens == dmax
    assert plan.num_kv_pages == want_pages
    assert (plan.state_bytes, plan.scratch_bytes, plan.table_bytes) == (hand.state, hand.scratch, hand.table)
    assert plan.kv_bytes == want_pages * hand.kv_per_page
    assert plan.total_bytes == fixed + want_pages * hand.kv_per_page <= budget

    pool = HybridStatePool(plan, device="meta")
    tensors = pool.tensors()
    assert pool.allocated_bytes() == plan.total_bytes
    assert {name: tuple(t.shape) for name, t in tensors.items()} == {
        t.name: t.shape for t in plan_tensors(plan)
    }
    n_attn = 8 if model == "qwen" else 6
    assert tensors["kv.k"].shape[:3] == (n_attn, want_pages, ps)
    first_linear = 0
    view = pool.layer_state(first_linear)
    assert view.conv is not None and view.conv.shape[0] == slots + 1
    if draft is None:
        assert view.conv_scratch is None
    else:
        assert view.conv_scratch is not None and view.conv_scratch.shape[:2] == (running + 1, dmax)
    if model == "qwen":
        assert view.recurrent is not None and tuple(view.recurrent.shape) == (slots + 1, 32, 128, 128)
        assert view.recurrent.dtype == torch.float32
    else:
        assert view.recurrent is None and tuple(view.conv.shape) == (slots + 1, 2048, 2)


def plan_tensors(plan: MemoryPlan) -> list[TensorSpec]:
    return [*plan.kv_tensors, *plan.state_tensors, *plan.scratch_tensors, *plan.table_tensors]


def test_kv_pages_are_capped_at_what_max_running_requests_can_use() -> None:
    plan = plan_memory(
        1 << 40,
        LFM2_1B2,
        max_model_len=4096,
        max_num_seqs=4,
        draft_shape=CHAIN,
        page_size=1,
        num_state_slots=None,
    )
    assert plan.num_kv_pages == 4 * (4096 + 4)
    assert plan.num_state_slots == 4


def test_bf16_recurrent_state_halves_that_part() -> None:
    kwargs = {"max_model_len": 1024, "max_num_seqs": 2, "draft_shape": CHAIN, "page_size": 16}
    fp32 = plan_memory(1 << 34, QWEN35_9B, **kwargs)  # type: ignore[arg-type]
    bf16 = plan_memory(1 << 34, QWEN35_9B, dtypes=StateDtypes(recurrent=torch.bfloat16), **kwargs)  # type: ignore[arg-type]
    recurrent_fp32 = 24 * 3 * 32 * 128 * 128 * 4
    assert fp32.state_bytes - bf16.state_bytes == recurrent_fp32 // 2
    pool = HybridStatePool(bf16, device="meta")
    assert pool.allocated_bytes() == bf16.total_bytes
    assert fp32.scratch_bytes == bf16.scratch_bytes  # the commit replays fp32 inputs: no state per step
    st = pool.layer_state(0)
    assert st.replay is not None and st.replay.k.dtype == torch.float32


def test_budget_errors_name_the_knobs() -> None:
    hand = _hand_bytes("qwen", slots=4, running=4, dmax=4, spec_on=True, ps=16, ctx=2048)
    fixed = hand.state + hand.scratch + hand.table
    kwargs = {"max_model_len": 2048, "max_num_seqs": 4, "draft_shape": CHAIN, "page_size": 16}
    with pytest.raises(ValueError, match=r"budget_bytes.*max_num_seqs=4.*Dmax=4.*lower max_num_seqs"):
        plan_memory(fixed - 1, QWEN35_9B, **kwargs)  # type: ignore[arg-type]
    one_request = -(-(2048 + 4) // 16)
    with pytest.raises(ValueError, match=r"needs 129 pages.*max_model_len=2048.*lower max_model_len"):
        plan_memory(fixed + (one_request - 1) * hand.kv_per_page, QWEN35_9B, **kwargs)  # type: ignore[arg-type]
    ok = plan_memory(fixed + one_request * hand.kv_per_page, QWEN35_9B, **kwargs)  # type: ignore[arg-type]
    assert ok.num_kv_pages == one_request == 129


def test_plan_validation() -> None:
    with pytest.raises(ValueError, match="num_state_slots: expected an int >= max_num_seqs=4"):
        MemoryPlan(
            LFM2_1B2,
            max_model_len=8,
            max_num_seqs=4,
            draft_shape=None,
            page_size=1,
            num_state_slots=3,
            num_kv_pages=1,
        )
    mixed = ModelStateSpecs.from_pairs([(0, AttentionSpec(2, 8)), (1, AttentionSpec(2, 16))])
    with pytest.raises(ValueError, match="one KV shape"):
        MemoryPlan(
            mixed,
            max_model_len=8,
            max_num_seqs=1,
            draft_shape=None,
            page_size=1,
            num_state_slots=1,
            num_kv_pages=1,
        )


def test_qwen35_shape_matches_transformers_defaults() -> None:
    transformers = pytest.importorskip("transformers")
    cfg = transformers.Qwen3_5TextConfig()
    attn = [i for i, t in enumerate(cfg.layer_types) if t == "full_attention"]
    assert [i for i, _ in QWEN35_9B.attention_layers] == attn
    gdn = QWEN35_9B.spec(0)
    assert gdn == GDNSpec(
        cfg.linear_num_key_heads,
        cfg.linear_num_value_heads,
        cfg.linear_key_head_dim,
        cfg.linear_value_head_dim,
        cfg.linear_conv_kernel_dim,
    )
    assert QWEN35_9B.spec(attn[0]) == AttentionSpec(cfg.num_key_value_heads, cfg.head_dim)
