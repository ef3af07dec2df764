"""commit_states rejects bad input with a ValueError that names the argument."""

from __future__ import annotations

import re
from collections.abc import Callable

import pytest
import torch
from hyspec_kernels import value_checks
from hyspec_kernels.commit import commit_states

L, S, R, DMAX = 2, 6, 3, 4


def _call(**overrides: object) -> None:
    args: dict[str, object] = dict(
        pairs=[(torch.zeros(L, S, 5), torch.zeros(L, R, DMAX, 5))],
        batch_rows=torch.tensor([0, 2]),
        state_slots=torch.tensor([1, 5]),
        steps=torch.tensor([3, -1]),
        track_slots=None,
        track_steps=None,
        backend="torch",
    )
    args.update(overrides)
    commit_states(**args)  # type: ignore[arg-type]


BAD: list[tuple[str, dict[str, object]]] = [
    ("pairs", dict(pairs=torch.zeros(L, S, 5))),
    ("pairs[0]", dict(pairs=[(torch.zeros(L, S, 5),)])),
    ("pairs[0][0] (state)", dict(pairs=[(torch.zeros(L), torch.zeros(L, R, DMAX))])),
    ("pairs[0][1] (scratch)", dict(pairs=[(torch.zeros(L, S, 5), torch.zeros(L, R, DMAX, 4))])),
    (
        "pairs[0][1] (scratch)",
        dict(pairs=[(torch.zeros(L, S, 5), torch.zeros(L + 1, R, DMAX, 5))]),
    ),
    (
        "pairs[0][1] (scratch)",
        dict(pairs=[(torch.zeros(L, S, 5), torch.zeros(L, R, DMAX, 5).double())]),
    ),
    ("batch_rows", dict(batch_rows=torch.tensor([0, 3]))),
    ("batch_rows", dict(batch_rows=torch.tensor([0.0, 1.0]))),
    ("batch_rows", dict(batch_rows=torch.tensor([[0, 1]]))),
    ("state_slots", dict(state_slots=torch.tensor([1, S]))),
    ("state_slots", dict(state_slots=torch.tensor([1, 2, 3]))),
    ("steps", dict(steps=torch.tensor([DMAX, 0]))),
    ("steps", dict(steps=torch.tensor([-2, 0]))),
    ("track_slots, track_steps", dict(track_slots=torch.tensor([1, 2]))),
    ("track_slots", dict(track_slots=torch.tensor([1, S + 3]), track_steps=torch.tensor([0, 0]))),
    ("track_steps", dict(track_slots=torch.tensor([1, 2]), track_steps=torch.tensor([0, DMAX]))),
    ("state_slots", dict(state_slots=torch.tensor([4, 4]), steps=torch.tensor([0, 1]), check_unique=True)),
    (
        "track_slots",
        dict(track_slots=torch.tensor([2, 2]), track_steps=torch.tensor([1, 0]), check_unique=True),
    ),
    ("backend", dict(backend="cuda")),
]


@pytest.mark.parametrize(("name", "overrides"), BAD)
def test_commit_rejects_bad_input(name: str, overrides: dict[str, object]) -> None:
    with pytest.raises(ValueError, match=f"^{re.escape(name)}"):
        _call(**overrides)


def test_duplicates_among_dead_rows_are_fine() -> None:
    """Two rows may share a slot when at most one of them is live (a finished request's row is dead)."""
    state = torch.zeros(L, S, 5)
    scratch = torch.arange(L * R * DMAX * 5, dtype=torch.float32).view(L, R, DMAX, 5)
    commit_states(
        pairs=[(state, scratch)],
        batch_rows=torch.tensor([0, 2]),
        state_slots=torch.tensor([4, 4]),
        steps=torch.tensor([-1, 2]),
        track_slots=torch.tensor([3, 3]),
        track_steps=torch.tensor([1, -1]),
        check_unique=True,
        backend="reference",
    )
    assert torch.equal(state[:, 4], scratch[:, 2, 2])
    assert torch.equal(state[:, 3], scratch[:, 0, 1])


def test_triton_path_needs_contiguous_entries() -> None:
    state = torch.zeros(L, S, 5, 3).transpose(2, 3)  # entry dims not row-major
    with pytest.raises(ValueError, match=re.escape("pairs[0][0] (state)")):
        _call(pairs=[(state, torch.zeros(L, R, DMAX, 3, 5))], backend="triton")


def test_triton_path_needs_scratch_entries_whose_leading_dims_merge() -> None:
    # entry [5, 2, 3] of [2, 5, 3] memory: its first two dims are no single run of rows
    scratch = torch.zeros(L, R, DMAX, 2, 5, 3).transpose(3, 4)
    with pytest.raises(ValueError, match=re.escape("pairs[0][1] (scratch)")):
        _call(pairs=[(torch.zeros(L, S, 5, 2, 3), scratch)], backend="triton")


def test_empty_batch_and_no_pairs_are_no_ops() -> None:
    calls: list[Callable[[], None]] = [
        lambda: _call(
            batch_rows=torch.zeros(0, dtype=torch.int64),
            state_slots=torch.zeros(0, dtype=torch.int64),
            steps=torch.zeros(0, dtype=torch.int64),
            backend="triton",
        ),
        lambda: _call(pairs=[]),
    ]
    for call in calls:
        call()


def test_value_checks_rule() -> None:
    """Value checks run on the CPU by default, on CUDA only when asked (each read is a sync there)."""
    cpu, cuda = torch.device("cpu"), torch.device("cuda")
    assert value_checks(cpu) and value_checks(cpu, True) and not value_checks(cpu, False)
    assert not value_checks(cuda) and not value_checks(cuda, False)
    # check_indices=False skips the range checks (the caller vouches for the indices), never the shapes
    _call(check_indices=False)
    with pytest.raises(ValueError, match=r"^steps"):
        _call(steps=torch.tensor([0, 1, 2]), check_indices=False)
