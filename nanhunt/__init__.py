"""nanhunt: find where a NaN or Inf is born in a PyTorch training step, and prove why."""

from __future__ import annotations

from ._errors import GuardError, NanhuntError, NonFiniteError
from .records import FullStats, Occurrence, Phase, Record, Role
from .capture import save_capture
from .precision import keep_fp32, keep_fp32_permanently
from .records import Report, Verdict
from .replay import replay
from .compare import compare
from .guard import Guard, GuardEvent
from .tracer import Trace, trace

__all__ = [
    "trace",
    "replay",
    "compare",
    "save_capture",
    "Guard",
    "GuardEvent",
    "GuardError",
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
]

__version__ = "0.1.0"
