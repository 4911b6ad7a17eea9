"""Plain result data: phases, per-tensor records, occurrences, reports, comparisons, guard events.

Nothing here imports torch or another nanhunt module (but the private ``_serial``, which writes and reads
them as JSON), so reports can be read, written and rendered without a model in sight.
"""

from __future__ import annotations

from . import _serial
from ._trace import DTYPE_MAX, FP16_SMALLEST_NORMAL, FullStats, Occurrence, PHASE_ORDER, Phase, RangeStats, Record, RecordView, Role, Level, role_text
from ._report import Advice, BackwardUnderflow, GraphNode, Inspection, LastUpdate, OptimizerSettings, Report, ReportConfig, Repro, Rung, SCHEMA_VERSION, Status, TensorSummary, Verdict, VerdictKind
from ._comparison import CLAUSES, Comparison, Decision, Failure, Quality, Regression, Rule, Speed, TensorDiff
from ._guard import GuardEvent, HeadroomHistory, HeadroomNote, HeadroomSeries
from ._trace import CastStats

__all__ = ["SCHEMA_VERSION", "Phase", "Role", "Level", "Status", "VerdictKind", "role_text", "FullStats", "Record", "Occurrence", "Advice", "Report", "ReportConfig", "BackwardUnderflow", "LastUpdate", "OptimizerSettings", "TensorSummary", "Inspection", "Verdict", "Rung", "GraphNode", "Repro", "PHASE_ORDER",
           "TensorDiff", "Decision", "Regression", "Comparison", "RangeStats", "RecordView", "GuardEvent", "HeadroomHistory",
           "HeadroomNote", "HeadroomSeries", "Rule",
           "Quality", "Failure", "Speed", "CLAUSES", "DTYPE_MAX", "FP16_SMALLEST_NORMAL", "CastStats"]
