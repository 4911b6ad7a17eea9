"""Golden-file helpers shared by the renderer tests (regenerate with NANHUNT_UPDATE_GOLDEN=1).

A golden holds only what every machine computes the same. Most goldens render hand-built records; a golden made
from a real run (``compare.nonfinite.*``) needs inputs whose float32 results are exact (powers of two, one-hot
rows: no kernel, fused multiply-add or summation order, rounds them), and any number it shows that cannot be exact
(a loss: log and exp) must sit far from the rounding boundary of its printed digits: :func:`prints_alike`.
"""

from __future__ import annotations

import dataclasses
import os
from pathlib import Path

import pytest

from nanhunt.records import Report

GOLDEN = Path(__file__).resolve().parents[1] / "golden"
UPDATE = os.environ.get("NANHUNT_UPDATE_GOLDEN") == "1"
WIDTH = 100  # fixed console width of every golden text
# The environment section of a golden made from a real run: the machine's own (kernel, CPU, versions) would
# make the golden pass only where it was written.
ENVIRONMENT = {"nanhunt": "0.1.0", "torch": "2.13.0+cpu", "python": "3.11.7", "os": "Linux-6.1-x86_64",
               "device": "Intel(R) Xeon(R) Processor"}


def fixed_environment(report: Report) -> Report:
    """``report`` with :data:`ENVIRONMENT` in place of the machine's."""
    return dataclasses.replace(report, environment=dict(ENVIRONMENT))


# Relative slack a printed float32 result must keep from its rounding boundary: kernels differ by a few ulp
# (float32's is 1.2e-07 relative), and a sum over many terms by more; 1e-5 leaves a wide margin over both.
KERNEL_SLACK = 1e-5


def prints_alike(x: float, digits: int = 4, slack: float = KERNEL_SLACK) -> bool:
    """Whether ``x`` printed with ``digits`` significant digits (the renderers' ``.4g``) reads the same when a kernel
    moves it by up to ``slack`` relative: what a golden may show of a result that is not exact."""
    return len({f"{x * (1 + d):.{digits}g}" for d in (-slack, 0.0, slack)}) == 1


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
