"""The memory seam: what the scheduler needs from the pool that holds per-request state.

The scheduler only counts: can a request be admitted (a request row and a state slot free), and can a
running request grow to N tokens (KV pages). The model runner reads the same pool for index tensors.
Implementations: `StatePoolMemory` (hyspec_statepool's pool, in `pool_memory.py`).
"""

from __future__ import annotations

from typing import Protocol


class RequestMemory(Protocol):
    @property
    def max_num_tokens_per_request(self) -> int:
        """Tokens one request can hold when it is alone in the pool."""
        ...

    def can_alloc(self) -> bool:
        """A request row and a state slot are free."""
        ...

    def alloc(self, request_id: str) -> None:
        """Gives the request a row and a state slot (no KV pages yet)."""
        ...

    def grow(self, request_id: str, num_tokens: int) -> bool:
        """Room for the request's first `num_tokens` tokens; False (nothing changed) when pages run out."""
        ...

    def free(self, request_id: str) -> None:
        """Returns the request's row, state slot and pages."""
        ...

    def num_live(self) -> int: ...

    def leak_check(self) -> None:
        """Raises when something is still allocated that no live request owns."""
        ...
