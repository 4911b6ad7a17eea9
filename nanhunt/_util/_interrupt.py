"""Ctrl-C that waits: a SIGINT (or SIGTERM) arriving while user state is being put back is delivered once it is
back.

:func:`atomic` marks a function that must run to its end (``StepState.restore``). :class:`deferred_interrupts`
installs, for as long as it is active, a handler of SIGINT and of SIGTERM that holds the signal while an atomic
function runs and hands it to the previous handler (``KeyboardInterrupt`` by default for SIGINT) as soon as the
outermost one is done. Outside atomic functions the previous handler runs at once, as if nothing were installed.
SIGTERM's default handler ends the process at once, running no ``finally``: :func:`terminate_raises` (the
command line) makes it raise :class:`Terminated` instead, which ``finally`` blocks see and these handlers hold.

The handler looks at the interrupted frames, so "runs" starts at the atomic function's first instruction: no
window between entering it and holding the signal. An atomic function called with no :class:`deferred_interrupts`
active installs one itself; a SIGINT in the few instructions before that leaves it not started (never half
done). Only the main thread receives signals: elsewhere nothing is installed.
"""

from __future__ import annotations

import functools
import signal
import sys
import threading
from collections.abc import Callable
from types import FrameType, TracebackType
from typing import Any, ParamSpec, TypeVar

__all__ = ["atomic", "deferred_interrupts", "terminate_raises", "Terminated"]

_P = ParamSpec("_P")
_R = TypeVar("_R")
_Handler = Callable[[int, FrameType | None], Any]
_SIGNALS: tuple[int, ...] = (signal.SIGINT, signal.SIGTERM)


class Terminated(BaseException):
    """SIGTERM, raised where the program was while :func:`terminate_raises` is active. Not a
    ``KeyboardInterrupt``: what ends a search early on Ctrl-C and goes on with what it found (the bisection)
    lets it through; the process is to stop."""


class _State:
    """The installed handlers (main thread only): how many users, what they replaced, a held signal."""

    depth = 0
    previous: dict[int, _Handler] = {}
    pending: tuple[int, FrameType | None] | None = None  # a held signal and the frame it arrived in


_state = _State()


class deferred_interrupts:  # noqa: N801  (used as a context manager, named like one)
    """While active, SIGINT and SIGTERM inside an :func:`atomic` function wait until that function is done.

    Reentrant; the previous handlers are put back exactly when the outermost one exits. Does nothing outside
    the main thread, nor for a signal whose current handler is not a Python callable (``SIG_DFL``, ``SIG_IGN``,
    or one installed from C): such a handler could not be put back, or does not raise.
    """

    __slots__ = ("_active",)

    def __init__(self) -> None:
        self._active = False

    def __enter__(self) -> deferred_interrupts:
        if self._active:
            raise RuntimeError("this deferred_interrupts is already active")
        if threading.current_thread() is not threading.main_thread():
            return self
        if _state.depth > 0:
            _state.depth, self._active = _state.depth + 1, True
            return self
        previous = {signum: h for signum in _SIGNALS if callable(h := signal.getsignal(signum))}
        if not previous:
            return self
        _state.previous, _state.pending = previous, None
        try:
            # From here a signal reaches _handler, which outside atomic functions hands it on at once: raised
            # below, and the handlers are put back.
            for signum, handler in previous.items():
                signal.signal(signum, functools.partial(_handler, handler))
            _state.depth, self._active = 1, True
        except BaseException:
            for signum, handler in previous.items():
                signal.signal(signum, handler)
            _state.previous = {}
            raise
        return self

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> None:
        if not self._active:
            return
        previous = _state.previous
        assert previous
        if _state.depth == 1:
            # Counted down first: a signal before its handler is back still finds its previous handler.
            _state.depth, _state.previous = 0, {}
            for signum, handler in previous.items():
                signal.signal(signum, handler)
        else:
            _state.depth -= 1
            if _holding(sys._getframe(1), but=self):
                self._active = False
                return  # an outer atomic function is still running: it delivers when it is done
        # One statement: a signal before it is held and taken here, one after it goes to `previous` at once.
        held, _state.pending, self._active = _state.pending, None, False
        if held is not None:
            previous[held[0]](*held)  # default_int_handler raises KeyboardInterrupt here


def atomic(fn: Callable[_P, _R]) -> Callable[_P, _R]:
    """Run ``fn`` to its end despite Ctrl-C; a SIGINT that arrives meanwhile is delivered when it is done."""

    @functools.wraps(fn)
    def atomic_call(*args: _P.args, **kwargs: _P.kwargs) -> _R:
        with deferred_interrupts() as shield:  # the handler reads `shield` in this frame: keep the name
            return fn(*args, **kwargs)

    return atomic_call


# Every atomic function runs inside this one code object: the handler looks for it among the interrupted frames.
_ATOMIC_CODE = atomic(lambda: None).__code__


def _holding(frame: FrameType | None, but: deferred_interrupts | None = None) -> bool:
    """Is an atomic function running in these frames (entering, or its shield still active)?"""
    while frame is not None:
        if frame.f_code is _ATOMIC_CODE:
            shield = frame.f_locals.get("shield")
            if shield is None or (shield is not but and shield._active):
                return True
        frame = frame.f_back
    return False


def _handler(previous: _Handler, signum: int, frame: FrameType | None) -> None:
    if _holding(frame):
        if _state.pending is None or signum == signal.SIGTERM:  # a Ctrl-C after a SIGTERM still ends the process
            _state.pending = (signum, frame)
    else:
        previous(signum, frame)


def _terminated(signum: int, frame: FrameType | None) -> None:
    raise Terminated


class terminate_raises:  # noqa: N801  (used as a context manager, named like one)
    """While active, SIGTERM raises :class:`Terminated` where the program is (``finally`` blocks run, and
    :func:`atomic` functions hold it like a Ctrl-C), instead of ending the process at once. Only in the main
    thread and only over the default handler: a program's own SIGTERM handler stays. The default is put back
    on leaving, unless a handler was set meanwhile: the distributed replay ignores SIGTERM once every rank agreed on
    its exit code, up to the process's end."""

    __slots__ = ("_installed",)

    def __init__(self) -> None:
        self._installed = False

    def __enter__(self) -> terminate_raises:
        if threading.current_thread() is threading.main_thread() \
                and signal.getsignal(signal.SIGTERM) is signal.SIG_DFL:
            signal.signal(signal.SIGTERM, _terminated)
            self._installed = True
        return self

    def __exit__(self, *exc: object) -> None:
        if self._installed:
            self._installed = False
            if signal.getsignal(signal.SIGTERM) is _terminated:
                signal.signal(signal.SIGTERM, signal.SIG_DFL)
