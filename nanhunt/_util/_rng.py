"""The script's random number generators, left where nanhunt found them.

A script seeds its generators and expects the same draws on every run: its dropout masks, its data order, its
augmentations. Whatever nanhunt does around a live run (making its Guard, opening and checking a step, writing a
capture) must not move them, or the run under nanhunt is another run than the one the user had. nanhunt's own code
draws nothing; :class:`preserve_rng` is the second line: what it wraps leaves the generators as they were.
"""

from __future__ import annotations

import functools
import random
import sys
from collections.abc import Callable
from types import TracebackType
from typing import Any, ParamSpec, TypeVar

import torch

__all__ = ["preserve_rng", "rng_preserved", "keep_rng"]

_P = ParamSpec("_P")
_R = TypeVar("_R")
_kept = [0]  # keep_rng() calls so far: a block that saw one leaves the generators as they are


class preserve_rng:  # noqa: N801  # a context manager, named as contextlib's are
    """Put back, at exit, the generators as they were at entry: torch's CPU one, each CUDA device's (only where
    CUDA is initialised already: this never initialises it, and not while a CUDA graph is being captured, whose
    generators must not be read), and with ``host`` Python's ``random`` and NumPy's global one (only where the
    script imported NumPy).

    ``host=False`` for the per-step path: torch's generators cost a 5 KB copy and a write back (3 microseconds),
    Python's and NumPy's 30 to 250, and nanhunt's step code calls neither (a test checks it). Never wrap the
    script's own code: its draws would be undone. After :func:`keep_rng` (a rollback puts the failed step's
    generators back on purpose) the blocks open then leave them as they are."""

    __slots__ = ("_host", "_torch", "_cuda", "_random", "_numpy", "_epoch")

    def __init__(self, *, host: bool = True) -> None:
        self._host = host
        self._torch: torch.Tensor | None = None
        self._cuda: list[torch.Tensor] | None = None
        self._random: Any = None
        self._numpy: Any = None
        self._epoch = 0

    def __enter__(self) -> preserve_rng:
        self._epoch = _kept[0]
        self._torch = torch.get_rng_state()
        self._cuda = torch.cuda.get_rng_state_all() if _cuda_ready() else None
        if self._host:
            self._random = random.getstate()
            np = sys.modules.get("numpy")
            self._numpy = np.random.get_state() if np is not None else None
        return self

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> None:
        saved, self._torch = self._torch, None
        cuda, self._cuda = self._cuda, None
        host, self._random = self._random, None
        numpy_state, self._numpy = self._numpy, None
        if saved is None or _kept[0] != self._epoch:
            return
        torch.set_rng_state(saved)
        if cuda is not None and _cuda_ready() and len(cuda) == torch.cuda.device_count():
            torch.cuda.set_rng_state_all(cuda)
        if host is not None:
            random.setstate(host)
        np = sys.modules.get("numpy")
        if numpy_state is not None and np is not None:
            np.random.set_state(numpy_state)


def keep_rng() -> None:
    """The generators now hold what they should (a rollback put back its step's): the :class:`preserve_rng`
    blocks open now leave them as they are."""
    _kept[0] += 1


def rng_preserved(fn: Callable[_P, _R]) -> Callable[_P, _R]:
    """``fn`` run inside :class:`preserve_rng` (Python's and NumPy's generators too): for what runs once or at a
    detection (making a Guard, writing a capture), where the copies cost nothing that matters."""

    @functools.wraps(fn)
    def call(*args: _P.args, **kwargs: _P.kwargs) -> _R:
        with preserve_rng():
            return fn(*args, **kwargs)

    return call


def _cuda_ready() -> bool:
    """CUDA's generators can be read without side effects: initialised, and no graph being captured."""
    return bool(torch.cuda.is_initialized()  # type: ignore[no-untyped-call]  # untyped in torch
                and not torch.cuda.is_current_stream_capturing())
