"""JSON: everything, machine-readable, strict JSON (NaN/Inf as strings)."""

from __future__ import annotations

from ..records import Report

__all__ = ["render"]


def render(report: Report) -> str:
    return report.to_json() + "\n"
