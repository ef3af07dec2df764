"""What `HybridStatePool.leak_check` reports."""

from __future__ import annotations

from dataclasses import dataclass

from hyspec_statepool.errors import LeakError


@dataclass(frozen=True, slots=True)
class LeakReport:
    """Resources allocated but owned by no live request, and any disagreement between bookkeeping and tables.

    Attributes:
        live_requests: requests live when the check ran.
        leaked_rows, leaked_slots, leaked_pages: allocated, but owned by no live request (nor detached).
        detached_slots: slots handed out by `alloc_detached_slots` and not yet freed.
        inconsistencies: one line per table entry or owner record that disagrees with the allocators.
    """

    live_requests: int
    leaked_rows: tuple[int, ...]
    leaked_slots: tuple[int, ...]
    leaked_pages: tuple[int, ...]
    detached_slots: tuple[int, ...]
    inconsistencies: tuple[str, ...]

    @property
    def clean(self) -> bool:
        """Nothing leaked and the tables agree with the allocators (detached slots are not a leak)."""
        return not (self.leaked_rows or self.leaked_slots or self.leaked_pages or self.inconsistencies)

    def raise_if_leaking(self, *, allow_detached: bool = True) -> None:
        """Raise LeakError describing every problem; detached slots count unless `allow_detached`."""
        if self.clean and (allow_detached or not self.detached_slots):
            return
        parts = [f"{self.live_requests} live requests"]
        for name in ("leaked_rows", "leaked_slots", "leaked_pages"):
            if getattr(self, name):
                parts.append(f"{name} {list(getattr(self, name))}")
        if self.detached_slots and not allow_detached:
            parts.append(f"detached_slots {list(self.detached_slots)} (free them with free_detached_slots)")
        parts.extend(self.inconsistencies)
        raise LeakError("state pool leak check failed: " + "; ".join(parts))
