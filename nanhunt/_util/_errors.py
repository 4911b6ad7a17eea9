"""Exceptions. ``InputError`` (bad input, one line) carries the exit code the command line gives it.
``visible`` makes text read from a file safe to show."""

from __future__ import annotations

import re
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING

from ._text import dtype_name

if TYPE_CHECKING:
    import torch

    from ..records import GuardEvent, Occurrence, Record

__all__ = ["NanhuntError", "NonFiniteError", "Stop", "GuardError", "TraceStateError", "InputError", "visible"]

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


@dataclass(frozen=True, eq=False)
class Stop:
    """Where ``trace(stop_at_first=True)`` stopped, with the tensors to look at (``nanhunt.last``).

    ``inputs``: the floating tensors the op read, in the order of ``record.inputs`` (a module-level
    stop: the module's arguments; an in-place op's written input already holds its result);
    ``outputs``: the floating tensors it made or wrote; ``output``: the one holding ``record``'s
    values. All detached (they keep no autograd graph alive). ``landing``: ``file:line in function``
    where a debugger's post-mortem starts, the user's frame that ran the op (in backward, the frame
    that ran the backward: the forward line, ``source``, has returned by then).
    """

    occurrence: Occurrence
    inputs: tuple[torch.Tensor, ...] = ()
    outputs: tuple[torch.Tensor, ...] = ()
    output: torch.Tensor | None = None
    landing: str | None = None

    @property
    def record(self) -> Record:
        """The record of the value that went non-finite."""
        return self.occurrence.output

    @property
    def op(self) -> str | None:
        return self.occurrence.op

    @property
    def source(self) -> str | None:
        """The user's line that ran the op (a backward op: the forward line that built its node)."""
        return self.occurrence.source

    def __repr__(self) -> str:
        return (f"Stop({self.occurrence.describe()}; source {self.source}; landing {self.landing}; "
                f"inputs [{_shapes(self.inputs)}]; outputs [{_shapes(self.outputs)}])")


def _shapes(ts: tuple[torch.Tensor, ...]) -> str:
    return ", ".join(f"{dtype_name(t.dtype)}{list(t.shape)}" for t in ts)


def _stop_message(occ: Occurrence, stop: Stop | None) -> str:
    """One line: what was born where, where a debugger lands, and what to type there."""
    text = occ.describe()
    backward = occ.phase.value == "backward"
    if occ.source:
        text += f", in the backward of {occ.source}" if backward else f" at {occ.source}"
    if stop is None or stop.landing is None:
        return text
    if stop.landing == occ.source:
        where = "that line"
    elif backward:
        where = f"{stop.landing}, which ran that backward"
    elif occ.op is None and occ.output.role.value == "output":
        where = f"{stop.landing}, which called that module"
    elif occ.op is None:
        where = f"{stop.landing}, where it was first read"  # a batch, weight or state entering non-finite
    else:
        where = stop.landing
    look = "nanhunt.last.inputs[0].abs().max()" if stop.inputs else "nanhunt.last.output.isnan().sum()"
    return (f"{text}; post-mortem (python -m pdb, %debug) lands on {where}: `import nanhunt`, then "
            f"`p {look}`, `p nanhunt.last.output`, `p nanhunt.last.record`")


class NonFiniteError(NanhuntError, FloatingPointError):
    """Raised inside the op that created a non-finite value (``stop_at_first=True``).

    Its traceback ends in the user's frame (:attr:`Stop.landing`), where ``python -m pdb``, ``%debug``
    and ``pdb.post_mortem()`` start; ``inputs``, ``outputs``, ``record`` and ``op`` are those of
    ``nanhunt.last`` (a :class:`Stop`).
    """

    def __init__(self, occurrence: Occurrence, stop: Stop | None = None) -> None:
        super().__init__(_stop_message(occurrence, stop))
        self.occurrence = occurrence
        self.stop = stop

    def _landed(self, landing: str) -> None:
        """The debugger lands on ``landing``, known only once the error reached it (a backward op run on
        autograd's device thread, which holds no frame of the user's): say so in the message."""
        if self.stop is not None and self.stop.landing is None:
            self.stop = replace(self.stop, landing=landing)
            self.args = (_stop_message(self.occurrence, self.stop),)

    @property
    def record(self) -> Record:
        return self.occurrence.output

    @property
    def op(self) -> str | None:
        return self.occurrence.op

    @property
    def inputs(self) -> tuple[torch.Tensor, ...]:
        return () if self.stop is None else self.stop.inputs

    @property
    def outputs(self) -> tuple[torch.Tensor, ...]:
        return () if self.stop is None else self.stop.outputs


class GuardError(NanhuntError, FloatingPointError):
    """Raised by :class:`nanhunt.Guard` (``on_fail="raise"``) at the first bad step of a training loop.

    ``event`` (a :class:`nanhunt.GuardEvent`) says what went wrong, at which step and rank, and where the
    capture is. The guard traces no op, so it names no origin (it is no :class:`NonFiniteError`): replay
    the capture to find it.
    """

    def __init__(self, event: GuardEvent) -> None:
        super().__init__(event.describe())
        self.event = event


class InputError(NanhuntError):
    """Bad input: a file, a name or an option nanhunt cannot use. Its message is one line naming the problem and
    the fix; the command line prints it and exits with ``exit_code`` (2, or 3 for a step that does not
    reproduce)."""

    def __init__(self, message: str, exit_code: int = 2) -> None:
        super().__init__(message)
        self.exit_code = exit_code


def first_line(e: BaseException) -> str:
    """``TypeName: the first line of its message``: an exception quoted inside one line of nanhunt's own."""
    s = str(e).strip().splitlines()
    return f"{type(e).__name__}: {s[0] if s else ''}"
