"""Renderers: ``render(report) -> str``, one module per format, picked from a file suffix.

Renderers only format a :class:`nanhunt.records.Report`; they never compute.
``write`` and ``write_bundle`` put the rendered text (and, beside an HTML page,
its picture as a PNG) on disk.
"""

from __future__ import annotations

import os
from collections.abc import Callable

from .._errors import CommandError
from ..records import Report

__all__ = ["renderer_for", "render_for_format", "write", "write_bundle", "FORMATS", "BUNDLE_FILES"]

FORMATS = {".json": "json", ".txt": "console", ".md": "md", ".markdown": "md", ".html": "html", ".htm": "html"}
BUNDLE_FILES = ("report.md", "report.json", "report.html", "report.png")


def render_for_format(fmt: str) -> Callable[[Report], str]:
    """The renderer of ``"json"``, ``"md"``, ``"html"`` or ``"console"`` (plain text at width 100)."""
    if fmt == "json":
        from .jsonreport import render

        return render
    if fmt in ("md", "markdown"):
        from .markdown import render as render_md

        return render_md
    if fmt == "html":
        from .html import render as render_html

        return render_html
    if fmt in ("console", "txt"):
        from .console import render_text

        return render_text
    raise CommandError(f"unknown report format {fmt!r}; use json, md, html or console")


def renderer_for(path: str) -> Callable[[Report], str]:
    suffix = os.path.splitext(path)[1].lower()
    fmt = FORMATS.get(suffix)
    if fmt is None:
        known = ", ".join(sorted(FORMATS))
        raise CommandError(f"cannot tell the report format from {path!r}; use a file ending in {known}")
    return render_for_format(fmt)


def _write_file(path: str, data: str | bytes) -> None:
    try:
        if isinstance(data, bytes):
            with open(path, "wb") as f:
                f.write(data)
        else:
            with open(path, "w", encoding="utf-8") as f:
                f.write(data)
    except OSError as e:
        raise CommandError(f"cannot write {path!r}: {e.strerror}") from e


def write(report: Report, path: str, fmt: str | None = None) -> list[str]:
    """Write ``report`` to ``path`` in ``fmt`` (default: the format its suffix names); beside an HTML
    page, also its picture (``page.png`` next to ``page.html``), to attach to a ticket. Returns the
    paths written."""
    render = renderer_for(path) if fmt is None else render_for_format(fmt)
    if (fmt or FORMATS.get(os.path.splitext(path)[1].lower())) != "html":
        _write_file(path, render(report))
        return [path]
    from .html import render as render_html
    from .picture import png

    picture = png(report)
    _write_file(path, render_html(report, png=picture, draw=False))
    if picture is None:
        return [path]
    beside = os.path.splitext(path)[0] + ".png"
    _write_file(beside, picture)
    return [path, beside]


def write_bundle(report: Report, directory: str) -> list[str]:
    """``report.md``, ``report.json``, ``report.html`` and ``report.png`` in ``directory`` (made if needed).
    The repro files, when there are any, were written there before (:func:`nanhunt.repro.make_repro`)."""
    try:
        os.makedirs(directory, exist_ok=True)
    except OSError as e:
        raise CommandError(f"cannot create {directory!r}: {e.strerror}") from e
    written: list[str] = []
    for name in ("report.md", "report.json", "report.html"):
        written += write(report, os.path.join(directory, name))
    return written
