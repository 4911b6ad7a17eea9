"""The picture of a Guard capture: the headroom history of the modules nearest their dtype's limit and the
warnings, written into the capture's event file, carried into the replay's report, shown by every renderer and
by ``nanhunt report``; a report without it renders as before."""

from __future__ import annotations

import dataclasses
import json
import warnings
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

import nanhunt
from nanhunt.capture._event import read_event
from nanhunt.cli import main as cli_main
from nanhunt.guard._headroom import PICTURED
from nanhunt.guard.guard import HeadroomWarning
from nanhunt.records import GuardEvent, HeadroomHistory, HeadroomNote, HeadroomSeries, Report
from nanhunt.report.console import render_text
from nanhunt.report.html import render as render_html
from nanhunt.report.markdown import render as render_md

from tests._support.golden import GOLDEN
from tests._support.guard import batch, guard_for, mlp_setup, train_step

ROOT = Path(__file__).resolve().parents[2]
GROWTH = 1.03  # fc1's weight grows 3% a step: its float16 output is warned about at step 188


@pytest.fixture(autouse=True)
def _repo_root(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(ROOT)  # captures name fixtures.models:MLP


def _event_file(event: GuardEvent) -> Path:
    assert event.checkpoint is not None
    return Path(event.checkpoint[: -len("checkpoint.pt")] + "event.json")


def _warned_capture(dump: Path) -> GuardEvent:
    """A float16 loop (no GradScaler, the loss not handed to the Guard: no spike or scale warning comes first)
    whose fc1 weight the loop scales up each step, sampled every 4 steps, run to its first warning, which
    on_warn="capture" captures."""
    model, opt, _ = mlp_setup(lr=0.0, scaler=False)
    guard = guard_for(model, opt, None, dump, on_warn="capture", headroom_every=4)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", HeadroomWarning)
        for i in range(300):
            train_step(guard, model, opt, None, batch(i % 16), hand_loss=False)
            with torch.no_grad():
                model.fc1.weight.mul_(GROWTH)
            if guard.events:
                break
    return guard.events[0]


def test_a_warning_capture_holds_the_history_and_its_replay_shows_it(tmp_path: Path,
                                                                     capsys: pytest.CaptureFixture[str]) -> None:
    # GIVEN a run whose fc1 output grows until the Guard warns, with on_warn="capture"
    event = _warned_capture(tmp_path / "caps")
    assert (event.kind, event.condition, event.module) == ("warning", "output", "fc1")
    assert event.checkpoint is not None and event.batch is not None and event.forecast_step is not None
    # THEN the capture's event file holds the history: fc1's output first, its samples up to the warned step
    written = json.loads(_event_file(event).read_text())
    picture = HeadroomHistory.from_dict(written["headroom"])
    assert picture.step == event.step and len(picture.series) == PICTURED
    fc1 = picture.series[0]
    assert (fc1.module, fc1.condition, fc1.limit) == ("fc1", "output", 65504.0)
    assert fc1.steps[-1] == event.step and len(fc1.steps) == 24 and all(s % 4 == 0 for s in fc1.steps)
    assert fc1.forecast_step == event.forecast_step and fc1.growth is not None and fc1.growth > 10
    assert 2.0 ** fc1.log2max[-1] == pytest.approx(event.measured, rel=1e-3)
    assert [(w.step, w.condition, w.module, w.detail) for w in picture.warnings][0] == (
        event.step, "output", "fc1", event.detail)
    # WHEN the capture is replayed by the command line
    out = tmp_path / "report.json"
    assert cli_main(["replay", event.checkpoint, event.batch, "--no-bisect", "--report", str(out)]) == 0
    report = Report.from_json(out.read_text())
    # THEN its report carries the history as the Guard wrote it, and round-trips it
    assert report.headroom == picture
    assert Report.from_json(report.to_json()).headroom == picture
    # AND the Markdown table names the module with its headroom, growth and forecast
    md = render_md(report)
    assert "#### Headroom before the Guard's event" in md
    assert "| module | condition | last max | headroom | growth per 100 steps | overflow forecast |" in md
    last = 2.0 ** fc1.log2max[-1]
    assert (f"| `fc1` | output | {last:.3g} | {65504 / last:.3g}x to float16 | {fc1.growth:.3g}x | "
            f"step {fc1.forecast_step} |") in md
    # AND the page draws the history as inline SVG: the float16 limit line, a triangle at the warned step
    page = render_html(report, draw=False)
    svg = page[page.index("<svg"): page.index("</svg>")]
    assert '<g class="limit-float16">' in svg and "float16 max 65504</text>" in svg
    assert "limit-bfloat16" not in svg  # 2**128 is far out of this range
    assert svg.count('<g class="series"') == PICTURED and "<polyline" in svg
    assert svg.count('<g class="warning"') == len(picture.warnings) and f"<title>step {event.step}: fc1 output" in svg
    assert "http" not in svg.replace('xmlns="http://www.w3.org/2000/svg"', "") and "<script" not in page
    # AND the console text has the table too
    console = render_text(report, width=120)
    assert "headroom before the guard's event" in console and "fc1" in console
    # AND `nanhunt report` shows it from the saved JSON
    capsys.readouterr()
    assert cli_main(["report", str(out), "--format", "md"]) == 0
    assert f"| `fc1` | output | {last:.3g} |" in capsys.readouterr().out


def test_a_failure_capture_holds_the_history_read_back_and_reads_nothing_more(tmp_path: Path) -> None:
    # GIVEN a guarded float16 loop sampling every step, read back every 4 samples, whose step 5 overflows
    model, opt, scaler = mlp_setup()
    guard = guard_for(model, opt, scaler, tmp_path, headroom_every=16)
    guard._watch.every = 1  # one sample a step, four a read: steps 0-3 read back at step 3, step 4 still on the device
    with pytest.raises(nanhunt.GuardError):
        for i in range(6):
            train_step(guard, model, opt, scaler, batch(i, big_input=i == 5))
    event = guard.events[-1]
    assert (event.step, event.kind) == (5, "loss")
    # THEN its event file holds the samples of steps 0-3, as the host held them, and no warning
    picture = HeadroomHistory.from_dict(json.loads(_event_file(event).read_text())["headroom"])
    assert picture.step == 5 and picture.warnings == ()
    assert {s.steps for s in picture.series} == {(0, 1, 2, 3)}
    assert [s.module for s in picture.series if s.condition == "output"][:2] == ["fc1", "act"]


def test_a_bad_history_in_an_event_file_is_dropped_with_a_note_and_the_event_kept(tmp_path: Path) -> None:
    # GIVEN an event file whose series has more steps than values
    event = GuardEvent(step=5, kind="loss", detail="non-finite loss")
    series = {"module": "fc1", "condition": "output", "limit": 65504.0, "steps": [0, 4], "log2max": [3.0]}
    path = tmp_path / "step000005-event.json"
    path.write_text(json.dumps({**event.to_dict(), "headroom": {"step": 5, "series": [series]}}))
    # WHEN it is read beside a capture
    got = read_event(str(path))
    assert got is not None
    read, headroom, note = got.event, got.headroom, got.note
    # THEN the event stands, the history is dropped, and a note says why
    assert read == event and headroom is None
    assert note == (f"the headroom history in the Guard event {str(path)!r} was ignored: headroom series of "
                    f"'fc1': 2 steps, 1 values")
    # AND a saved report holding it is refused by `nanhunt report` in one line (exit 2)
    report = json.loads((GOLDEN / "report_context.json").read_text())
    report["headroom"] = {"step": 5, "series": [{**series, "log2max": [3.0, "nan"]}]}
    bad = tmp_path / "bad.json"
    bad.write_text(json.dumps(report))
    assert cli_main(["report", str(bad)]) == 2


@pytest.mark.parametrize("name", ["report_context.json", "report_v1.json"])
def test_a_report_without_the_history_loads_and_renders_as_before(name: str) -> None:
    # GIVEN a saved report from before the history (one with a Guard event, one of schema 1)
    report = Report.from_json((GOLDEN / name).read_text())
    # THEN it has none, writes no key for it, and no renderer shows the section
    assert report.headroom is None and "headroom" not in report.to_dict()
    assert "Headroom before" not in render_md(report) and "<svg" not in render_html(report, draw=False)
    assert "headroom before" not in render_text(report)


def test_module_names_from_a_file_are_escaped_in_every_format() -> None:
    # GIVEN a report whose history names a hostile module (a saved report comes from anywhere)
    name = "</svg><script>alert(1)</script>|@everyone"
    series = HeadroomSeries(name, "output", 65504.0, (0, 16), (3.0, 14.5), growth=2.0, forecast_step=40)
    note = HeadroomNote(16, "output", name, f"{name} output: max 2.32e+04")
    report = dataclasses.replace(Report.from_dict({}), headroom=HeadroomHistory(16, (series,), (note,)))
    # THEN the page holds it only as text, in the chart and in the table
    page = render_html(report, draw=False)
    # the legend, the two samples', the forecast's and the warning's tooltips, the table, the warnings' list
    assert "<script>" not in page and page.count("&lt;/svg&gt;&lt;script&gt;") == 7
    # AND Markdown keeps it in one table cell, pinging nobody
    md = render_md(report)
    assert "| `</svg><script>alert(1)</script>\\|@everyone` | output | 2.32e+04 | 2.83x to float16 | 2x | step 40 |" in md
    assert "@everyone" not in md.replace("`</svg><script>alert(1)</script>\\|@everyone`", "")
