"""Exceptions. ``CommandError`` carries the CLI exit code."""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from .guard import GuardEvent
    from .records import Occurrence

__all__ = ["NanhuntError", "NonFiniteError", "GuardError", "TraceStateError", "CommandError"]


class NanhuntError(Exception):
    """Base class of nanhunt's own errors."""


class TraceStateError(NanhuntError, RuntimeError):
    """A trace was used out of order (results read while running, started twice, ...)."""


class NonFiniteError(NanhuntError, FloatingPointError):
    """Raised inside the op that created a non-finite value (``stop_at_first=True``)."""

    def __init__(self, occurrence: Occurrence) -> None:
        super().__init__(occurrence.describe())
        self.occurrence = occurrence


class GuardError(NonFiniteError):
    """Raised by :class:`nanhunt.Guard` (``on_fail="raise"``) at the first bad step of a training loop.

    ``event`` (a :class:`nanhunt.guard.GuardEvent`) says what went wrong, at which step and rank, and where the
    capture is. The guard does not trace ops, so ``occurrence`` is None: replay the capture to find the origin.
    """

    def __init__(self, event: GuardEvent) -> None:
        NanhuntError.__init__(self, event.describe())
        self.event = event
        self.occurrence = None  # type: ignore[assignment]


class CommandError(NanhuntError):
    """A user-facing failure of the command line: one line and an exit code."""

    def __init__(self, message: str, exit_code: int = 2) -> None:
        super().__init__(message)
        self.exit_code = exit_code
