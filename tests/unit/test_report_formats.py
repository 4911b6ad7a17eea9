"""Reports with missing fields or no origins render in every format and round-trip."""

from __future__ import annotations

import dataclasses
import json
import math
from typing import Any

from nanhunt.records import Report

from tests._support.golden import render
from tests.unit.test_report import sample_report


def _strict(text: str) -> Any:
    def bad(c: str) -> Any:
        raise ValueError(f"non-standard JSON constant {c}")
    return json.loads(text, parse_constant=bad)


# ------------------------------------------------------------------ report layer


def test_finding_without_module_source_or_op_renders_and_round_trips() -> None:
    # GIVEN a finding outside the model (module None), with no source line and no op (an input entering non-finite)
    r = sample_report()
    assert r.first is not None
    occ = dataclasses.replace(r.first, module=None, module_class=None, source=None, op=None)
    r = dataclasses.replace(r, first=occ, origins=(occ,), runs=(occ, occ), loss=math.inf)
    # THEN every renderer copes and the JSON is strict and reads back to the same file
    for fmt in ("md", "html", "console"):
        assert render(fmt, r)
    text = r.to_json()
    assert _strict(text)["loss"] == "inf"
    assert Report.from_json(text).to_json() == text


def test_clean_report_with_zero_origins_in_every_format() -> None:
    r = Report(status="clean", first=None, loss=0.5, n_records=7)
    for fmt in ("md", "html", "console"):
        out = render(fmt, r)
        assert "None" not in out  # no Python repr of a missing finding leaks into the page
    text = r.to_json()
    assert _strict(text)["first"] is None and _strict(text)["origins"] == []
    assert Report.from_json(text).to_json() == text
