"""The headroom chart extends each rising trend to its forecast step and draws the loss, gradient norm and scale
under it; the history carries those tracks (a Guard's capture writes them, JSON round trip), and a history from
before them renders as it did."""

from __future__ import annotations

import dataclasses
import json
import math
import warnings
from collections import deque
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

import nanhunt
from nanhunt.capture._event import read_event
from nanhunt.guard._headroom import _tracks
from nanhunt.guard.guard import GuardWarning
from nanhunt.records import HeadroomHistory, HeadroomSeries, Report
from nanhunt.records._guard import HeadroomTrack
from nanhunt.report._headroom_svg import chart

from tests._support.golden import GOLDEN
from tests._support.guard import batch, guard_for, mlp_setup, train_step

FP16 = 65504.0


def _history(*series: HeadroomSeries, tracks: tuple[HeadroomTrack, ...] = ()) -> HeadroomHistory:
    return HeadroomHistory(100, series, (), tracks)


def test_a_history_from_before_the_tracks_reads_without_them_and_renders_as_before() -> None:
    # GIVEN a history as a capture of the earlier version wrote it: no "tracks" key, no forecast
    written = json.loads((GOLDEN / "headroom_history_v1.json").read_text())
    assert "tracks" not in written
    h = HeadroomHistory.from_dict(written)
    # THEN it has no tracks, and its chart is the one the earlier version drew, byte for byte
    assert h.tracks == ()
    assert chart(h) == (GOLDEN / "headroom_chart_v1.svg").read_text()


def test_a_forecast_within_reach_is_a_dashed_segment_to_the_limit_at_its_step() -> None:
    # GIVEN fc1's output rising 16x per 50 steps to step 100, forecast to meet float16's limit at step 150
    fc1 = HeadroomSeries("fc1", "output", FP16, (0, 50, 100), (4.0, 8.0, 12.0), growth=16.0, forecast_step=150)
    svg = chart(_history(fc1))
    # THEN the steps axis reaches step 150 (x 64 to 610), and a dashed segment goes from the last sample
    # (step 100, 2**12) to (step 150, 65504), a ring there; y: log2 from 3 to 17 (15.99998 + 1) over 208 px
    x = lambda s: 64 + s / 150 * 546  # noqa: E731
    y = lambda v: 224 - (v - 3.0) / (math.log2(FP16) + 1 - 3.0) * 208  # noqa: E731
    assert (f"{x(100):.1f}", f"{y(12.0):.1f}", f"{x(150):.1f}", f"{y(math.log2(FP16)):.1f}") == (
        "428.0", "90.3", "610.0", "30.9")
    assert ('<g class="forecast" stroke="#1f77b4"><title>fc1 output: its trend meets 65504 near step 150</title>'
            '<line x1="428.0" y1="90.3" x2="610.0" y2="30.9" stroke-width="1.5" stroke-dasharray="5 4"/>'
            '<circle cx="610.0" cy="30.9" r="3.5" fill="none"/></g>') in svg
    assert svg.count('<g class="forecast"') == 1 and '<text x="610.0" y="240" text-anchor="middle" fill="#666">150' \
        in svg  # the last tick: the forecast step


def test_a_forecast_beyond_reach_is_cut_at_the_axis_end_and_says_its_step() -> None:
    # GIVEN a series whose trend meets the limit only at step 10000, beside one forecast at step 150
    fc1 = HeadroomSeries("fc1", "output", FP16, (0, 50, 100), (4.0, 8.0, 12.0), growth=16.0, forecast_step=150)
    slow = HeadroomSeries("fc2", "output", FP16, (0, 50, 100), (1.0, 2.0, 3.0), growth=4.0, forecast_step=10_000)
    svg = chart(_history(fc1, slow))
    # THEN the axis reaches step 200, twice the samples' span (x 64 to 610; y: log2 from 0 to 17 over 208 px); the
    # far segment follows its line to there (log2 3 + 13 * 100 / 9900 = 3.131), with no ring, its title naming
    # step 10000; the near one ends at its forecast with its ring
    assert ('<g class="forecast" stroke="#ff7f0e"><title>fc2 output: its trend meets 65504 near step 10000</title>'
            '<line x1="337.0" y1="187.3" x2="610.0" y2="185.7" stroke-width="1.5" stroke-dasharray="5 4"/></g>') \
        in svg
    assert '<line x1="337.0" y1="77.2" x2="473.5" y2="28.2" stroke-width="1.5" stroke-dasharray="5 4"/><circle ' \
        in svg
    # AND a series without a forecast has no segment
    flat = HeadroomSeries("fc3", "output", FP16, (0, 50, 100), (1.0, 1.0, 1.0), growth=1.0)
    assert chart(_history(flat)).count('class="forecast"') == 0


def test_the_loss_gradient_norm_and_scale_are_drawn_under_the_chart() -> None:
    # GIVEN a history with its three tracks
    fc1 = HeadroomSeries("fc1", "output", FP16, (0, 50, 100), (4.0, 8.0, 12.0))
    tracks = (HeadroomTrack("loss", (0, 50, 100), (1.0, 0.5, 2.0)),
              HeadroomTrack("gradient norm", (0, 100), (3.0, 3.0)),
              HeadroomTrack("scale", (0, 50, 100), (65536.0, 32768.0, 16384.0)))
    h = _history(fc1, tracks=tracks)
    svg = chart(h)
    # THEN three panels of 56 px under the 260 px chart, each after a 10 px gap, the legend below them
    assert svg.startswith('<svg xmlns="http://www.w3.org/2000/svg" class="headroom" width="760" height="482" ')
    assert svg.count('<g class="track"') == 3
    # the loss over the same steps (x 64, 337, 610), its smallest and largest value at the left
    assert ('<g class="track" data-name="loss"><rect x="64" y="270" width="546" height="56" fill="none" '
            'stroke="#ccc"/><polyline points="64.0,306.0 337.0,322.0 610.0,274.0" fill="none" stroke="#444" '
            'stroke-width="1.2"/><text x="60" y="280" text-anchor="end" fill="#666">2</text>'
            '<text x="60" y="326" text-anchor="end" fill="#666">0.5</text>') in svg
    assert '<g class="track" data-name="gradient norm"><rect x="64" y="336" ' in svg
    # the scale on a log scale: its halvings evenly spaced
    assert ('<g class="track" data-name="scale"><rect x="64" y="402" width="546" height="56" fill="none" '
            'stroke="#ccc"/><polyline points="64.0,406.0 337.0,430.0 610.0,454.0" ') in svg
    assert '>scale (log)</text>' in svg
    # AND the legend row of fc1 moved under them
    assert '<line x1="64" y1="466" x2="88" y2="466" stroke="#1f77b4" stroke-width="2"/>' in svg
    # AND the history round-trips through JSON, in a report too
    assert HeadroomHistory.from_dict(json.loads(json.dumps(h.to_dict()))) == h
    report = dataclasses.replace(Report.from_dict({}), headroom=h)
    assert Report.from_json(report.to_json()).headroom == h


@pytest.mark.parametrize("bad", [{"steps": [0, 1], "values": [1.0]}, {"steps": [0], "values": ["nan"]},
                                 {"steps": [-1], "values": [1.0]}, {"steps": [], "values": []}])
def test_a_bad_track_in_a_file_is_refused(bad: dict[str, object]) -> None:
    with pytest.raises(ValueError, match="headroom (track 'loss'|history's step)"):
        HeadroomHistory.from_dict({"step": 5, "tracks": [{"name": "loss", **bad}]})


def test_a_long_track_is_thinned_to_120_runs_keeping_a_spike_and_a_backoff() -> None:
    # GIVEN 1024 steps of a flat loss with one spike at step 500, and a scale that backs off once at step 700
    own = deque((s, 9.0 if s == 500 else 1.0, math.nan, 512.0 if s == 700 else 1024.0) for s in range(1024))
    loss, scale = (HeadroomTrack.from_dict(t) for t in _tracks(own, since=0))
    # THEN each is 120 points, each the last step of its run of steps, the spike and the backoff kept
    assert (loss.name, scale.name) == ("loss", "scale")
    assert len(loss.steps) == len(scale.steps) == 120 and loss.steps[-1] == 1023
    assert max(loss.values) == 9.0 and sorted(loss.values)[-2] == 1.0
    assert min(scale.values) == 512.0 and sorted(scale.values)[1] == 1024.0
    # AND from a step on, the steps before it are left out
    nan = math.nan
    (loss_after,) = (HeadroomTrack.from_dict(t) for t in _tracks(deque((s, 1.0, nan, nan) for s in range(10)), 6))
    assert loss_after.steps == (6, 7, 8, 9)


@pytest.fixture
def _one_thread() -> Iterator[None]:
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)


@pytest.mark.usefixtures("_one_thread")
def test_a_guard_capture_holds_the_loss_and_scale_tracks(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(Path(__file__).resolve().parents[2])  # captures name fixtures.models:MLP
    # GIVEN a guarded float16 loop with a GradScaler sampling every step, whose step 69 overflows (one window read
    # at step 63)
    model, opt, scaler = mlp_setup()
    guard = guard_for(model, opt, scaler, tmp_path, headroom_every=1)
    with warnings.catch_warnings(), pytest.raises(nanhunt.GuardError):
        warnings.simplefilter("ignore", GuardWarning)
        for i in range(70):
            train_step(guard, model, opt, scaler, batch(i % 16, big_input=i == 69))
    event = guard.events[-1]
    assert (event.step, event.kind) == (69, "loss")
    # THEN its event file's history holds the loss and the scale of every step from the series' first sample (the
    # last 24: step 40) up to the failing step, not only to the last read (the gradient norm was not handed over)
    assert event.checkpoint is not None
    got = read_event(event.checkpoint[: -len("checkpoint.pt")] + "event.json")
    assert got is not None and got.headroom is not None
    loss, scale = got.headroom.tracks
    assert (loss.name, scale.name) == ("loss", "scale")
    assert {s.steps[0] for s in got.headroom.series} == {40}
    assert loss.steps == scale.steps == tuple(range(40, 69))
    assert scale.values[0] == 1024.0 and all(v > 0 for v in loss.values)
    assert '<g class="track" data-name="loss">' in chart(got.headroom)
