"""nanhunt: find where a NaN or Inf is born in a PyTorch training step, and prove why.

The names below are imported when first used (PEP 562): ``nanhunt --help`` and the renderers never
import torch, and ``import nanhunt`` costs what the name you use needs.
"""

import sys


def _run_with_m(argv: list[str]) -> bool:
    """``argv`` (``sys.orig_argv``, the interpreter's own command line) runs nanhunt as a module: ``python -m
    nanhunt``, ``-mnanhunt``, ``-um nanhunt`` or ``-m nanhunt.cli``, after any interpreter options."""
    i = 1
    while i < len(argv):
        arg = argv[i]
        if arg in ("-W", "-X"):  # their value is the next argument
            i += 2
            continue
        if not arg.startswith("-") or arg in ("-", "-c"):
            return False  # a script, stdin or -c's code
        flags, m, module = arg[1:].partition("m")
        if m and set(flags) <= set("bBdEiIOPqsSuvRx"):
            module = module or (argv[i + 1] if i + 1 < len(argv) else "")
            return module == "nanhunt" or module.startswith("nanhunt.")
        i += 1
    return False


# First, before anything else is imported: ``python -m nanhunt`` (and ``torchrun ... -m nanhunt``) puts the current
# directory first on sys.path, where a networkx.py or rich.py (an unpacked ticket) would be imported in place of
# the library, and run. Python imports this package to find the module it runs while sys.argv[0] is "-m".
if sys.argv[:1] == ["-m"] and sys.path and _run_with_m(list(getattr(sys, "orig_argv", []))):
    import os

    if os.path.realpath(sys.path[0] or ".") == os.path.realpath(os.getcwd()):
        del sys.path[0]
    del os

import importlib as _importlib
import types as _types
import typing as _typing

from ._util import _last
from ._util._errors import GuardError, InputError, NanhuntError, NonFiniteError, Stop
from ._util._version import __version__

if _typing.TYPE_CHECKING:
    from .capture.capture import load_capture, save_capture
    from .comparison.engine import compare
    from .guard.guard import Guard, GuardEvent, GuardWarning, HeadroomWarning
    from .hunt.pipeline import replay
    from .step.precision import keep_fp32, keep_fp32_permanently
    from .records import FullStats, Occurrence, Phase, Record, Report, Role, Verdict
    from .tracing.tracer import Trace, trace

__all__ = [
    "trace",
    "replay",
    "compare",
    "save_capture",
    "load_capture",
    "Guard",
    "GuardEvent",
    "GuardError",
    "GuardWarning",
    "HeadroomWarning",
    "InputError",
    "Report",
    "Verdict",
    "keep_fp32",
    "keep_fp32_permanently",
    "Trace",
    "Occurrence",
    "Record",
    "Phase",
    "Role",
    "FullStats",
    "NanhuntError",
    "NonFiniteError",
    "__version__",
]

# ``nanhunt.last``: where the last ``trace(stop_at_first=True)`` stopped, with its op's tensors (set by the trace
# in _util/_last.py, read here by __getattr__; a debugger reads ``nanhunt.last.inputs[0]``, ``nanhunt.last.record``).
# Holds those tensors until the next stop. Not in __all__: read it as ``nanhunt.last`` (a name imported from here
# would keep an old stop).

_WHERE = {
    "trace": "tracing.tracer", "Trace": "tracing.tracer", "replay": "hunt.pipeline", "compare": "comparison.engine",
    "save_capture": "capture.capture", "load_capture": "capture.capture", "Guard": "guard.guard", "GuardEvent": "guard.guard",
    "GuardWarning": "guard.guard", "HeadroomWarning": "guard.guard",
    "keep_fp32": "step.precision", "keep_fp32_permanently": "step.precision",
    "Report": "records", "Verdict": "records", "Occurrence": "records", "Record": "records", "Phase": "records",
    "Role": "records", "FullStats": "records",
}


class _Package(_types.ModuleType):
    """Importing the submodule ``nanhunt.replay`` (or ``nanhunt.compare``) must not replace the function of
    that name: the import system sets the submodule as the package's attribute, eagerly imported names
    used to win by coming later. The submodule stays in ``sys.modules`` (``from nanhunt.hunt._twice import ...``)."""

    def __setattr__(self, name: str, value: _typing.Any) -> None:
        if name in _WHERE and isinstance(value, _types.ModuleType):
            return
        if name == "last":  # as before: ``nanhunt.last = None`` lets go of the stop's tensors
            _last.stop = value
            return
        super().__setattr__(name, value)


sys.modules[__name__].__class__ = _Package
del sys  # dir(nanhunt) and its globals: the public API, and private names only


def __getattr__(name: str) -> _typing.Any:
    if name == "last":
        return _last.stop  # read each time: a stop comes after the package was imported
    where = _WHERE.get(name)
    if where is None:
        raise AttributeError(f"module 'nanhunt' has no attribute {name!r}")
    value = getattr(_importlib.import_module(f".{where}", __name__), name)
    globals()[name] = value  # once: later lookups do not come here
    return value


def __dir__() -> list[str]:
    """The public API: ``__all__`` and ``last``; not the helpers nor the sub-packages imported meanwhile."""
    return sorted({*__all__, "last"})
