"""Exceptions. ``CommandError`` carries the CLI exit code. ``visible`` makes text read from a file safe to show."""

from __future__ import annotations

import re
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from .records import GuardEvent, Occurrence

__all__ = ["NanhuntError", "NonFiniteError", "GuardError", "TraceStateError", "CommandError", "visible"]

# C0, DEL, C1, the Unicode line and paragraph separators and the bidi controls (Trojan Source): a name read
# from a file holding one could end a line, forge a second one, recolour a terminal or reorder what it shows.
_CONTROL = re.compile("[\x00-\x1f\x7f-\x9f\u061c\u200e\u200f\u2028\u2029\u202a-\u202e\u2066-\u2069]")
_NAMED = {"\n": "\\n", "\r": "\\r", "\t": "\\t"}


def _escaped(ch: str) -> str:
    code = ord(ch)
    return _NAMED.get(ch) or (f"\\x{code:02x}" if code < 0x100 else f"\\u{code:04x}")


def visible(text: str, *, multiline: bool = False) -> str:
    """``text`` with every control character written as a visible escape (``\\n``, ``\\x1b``, ``\\u202e``).

    ``multiline`` keeps line breaks and tabs (a code block); anything else is still escaped.
    """
    if _CONTROL.search(text) is None:
        return text
    if multiline:
        return _CONTROL.sub(lambda m: m.group() if m.group() in "\n\t" else _escaped(m.group()), text)
    return _CONTROL.sub(lambda m: _escaped(m.group()), text)


class NanhuntError(Exception):
    """Base class of nanhunt's own errors."""


class TraceStateError(NanhuntError, RuntimeError):
    """A trace was used out of order (results read while running, started twice, ...)."""


class NonFiniteError(NanhuntError, FloatingPointError):
    """Raised inside the op that created a non-finite value (``stop_at_first=True``)."""

    def __init__(self, occurrence: Occurrence) -> None:
        super().__init__(occurrence.describe())
        self.occurrence = occurrence


class GuardError(NanhuntError, FloatingPointError):
    """Raised by :class:`nanhunt.Guard` (``on_fail="raise"``) at the first bad step of a training loop.

    ``event`` (a :class:`nanhunt.GuardEvent`) says what went wrong, at which step and rank, and where the
    capture is. The guard traces no op, so it names no origin (it is no :class:`NonFiniteError`): replay
    the capture to find it.
    """

    def __init__(self, event: GuardEvent) -> None:
        super().__init__(event.describe())
        self.event = event


class CommandError(NanhuntError):
    """A user-facing failure of the command line: one line and an exit code."""

    def __init__(self, message: str, exit_code: int = 2) -> None:
        super().__init__(message)
        self.exit_code = exit_code
