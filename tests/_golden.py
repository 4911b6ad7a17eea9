"""Golden-file helpers shared by the renderer tests (regenerate with NANHUNT_UPDATE_GOLDEN=1)."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from nanhunt.records import Report

GOLDEN = Path(__file__).parent / "golden"
UPDATE = os.environ.get("NANHUNT_UPDATE_GOLDEN") == "1"
WIDTH = 100  # fixed console width of every golden text


def check_golden(name: str, text: str) -> None:
    path = GOLDEN / name
    if UPDATE or not path.exists():
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text, encoding="utf-8")
        if not UPDATE:
            pytest.fail(f"golden file {name} was missing and has been written; check it and run again")
    assert text == path.read_text(encoding="utf-8"), f"{name} changed; NANHUNT_UPDATE_GOLDEN=1 rewrites it"


def render(fmt: str, report: Report, width: int = WIDTH) -> str:
    """``report`` in format ``fmt`` (md, html without the picture, console at ``width``, json)."""
    if fmt == "md":
        from nanhunt.report.markdown import render as md

        return md(report)
    if fmt == "html":
        from nanhunt.report.html import render as page

        return page(report, draw=False)  # the picture's pixels depend on fonts: tested apart
    if fmt == "console":
        from nanhunt.report.console import render_text

        return render_text(report, width=width)
    from nanhunt.report.jsonreport import render as js

    return js(report)


def markdown_to_html(md: str) -> str:
    """CommonMark (with tables) rendered to HTML, to check a Markdown report's structure."""
    from markdown_it import MarkdownIt  # rich's own dependency: a CommonMark parser

    return MarkdownIt("commonmark").enable("table").render(md)
