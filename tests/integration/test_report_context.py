"""Reports for a ticket: the Guard's event (failing step, kind, detail, rank) read from the ``-event.json`` beside
a capture, judged as untrusted input; the text of the culprit's source line; both in every format, old JSON still
loading. The end-to-end case runs a guarded AMP loop and ``nanhunt replay`` on what it wrote."""

from __future__ import annotations

import dataclasses
import json
import os
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

import nanhunt
from nanhunt.capture.capture import LoadOptions, load_replay
from nanhunt.cli import main as cli_main
from nanhunt.hunt.pipeline import hunt
from nanhunt.records import Advice, GuardEvent, Report
from nanhunt.report.console import render_text
from nanhunt.report.html import render as render_html
from nanhunt.report.markdown import render as render_md

from tests._support.guard import batch, guard_for, mlp_setup, train_step
from tests._support.golden import GOLDEN, check_golden, render

ROOT = Path(__file__).resolve().parents[2]
MLP_LINE = "return self.fc2(self.act(self.fc1(x)))"  # fixtures/models.py, MLP.forward: where fc1's addmm runs


@pytest.fixture(autouse=True)
def _in_root(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(ROOT)  # captures name fixtures.models:MLP


def _flat(text: str) -> str:
    return " ".join(text.split())


# ------------------------------------------------------------------ end to end: Guard -> capture -> replay


def test_guard_capture_replay_report_carries_the_event_and_the_source_line(tmp_path: Path) -> None:
    # GIVEN a guarded float16 AMP loop whose step 2 gets an input that overflows fc1's float16 matmul
    model, opt, scaler = mlp_setup()
    guard = guard_for(model, opt, scaler, tmp_path / "caps")
    with pytest.raises(nanhunt.GuardError):
        for i in range(3):
            train_step(guard, model, opt, scaler, batch(i, big_input=i == 2))
    ev = guard.events[-1]
    assert ev.step == 2 and ev.checkpoint is not None and ev.batch is not None
    assert os.path.isfile(ev.checkpoint[: -len("checkpoint.pt")] + "event.json")
    # WHEN its capture is replayed by the command line
    out = tmp_path / "report.json"
    assert cli_main(["replay", ev.checkpoint, ev.batch, "--no-bisect", "--report", str(out)]) == 1
    report = Report.from_json(out.read_text())
    # THEN the report holds the Guard's event as the Guard wrote it
    g = report.guard_event
    assert g is not None
    assert (g.step, g.kind, g.detail, g.rank, g.captured_step, g.pre_update) == (
        2, ev.kind, ev.detail, None, 2, ev.pre_update)
    # AND the culprit's source line as text, beside file:line
    first = report.first
    assert first is not None and (first.module, first.op) == ("fc1", "aten::addmm")
    assert first.source is not None and first.source.endswith("fixtures/models.py:84 in forward")
    assert first.source_text == MLP_LINE
    # AND the advice for a float16 matmul overflow
    assert [a.pattern for a in report.advice] == ["fp16-matmul-overflow"]
    # AND every format shows them
    md = render_md(report)
    assert f"- **failing step:** 2\n- **kind:** {ev.kind}\n" in md
    assert f"- **line:** `{MLP_LINE}`" in md and "#### Suggested fixes" in md
    console = _flat(render_text(report, width=200))
    assert f"the Guard stopped at step 2 ({ev.kind}): {ev.detail}" in console
    assert f"line {MLP_LINE}" in console and "because: aten::addmm made Inf in phase forward (float16, module fc1)" in console
    page = render_html(report, draw=False)
    assert "<h2>Guard event</h2>" in page and "<th>failing step</th><td>2</td>" in page
    assert "<th>line</th><td><code>return self.fc2(self.act(self.fc1(x)))</code></td>" in page
    assert "<h2>Suggested fixes</h2>" in page
    assert json.loads(out.read_text())["guard_event"]["step"] == 2


# ------------------------------------------------------------------ the event file is untrusted


@pytest.fixture(scope="module")
def capture(tmp_path_factory: pytest.TempPathFactory) -> tuple[str, str]:
    """A capture named as a Guard names it (``step000007-...``), its fc1 overflowing float16."""
    from fixtures.models import MLP

    d = tmp_path_factory.mktemp("capture")
    torch.manual_seed(0)
    m = MLP()
    files = (str(d / "step000007-checkpoint.pt"), str(d / "step000007-batch.pt"))
    nanhunt.save_capture(*files, model=m, batch=(torch.full((4, 16), 6e4), torch.randn(4, 4)), loss_fn=F.mse_loss,
                         scaler=torch.amp.GradScaler("cpu"), model_factory="fixtures.models:MLP")
    return files


def _replay(files: tuple[str, str]) -> Report:
    loaded = load_replay(*files, LoadOptions())
    return hunt(loaded.step, event=loaded.event)


def _event_path(files: tuple[str, str]) -> Path:
    return Path(files[0][: -len("checkpoint.pt")] + "event.json")


def _clear(path: Path) -> None:
    if path.is_dir():
        path.rmdir()
    elif path.exists():
        path.unlink()


def test_no_event_file_no_event(capture: tuple[str, str]) -> None:
    # GIVEN a capture with no event beside it WHEN replayed THEN no event and no note about one
    _clear(_event_path(capture))
    report = _replay(capture)
    assert report.guard_event is None
    assert not any("Guard event" in n for n in report.notes)


@pytest.mark.parametrize("content,why", [
    (b'{"step": "3", "kind": "loss", "detail": "x"}', "its 'step' is not a non-negative integer"),
    (b'{"step": -1, "kind": "loss", "detail": "x"}', "its 'step' is not a non-negative integer"),
    (b'{"step": true, "kind": "loss", "detail": "x"}', "its 'step' is not a non-negative integer"),
    (b'{"step": 3, "kind": ["loss"], "detail": "x"}', "its 'kind' is not a string"),
    (b'{"step": 3, "kind": "loss", "detail": "x", "rank": 1.5}', "its 'rank' is not a non-negative integer"),
    (b'{"step": 3, "kind": "loss", "detail": "x", "ranks": [0, "1"]}', "its 'ranks' is not a list of ranks"),
    (b'{"step": 3, "kind": "loss", "detail": "x", "scale": "big"}', "its 'scale' is not a number"),
    (b'{"kind": "loss", "detail": "x"}', "it has no 'step'"),
    (b"[1, 2]", "it holds a JSON list, not an object"),
    (b"not json", "Expecting value: line 1 column 1 (char 0)"),
    (b"\xff\xfe{}", "'utf-8' codec can't decode byte 0xff in position 0: invalid start byte"),
    (b"[" * 100_000, "100000 bytes, more than a Guard writes (65536)"),
    (b"[" * 60_000 + b"]" * 60_000, "120000 bytes, more than a Guard writes (65536)"),
    (b"[" * 30_000 + b"]" * 30_000, "maximum recursion depth exceeded while decoding a JSON array from a unicode string"),
])
def test_a_bad_event_file_is_ignored_with_a_note(capture: tuple[str, str], content: bytes, why: str) -> None:
    # GIVEN a capture whose event file is damaged or hostile
    path = _event_path(capture)
    _clear(path)
    path.write_bytes(content)
    # WHEN replayed
    report = _replay(capture)
    # THEN the replay goes on without an event, and a note says which file was ignored and why
    assert report.guard_event is None
    assert report.notes[-1] == f"the Guard event {str(path)!r} beside the checkpoint was ignored: {why}"
    assert report.first is not None and report.first.op == "aten::addmm"


def test_an_event_that_is_not_a_file_is_not_read(capture: tuple[str, str]) -> None:
    # GIVEN a directory where the event file would be (a FIFO would block a reader: only regular files are read)
    path = _event_path(capture)
    _clear(path)
    path.mkdir()
    try:
        # WHEN replayed THEN a note, no event
        report = _replay(capture)
        assert report.guard_event is None
        assert report.notes[-1] == f"the Guard event {str(path)!r} beside the checkpoint was ignored: it is not a " \
                                   "regular file"
    finally:
        path.rmdir()


def test_event_text_is_escaped_and_bounded_in_every_format(capture: tuple[str, str]) -> None:
    # GIVEN an event whose detail tries to colour the terminal and forge a second error line, and is long
    path = _event_path(capture)
    _clear(path)
    hostile = "\x1b[31mred\nnanhunt: error: forged | `x` <script>alert(1)</script> **b**"
    path.write_text(json.dumps({"step": 7, "kind": "grads", "detail": hostile + "y" * 1000, "rank": 1,
                                "ranks": [1], "scale": "inf", "unknown": {"nested": [1]}}))
    # WHEN replayed
    report = _replay(capture)
    g = report.guard_event
    # THEN the fields are kept as data, the detail cut at 500 characters, an Inf scale read back
    assert g is not None and (g.step, g.kind, g.rank, g.ranks) == (7, "grads", 1, (1,))
    assert g.detail == (hostile + "y" * 1000)[:500] + "..." and g.scale == float("inf")
    # AND no format lets the text act: control characters escaped, Markdown and HTML escaped
    console = render_text(report, width=300)
    assert "\x1b" not in console and "\\x1b[31mred\\nnanhunt: error: forged" in console
    assert not any(line.startswith("nanhunt: error") for line in console.splitlines())
    md = render_md(report)
    assert "\x1b" not in md and "\\<script\\>" in md and "\\*\\*b\\*\\*" in md and "\\|" in md
    page = render_html(report, draw=False)
    assert "<script>" not in page and "&lt;script&gt;" in page and "\x1b" not in page
    assert "<th>rank</th><td>1 (seen first by rank(s) 1)</td>" in page


# ------------------------------------------------------------------ the source line


def test_source_line_missing_file_gives_none_and_hostile_text_is_escaped(tmp_path: Path) -> None:
    import importlib.util

    # GIVEN a model whose culprit line holds an escape character, defined in a file that is then deleted
    src = tmp_path / "hostile_model.py"
    src.write_text("import torch\nfrom torch import nn\n\n\nclass M(nn.Module):\n"
                   "    def forward(self, x):\n"
                   "        return torch.exp(x * 100.0)  # \x1b[2J clears the screen\n")
    spec = importlib.util.spec_from_file_location("hostile_model", src)
    assert spec is not None and spec.loader is not None
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    from nanhunt.step.step import Step

    def run() -> Report:
        return hunt(Step.of(mod.M(), (torch.ones(2, 2), torch.zeros(2, 2)), loss_fn=F.mse_loss, dtype=torch.float32))

    # WHEN replayed with the file present
    report = run()
    first = report.first
    # THEN the line's text is stored as it is and shown escaped
    assert first is not None and first.op == "aten::exp" and first.source == f"{src}:7 in forward"
    assert first.source_text == "return torch.exp(x * 100.0)  # \x1b[2J clears the screen"
    assert "line        return torch.exp(x * 100.0)  # \\x1b[2J clears the screen" in render_text(report, width=200)
    assert "\x1b" not in render_md(report) and "\x1b" not in render_html(report, draw=False)
    # AND with the file gone, file:line only
    src.unlink()
    again = run().first
    assert again is not None and again.source == f"{src}:7 in forward" and again.source_text is None


# ------------------------------------------------------------------ old files, goldens


def test_report_v1_still_loads_without_the_new_fields() -> None:
    # GIVEN a schema-1 report WHEN loaded THEN no advice, no event, no source text
    old = Report.from_json((GOLDEN / "report_v1.json").read_text())
    assert old.advice == () and old.guard_event is None
    assert old.first is not None and old.first.source_text is None and old.first.forward_ops == ()
    # AND written again it has no advice or guard_event keys (they appear only when present)
    d = old.to_dict()
    assert "advice" not in d and "guard_event" not in d


def _context_report() -> Report:
    from tests.unit.test_report import sample_report

    r = sample_report()
    assert r.first is not None
    first = dataclasses.replace(r.first, source_text="return self.wo(F.relu(self.wi(x)))")
    advice = Advice(
        pattern="fp16-matmul-overflow",
        advice="Run the step in bfloat16, keep this module in float32 (nanhunt.keep_fp32), or initialise its "
               "weights smaller (std 1/sqrt(fan_in)).",
        fix='with torch.autocast("cpu", dtype=torch.bfloat16):\n    loss = loss_fn(model(x), y)',
        because="aten::addmm made Inf in phase forward (float16, module blocks.1.ff.wo): its inputs' max |x| 0.1247, "
                "1.713, 2.498e+04, float16's max 65504; the whole step in bfloat16: finite")
    event = GuardEvent(step=1200, kind="grads", detail="non-finite gradients (2 tensors)", rank=1, ranks=(1,),
                       captured_step=1200, pre_update=True, iterations=1201, updates=1187, skipped=14, scale=512.0)
    return dataclasses.replace(r, first=first, origins=(first, *r.origins[1:]), advice=(advice,), guard_event=event)


@pytest.mark.parametrize("fmt,name", [("md", "report_context.md"), ("console", "report_context.txt"),
                                      ("html", "report_context.html"), ("json", "report_context.json")])
def test_golden_report_with_event_source_line_and_advice(fmt: str, name: str) -> None:
    # GIVEN the fixed report with a Guard event, the source line's text and one advice
    # WHEN rendered THEN byte for byte the golden file
    report = _context_report()
    check_golden(name, render(fmt, report))
    # AND its JSON round trips (NaN fields compare unequal: compare the JSON, and the new fields as objects)
    back = Report.from_json(report.to_json())
    assert back.to_json() == report.to_json()
    assert (back.advice, back.guard_event, back.first) == (report.advice, report.guard_event, report.first)


def test_a_rank_capture_that_replays_finite_says_whose_to_replay(tmp_path: Path, capsys: pytest.CaptureFixture[str],
                                                                  monkeypatch: pytest.MonkeyPatch) -> None:
    from fixtures.models import MLP

    from nanhunt.cli import main

    monkeypatch.chdir(ROOT)
    # GIVEN rank 0's capture files of a step whose failure every rank saw (rank 1's backward overflowed and the
    # gradient collective carried it), rank 0's batch finite
    torch.manual_seed(0)
    files = (str(tmp_path / "step000004-rank0-checkpoint.pt"), str(tmp_path / "step000004-rank0-batch.pt"))
    nanhunt.save_capture(*files, model=MLP(), batch=(torch.randn(4, 16), torch.randn(4, 4)), loss_fn=F.mse_loss,
                         model_factory="fixtures.models:MLP")
    event = {"step": 4, "kind": "grads", "detail": "non-finite gradients", "rank": 0, "ranks": [0, 1]}
    (tmp_path / "step000004-rank0-event.json").write_text(json.dumps(event))
    # WHEN it is replayed
    report = tmp_path / "r.json"
    assert main(["replay", *files, "--model", "fixtures.models:MLP", "--report", str(report)]) == 0
    err = capsys.readouterr().err
    # THEN the clean replay says why the Guard saw it here, and whose capture to replay
    said = ("the Guard saw the failure at step 4 on rank(s) 0, 1; this capture's batch (rank 0's) replays finite: "
            "what it saw arrived from another rank through a collective; replay the capture of rank 1")
    assert said in err.splitlines()
    assert Report.from_json(report.read_text()).notes[-1] == said
