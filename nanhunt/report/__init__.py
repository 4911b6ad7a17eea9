"""Renderers: ``render(report) -> str``, one module per format, picked from a file suffix.

Renderers only format a :class:`nanhunt.records.Report`; they never compute.
``write`` and ``write_bundle`` put the rendered text (and, beside an HTML page,
its picture as a PNG) on disk.
"""

from __future__ import annotations

import os
from collections.abc import Callable

from .._util._bundle import BUNDLE_FILES, claim
from .._util._errors import InputError
from .._util._files import write_file
from ..records import Report

__all__ = ["renderer_for", "render_for_format", "write", "write_bundle", "targets", "FORMATS", "BUNDLE_FILES"]

FORMATS = {".json": "json", ".txt": "console", ".md": "md", ".markdown": "md", ".html": "html", ".htm": "html"}


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
    raise InputError(f"unknown report format {fmt!r}; use json, md, html or console")


def renderer_for(path: str) -> Callable[[Report], str]:
    suffix = os.path.splitext(path)[1].lower()
    fmt = FORMATS.get(suffix)
    if fmt is None:
        known = ", ".join(sorted(FORMATS))
        raise InputError(f"cannot tell the report format from {path!r}; use a file ending in {known}")
    return render_for_format(fmt)


def targets(path: str, fmt: str | None = None) -> list[str]:
    """The files :func:`write` may write for ``path``: beside an HTML page, also its picture."""
    if (fmt or FORMATS.get(os.path.splitext(path)[1].lower())) != "html":
        return [path]
    return [path, os.path.splitext(path)[0] + ".png"]


def write(report: Report, path: str, fmt: str | None = None) -> list[str]:
    """Write ``report`` to ``path`` in ``fmt`` (default: the format its suffix names); beside an HTML
    page, also its picture (``page.png`` next to ``page.html``), to attach to a ticket. Returns the
    paths written. Its directory is made if missing. Each file is written new and renamed onto its
    name: a symbolic link at a name is refused, never written through."""
    render = renderer_for(path) if fmt is None else render_for_format(fmt)
    paths = targets(path, fmt)
    directory = os.path.dirname(os.path.abspath(path))
    try:
        os.makedirs(directory, exist_ok=True)
    except OSError as e:
        raise InputError(f"cannot create {directory!r}: {e.strerror}") from e
    if len(paths) == 1:
        write_file(path, render(report))
        return paths
    from .html import render as render_html
    from .picture import png

    picture = png(report)
    write_file(path, render_html(report, png=picture, draw=False))
    if picture is None:
        return [path]
    write_file(paths[1], picture)
    return paths


def write_bundle(report: Report, directory: str) -> list[str]:
    """``report.md``, ``report.json``, ``report.html`` and ``report.png`` in ``directory`` (made if needed), and
    the marker that makes it a bundle nanhunt may replace; refused in one line when it holds files nanhunt did
    not write. The repro files, when there are any, were written there before (:func:`nanhunt.hunt.repro.make_repro`).
    Each file is replaced on its own: the command line writes into a new directory and swaps it in whole
    (:class:`nanhunt._util._bundle.Staging`)."""
    claim(directory)
    written: list[str] = []
    for name in ("report.md", "report.json", "report.html"):
        written += write(report, os.path.join(directory, name))
    return written
