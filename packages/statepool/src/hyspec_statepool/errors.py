"""Errors of the pool's lifecycle. Each message says what happened and which knob or call to change."""

from __future__ import annotations


class PoolExhaustedError(RuntimeError):
    """No free request row, state slot or KV page is left for an allocation."""


class DoubleFreeError(ValueError):
    """A request, state slot or page was freed while it was not allocated."""


class UseAfterFreeError(ValueError):
    """A request id or request row was used after it was freed (or before it was allocated)."""


class LeakError(RuntimeError):
    """Something is still allocated that no live request owns (raised by `LeakReport.raise_if_leaking`)."""
