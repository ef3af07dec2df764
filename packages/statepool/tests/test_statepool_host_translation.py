"""Host mirrors of the request table and the pool's host translations (`host_state_slots`, `host_kv_slots`,
`host_page_table`): equal to the device tables and translations, padding included, with the same errors."""

from __future__ import annotations

from collections.abc import Callable

import pytest
import torch
from hyspec_statepool import HybridStatePool, UseAfterFreeError
from hyspec_statepool import positions as positions_module
from hyspec_statepool import translate as translate_module
from hyspec_statepool.positions import packed_positions
from hyspec_statepool.transfer import host_staging, upload, write_into

MakePool = Callable[..., HybridStatePool]


def _mixed_pool(make_pool: MakePool, **plan_args: object) -> tuple[HybridStatePool, list[str]]:
    """Live requests whose rows, state slots and pages all differ from their order (frees in between)."""
    pool = make_pool(
        max_num_seqs=5, num_state_slots=7, num_kv_pages=30, page_size=3, max_model_len=24, **plan_args
    )
    pool.alloc_detached_slots(2)  # state slots now run ahead of rows
    pool.alloc(["x", "a", "y", "b"])
    pool.ensure_kv_capacity(["x", "a", "y", "b"], [4, 2, 7, 1])
    pool.free(["x", "y"])  # rows 0 and 2 free; their pages go back and interleave with later ones
    pool.alloc(["c"])
    for t in range(1, 12):  # pages granted a few tokens at a time: each request's pages interleave
        pool.ensure_kv_capacity(["a", "b", "c"], [min(t, 10), min(t, 5), min(t, 11)])
    pool.truncate_kv("a", 7)
    return pool, ["c", "a", "b"]


def test_mirrors_follow_every_table_write(make_pool: MakePool) -> None:
    pool, ids = _mixed_pool(make_pool)
    table = pool.table
    assert table.mirror_mismatches() == []
    assert table.host_row_to_slot == table.row_to_slot.tolist()
    assert torch.equal(table.host_page_table, table.page_table)
    assert table.host_pages == [[p for p in row if p >= 0] for row in table.page_table.tolist()]
    # a write past a row's last page leaves a gap of unmapped pages, on the host as on the device
    free_row = 4
    table.set_pages(free_row, 2, [9])
    assert table.host_pages[free_row] == [-1, -1, 9] and table.mirror_mismatches() == []
    table.clear_pages(free_row, 0)
    rows = [int(r) for r in pool.req_rows(ids).tensor]
    versions = list(table.row_versions)
    pool.free(ids)  # three requests at once: their rows cleared in one write (`clear_rows`)
    assert table.mirror_mismatches() == [] and pool.leak_check().clean
    assert bool((table.page_table == -1).all()) and table.row_to_slot.tolist() == [0] * table.num_rows
    assert all(table.row_versions[r] > versions[r] for r in rows)


def test_pages_past_a_row_are_refused_and_change_nothing(make_pool: MakePool) -> None:
    """`set_pages_many` writes through flat indices: a page past a row's last column (or a row past the
    table) is a ValueError naming it, before any write, not another row's entry; rows written together land
    each in its own row."""
    pool, _ = _mixed_pool(make_pool)
    table = pool.table
    before = table.host_page_table.clone(), [list(p) for p in table.host_pages], list(table.row_versions)
    last = table.max_pages - 1
    for bad in ([(4, last, [7, 8])], [(4, 0, [1]), (table.num_rows, 0, [2])], [(3, -1, [5])]):
        with pytest.raises(ValueError, match="updates"):
            table.set_pages_many(bad)
        assert torch.equal(table.host_page_table, before[0]) and table.host_pages == before[1]
        assert table.row_versions == before[2] and table.mirror_mismatches() == []
    table.set_pages_many([(4, last, [7]), (3, 0, [11, 12])])
    assert table.host_pages[4][last] == 7 and table.host_pages[3][:2] == [11, 12]
    assert table.page_table[4, last] == 7 and table.page_table[3, :2].tolist() == [11, 12]
    assert table.mirror_mismatches() == []


def test_mirror_mismatch_is_reported(make_pool: MakePool) -> None:
    """The check is able to fail: a device table written behind the mirrors' back is reported."""
    pool, _ = _mixed_pool(make_pool)
    pool.table.page_table[1, 0] += 1
    pool.table.row_to_slot[4] = 3
    problems = pool.table.mirror_mismatches()
    assert any(p.startswith("host_page_table rows [1]") for p in problems), problems
    assert any(p.startswith("host_row_to_slot rows [4]") for p in problems), problems
    assert not pool.leak_check().clean


@pytest.mark.parametrize("pad", [0, 2])
def test_host_state_slots_and_page_table_equal_the_device_ones(make_pool: MakePool, pad: int) -> None:
    pool, ids = _mixed_pool(make_pool)
    rows = pool.req_rows(ids)
    n = len(ids)
    slots = pool.host_state_slots(rows, pad_to=n + pad)
    assert slots.tensor.device.type == "cpu" and slots.bound == pool.state_slots(rows).bound
    assert slots.tolist() == pool.state_slots(rows).tolist() + [-1] * pad
    assert slots.tolist()[:n] != rows.tolist()  # state slots are not request rows here
    table = pool.host_page_table(rows, pad_to=n + pad)
    want = torch.cat([pool.page_table(rows), torch.zeros(pad, pool.table.max_pages, dtype=torch.int32)])
    assert table.dtype == torch.int32 and torch.equal(table, want)


@pytest.mark.parametrize("loop_max", [translate_module.LOOP_MAX_TOKENS, 0], ids=["python", "vectorised"])
@pytest.mark.parametrize(
    ("starts", "counts"),
    [
        ([5, 0, 3], [4, 0, 2]),  # ragged, an empty request
        ([0, 6, 2], [3, 1, 0]),  # ragged, the last request empty
        ([4, 8, 1], 1),  # decode
        ([2, 6, 0], 3),  # verify blocks
        ([], []),
    ],
)
def test_host_kv_slots_equal_the_device_ones(
    make_pool: MakePool,
    monkeypatch: pytest.MonkeyPatch,
    loop_max: int,
    starts: list[int],
    counts: list[int] | int,
) -> None:
    monkeypatch.setattr(translate_module, "LOOP_MAX_TOKENS", loop_max)
    pool, ids = _mixed_pool(make_pool)
    ids = ids[: len(starts)]
    rows = pool.req_rows(ids)
    total = sum(counts) if isinstance(counts, list) else counts * len(ids)
    for pad in (0, 3):
        got = pool.host_kv_slots(req_rows=rows, start_positions=starts, num_tokens=counts, pad_to=total + pad)
        device_counts = torch.tensor(counts, dtype=torch.long) if isinstance(counts, list) else counts
        want = pool.kv_slots(
            req_rows=rows, start_positions=torch.tensor(starts, dtype=torch.long), num_tokens=device_counts
        )
        assert got.tensor.device.type == "cpu" and got.bound == want.bound
        assert got.tolist() == want.tolist() + [-1] * pad


def test_host_translations_check_on_the_host_with_the_device_errors(make_pool: MakePool) -> None:
    pool, ids = _mixed_pool(make_pool)
    rows = pool.req_rows(ids)
    width = pool.table.width
    with pytest.raises(ValueError, match="no KV page yet"):
        pool.host_kv_slots(req_rows=rows, start_positions=[0, 8, 0], num_tokens=2)  # "a" holds 9 tokens
    with pytest.raises(ValueError, match=rf"start \+ count <= {width}"):
        pool.host_kv_slots(req_rows=rows, start_positions=[width, 0, 0], num_tokens=1)
    with pytest.raises(ValueError, match="start_positions: expected 3 ints"):
        pool.host_kv_slots(req_rows=rows, start_positions=[0, 0], num_tokens=1)
    with pytest.raises(ValueError, match="num_tokens"):
        pool.host_kv_slots(req_rows=rows, start_positions=[0, 0, 0], num_tokens=-1)
    with pytest.raises(ValueError, match="pad_to"):
        pool.host_kv_slots(req_rows=rows, start_positions=[0, 0, 0], num_tokens=1, pad_to=2)
    with pytest.raises(ValueError, match="pad_to"):
        pool.host_state_slots(rows, pad_to=2)
    with pytest.raises(ValueError, match="pad_to"):
        pool.host_page_table(rows, pad_to=2)
    pool.free(["a"])
    with pytest.raises(UseAfterFreeError, match="not mapped"):
        pool.host_state_slots(rows)
    other = make_pool(max_num_seqs=3)
    with pytest.raises(ValueError, match="another pool"):
        other.host_page_table(rows)


def test_req_rows_remember_their_host_values(make_pool: MakePool) -> None:
    pool, ids = _mixed_pool(make_pool)
    rows = pool.req_rows(ids)
    assert rows.host_values == tuple(rows.tolist())
    # a view of a buffer may change in place: no host values, so the pool reads the rows back
    view = rows.copy_into(torch.zeros(5, dtype=torch.int32))
    assert view.host_values is None
    assert pool.host_state_slots(view).tolist() == pool.host_state_slots(rows).tolist()
    assert rows.head(2).tolist() == rows.tolist()[:2] and rows.head(0).tolist() == []
    with pytest.raises(ValueError, match="n: expected"):
        rows.head(4)


def test_host_index_copy_into_a_buffer(make_pool: MakePool) -> None:
    pool, ids = _mixed_pool(make_pool)
    rows = pool.req_rows(ids)
    buf = torch.full((8,), 7, dtype=torch.int32)
    slots = pool.host_state_slots(rows).copy_into(buf, pad_to=5)
    assert slots.tensor.data_ptr() == buf.data_ptr()
    assert buf.tolist() == [*pool.state_slots(rows).tolist(), -1, -1, 7, 7, 7]


@pytest.mark.parametrize("loop_max", [translate_module.LOOP_MAX_TOKENS, 0], ids=["python", "vectorised"])
def test_packed_positions(monkeypatch: pytest.MonkeyPatch, loop_max: int) -> None:
    monkeypatch.setattr(positions_module, "LOOP_MAX_TOKENS", loop_max)
    assert packed_positions([5, 0, 3], [2, 0, 3]).tolist() == [5, 6, 3, 4, 5]
    assert packed_positions([0, 4], [0, 2]).tolist() == [4, 5]
    assert packed_positions([7, 2], 3).tolist() == [7, 8, 9, 2, 3, 4]
    assert packed_positions([], []).tolist() == [] and packed_positions([], 4).tolist() == []
    assert packed_positions([1], [2]).dtype == torch.int64


def test_transfer_writes_into_the_front_of_a_buffer() -> None:
    cpu = torch.device("cpu")
    buf = torch.full((2, 4), 9, dtype=torch.int32)
    staged = host_staging((1, 3), dtype=torch.int32, device=cpu)
    staged.copy_(torch.tensor([[1, 2, 3]]))
    view = upload(staged, buf)
    assert view.data_ptr() == buf.data_ptr() and buf.tolist() == [[1, 2, 3, 9], [9, 9, 9, 9]]
    flat = torch.zeros(5, dtype=torch.int64)
    assert write_into(flat, [4, 5]).tolist() == [4, 5] and flat.tolist() == [4, 5, 0, 0, 0]
    source = torch.tensor([6, 7, 8])
    write_into(flat, source)
    source.fill_(0)  # the caller may change its tensor at once: the copy was taken
    assert flat.tolist() == [6, 7, 8, 0, 0]
    with pytest.raises(ValueError, match="buffer: expected room"):
        write_into(flat, list(range(6)))
    with pytest.raises(ValueError, match="buffer: expected room"):
        upload(torch.zeros(3, dtype=torch.int32), buf)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_host_translations_reach_cuda_without_a_sync(make_pool: MakePool) -> None:
    from hyspec_statepool import HybridStatePool as Pool

    cpu_pool, ids = _mixed_pool(make_pool)
    pool = Pool(cpu_pool.plan, device="cuda")
    pool.alloc(ids)
    pool.ensure_kv_capacity(ids, [9, 9, 9])
    rows = pool.req_rows(ids)
    buf = torch.full((16,), 5, dtype=torch.int32, device="cuda")
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        kv = pool.host_kv_slots(req_rows=rows, start_positions=[1, 2, 3], num_tokens=2, pad_to=8)
        assert kv.tensor.device.type == "cpu" and not kv.tensor.is_pinned()  # small: staged by the driver
        view = kv.copy_into(buf)
        slots = pool.host_state_slots(rows).copy_into(buf[8:], pad_to=4)
    finally:
        torch.cuda.set_sync_debug_mode("default")
    want = pool.kv_slots(req_rows=rows, start_positions=torch.tensor([1, 2, 3]), num_tokens=2)
    assert view.tensor.device.type == "cuda" and view.tolist() == [*want.tolist(), -1, -1]
    assert slots.tolist() == [*pool.state_slots(rows).tolist(), -1]


def test_pages_of_many_rows_in_one_write(make_pool: MakePool) -> None:
    """`set_pages_many` (what a round's growth of many rows uses) writes every row's page-table entries, and
    the KV slots they give, including a last page that reaches past the table width, are what page-by-page
    reasoning says."""
    pool = make_pool(max_num_seqs=4, num_state_slots=5, num_kv_pages=40, page_size=4, max_model_len=10)
    table = pool.table
    width, ps = table.width, table.page_size
    assert width % ps, "the case needs a last page that reaches past the table width"
    last = (width - 1) // ps  # the page holding the last column
    table.set_pages_many([(0, 0, [7, 3]), (2, 1, [5]), (3, last, [11]), (1, 0, [])])
    want = torch.full((table.num_rows, width), -1, dtype=torch.int32)
    for row, first, pages in ((0, 0, [7, 3]), (2, 1, [5]), (3, last, [11])):
        for j, page in enumerate(pages):
            for o in range(ps):
                if (first + j) * ps + o < width:
                    want[row, (first + j) * ps + o] = page * ps + o
    grid = torch.arange(table.num_rows).repeat_interleave(width)  # every row's slot at every position
    got = table.kv_slots(grid, torch.arange(width).repeat(table.num_rows)).view(table.num_rows, width)
    assert torch.equal(got, want)
    assert table.page_table[0, :2].tolist() == [7, 3] and int(table.page_table[2, 1]) == 5
    assert table.mirror_mismatches() == []
