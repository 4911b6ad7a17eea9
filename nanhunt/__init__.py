"""nanhunt: find where a NaN or Inf is born in a PyTorch training step, and prove why."""

from __future__ import annotations

from ._errors import NanhuntError, NonFiniteError
from .records import FullStats, Occurrence, Phase, Record, Role
from .capture import save_capture
from .records import Report
from .replay import replay
from .tracer import Trace, trace

__all__ = [
    "trace",
    "replay",
    "save_capture",
    "Report",
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
