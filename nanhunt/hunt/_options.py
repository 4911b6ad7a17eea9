"""How ``nanhunt replay`` replays, as one frozen object made from the command line and checked when it is made: how
the capture is loaded (``load``, which the loader takes) and how the step is hunted (the rest, which
:func:`~nanhunt.hunt.pipeline.hunt` takes)."""

from __future__ import annotations

from dataclasses import dataclass

from .._util._errors import InputError
from ..capture._options import LoadOptions
from ..records import Level

__all__ = ["ReplayOptions"]


@dataclass(frozen=True)
class ReplayOptions:
    """``level``: :class:`~nanhunt.records.Level` (``--level``); ``allow``: the modules and ops whose NaN/Inf is intentional
    (``--allow``); ``prove``: bisect a non-finite step (not ``--no-bisect``); ``repeat``: replay up to that many
    times while the step stays finite (``--repeat``)."""

    load: LoadOptions
    level: Level = Level.OP
    allow: tuple[str, ...] = ()
    prove: bool = True
    repeat: int = 1

    def __post_init__(self) -> None:
        object.__setattr__(self, "allow", tuple(self.allow))  # a list from a caller: still frozen
        try:
            object.__setattr__(self, "level", Level(self.level))  # "op" from a caller: the member
        except ValueError:
            raise InputError(f"--level {self.level}: name op or module") from None
        if self.repeat < 1:
            raise InputError(f"--repeat {self.repeat}: replay at least once (--repeat 1, the default)")

    def check_ranks(self) -> None:
        """Refuse what a replay under torchrun does not do (each rank replays its own batch once, eagerly)."""
        for flag, given in (("--snapshot", self.load.snapshot is not None), ("--repeat", self.repeat != 1),
                            ("--compile", self.load.compile is not None),
                            ("--trust-compile-options", self.load.trust_compile_options)):
            if given:
                raise InputError(f"{flag} applies to a replay in one process; under torchrun leave it out")
