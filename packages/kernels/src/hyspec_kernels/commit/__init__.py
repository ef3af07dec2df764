"""State commit: copy the accepted verify step from scratch (by batch row) into the state pools (by slot)."""

from hyspec_kernels.commit.op import commit_states
from hyspec_kernels.commit.reference import StatePair, commit_states_reference
from hyspec_kernels.commit.torch_impl import commit_states_torch

__all__ = ["StatePair", "commit_states", "commit_states_reference", "commit_states_torch"]
