"""The four index spaces: only the pool builds them, values are range-checked, and mypy keeps them apart."""

from __future__ import annotations

import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

import pytest
import torch
from hyspec_statepool import BatchRows, HybridStatePool, KVSlots, ReqRows, StateSlots
from hyspec_statepool.indices import _MINT, _mint
from hyspec_statepool.transfer import to_device

MakePool = Callable[..., HybridStatePool]


@pytest.mark.parametrize("cls", [ReqRows, KVSlots, StateSlots, BatchRows])
def test_direct_construction_is_refused(cls: type[ReqRows]) -> None:
    with pytest.raises(TypeError, match="built only by hyspec_statepool"):
        cls(torch.zeros(2, dtype=torch.int32), bound=4, token=object())


@pytest.mark.parametrize(
    ("cls", "values", "ok"),
    [
        (ReqRows, [0, 3], True),
        (ReqRows, [4], False),
        (ReqRows, [-1], False),
        (BatchRows, [-1], False),
        (StateSlots, [-1, 0, 3], True),
        (StateSlots, [-2], False),
        (KVSlots, [-1, 3], True),
        (KVSlots, [4], False),
    ],
)
def test_range_is_checked_at_construction(cls: type[ReqRows], values: list[int], ok: bool) -> None:
    tensor = torch.tensor(values, dtype=torch.int32)
    if ok:
        assert cls(tensor, bound=4, token=_MINT).tolist() == values
    else:
        with pytest.raises(ValueError, match=r"expected values in \[0, 4\)"):
            cls(tensor, bound=4, token=_MINT)


@pytest.mark.parametrize(("cls", "values"), [(ReqRows, [0, 4]), (ReqRows, [-1]), (KVSlots, [1, -2])])
def test_host_values_are_checked_on_the_host_like_the_constructor(
    cls: type[ReqRows], values: list[int]
) -> None:
    """Minting host values checks them as Python ints (no device read), with the constructor's error."""
    with pytest.raises(ValueError) as from_tensor:
        cls(torch.tensor(values, dtype=torch.int32), bound=4, token=_MINT)
    for given in (values, torch.tensor(values)):
        with pytest.raises(ValueError) as from_host:
            _mint(cls, given, bound=4, device=torch.device("cpu"))
        assert str(from_host.value) == str(from_tensor.value)
    assert _mint(cls, [3, 0], bound=4, device=torch.device("cpu")).tolist() == [3, 0]


def test_to_device_on_the_cpu_keeps_values_and_dtype() -> None:
    cpu = torch.device("cpu")
    assert to_device([1, 2], dtype=torch.int32, device=cpu).dtype == torch.int32
    t = to_device(torch.tensor([1.5, 2.0]), dtype=torch.float32, device=cpu)
    assert t.tolist() == [1.5, 2.0] and t.device == cpu


def test_dtype_and_rank_are_checked() -> None:
    with pytest.raises(ValueError, match="1-D int32"):
        ReqRows(torch.zeros(2, dtype=torch.int64), bound=4, token=_MINT)
    with pytest.raises(ValueError, match="1-D int32"):
        ReqRows(torch.zeros(2, 2, dtype=torch.int32), bound=4, token=_MINT)


def test_padded_state_slots(make_pool: MakePool) -> None:
    pool = make_pool()
    rows = pool.alloc(["a", "b"])
    slots = pool.state_slots(rows)
    padded = slots.padded(4)
    assert padded.tolist() == [*slots.tolist(), -1, -1]
    assert padded.bound == slots.bound
    with pytest.raises(ValueError, match="n: expected >= 2"):
        slots.padded(1)


def test_mypy_rejects_one_index_space_for_another(tmp_path: Path) -> None:
    pytest.importorskip("mypy")
    # torch is skipped so a cold mypy run takes seconds; the index types themselves are fully checked
    (tmp_path / "mypy.ini").write_text(
        "[mypy]\nstrict = True\n"
        "[mypy-torch.*]\nfollow_imports = skip\n"
        "[mypy-hyspec_kernels.*]\nfollow_imports = skip\n"
    )
    snippet = tmp_path / "snippet.py"
    snippet.write_text(
        "from hyspec_statepool import BatchRows, HybridStatePool, KVSlots, ReqRows, StateSlots\n"
        "\n"
        "\n"
        "def ok(pool: HybridStatePool, rows: ReqRows) -> StateSlots:\n"
        "    return pool.state_slots(rows)\n"
        "\n"
        "\n"
        "def wrong(pool: HybridStatePool, slots: StateSlots, batch: BatchRows, kv: KVSlots) -> None:\n"
        "    pool.state_slots(slots)\n"  # line 9
        "    pool.state_slots(batch)\n"  # line 10
        "    pool.page_table(kv)\n"  # line 11
        "    x: ReqRows = slots\n"  # line 12
    )
    result = subprocess.run(
        [
            sys.executable,
            "-m",
            "mypy",
            "--config-file",
            "mypy.ini",
            "--cache-dir",
            str(tmp_path / "c"),
            "snippet.py",
        ],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=120,
    )
    error_lines = sorted(
        int(line.split(":")[1]) for line in result.stdout.splitlines() if line.startswith("snippet.py:")
    )
    assert error_lines == [9, 10, 11, 12], result.stdout
    assert 'incompatible type "StateSlots"; expected "ReqRows"' in result.stdout


def test_host_minted_rows_make_their_device_tensor_only_when_asked() -> None:
    """Rows looked up from host values (`pool.req_rows`) are translated on the host; their device tensor
    (one host-to-device copy) is made at the first `.tensor` and kept."""
    from torch.utils._python_dispatch import TorchDispatchMode

    class Count(TorchDispatchMode):  # type: ignore[no-untyped-call]
        ops = 0

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # type: ignore[no-untyped-def]
            Count.ops += 1
            return func(*args, **(kwargs or {}))

    rows = _mint(ReqRows, [3, 0, 2], bound=4, device=torch.device("cpu"))
    with Count():  # type: ignore[no-untyped-call]
        head = rows.head(2)
        seen = (len(rows), rows.tolist(), rows.host_values, len(head), head.tolist(), head.host_values)
    assert Count.ops == 0
    assert seen == (3, [3, 0, 2], (3, 0, 2), 2, [3, 0], (3, 0))
    with Count():  # type: ignore[no-untyped-call]
        t = rows.tensor
    assert Count.ops > 0 and t.dtype == torch.int32 and t.tolist() == [3, 0, 2]
    assert rows.tensor is t  # made once
    assert head.tensor.tolist() == [3, 0] and repr(head) == "ReqRows([3, 0], bound=4)"
    with pytest.raises(ValueError, match="ReqRows"):
        _mint(ReqRows, [4], bound=4, device=torch.device("cpu"))  # still checked at once, on the host
