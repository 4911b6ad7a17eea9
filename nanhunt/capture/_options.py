"""How a capture is loaded for its replay, as one frozen object checked when it is made: the flags of
``nanhunt replay`` that concern the files (the keyword arguments of :func:`nanhunt.load_capture`)."""

from __future__ import annotations

from dataclasses import dataclass, field

from . import _names
from .._util._errors import InputError
from ..step.snapshot import SNAPSHOTS, Snapshot
from ._statedict import parse_dtype

__all__ = ["LoadOptions"]


@dataclass(frozen=True)
class LoadOptions:
    """``model_factory``, ``loss``, ``optimizer``: the names you confirm (``--model``, ``--loss``, ``--optimizer``);
    ``trust_names``: the package prefixes whose names the file may choose (``--trust-names``; ``trust`` adds
    NANHUNT_TRUST_NAMES's, read when the options are made); ``device`` (default cpu), ``dtype`` (autocast; default
    the capture's), ``no_scaler``, ``train`` (None: as captured), ``trust_pickle``; ``snapshot``: where the Step
    keeps its copy of the weights and optimizer state (None: by size, ``--snapshot auto``); ``compile``: a backend
    to replay the step compiled by too (``--compile``; None: the one the capture recorded, if any);
    ``trust_compile_options``: use the compile options, mode and dynamic flag the capture recorded as they are
    (``--trust-compile-options``; else only those that change nothing but the numbers, ``_compiled.SAFE_OPTIONS``:
    inductor's other options can name the C++ compiler and its flags, which then run); ``eager``: the caller runs
    the step eagerly only (``nanhunt compare``, a replay under torchrun): a compiled capture is said so in a note,
    and its compile settings are neither judged nor offered for confirmation.

    The device is judged when the capture is loaded (under torchrun each rank takes its own GPU), the compile
    backend too (a name of yours is imported then)."""

    model_factory: str | None = None
    loss: str | None = None
    optimizer: str | None = None
    trust_names: tuple[str, ...] = ()
    device: str | None = None
    dtype: str | None = None
    no_scaler: bool = False
    train: bool | None = None
    trust_pickle: bool = False
    snapshot: Snapshot | None = None
    compile: str | None = None
    trust_compile_options: bool = False
    eager: bool = False
    trust: tuple[str, ...] = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        object.__setattr__(self, "trust_names", tuple(self.trust_names))  # a list from a caller: still frozen
        object.__setattr__(self, "trust", _names.trusted_prefixes(self.trust_names))
        if self.dtype is not None:
            parse_dtype(self.dtype)
        if self.snapshot is not None and self.snapshot not in SNAPSHOTS:
            raise InputError(f"snapshot={self.snapshot!r}: use memory, host or disk, or None (by size)")
