"""Exceptions. ``CommandError`` carries the CLI exit code."""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from .records import Occurrence

__all__ = ["NanhuntError", "NonFiniteError", "TraceStateError", "CommandError"]


class NanhuntError(Exception):
    """Base class of nanhunt's own errors."""


class TraceStateError(NanhuntError, RuntimeError):
    """A trace was used out of order (results read while running, started twice, ...)."""


class NonFiniteError(NanhuntError, FloatingPointError):
    """Raised inside the op that created a non-finite value (``stop_at_first=True``)."""

    def __init__(self, occurrence: Occurrence) -> None:
        super().__init__(occurrence.describe())
        self.occurrence = occurrence


class CommandError(NanhuntError):
    """A user-facing failure of the command line: one line and an exit code."""

    def __init__(self, message: str, exit_code: int = 2) -> None:
        super().__init__(message)
        self.exit_code = exit_code
