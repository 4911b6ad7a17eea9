"""Renderers: ``render(report) -> str``, one module per format, picked from a file suffix.

Renderers only format a :class:`nanhunt.records.Report`; they never compute.
"""

from __future__ import annotations

import os
from collections.abc import Callable

from .._errors import CommandError
from ..records import Report

__all__ = ["renderer_for", "FORMATS"]

FORMATS = {".json": "json", ".txt": "console"}


def renderer_for(path: str) -> Callable[[Report], str]:
    suffix = os.path.splitext(path)[1].lower()
    fmt = FORMATS.get(suffix)
    if fmt == "json":
        from .jsonreport import render

        return render
    if fmt == "console":
        from .console import render_text

        return render_text
    known = ", ".join(sorted(FORMATS))
    raise CommandError(f"cannot tell the report format from {path!r}; use a file ending in {known}")
